"""The extend batch (SGLang ``get_new_batch_prefill``, ``run_batch``,
``process_prefill_chunk``): the running (chunked) request, its chunk boundaries and the end of
its prefill; the batch's selection within the token budget and its forward. A load back that
fails sends the requests it served back to recompute their host hits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache_prefill.hicache.transfer.errors import LoadBackError
from hicache_prefill.prefill.disagg.protocol import KVPoll
from hicache_prefill.prefill.model.paged import ExtendInput, PagedTransformer
from hicache_prefill.prefill.request.state import PrefillRequest, Stage
from hicache_prefill.prefill.scheduler.inflight_queue import InflightQueue
from hicache_prefill.prefill.tp_lockstep.sync import check_batch

if TYPE_CHECKING:
    from hicache_prefill.hicache.builder import KVCache
    from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)

CostModel = Callable[[int, int], float]  # (new_tokens, prefix_tokens) -> seconds of a forward
Batch = list[tuple[PrefillRequest, int]]  # (request, new_tokens)


class BatchRunner:
    """Builds and runs extend batches and decides for the running request."""

    def __init__(
        self,
        args: ServerArgs,
        cache: KVCache,
        model: PagedTransformer,
        cost_model: CostModel | None,
        inflight: InflightQueue,
    ) -> None:
        self.cache = cache
        self.model = model
        self.cost_model = cost_model
        self.inflight = inflight
        self.pending = inflight.pending
        self.admission = inflight.admission
        self.kv = inflight.kv
        self.stats = inflight.stats
        self.clock = inflight.clock
        self.prefetch = self.pending.prefetch
        self.page_size = self.kv.page_size
        cps = int(args.chunked_prefill_size)
        self.chunk_budget = cps if cps > 0 else None
        self.chunked_req: PrefillRequest | None = None

    def abort(self, req: PrefillRequest) -> None:
        if self.chunked_req is req:
            self.chunked_req = None
        self.inflight.abort(req)

    def process_chunked_req(self) -> None:
        """The running request's chunk boundary; still bootstrapping: yield when a
        bootstrapped request waits, else keep computing without sending."""
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
        else:
            self.inflight.send_kv_chunk(req, last=False)

    def get_new_batch(self) -> Batch:
        """The next extend batch (possibly empty), chunked request first. Collective under TP."""
        holding = (
            len(self.inflight.inflight_queue)
            + len(self.inflight.draining_queue)
            + int(self.chunked_req is not None)
        )
        batch = self._build(self.inflight.max_running_requests - holding)
        for req, _ in batch:
            if req is not self.chunked_req:
                self.admission.remove_started(req)
        check_batch(self.cache.group, batch)
        return batch

    def _build(self, free_request_slots: int) -> Batch:
        """Select the batch and launch its host loads; a failed launch (single rank) flags the
        examined candidates to recompute and selects again (so this ends)."""
        candidates = self.admission.candidates()
        while True:
            batch, examined = self._select(candidates, free_request_slots)
            try:
                self.cache.tree.ready_to_load_host_cache()
                return batch
            except LoadBackError as exc:
                if self.cache.group.size > 1:
                    raise
                logger.warning("host loads not launched; their requests recompute: %s", exc)
                self.undo_admissions([r for r, _ in batch if r is not self.chunked_req], examined)

    def _select(
        self, candidates: list[PrefillRequest], free_request_slots: int
    ) -> tuple[Batch, list[PrefillRequest]]:
        budget = self.chunk_budget
        batch: Batch = []
        examined: list[PrefillRequest] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            n = self._chunk_len(req, budget)
            if n == 0 or not self.kv.alloc_extend(req, n):
                return [], examined  # wait for memory (transfers / loads free it)
            batch.append((req, n))
            budget = None if budget is None else budget - n
        for req in candidates:
            if budget is not None and budget < self.page_size:
                break
            if free_request_slots <= 0:
                break
            if not self.prefetch.ready(req):
                continue  # its L3 prefetch is still wanted: the others go ahead
            self.kv.match_and_lock(req)
            examined.append(req)
            n = self._chunk_len(req, budget)
            if n == 0 or not self.kv.alloc_extend(req, n):
                self.kv.release(req)
                break
            req.stage = Stage.RUNNING
            self.prefetch.admitted(req)
            free_request_slots -= 1
            batch.append((req, n))
            budget = None if budget is None else budget - n
            if req.computed_len + n < req.num_tokens:
                break  # it becomes the chunked request; one at a time
        return batch, examined

    def record_admissions(self, reqs: list[PrefillRequest]) -> None:
        """Prefix hits of requests whose first forward of this attempt ran."""
        for req in reqs:
            self.stats.cached_device_tokens += req.cached_device
            self.stats.cached_host_tokens += req.cached_host
            self.stats.cached_storage_tokens += req.cached_storage
            self.cache.stats.record_match(req.cached_device, req.cached_host, req.cached_storage)
            if req.yielded_len:  # a retry: what its yielded attempt had computed, computed again
                self.stats.yield_recomputed_tokens += max(0, req.yielded_len - req.computed_len)
                req.yielded_len = 0

    def undo_admissions(
        self, admitted: list[PrefillRequest], examined: list[PrefillRequest] | None = None
    ) -> None:
        """A load back failed: ``admitted`` give back their KV (``WAITING``, the caller queues
        them); they and ``examined`` recompute host hits for the rest of the attempt."""
        for req in reversed(admitted):
            self.kv.release(req)
            req.cached_device = req.cached_host = req.cached_storage = 0
            req.stage = Stage.WAITING
        for req in [*admitted, *(examined or ())]:
            req.skip_load_back = True
        undone = self.cache.tree.cancel_load_back()
        self.stats.load_back_failures += 1
        logger.warning(
            "load back failed: %d tokens host-only again; %d requests recompute them",
            undone,
            len(admitted),
        )

    def _chunk_len(self, req: PrefillRequest, budget: int | None) -> int:
        rest = req.num_tokens - req.computed_len
        if budget is None or rest <= budget:
            return rest
        return budget // self.page_size * self.page_size

    def run_batch(self, batch: Batch) -> None:
        """Forward ``batch`` and advance its requests. After a failed host load the new ones
        go back to the waiting queue; the chunked request reruns its chunk next step."""
        new = [req for req, _ in batch if req is not self.chunked_req]
        try:
            logits = self.forward(batch)
        except LoadBackError as exc:
            if self.cache.group.size > 1:
                raise
            logger.warning("a host load failed under the forward; requests recompute: %s", exc)
            self.undo_admissions(new)
            self.admission.requeue_unstarted(new)
            return
        self.record_admissions(new)
        self.chunked_req = None
        for (req, n), out in zip(batch, logits, strict=True):
            req.computed_len += n
            req.total_computed += n
            if req.computed_len < req.num_tokens:
                self.chunked_req = req
                continue
            req.first_token = int(out.argmax())
            self._finish_prefill(req)

    def _finish_prefill(self, req: PrefillRequest) -> None:
        self.pending.publish(req, chunked=False)
        req.prefill_done_time = self.clock.now()
        if req.pending_bootstrap and self.admission.forced(req):
            self.pending.yield_(req)
            return
        self.inflight.add(req)

    def forward(self, batch: Batch) -> list[torch.Tensor]:
        """Returns each request's last-token logits; ``LoadBackError`` (nothing charged or
        counted) when a layer's load failed."""
        inputs = []
        for req, n in batch:  # alloc_extend gave each its slots
            lo = req.computed_len
            ids = torch.tensor(req.token_ids[lo : lo + n], dtype=torch.int64)
            inputs.append(ExtendInput(ids, req.slots[: lo + n], lo))
        logits = self.model.forward_extend(
            self.cache.device_pool, inputs, layer_wait=self.cache.tree.layer_wait
        )
        n_new = sum(n for _, n in batch)
        if self.cost_model is not None:
            cost = self.cost_model(n_new, sum(r.computed_len for r, _ in batch))
            self.clock.advance(cost)
            controller = self.cache.controller
            loaded = None if controller is None else controller.loads_ready_at()
            if loaded is not None:  # the last layer computes after its timed load ended
                self.clock.wait_until(loaded + cost / self.cache.device_pool.layer_num)
        self.stats.forward_passes += 1
        self.stats.chunks += len(batch)
        self.stats.computed_tokens += n_new
        return logits
