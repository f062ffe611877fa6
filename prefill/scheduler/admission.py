"""Admission of the optimistic prefill executor (SGLang ``PrefillBootstrapQueue``), see
docs/DESIGN.md: the bootstrap and waiting queues, the decode peer's bootstrap state as the
scheduler sees it, the optimistic-attempt policy and the metadata buffers.

- A request still ``Bootstrapping`` is admitted optimistically while its
  ``optimistic_attempts < N`` (the attempt is counted at admission); a ready one is admitted and
  finalized at once; a failed one is handed back to the executor to abort.
- Every admission needs a metadata buffer (SGLang ``ensure_metadata_buffer``), held until the
  request's outcome or its fall back to the bootstrap queue; with none free the request waits
  in the bootstrap queue. The pool (``2 * max_running_requests``) caps optimistic admissions.
- ``finalize`` commits an attempt (``peer.init``): nothing is sent before it.
- A yielded request goes back to the head of the waiting queue for another optimistic attempt,
  or to the tail of the bootstrap queue once its attempts are used up.
- The test hook "force not ready" (SGLang ``should_force_retry``): the first attempt of a forced
  request runs as if its peer were not ready and yields at its end, whatever
  ``optimistic_prefill_attempts`` is (upstream's hook ignores the limit too).

This file never touches KV: requests in both queues hold no slots and no lock.

Peer states come from ``PeerPolls`` (``prefill.tp.sync``): under tensor parallelism each queue's
polls are MIN-reduced over the ranks before any decision; with one rank it is a plain poll.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from prefill.disagg.protocol import KVPoll
from prefill.request.state import PrefillRequest, Stage
from prefill.scheduler.metadata_buffers import ReqToMetadataIdxAllocator
from prefill.stats import ExecutorStats
from prefill.tp.sync import PeerPolls

logger = logging.getLogger(__name__)


class AdmissionQueue:
    """The bootstrap and waiting queues and who leaves them when.

    Args:
        max_attempts: ``optimistic_prefill_attempts`` after the gate (0 disables optimism).
        stats: the executor's counters (admissions, finalized, retries, fallbacks).
        metadata: the metadata buffer pool every admitted request takes one index from.
        polls: how peer states are read (agreed over tensor-parallel ranks).
    """

    def __init__(
        self,
        max_attempts: int,
        stats: ExecutorStats,
        metadata: ReqToMetadataIdxAllocator,
        polls: PeerPolls,
    ) -> None:
        self.max_attempts = max_attempts
        self.stats = stats
        self.metadata = metadata
        self.polls = polls
        self.bootstrap_queue: list[PrefillRequest] = []
        self.waiting_queue: list[PrefillRequest] = []
        self.on_finalize: list = []  # told of each finalized request (L3 provenance)

    # ------------------------------------------------------------------ bootstrap state
    def forced(self, req: PrefillRequest) -> bool:
        """Test hook: the peer looks not ready until the request's first attempt yielded."""
        return req.force_not_ready and not req.forced_yield_done

    def _hooked(self, req: PrefillRequest, state: KVPoll) -> KVPoll:
        if state == KVPoll.WaitingForInput and req.pending_bootstrap and self.forced(req):
            return KVPoll.Bootstrapping
        return state

    def poll(self, req: PrefillRequest) -> KVPoll:
        """The peer's state, except that a forced pending request still sees ``Bootstrapping``."""
        return self._hooked(req, self.polls.one(req))

    def poll_each(
        self, reqs: Sequence[PrefillRequest]
    ) -> Iterable[tuple[PrefillRequest, KVPoll]]:
        """``(req, poll(req))`` for a whole queue, in order (agreed once for the queue)."""
        return ((r, self._hooked(r, s)) for r, s in self.polls.each(reqs))

    def ensure_metadata_buffer(self, req: PrefillRequest) -> bool:
        """Give ``req`` a metadata buffer unless it holds one; False when none is free."""
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
        """Bootstrap done: commit this attempt (``peer.init``); sends may follow. The request
        holds a metadata buffer since its admission."""
        if not req.pending_bootstrap or req.metadata_buffer_index < 0:
            raise RuntimeError(f"{req.rid}: finalize twice, or without a metadata buffer")
        req.peer.init(req.attempt)
        req.pending_bootstrap = False
        req.start_send_idx = req.peer.decode_prefix_len
        self.stats.finalized += 1
        for hook in self.on_finalize:
            hook(req)

    # ------------------------------------------------------------------ queues
    def add(self, req: PrefillRequest) -> None:
        """A new request waits for its peer (or an optimistic attempt)."""
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
        """Move ready requests (finalized) and optimistic ones (while attempts are left, and a
        forced one whatever the limit) to the tail of the waiting queue, each with a metadata
        buffer; without a free buffer a request stays. Returns the requests whose peer failed,
        removed from the queue, for the caller to abort."""
        keep, failed = [], []
        for req, state in self.polls.each(self.bootstrap_queue):
            if state == KVPoll.Failed:
                failed.append(req)
            elif state == KVPoll.Bootstrapping:
                if req.optimistic_attempts < self.max_attempts and self.ensure_metadata_buffer(
                    req
                ):
                    self._admit(req, optimistic=True)
                    self.waiting_queue.append(req)
                else:
                    keep.append(req)
            elif state == KVPoll.WaitingForInput:
                if not self.ensure_metadata_buffer(req):
                    keep.append(req)
                elif self.forced(req):
                    self._admit(req, optimistic=True)  # the hook: run as if not ready
                    self.waiting_queue.append(req)
                else:
                    self._admit(req, optimistic=False)
                    self.finalize(req)
                    self.waiting_queue.append(req)
            else:
                raise RuntimeError(f"{req.rid}: unexpected {state.name} in the bootstrap queue")
        self.bootstrap_queue = keep
        return failed

    def resolve_waiting_bootstrap(self) -> list[PrefillRequest]:
        """Finalize waiting requests whose peer became ready. Returns the ones whose peer
        failed, removed from the queue, for the caller to abort."""
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
        """A request waits for a running slot: the waiting queue is not empty, or the bootstrap
        queue is not and no metadata buffer is free."""
        return bool(self.waiting_queue) or (
            bool(self.bootstrap_queue) and self.metadata.available_size() == 0
        )

    def candidates(self) -> list[PrefillRequest]:
        """Waiting requests in batch order: bootstrapped (finalized) ones first, so a yield really
        yields; queue order within each class (a yielded request heads the optimistic ones)."""
        return sorted(self.waiting_queue, key=lambda r: r.pending_bootstrap)

    def remove_started(self, req: PrefillRequest) -> None:
        """``req`` left the waiting queue for a batch."""
        self.waiting_queue.remove(req)

    def requeue_unstarted(self, reqs: list[PrefillRequest]) -> None:
        """Requests that left the waiting queue for a batch whose forward did not run (a host
        load failed; they hold no KV again) go back to its head, in their order."""
        self.waiting_queue[:0] = reqs

    def requeue_yielded(self, req: PrefillRequest) -> None:
        """After a yield (``req`` holds no KV and was reset): another optimistic attempt at the
        head of the waiting queue (keeping its metadata buffer), or the tail of the bootstrap
        queue once attempts are used (giving the buffer back)."""
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
