"""Admission (SGLang ``PrefillBootstrapQueue``): the bootstrap and waiting queues, the
optimistic-attempt policy, the metadata buffers, and the executor's side of the gate.
Requests in both queues hold no KV; every admitted one holds a metadata buffer until its
outcome or its fall back to the bootstrap queue.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from hicache_prefill.hicache.tp.group import TPGroup
from hicache_prefill.prefill.disagg.protocol import KVPoll
from hicache_prefill.prefill.executor_stats import ExecutorStats
from hicache_prefill.prefill.request.state import PrefillRequest, Stage
from hicache_prefill.prefill.tp_lockstep.sync import PeerPolls

if TYPE_CHECKING:
    from hicache_prefill.hicache.builder import KVCache
    from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 2048
"""``max_running_requests`` when unset: the floor of SGLang's derived value."""


def metadata_buffer_count(max_running_requests: int) -> int:
    """SGLang's prefill-side pool size: twice ``max_running_requests`` (headroom)."""
    return 2 * max_running_requests


def resolved_attempts(args: ServerArgs) -> int:
    """The gate's resolved attempts; 0 outside ``--disaggregation-mode prefill``."""
    attempts = int(args.optimistic_prefill_attempts)
    if attempts > 0 and args.disaggregation_mode != "prefill":
        logger.warning(
            "optimistic prefill ignored: --optimistic-prefill-attempts=%d applies only with "
            "--disaggregation-mode prefill (got %s)",
            attempts,
            args.disaggregation_mode,
        )
        return 0
    return attempts


def check_gate(args: ServerArgs, cache: KVCache, attempts: int) -> None:
    """Raise ``ValueError`` when ``attempts > 0`` but the gate, asked with what the cache
    declares, would resolve them to 0."""
    if attempts <= 0:
        return
    tree = cache.tree
    policy = getattr(tree, "write_policy", None) if cache.hierarchical else None
    storage = cache.storage
    mode = storage.settings.host_memory_mode if storage is not None else "cache"
    if args.optimistic_gate_allows(policy, storage=storage is not None, host_memory_mode=mode):
        return
    raise ValueError(
        f"--optimistic-prefill-attempts={attempts} is not allowed with this cache: its tree "
        f"declares --hicache-write-policy={policy} (backs up at insert: "
        f"{tree.backs_up_on_insert}) with --optimistic-prefill-write-through="
        f"{args.optimistic_prefill_write_through}, "
        f"a storage tier: {storage is not None} (--hicache-host-memory-mode={mode}), "
        f"--pp-size={args.pp_size}, --uses-mamba-radix-cache="
        f"{args.uses_mamba_radix_cache}; the gate resolves this to 0 "
        "attempts (were ServerArgs changed after they were resolved?)"
    )


def log_gate_once(args: ServerArgs) -> None:
    """Warn once when the gate turned optimism off."""
    for r in args.resolutions:
        if r.field == "optimistic_prefill_attempts" and r.new == 0:
            logger.warning(
                "optimistic prefill disabled: %s (requested %s attempts); requests wait for "
                "their decode peer before prefill",
                r.reason,
                r.old,
            )
            return


