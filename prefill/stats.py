"""Executor counters (SGLang's prefill metrics, plus what the optimistic path adds)."""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class ExecutorStats:
    """Counters since the executor started. Every field is a plain int / list for JSON.

    ``optimistic_admissions``: admissions while the peer was still bootstrapping (each one is an
    optimistic forward pass, i.e. one attempt). ``retries``: yields requeued at the head of the
    waiting queue for another optimistic attempt. ``fallbacks``: yields sent back to the
    bootstrap queue because attempts were used up. ``bootstrap_failures``: peers that failed
    before the request was finalized; ``transfer_failures``: after.
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
    finalized: int = 0
    aborts: int = 0
    bootstrap_failures: int = 0
    transfer_failures: int = 0
    successes: int = 0
    forward_passes: int = 0
    chunks: int = 0
    computed_tokens: int = 0
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    sends: int = 0
    sent_tokens: int = 0
    ttft_samples: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ttft_mean"] = statistics.fmean(self.ttft_samples) if self.ttft_samples else None
        out["ttft_p50"] = statistics.median(self.ttft_samples) if self.ttft_samples else None
        return out
