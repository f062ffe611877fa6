"""One extend batch of the optimistic prefill executor (SGLang ``get_new_batch_prefill`` and
``run_batch``): pick requests within the token budget, give them slots, run the forward.

- The continuing chunked request comes first; then waiting requests in the order the admission
  queue gives (bootstrapped before optimistic), while fewer than ``max_running_requests``
  requests hold KV. At most one request is left unfinished per batch: the one that did not fit
  becomes the next chunked request.
- A waiting request enters the batch by matching and locking its cached prefix (device hits, and
  host hits loaded back layer by layer under the forward) and allocating the rest of its chunk.
  That is its admission into running, where its prefix hit is counted, once per attempt.
- Without memory for the next chunk nothing waits here: the batch stops (transfers, loads and
  evictions free slots for a later step).
- A load back that fails (at its launch here, or at a layer's wait in the forward): the requests
  it served give their KV back and recompute their host hits (``undo_admissions``); the tree
  makes those nodes host-only again. Nothing else of the batch changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hicache.transfer.errors import LoadBackError
from prefill.clock import Clock
from prefill.model.paged import ExtendInput, PagedTransformer
from prefill.request.kv import RequestKV
from prefill.request.state import PrefillRequest, Stage
from prefill.scheduler.storage_prefetch import StoragePrefetch
from prefill.stats import ExecutorStats

logger = logging.getLogger(__name__)

CostModel = Callable[[int, int], float]
"""``(new_tokens, prefix_tokens) -> seconds`` of one forward pass (charged to a virtual clock)."""

Batch = list[tuple[PrefillRequest, int]]
"""``(request, new_tokens)`` pairs of one forward pass."""


class BatchRunner:
    """Builds and runs extend batches.

    Args:
        cache: ``hicache.builder.KVCache``; its ``tree`` gives the load-back hooks and ``stats``
            receives one ``record_match`` per admitted attempt.
        kv: the executor's ``RequestKV`` (match, lock, allocate, release).
        model: the paged model; ``forward_extend`` writes each token's KV into its slot.
        chunk_budget: tokens per forward (``chunked_prefill_size``), ``None`` for no limit.
        clock, cost_model: a forward's cost is charged to ``clock`` when ``cost_model`` is set.
        stats: the executor's counters (forward passes, chunks, tokens computed and cached).
        prefetch: the L3 prefetch admission check (``storage_prefetch.StoragePrefetch``); a
            candidate whose prefetch the stop policy still waits for is skipped this step.
    """

    def __init__(
        self,
        cache: Any,
        kv: RequestKV,
        model: PagedTransformer,
        chunk_budget: int | None,
        clock: Clock,
        cost_model: CostModel | None,
        stats: ExecutorStats,
        prefetch: StoragePrefetch | None = None,
    ) -> None:
        self.cache = cache
        self.prefetch = prefetch
        self.kv = kv
        self.model = model
        self.chunk_budget = chunk_budget
        self.clock = clock
        self.cost_model = cost_model
        self.stats = stats
        self.page_size = kv.page_size

    def get_new_batch(
        self,
        chunked_req: PrefillRequest | None,
        candidates: list[PrefillRequest],
        free_request_slots: int,
    ) -> Batch:
        """Pick ``(request, new_tokens)`` pairs within the token budget, allocate their slots
        and launch the host loads their admissions queued (``ready_to_load_host_cache``):
        ``chunked_req`` first, then at most ``free_request_slots`` of ``candidates`` in order.
        Each candidate taken is ``RUNNING`` and holds its prefix lock and slots (the caller
        removes it from the waiting queue); a candidate that does not fit is released again and
        ends the batch. Admission stats are recorded once the batch's forward ran
        (``record_admissions``).

        When the loads' launch fails (``LoadBackError``): every candidate examined gives back
        what it took and recomputes its host hit for the rest of its attempt
        (``skip_load_back``), the tree undoes the loads (``cancel_load_back``) and the batch is
        picked again; each failure flags at least one more request, so this ends. Under tensor
        parallelism the error is raised (a rank-local failure cannot be agreed)."""
        while True:
            batch, examined = self._select(chunked_req, candidates, free_request_slots)
            try:
                self.cache.tree.ready_to_load_host_cache()
                return batch
            except LoadBackError as exc:
                if self.cache.group.size > 1:
                    raise
                logger.warning("host loads not launched; their requests recompute: %s", exc)
                self.undo_admissions([r for r, _ in batch if r is not chunked_req], examined)

    def _select(
        self,
        chunked_req: PrefillRequest | None,
        candidates: list[PrefillRequest],
        free_request_slots: int,
    ) -> tuple[Batch, list[PrefillRequest]]:
        """The batch, and every candidate whose prefix was matched (the last one may have been
        released again)."""
        budget = self.chunk_budget
        batch: Batch = []
        examined: list[PrefillRequest] = []
        if chunked_req is not None:
            req = chunked_req
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
            if self.prefetch is not None and not self.prefetch.ready(req):
                continue  # its L3 prefetch is still wanted: the others go ahead
            self.kv.match_and_lock(req)
            examined.append(req)
            n = self._chunk_len(req, budget)
            if n == 0 or not self.kv.alloc_extend(req, n):
                self.kv.release(req)
                break
            req.stage = Stage.RUNNING
            if self.prefetch is not None:
                self.prefetch.admitted(req)
            free_request_slots -= 1
            batch.append((req, n))
            budget = None if budget is None else budget - n
            if req.computed_len + n < req.num_tokens:
                break  # it becomes the chunked request; one at a time
        return batch, examined

    def record_admissions(self, reqs: list[PrefillRequest]) -> None:
        """The prefix hits of requests whose first forward of this attempt ran. Prefix-hit
        accounting belongs to admission (SGLang's scheduler), once per attempt: the tree's
        re-matches after chunk inserts are not hits."""
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
        """A load back of this batch failed: the ``admitted`` requests give back their lock and
        slots and are ``WAITING`` again (the caller queues them); they and every ``examined``
        one recompute their host hits for the rest of the attempt; then the tree makes the
        loaded nodes host-only again (``cancel_load_back``). Single rank only."""
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

    def forward(self, batch: Batch) -> list[torch.Tensor]:
        """One forward pass over ``batch`` (tokens ``[computed_len, computed_len + n)`` of each
        request, attending to ``slots[:computed_len + n]``). Writes the new tokens' KV into
        their slots, waits per layer for host loads (``tree.layer_wait``), charges the clock (and
        with timed copies, ends no earlier than the last timed load plus one layer's compute).
        Returns each request's last-token logits; request state is the caller's to advance.
        Raises ``LoadBackError`` (nothing charged, nothing counted) when a layer's load failed
        while it ran (thread CPU streams)."""
        inputs = []
        for req, n in batch:
            if req.slots is None:
                raise RuntimeError(f"{req.rid}: in a batch without slots")
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