class ReqToMetadataIdxAllocator:
    """``size`` metadata buffer indices, handed out first-free-first (SGLang's)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.free_slots: deque[int] = deque(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.popleft() if self.free_slots else None

    def free(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise ValueError(f"index {index} is not a buffer of this pool (size {self.size})")
        self.free_slots.append(index)


class AdmissionQueue:
    """The bootstrap and waiting queues and who leaves them when (``max_attempts`` 0: no
    optimism)."""

    def __init__(
        self, max_attempts: int, stats: ExecutorStats, metadata_buffers: int, group: TPGroup
    ) -> None:
        self.max_attempts = max_attempts
        self.stats = stats
        self.metadata = ReqToMetadataIdxAllocator(metadata_buffers)
        self.polls = PeerPolls(group)
        self.bootstrap_queue: list[PrefillRequest] = []
        self.waiting_queue: list[PrefillRequest] = []
        self.on_finalize: Callable[[PrefillRequest], None] | None = None

    def forced(self, req: PrefillRequest) -> bool:
        """Test hook: the peer looks not ready until the request's first attempt yielded."""
        return req.force_not_ready and not req.forced_yield_done

    def _hooked(self, req: PrefillRequest, state: KVPoll) -> KVPoll:
        if state == KVPoll.WaitingForInput and req.pending_bootstrap and self.forced(req):
            return KVPoll.Bootstrapping
        return state

    def poll(self, req: PrefillRequest) -> KVPoll:
        return self._hooked(req, self.polls.one(req))

    def poll_each(self, reqs: Sequence[PrefillRequest]) -> Iterable[tuple[PrefillRequest, KVPoll]]:
        return ((r, self._hooked(r, s)) for r, s in self.polls.each(reqs))

    def ensure_metadata_buffer(self, req: PrefillRequest) -> bool:
        if req.metadata_buffer_index >= 0:
            return True
        index = self.metadata.alloc()
        if index is None:
            self.stats.metadata_buffer_waits += 1
            return False
        req.metadata_buffer_index = index
        return True

    def release_metadata_buffer(self, req: PrefillRequest) -> None:
        if req.metadata_buffer_index >= 0:
            self.metadata.free(req.metadata_buffer_index)
            req.metadata_buffer_index = -1

    def finalize(self, req: PrefillRequest) -> None:
        if not req.pending_bootstrap or req.metadata_buffer_index < 0:
            raise RuntimeError(f"{req.rid}: finalize twice, or without a metadata buffer")
        req.peer.init(req.attempt)
        req.pending_bootstrap = False
        req.start_send_idx = req.peer.decode_prefix_len
        self.stats.finalized += 1
        if self.on_finalize is not None:
            self.on_finalize(req)

    def add(self, req: PrefillRequest) -> None:
        self.bootstrap_queue.append(req)

    def _admit(self, req: PrefillRequest, optimistic: bool) -> None:
        req.attempt += 1
        req.stage = Stage.WAITING
        req.attempt_log.append((req.attempt, optimistic))
        self.stats.admissions += 1
        if optimistic:
            req.optimistic_attempts += 1
            self.stats.optimistic_admissions += 1
            if self.forced(req):
                self.stats.forced_not_ready += 1

    def pop_bootstrapped(self) -> list[PrefillRequest]:
        """Move ready (finalized) and optimistic requests to the waiting queue, each with a
        metadata buffer. Returns the requests whose peer failed, dequeued, for the caller to
        abort."""
        keep, failed = [], []
        for req, state in self.polls.each(self.bootstrap_queue):
            if state == KVPoll.Failed:
                failed.append(req)
            elif state == KVPoll.Bootstrapping:
                if req.optimistic_attempts < self.max_attempts and self.ensure_metadata_buffer(req):
                    self._admit(req, optimistic=True)
                    self.waiting_queue.append(req)
                else:
                    keep.append(req)
            elif state == KVPoll.WaitingForInput:
                if not self.ensure_metadata_buffer(req):
                    keep.append(req)
                    continue
                forced = self.forced(req)  # the hook: run as if not ready
                self._admit(req, optimistic=forced)
                if not forced:
                    self.finalize(req)
                self.waiting_queue.append(req)
            else:
                raise RuntimeError(f"{req.rid}: unexpected {state.name} in the bootstrap queue")
        self.bootstrap_queue = keep
        return failed

    def resolve_waiting_bootstrap(self) -> list[PrefillRequest]:
        """Finalize waiting requests whose peer became ready; returns (dequeued) the failed."""
        keep, failed = [], []
        for req, state in self.poll_each(self.waiting_queue):
            if state == KVPoll.Failed:
                failed.append(req)
                continue
            if state == KVPoll.WaitingForInput and req.pending_bootstrap:
                self.finalize(req)
            keep.append(req)
        self.waiting_queue = keep
        return failed

    def has_bootstrapped_waiting_req(self) -> bool:
        return any(not r.pending_bootstrap for r in self.waiting_queue)

    def someone_waits_for_a_slot(self) -> bool:
        return bool(self.waiting_queue) or (
            bool(self.bootstrap_queue) and self.metadata.available_size() == 0
        )

    def candidates(self) -> list[PrefillRequest]:
        """Bootstrapped requests first, so a yield really yields."""
        return sorted(self.waiting_queue, key=lambda r: r.pending_bootstrap)

    def remove_started(self, req: PrefillRequest) -> None:
        self.waiting_queue.remove(req)

    def requeue_unstarted(self, reqs: list[PrefillRequest]) -> None:
        self.waiting_queue[:0] = reqs

    def requeue_yielded(self, req: PrefillRequest) -> None:
        """Another attempt at the head of the waiting queue, or back to bootstrap once
        attempts are used up."""
        if self.forced(req):
            req.forced_yield_done = True
        if req.optimistic_attempts >= self.max_attempts:
            logger.info(
                "%s used %d optimistic attempts: back to bootstrap",
                req.rid,
                req.optimistic_attempts,
            )
            self.release_metadata_buffer(req)
            req.stage = Stage.BOOTSTRAP
            self.bootstrap_queue.append(req)
            self.stats.fallbacks += 1
        else:
            self._admit(req, optimistic=True)
            self.waiting_queue.insert(0, req)
            self.stats.retries += 1
