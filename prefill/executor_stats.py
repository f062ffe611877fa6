"""Executor counters (SGLang's prefill metrics, plus the optimistic path's), bounded in memory:
TTFT as exact aggregates plus a fixed-size uniform reservoir for percentiles."""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

TTFT_RESERVOIR_SIZE = 4096  # TTFT samples kept for percentiles


@dataclass
class ExecutorStats:
    """Counters since the executor started, JSON-plain. ``speculative_l2_pages`` and
    ``speculative_l3_pages`` (pages of attempts never finalized in L2 / L3) must stay 0."""

    submitted: int = 0
    rejected: int = 0  # prompts that can never fit the device pool
    admissions: int = 0
    optimistic_admissions: int = 0  # while the peer was still bootstrapping: one attempt each
    forced_not_ready: int = 0
    yields: int = 0
    retries: int = 0  # yields requeued for another optimistic attempt
    fallbacks: int = 0  # yields sent back to the bootstrap queue (attempts used up)
    parks: int = 0
    parked_yields: int = 0  # parked requests yielded: every running slot taken, others waiting
    finalized: int = 0
    aborts: int = 0
    bootstrap_failures: int = 0  # peers failed before finalize (bootstrap_timeouts of them)
    bootstrap_timeouts: int = 0
    transfer_failures: int = 0  # peers failed after finalize
    abort_drains: int = 0  # aborts that waited for the transport to stop reading
    successes: int = 0
    metadata_buffer_waits: int = 0  # admissions put off for lack of a buffer (per step)
    forward_passes: int = 0
    chunks: int = 0
    computed_tokens: int = 0
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    load_back_failures: int = 0  # host loads that failed; their requests recomputed
    sends: int = 0
    sent_tokens: int = 0
    unpublished_dropped_tokens: int = 0  # pending KV freed unpublished (backs-up-at-insert)
    yield_recomputed_tokens: int = 0  # a retry's tokens its yielded attempt had computed
    speculative_l2_pages: int = 0
    speculative_l3_pages: int = 0
    cached_storage_tokens: int = 0  # of cached_host_tokens: fetched from L3
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_min: float | None = None
    ttft_max: float | None = None
    ttft_samples: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(0)  # reservoir draws; deterministic across runs

    def record_ttft(self, ttft: float) -> None:
        """Exact aggregates, and Algorithm R into the reservoir."""
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
