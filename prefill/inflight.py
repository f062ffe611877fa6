"""KV transfers of the optimistic prefill executor and what ends a request (SGLang
``send_kv_chunk`` and ``process_disagg_prefill_inflight_queue``), DESIGN.md section 7.

- ``send_kv_chunk``: send the computed whole pages (or everything, for the last chunk), only
  after finalize.
- The inflight queue holds requests whose prefill finished: **parked** ones (still pending:
  finalized and sent once the peer is ready, aborted if it fails) and **transferring** ones
  (released and reported at ``Success``, aborted at ``Failed``).
- **Abort** (the peer failed at any stage): release everything once no send reads it (the
  ``releasing`` list), send nothing more, report the error.
- Every finished request gets a ``RequestResult`` in ``results``.
"""

from __future__ import annotations

import logging

from prefill.admission import AdmissionQueue
from prefill.bootstrap import KVPoll
from prefill.clock import Clock
from prefill.req_kv import RequestKV
from prefill.request import Outcome, PrefillRequest, RequestResult, Stage
from prefill.stats import ExecutorStats

logger = logging.getLogger(__name__)


class InflightQueue:
    """Sends, the inflight queue, deferred releases and results.

    Args:
        kv: the executor's ``RequestKV`` (release).
        admission: peer polling (with the force-not-ready hook) and finalize.
        clock: time of results.
        stats: the executor's counters (sends, parks, aborts, successes, TTFT samples).
    """

    def __init__(
        self, kv: RequestKV, admission: AdmissionQueue, clock: Clock, stats: ExecutorStats
    ) -> None:
        self.kv = kv
        self.admission = admission
        self.clock = clock
        self.stats = stats
        self.page_size = kv.page_size
        self.inflight_queue: list[PrefillRequest] = []
        self.releasing: list[PrefillRequest] = []
        self.results: dict[str, RequestResult] = {}

    # ------------------------------------------------------------------ sends
    def send_kv_chunk(self, req: PrefillRequest, last: bool) -> None:
        """Send ``[start_send_idx, end)``: whole pages of the computed KV, or all of it when
        ``last``. Only after finalize. The source slots stay owned (tree-locked or request-owned)
        until the request's release, which waits for every ack."""
        assert not req.pending_bootstrap and req.slots is not None
        end = req.num_tokens if last else req.computed_len // self.page_size * self.page_size
        if end <= req.start_send_idx and not last:
            return
        start = req.start_send_idx
        if not req.peer.send(req.attempt, start, end, req.slots[start:end], last=last):
            return  # the peer failed: the request aborts at its queue's next poll
        req.start_send_idx = end
        self.stats.sends += 1
        self.stats.sent_tokens += end - start

    # ------------------------------------------------------------------ inflight
    def add(self, req: PrefillRequest) -> None:
        """Prefill of ``req`` finished (its pages are in the tree): park it while its peer is
        pending, else send the rest (last chunk)."""
        req.stage = Stage.INFLIGHT
        self.inflight_queue.append(req)
        if req.pending_bootstrap:
            req.parked = req.was_parked = True
            self.stats.parks += 1
        else:
            self.send_kv_chunk(req, last=True)

    def process_inflight_queue(self) -> None:
        """Parked + ready -> finalize and send; parked + failed -> abort; transfer ``Success``
        -> release and report; ``Failed`` -> abort."""
        keep = []
        for req in self.inflight_queue:
            state = self.admission.poll(req)
            if state == KVPoll.Failed:
                self.abort(req)
                continue
            if req.pending_bootstrap:  # parked
                if state == KVPoll.WaitingForInput:
                    self.admission.finalize(req)
                    req.parked = False
                    self.send_kv_chunk(req, last=True)
                keep.append(req)
            elif state == KVPoll.Success:
                self._complete(req)
            else:
                keep.append(req)
        self.inflight_queue = keep

    # ------------------------------------------------------------------ abort / done
    # Slot ownership at abort / completion (see prefill/req_kv.py for the ranges):
    #   [0, tree_len)          tree-owned, locked by this request: the lock is dropped.
    #   [tree_len, len(slots)) request-owned: freed.
    #   sends in flight        read slots of either range: release waits until the peer acks
    #                          them (an abort waits in ``releasing``; ``Success`` comes only
    #                          once the last range is acked).
    def abort(self, req: PrefillRequest) -> None:
        """The peer failed: release the request's KV once no send reads it, report the error.
        The caller has removed it from its queue (and cleared it as the chunked request)."""
        before_finalize = req.pending_bootstrap
        self.stats.aborts += 1
        if before_finalize:
            self.stats.bootstrap_failures += 1
        else:
            self.stats.transfer_failures += 1
        req.stage = Stage.RELEASING
        self.releasing.append(req)
        self.process_releasing()
        self._report(req, Outcome.ABORTED, req.peer.failure or "decode peer failed")

    def process_releasing(self) -> None:
        """Release aborted requests whose sends have all acked."""
        keep = []
        for req in self.releasing:
            if req.peer.inflight_reads() > 0:
                keep.append(req)
                continue
            self.kv.release(req)
            req.stage = Stage.DONE
        self.releasing = keep

    def _complete(self, req: PrefillRequest) -> None:
        self.kv.release(req)
        req.stage = Stage.DONE
        self.stats.successes += 1
        self._report(req, Outcome.SUCCESS, None)

    def _report(self, req: PrefillRequest, outcome: Outcome, error: str | None) -> None:
        result = req.to_result(outcome, self.clock.now(), error)
        if result.ttft is not None:
            self.stats.ttft_samples.append(result.ttft)
        self.results[req.rid] = result
