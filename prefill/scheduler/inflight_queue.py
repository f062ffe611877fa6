"""Sends and what ends a request (SGLang ``send_kv_chunk``,
``process_disagg_prefill_inflight_queue``): the inflight queue (parked while pending,
transferring once finalized), aborts and their draining, and the results. An aborted request
keeps its KV and metadata buffer until its transport reads none of its sends.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_prefill.prefill.clock import Clock
from hicache_prefill.prefill.disagg.protocol import KVPoll, MetadataRow
from hicache_prefill.prefill.request.state import Outcome, PrefillRequest, RequestResult, Stage
from hicache_prefill.prefill.scheduler.pending_kv import PendingKV


class InflightQueue:
    """``on_done`` is told of each request that got its outcome."""

    def __init__(
        self,
        pending: PendingKV,
        clock: Clock,
        max_running_requests: int,
        on_done: Callable[[PrefillRequest], None],
    ) -> None:
        self.pending = pending
        self.kv = pending.kv
        self.admission = pending.admission
        self.stats = pending.stats
        self.clock = clock
        self.on_done = on_done
        self.max_running_requests = max_running_requests
        self.page_size = self.kv.page_size
        self.inflight_queue: list[PrefillRequest] = []
        self.draining_queue: list[PrefillRequest] = []
        self.results: dict[str, RequestResult] = {}

    def send_kv_chunk(self, req: PrefillRequest, last: bool) -> None:
        """Send whole pages of the computed KV from ``start_send_idx``, or all of it when
        ``last``."""
        if req.pending_bootstrap or req.slots is None:
            raise RuntimeError(f"{req.rid}: a send before finalize or without slots")
        end = req.num_tokens if last else req.computed_len // self.page_size * self.page_size
        if end <= req.start_send_idx and not last:
            return
        start = req.start_send_idx
        metadata = None
        if last:
            assert req.first_token is not None
            metadata = MetadataRow(
                req.metadata_buffer_index,
                req.first_token,
                req.cached_device,
                req.cached_host - req.cached_storage,
                req.cached_storage,
            )
        sent = req.peer.send(
            req.attempt, start, end, req.slots[start:end], last=last, metadata=metadata
        )
        if not self.admission.polls.sent(req, sent):
            return  # the peer failed (on some rank): the request aborts at its next poll
        req.start_send_idx = end
        self.stats.sends += 1
        self.stats.sent_tokens += end - start

    def add(self, req: PrefillRequest) -> None:
        """Prefill finished: park while the peer is pending, else send the last chunk."""
        req.stage = Stage.INFLIGHT
        self.inflight_queue.append(req)
        if req.pending_bootstrap:
            req.parked = req.was_parked = True
            self.stats.parks += 1
        else:
            self.send_kv_chunk(req, last=True)

    def process_inflight_queue(self, other_holders: int) -> None:
        """A parked request yields while every running slot is held and someone waits for one
        (against a circular wait). ``other_holders``: requests holding KV outside these queues.
        """
        self.process_draining()
        queue, self.inflight_queue = self.inflight_queue, []
        holding = len(queue) + len(self.draining_queue) + other_holders
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
                self.stats.successes += 1
                self._report(req, Outcome.SUCCESS, None)
                holding -= 1
            else:
                self.inflight_queue.append(req)

    def abort(self, req: PrefillRequest) -> None:
        """The peer failed: release and report once its reads drained. The caller dequeued it."""
        self.stats.aborts += 1
        if req.pending_bootstrap:
            self.stats.bootstrap_failures += 1
            if req.peer.timed_out:
                self.stats.bootstrap_timeouts += 1
        else:
            self.stats.transfer_failures += 1
        self.pending.drop(req)
        if self.admission.polls.drained([req])[0]:
            self._release_aborted(req)
            return
        req.stage = Stage.DRAINING
        self.draining_queue.append(req)
        self.stats.abort_drains += 1

    def process_draining(self) -> None:
        queue, self.draining_queue = self.draining_queue, []
        for req, done in zip(queue, self.admission.polls.drained(queue), strict=True):
            if done:
                self._release_aborted(req)
            else:
                self.draining_queue.append(req)

    def _release_aborted(self, req: PrefillRequest) -> None:
        self._report(req, Outcome.ABORTED, req.peer.failure or "decode peer failed")

    def _report(self, req: PrefillRequest, outcome: Outcome, error: str | None) -> None:
        self.kv.release(req)
        self.admission.release_metadata_buffer(req)
        req.stage = Stage.DONE
        result = req.to_result(outcome, self.clock.now(), error)
        if result.ttft is not None:
            self.stats.record_ttft(result.ttft)
        self.results[req.rid] = result
        self.on_done(req)
