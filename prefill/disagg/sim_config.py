"""How simulated decode peers behave: bootstrap delay distribution, failure probabilities,
transfer model, the bootstrap timeout and the force-not-ready test hook (SGLang's environment
variables for the last two, read through ``prefill.disagg.protocol``).

``PeerConfig.from_server_args(args)`` reads the failure hooks and the simulated transfer model
from ``ServerArgs`` and the two SGLang environment variables:

- ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (seconds, default 300): a peer still
  ``Bootstrapping`` this long after the request arrived turns ``Failed``, as SGLang's sender
  does, so a request whose decode side never preallocates is aborted instead of waiting forever.
- ``SGLANG_TEST_FORCE_OPTIMISTIC_PREFILL_RETRY_PROB``: overrides the force-not-ready probability.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

from prefill.disagg.protocol import (
    DEFAULT_BOOTSTRAP_TIMEOUT_S,
    bootstrap_timeout_from_env,
    force_not_ready_prob,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DelayDistribution:
    """Bootstrap delay in seconds: ``fixed`` (``a``), ``uniform`` on ``[a, b]``, or
    ``exponential`` with mean ``a``. ``parse("uniform:0.01,0.05")`` reads the CLI form."""

    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "exponential"):
            raise ValueError(f"kind must be fixed, uniform or exponential, got {self.kind!r}")
        if self.a < 0 or self.b < 0 or (self.kind == "uniform" and self.b < self.a):
            raise ValueError(f"bad delay parameters for {self.kind}: a={self.a}, b={self.b}")

    @classmethod
    def parse(cls, spec: str | float | DelayDistribution) -> DelayDistribution:
        if isinstance(spec, DelayDistribution):
            return spec
        if isinstance(spec, (int, float)):
            return cls("fixed", float(spec))
        kind, _, params = str(spec).partition(":")
        values = [float(x) for x in params.split(",") if x.strip()] if params else []
        if kind in ("fixed", "exponential") and len(values) == 1:
            return cls(kind, values[0])
        if kind == "uniform" and len(values) == 2:
            return cls(kind, values[0], values[1])
        raise ValueError(
            f"bootstrap delay spec {spec!r}: use fixed:S, uniform:LO,HI or exponential:MEAN"
        )

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0


@dataclass(frozen=True)
class PeerConfig:
    """How simulated decode peers behave. ``decode_prefix_len`` is capped per request to a
    page-aligned length that leaves at least one token to send. ``bootstrap_timeout_s``: a peer
    still ``Bootstrapping`` that long after its creation fails (``math.inf``: never)."""

    bootstrap_delay: DelayDistribution = field(default_factory=DelayDistribution)
    bootstrap_failure_prob: float = 0.0
    transfer_failure_prob: float = 0.0
    force_not_ready_prob: float = 0.0
    transfer_latency_s: float = 0.0
    transfer_bandwidth: float = math.inf  # bytes per second
    decode_prefix_len: int = 0
    seed: int = 0
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("bootstrap_failure_prob", "transfer_failure_prob", "force_not_ready_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.transfer_latency_s < 0 or self.transfer_bandwidth <= 0:
            raise ValueError("transfer_latency_s must be >= 0 and transfer_bandwidth > 0")
        if self.decode_prefix_len < 0:
            raise ValueError(f"decode_prefix_len must be >= 0, got {self.decode_prefix_len}")
        if not self.bootstrap_timeout_s > 0:
            raise ValueError(f"bootstrap_timeout_s must be > 0, got {self.bootstrap_timeout_s}")

    @classmethod
    def from_server_args(cls, args: Any) -> PeerConfig:
        """Failure probabilities from ``ServerArgs`` (``FORCE_RETRY_ENV`` overrides the force
        probability, as upstream's test hook); the delay / transfer model from optional fields
        (``disaggregation_bootstrap_delay``, ``disaggregation_transfer_latency_s``,
        ``disaggregation_transfer_bandwidth_gbps``, ``disaggregation_decode_prefix_len``); the
        bootstrap timeout from ``BOOTSTRAP_TIMEOUT_ENV`` (integer seconds, as upstream)."""
        bw_gbps = float(getattr(args, "disaggregation_transfer_bandwidth_gbps", 0.0) or 0.0)
        force = force_not_ready_prob(args)
        return cls(
            bootstrap_delay=DelayDistribution.parse(
                getattr(args, "disaggregation_bootstrap_delay", "fixed:0")
            ),
            bootstrap_failure_prob=float(getattr(args, "disaggregation_bootstrap_failure_prob", 0)),
            transfer_failure_prob=float(getattr(args, "disaggregation_transfer_failure_prob", 0)),
            force_not_ready_prob=force,
            transfer_latency_s=float(getattr(args, "disaggregation_transfer_latency_s", 0.0)),
            transfer_bandwidth=bw_gbps * 1e9 if bw_gbps > 0 else math.inf,
            decode_prefix_len=int(getattr(args, "disaggregation_decode_prefix_len", 0)),
            seed=int(getattr(args, "random_seed", 0)),
            bootstrap_timeout_s=bootstrap_timeout_from_env(),
        )

