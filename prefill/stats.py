"""Executor counters (SGLang's prefill metrics, plus what the optimistic path adds), bounded in
memory over any number of requests: TTFT is kept as exact aggregates plus a fixed-size uniform
reservoir for percentiles."""

from __future__ import annotations

import logging
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

TTFT_RESERVOIR_SIZE = 4096
"""TTFT samples kept for percentiles; exact while fewer requests succeeded."""


@dataclass
class ExecutorStats:
    """Counters since the executor started. Every field is a plain int / float / list for JSON.

    ``rejected``: submits refused because the prompt can never fit the device pool (SGLang
    rejects those at intake as over the maximum input length). ``optimistic_admissions``:
    admissions while the peer was still bootstrapping (each one is an optimistic forward pass,
    i.e. one attempt). ``retries``: yields requeued at the head of the waiting queue for
    another optimistic attempt. ``fallbacks``: yields sent back to the bootstrap queue because
    attempts were used up. ``parked_yields``: parked requests yielded because every running
    slot was taken while others waited (SGLang's rule). ``bootstrap_failures``: peers that
    failed before the request was finalized (``bootstrap_timeouts`` of them by timeout);
    ``transfer_failures``: after. ``metadata_buffer_waits``: admissions put off for lack of a
    metadata buffer (one per request and step).

    ``unpublished_dropped_tokens``: KV computed by a pending attempt and freed unpublished (its
    yield or abort, under a policy that backs up at insert). ``yield_recomputed_tokens``:
    tokens a retry computed again that its yielded attempt had computed (both policies).
    ``speculative_l2_pages``: host pages whose backup was issued by an insert made for an
    attempt that was not finalized (must stay 0; ``check_integrity`` asserts it).
    ``load_back_failures``: host loads that failed (at their launch or under the forward); the
    requests they served recomputed their host hits.
    ``speculative_l3_pages``: pages stored in L3 from KV an attempt computed that was not
    finalized when it was inserted and never was (must stay 0; ``check_integrity`` asserts it;
    ``prefill.scheduler.l3_provenance``). ``cached_storage_tokens``: of ``cached_host_tokens``,
    tokens admitted attempts had fetched from L3 storage.

    TTFT: ``ttft_count`` / ``ttft_sum`` / ``ttft_min`` / ``ttft_max`` are exact;
    ``ttft_samples`` is a uniform reservoir of at most ``TTFT_RESERVOIR_SIZE`` values.
    """

    submitted: int = 0
    rejected: int = 0
    admissions: int = 0
    optimistic_admissions: int = 0
    forced_not_ready: int = 0
    yields: int = 0
    retries: int = 0
    fallbacks: int = 0
    parks: int = 0
    parked_yields: int = 0
    finalized: int = 0
    aborts: int = 0
    bootstrap_failures: int = 0
    bootstrap_timeouts: int = 0
    transfer_failures: int = 0
    successes: int = 0
    metadata_buffer_waits: int = 0
    forward_passes: int = 0
    chunks: int = 0
    computed_tokens: int = 0
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    load_back_failures: int = 0
    sends: int = 0
    sent_tokens: int = 0
    unpublished_dropped_tokens: int = 0
    yield_recomputed_tokens: int = 0
    speculative_l2_pages: int = 0
    speculative_l3_pages: int = 0
    cached_storage_tokens: int = 0
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_min: float | None = None
    ttft_max: float | None = None
    ttft_samples: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(0)  # reservoir draws; deterministic across runs

    def record_ttft(self, ttft: float) -> None:
        """Add one sample: exact aggregates, and Algorithm R into the reservoir."""
        self.ttft_count += 1
        self.ttft_sum += ttft
        self.ttft_min = ttft if self.ttft_min is None else min(self.ttft_min, ttft)
        self.ttft_max = ttft if self.ttft_max is None else max(self.ttft_max, ttft)
        if len(self.ttft_samples) < TTFT_RESERVOIR_SIZE:
            self.ttft_samples.append(ttft)
            return
        j = self._rng.randrange(self.ttft_count)
        if j < TTFT_RESERVOIR_SIZE:
            self.ttft_samples[j] = ttft

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ttft_mean"] = self.ttft_sum / self.ttft_count if self.ttft_count else None
        out["ttft_p50"] = statistics.median(self.ttft_samples) if self.ttft_samples else None
        return out
