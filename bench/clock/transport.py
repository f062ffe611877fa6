"""What the KV transfer from prefill to decode costs on the virtual clock.

A send of ``nbytes`` costs ``latency_s + nbytes / bytes_per_s``. Two sources:

- ``measured`` (the default): the calibrated rate of the decode side's own read
  (``bench.clock.copy_fit.calibrate_transfer_copy``): the in-process stand-in for a transport
  copies the bytes itself, on the executor's thread, when a send completes. The virtual clock
  charges that copy where it happens (``blocking``: the executor is held for it, as on wall
  time), and the simulated peer adds no wait of its own.
- given (``--transfer-gbps`` / ``--transfer-latency-us``, source ``flag``; or a calibration
  file whose ``transfer`` entry holds a real transport's measured rate under its own
  ``source`` name, e.g. ``{"latency_s": 1.2e-05, "gb_per_s": 21.0, "source": "mooncake"}``):
  the simulated peer reads a send ``latency_s + nbytes / bytes_per_s`` after it was queued, on
  both clocks (``PeerConfig.transfer_latency_s`` / ``transfer_bandwidth``), and the in-process
  copy is not charged (a transport does not use the executor's thread; on wall time it still
  costs what it costs).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from bench.clock.copy_fit import CopyFit

logger = logging.getLogger(__name__)

__all__ = ["TransferModel"]


@dataclass(frozen=True)
class TransferModel:
    """``seconds(nbytes) = latency_s + nbytes / bytes_per_s``; see the module docstring."""

    latency_s: float
    bytes_per_s: float
    source: str  # "measured" (the in-process copy's fit), "flag", or a transport's name
    fit: CopyFit | None = None  # the measured fit (kept also when a flag overrides it)

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bytes_per_s > 0:
            raise ValueError("transfer: latency_s >= 0 and bytes_per_s > 0")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"transfer source must be a non-empty name, got {self.source!r}")

    @property
    def blocking(self) -> bool:
        """Charged as the executor's own copy (``measured``), not as a wait of the peer."""
        return self.source == "measured"

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def measured(cls, fit: CopyFit) -> TransferModel:
        return cls(fit.per_call_s, fit.bytes_per_s, "measured", fit)

    def with_flags(self, gbps: float | None, latency_us: float | None) -> TransferModel:
        """This model, or a ``flag`` one when either flag is given (the other: 0 latency or an
        infinite bandwidth). ``ValueError`` for a non-positive bandwidth or negative latency."""
        if gbps is None and latency_us is None:
            return self
        if gbps is not None and not gbps > 0:
            raise ValueError(f"--transfer-gbps must be > 0, got {gbps}")
        if latency_us is not None and latency_us < 0:
            raise ValueError(f"--transfer-latency-us must be >= 0, got {latency_us}")
        bw = gbps * 1e9 if gbps is not None else math.inf
        return replace(self, latency_s=(latency_us or 0.0) / 1e6, bytes_per_s=bw,
                       source="flag")  # fmt: skip

    def peer_fields(self) -> dict[str, float]:
        """``PeerConfig`` fields of the simulated peer's own wait (none for ``measured``)."""
        if self.blocking:
            return {"transfer_latency_s": 0.0, "transfer_bandwidth": math.inf}
        return {"transfer_latency_s": self.latency_s, "transfer_bandwidth": self.bytes_per_s}

    def as_dict(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s,
                "gb_per_s": None if math.isinf(self.bytes_per_s) else self.bytes_per_s / 1e9,
                "source": self.source, "blocking": self.blocking,
                "fit": None if self.fit is None else self.fit.as_dict()}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferModel:
        try:
            gbps = d["gb_per_s"]
            fit = None if d.get("fit") is None else CopyFit.from_dict(d["fit"])
            return cls(float(d["latency_s"]), math.inf if gbps is None else float(gbps) * 1e9,
                       str(d["source"]), fit)  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"transfer: missing or bad field ({exc!r}) in {sorted(d)}") from None
