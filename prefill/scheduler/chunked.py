"""The running request of the optimistic prefill executor: the extend batch, the chunked request
(one at a time, SGLang's ``chunked_req``) and the decisions at its chunk boundaries and at the
end of its prefill, yield included (steps 4-6 of the executor's step order).

- **Chunk boundary** (``process_chunked_req``, SGLang's ``process_prefill_chunk``): publish the
  computed pages; failed peer -> abort; ready peer -> finalize, publish once more (now final)
  and send the computed pages; still bootstrapping -> yield when a bootstrapped request waits
  (adaptive yield), else keep computing and send nothing. A finalized request just sends.
- **Batch** (``get_new_batch`` / ``run_batch``): the chunked request first, then waiting
  candidates while fewer than ``max_running_requests`` requests hold KV; every rank checks its
  batch against rank 0's (``check_batch``). A request whose prompt is not done becomes the
  chunked request.
- **End of prefill** (``_finish_prefill``): publish its pages; a request forced not ready
  (test hook) yields; any other joins the inflight queue (parked while pending, else its last
  chunk is sent there).

What publishing and yield do with a pending attempt's KV is ``prefill.scheduler.pending_kv``'s;
sends, the inflight queue and abort are ``prefill.scheduler.sends``'s.
"""

from __future__ import annotations

import logging

from hicache.tp.group import TPGroup
from hicache.transfer.errors import LoadBackError
from prefill.clock import Clock
from prefill.disagg.protocol import KVPoll
from prefill.request.state import PrefillRequest
from prefill.scheduler.admission import AdmissionQueue
from prefill.scheduler.batch import Batch, BatchRunner
from prefill.scheduler.pending_kv import PendingKV
from prefill.scheduler.sends import InflightQueue
from prefill.tp.sync import check_batch

logger = logging.getLogger(__name__)

__all__ = ["ChunkedPrefill"]


class ChunkedPrefill:
    """Builds and runs extend batches and decides for the running request.

    Args:
        admission: peer polls (with the force-not-ready hook), finalize, the waiting queue.
        pending: publishing and yield of attempts' KV.
        inflight: sends, the inflight queue, abort.
        batch_runner: batch selection (slots, locks) and the forward pass.
        clock: the time a prefill finished.
        group: the cache group each batch is checked on.
        max_running_requests: requests that may hold KV at once.
    """

    def __init__(
        self,
        admission: AdmissionQueue,
        pending: PendingKV,
        inflight: InflightQueue,
        batch_runner: BatchRunner,
        clock: Clock,
        group: TPGroup,
        max_running_requests: int,
    ) -> None:
        self.admission = admission
        self.pending = pending
        self.inflight = inflight
        self.batch_runner = batch_runner
        self.clock = clock
        self.group = group
        self.max_running_requests = max_running_requests
        self.chunked_req: PrefillRequest | None = None

    def abort(self, req: PrefillRequest) -> None:
        """The peer failed: drop the request from the running slot (callers remove it from the
        queue they iterate) and hand it to ``inflight.abort`` (release, error result)."""
        if self.chunked_req is req:
            self.chunked_req = None
        self.inflight.abort(req)

    # ------------------------------------------------------------------ step 4
    def process_chunked_req(self) -> None:
        """The chunk boundary of the running request (module docstring)."""
        req = self.chunked_req
        if req is None:
            return
        self.pending.publish(req, chunked=True)
        state = self.admission.poll(req)
        if state == KVPoll.Failed:
            self.abort(req)
        elif req.pending_bootstrap:
            if state == KVPoll.WaitingForInput:
                self.admission.finalize(req)
                self.pending.publish(req, chunked=True)  # once, now that it is final
                self.inflight.send_kv_chunk(req, last=False)
            elif self.admission.has_bootstrapped_waiting_req():
                self.chunked_req = None
                self.pending.yield_(req)
            # else: still bootstrapping, nobody ready is waiting: keep computing, send nothing
        else:
            self.inflight.send_kv_chunk(req, last=False)

    # ------------------------------------------------------------------ step 5
    def get_new_batch(self) -> Batch:
        """The next extend batch (possibly empty); its new requests leave the waiting queue.
        Collective under tensor parallelism (``check_batch``)."""
        holding = len(self.inflight.inflight_queue) + int(self.chunked_req is not None)
        batch = self.batch_runner.get_new_batch(
            self.chunked_req, self.admission.candidates(), self.max_running_requests - holding
        )
        for req, _ in batch:
            if req is not self.chunked_req:
                self.admission.remove_started(req)
        check_batch(self.group, batch)
        return batch

    def run_batch(self, batch: Batch) -> None:
        """Forward ``batch`` and advance its requests: an unfinished prompt becomes the
        chunked request, a finished one ends its prefill (step 6).

        When a host load the forward waits for failed while it ran (``LoadBackError``, thread
        CPU streams): the batch's new requests give their KV back and return to the head of the
        waiting queue to recompute their host hits; the chunked request keeps its KV and runs
        the same chunk again next step. Under tensor parallelism the error is raised."""
        new = [req for req, _ in batch if req is not self.chunked_req]
        try:
            logits = self.batch_runner.forward(batch)
        except LoadBackError as exc:
            if self.group.size > 1:
                raise
            logger.warning("a host load failed under the forward; requests recompute: %s", exc)
            self.batch_runner.undo_admissions(new)
            self.admission.requeue_unstarted(new)
            return
        self.batch_runner.record_admissions(new)
        self.chunked_req = None
        for (req, n), out in zip(batch, logits, strict=True):
            req.computed_len += n
            req.total_computed += n
            if req.computed_len < req.num_tokens:
                self.chunked_req = req
                continue
            req.first_token = int(out.argmax())
            self._finish_prefill(req)

    # ------------------------------------------------------------------ step 6
    def _finish_prefill(self, req: PrefillRequest) -> None:
        self.pending.publish(req, chunked=False)
        req.prefill_done_time = self.clock.now()
        if req.pending_bootstrap and self.admission.forced(req):
            self.pending.yield_(req)
            return
        self.inflight.add(req)
