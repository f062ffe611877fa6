"""KV transfers of the optimistic prefill executor and what ends a request (SGLang
``send_kv_chunk`` and ``process_disagg_prefill_inflight_queue``), see docs/DESIGN.md.

- ``send_kv_chunk``: send the computed whole pages (or everything, for the last chunk), only
  after finalize.
- The inflight queue holds requests whose prefill finished: **parked** ones (still pending:
  finalized, published and sent once the peer is ready, aborted if it fails, yielded when every
  running slot is taken while others wait) and **transferring** ones (released and reported at
  ``Success``, aborted at ``Failed``).
- **Abort** (the peer failed at any stage): release everything at once (a failed peer reads
  none of the sends still in flight), send nothing more, report the error.
- Every finished request gets a ``RequestResult`` in ``results`` until the caller pops it; the
  request itself is handed to ``on_done`` (the executor forgets it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prefill.clock import Clock
from prefill.disagg.protocol import KVPoll
from prefill.request.kv import RequestKV
from prefill.request.state import Outcome, PrefillRequest, RequestResult, Stage
from prefill.scheduler.admission import AdmissionQueue
from prefill.scheduler.pending_kv import PendingKV
from prefill.stats import ExecutorStats

logger = logging.getLogger(__name__)


class InflightQueue:
    """Sends, the inflight queue, aborts and results.

    Args:
        kv: the executor's ``RequestKV`` (release).
        admission: peer polling (with the force-not-ready hook), finalize, metadata buffers.
        pending: publishes a just-finalized request's pages, yields a parked one, counts KV
            an abort drops unpublished.
        clock: time of results.
        stats: the executor's counters (sends, parks, aborts, successes, TTFT).
        on_done: told of each request that got its outcome.
        max_running_requests: requests that may hold KV at once (SGLang's request pool).
    """

    def __init__(
        self,
        kv: RequestKV,
        admission: AdmissionQueue,
        pending: PendingKV,
        clock: Clock,
        stats: ExecutorStats,
        on_done: Callable[[PrefillRequest], None],
        max_running_requests: int,
    ) -> None:
        self.kv = kv
        self.admission = admission
        self.pending = pending
        self.clock = clock
        self.stats = stats
        self.on_done = on_done
        self.max_running_requests = max_running_requests
        self.page_size = kv.page_size
        self.inflight_queue: list[PrefillRequest] = []
        self.results: dict[str, RequestResult] = {}

    # ------------------------------------------------------------------ sends
    def send_kv_chunk(self, req: PrefillRequest, last: bool) -> None:
        """Send ``[start_send_idx, end)``: whole pages of the computed KV, or all of it when
        ``last``. Only after finalize. The source slots stay owned (tree-locked or request-owned)
        until the request's release, which comes after every ack (or after its peer failed)."""
        if req.pending_bootstrap or req.slots is None:
            raise RuntimeError(f"{req.rid}: a send before finalize or without slots")
        end = req.num_tokens if last else req.computed_len // self.page_size * self.page_size
        if end <= req.start_send_idx and not last:
            return
        start = req.start_send_idx
        sent = req.peer.send(req.attempt, start, end, req.slots[start:end], last=last)
        if not self.admission.polls.sent(req, sent):
            return  # the peer failed (on some rank): the request aborts at its next poll
        req.start_send_idx = end
        self.stats.sends += 1
        self.stats.sent_tokens += end - start

    # ------------------------------------------------------------------ inflight
    def add(self, req: PrefillRequest) -> None:
        """Prefill of ``req`` finished: park it while its peer is pending, else send the rest
        (last chunk; its pages were published by the caller)."""
        req.stage = Stage.INFLIGHT
        self.inflight_queue.append(req)
        if req.pending_bootstrap:
            req.parked = req.was_parked = True
            self.stats.parks += 1
        else:
            self.send_kv_chunk(req, last=True)

    def process_inflight_queue(self, other_holders: int) -> None:
        """Parked + ready -> finalize, publish and send; parked + failed -> abort; parked +
        bootstrapping -> yield when starved (below); transfer ``Success`` -> release and
        report; ``Failed`` -> abort. ``other_holders``: requests outside the inflight queue
        that hold KV (the chunked one).

        Starved (SGLang's rule against a circular wait with the decode side): every running
        slot (``max_running_requests``) is held, and a request waits for one (the waiting queue
        is not empty, or the bootstrap queue is not and no metadata buffer is free). Then a
        parked request whose peer is still bootstrapping yields, one per freed slot."""
        queue, self.inflight_queue = self.inflight_queue, []
        holding = len(queue) + other_holders
        for req, state in self.admission.poll_each(queue):
            if state == KVPoll.Failed:
                self.abort(req)
                holding -= 1
                continue
            if req.pending_bootstrap:  # parked
                if state == KVPoll.WaitingForInput:
                    self.admission.finalize(req)
                    req.parked = False
                    self.pending.publish(req, chunked=False)
                    self.send_kv_chunk(req, last=True)
                elif (
                    state == KVPoll.Bootstrapping
                    and holding >= self.max_running_requests
                    and self.admission.someone_waits_for_a_slot()
                ):
                    req.parked = False
                    self.stats.parked_yields += 1
                    self.pending.yield_(req)
                    holding -= 1
                    continue
                self.inflight_queue.append(req)
            elif state == KVPoll.Success:
                self._complete(req)
                holding -= 1
            else:
                self.inflight_queue.append(req)

    # ------------------------------------------------------------------ abort / done
    # Slot ownership at abort / completion (see prefill/request/kv.py for the ranges):
    #   [0, tree_len)          tree-owned, locked by this request: the lock is dropped.
    #   [tree_len, len(slots)) request-owned: freed.
    #   sends in flight        none at Success (the last range acked last); at abort the peer
    #                          has failed and reads none of them, so the slots are freed at once.
    def abort(self, req: PrefillRequest) -> None:
        """The peer failed: release the request's KV and metadata buffer, report the error.
        The caller has removed it from its queue (and cleared it as the chunked request)."""
        if req.peer.inflight_reads():  # before anything changes: the release frees what it reads
            raise RuntimeError(f"{req.rid}: a failed peer still reads")
        self.stats.aborts += 1
        if req.pending_bootstrap:
            self.stats.bootstrap_failures += 1
            if req.peer.timed_out:
                self.stats.bootstrap_timeouts += 1
        else:
            self.stats.transfer_failures += 1
        self.pending.drop(req)
        self.kv.release(req)
        self._report(req, Outcome.ABORTED, req.peer.failure or "decode peer failed")

    def _complete(self, req: PrefillRequest) -> None:
        self.kv.release(req)
        self.stats.successes += 1
        self._report(req, Outcome.SUCCESS, None)

    def _report(self, req: PrefillRequest, outcome: Outcome, error: str | None) -> None:
        self.admission.release_metadata_buffer(req)
        req.stage = Stage.DONE
        result = req.to_result(outcome, self.clock.now(), error)
        if result.ttft is not None:
            self.stats.record_ttft(result.ttft)
        self.results[req.rid] = result
        self.on_done(req)
