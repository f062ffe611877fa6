"""Prefill requests: mutable scheduler state, and the typed result a caller gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hicache_prefill.prefill.disagg.protocol import DecodeLink


class Stage(enum.Enum):
    """Which queue a request is in (exactly one at a time)."""

    BOOTSTRAP = "bootstrap"  # waiting for its peer (or for an optimistic attempt)
    WAITING = "waiting"  # admitted, not yet running
    RUNNING = "running"  # holds slots; the chunked request between chunks
    INFLIGHT = "inflight"  # prefill done: parked (pending) or transferring (finalized)
    DRAINING = "draining"  # aborted; holds its KV until no engine call reads its sends
    DONE = "done"  # has its outcome; holds nothing


class Outcome(enum.Enum):
    SUCCESS = "success"
    ABORTED = "aborted"


@dataclass(eq=False)
class PrefillRequest:
    """``attempt`` numbers admissions (1, 2, ...); ``reset_attempt`` resets the per-attempt
    state. ``slots``: int64 slots of ``[0, computed_len)`` padded to whole pages; the tree owns
    ``[0, tree_len)`` under this request's lock on ``last_node``."""

    rid: str
    token_ids: list[int]
    peer: DecodeLink
    submit_time: float
    force_not_ready: bool = False
    stage: Stage = Stage.BOOTSTRAP
    attempt: int = 0
    optimistic_attempts: int = 0
    forced_yield_done: bool = False
    pending_bootstrap: bool = True
    metadata_buffer_index: int = -1  # held from admission (optimistic or finalized) to outcome
    # per-attempt state
    slots: torch.Tensor | None = None
    computed_len: int = 0
    tree_len: int = 0
    last_node: Any = None
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0  # of cached_host: tokens fetched from L3 storage for this attempt
    start_send_idx: int = 0
    parked: bool = False
    skip_load_back: bool = False  # a load back of this attempt failed: recompute host hits
    # history
    total_computed: int = 0
    yields: int = 0
    yielded_len: int = 0  # tokens with KV at the last yield (recompute accounting of the retry)
    was_parked: bool = False
    prefill_done_time: float | None = None
    first_token: int | None = None
    attempt_log: list[tuple[int, bool]] = field(default_factory=list)  # (attempt, optimistic)
    # L3 prefetch: its attempt (new after each yield), its lookup's start, lookups re-issued
    storage_epoch: int = 0
    storage_prefetch_last_match_len: int | None = None
    storage_prefetch_retries: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.rid, self.attempt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def owned_slots(self) -> int:
        return 0 if self.slots is None else self.slots.numel() - self.tree_len

    def to_result(self, outcome: Outcome, now: float, error: str | None) -> RequestResult:
        ok = outcome == Outcome.SUCCESS
        done = self.prefill_done_time
        return RequestResult(
            rid=self.rid,
            outcome=outcome,
            submit_time=self.submit_time,
            finish_time=now,
            ttft=now - self.submit_time if ok else None,
            prefill_latency=(done - self.submit_time) if ok and done is not None else None,
            num_tokens=self.num_tokens,
            cached_device_tokens=self.cached_device,
            cached_host_tokens=self.cached_host,
            cached_storage_tokens=self.cached_storage,
            computed_tokens=self.num_tokens - self.cached_device - self.cached_host if ok else 0,
            total_computed_tokens=self.total_computed,
            attempts=self.optimistic_attempts,
            passes=self.attempt,
            yields=self.yields,
            parked=self.was_parked,
            decode_prefix_len=self.peer.decode_prefix_len,
            first_token=self.first_token,
            error=error,
        )

    def reset_attempt(self) -> None:
        self.slots = None
        self.computed_len = 0
        self.tree_len = 0
        self.last_node = None
        self.cached_device = 0
        self.cached_host = 0
        self.cached_storage = 0
        self.start_send_idx = 0
        self.parked = False
        self.skip_load_back = False
        self.pending_bootstrap = True


@dataclass(frozen=True)
class RequestResult:
    """What happened to one request. ``ttft``: submit to the transfer's ``Success`` (``None``
    when aborted); ``cached_*`` / ``computed_tokens``: how the final attempt got its KV;
    ``attempts``: optimistic attempts used; ``passes``: admissions."""

    rid: str
    outcome: Outcome
    submit_time: float
    finish_time: float
    ttft: float | None
    prefill_latency: float | None
    num_tokens: int
    cached_device_tokens: int
    cached_host_tokens: int
    computed_tokens: int
    total_computed_tokens: int
    attempts: int
    passes: int
    yields: int
    parked: bool
    decode_prefix_len: int
    first_token: int | None
    error: str | None
    cached_storage_tokens: int = 0
