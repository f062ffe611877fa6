"""Optimistic prefill executor: the prefill side of PD disaggregation (SGLang
``SchedulerDisaggregationPrefillMixin``); design in docs/DESIGN.md section 7.

One ``step()`` is one scheduler iteration: (0) rank 0's inputs reach every rank; (1) cache
acks; (2-3) admission; (4) the chunked request's boundary; (5-6) one extend batch and the end
of its prefills; (7) the inflight queue. Results wait for ``pop_results()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hicache_prefill.hicache.tp.group import TPGroup
from hicache_prefill.prefill.clock import Clock, WallClock
from hicache_prefill.prefill.disagg.backends import make_decode_backend
from hicache_prefill.prefill.disagg.protocol import DecodeBackend, DecodeLink, force_not_ready
from hicache_prefill.prefill.executor_stats import ExecutorStats
from hicache_prefill.prefill.integrity import check_executor
from hicache_prefill.prefill.model.paged import PagedTransformer
from hicache_prefill.prefill.request.kv import RequestKV
from hicache_prefill.prefill.request.state import PrefillRequest, RequestResult
from hicache_prefill.prefill.scheduler.admission import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    AdmissionQueue,
    ReqToMetadataIdxAllocator,
    check_gate,
    log_gate_once,
    metadata_buffer_count,
    resolved_attempts,
)
from hicache_prefill.prefill.scheduler.batch_runner import BatchRunner, CostModel
from hicache_prefill.prefill.scheduler.inflight_queue import InflightQueue
from hicache_prefill.prefill.scheduler.pending_kv import PendingKV
from hicache_prefill.prefill.scheduler.storage_prefetch import StoragePrefetch
from hicache_prefill.prefill.tp_lockstep.driver import TPDriver, agreed_clock
from hicache_prefill.prefill.tp_lockstep.sync import PeerPolls

if TYPE_CHECKING:
    from hicache_prefill.hicache.builder import KVCache
    from hicache_prefill.server_args import ServerArgs


class OptimisticPrefillExecutor:
    """``cache``, ``model`` and ``decode`` are built from ``args`` when omitted. Raises
    ``ValueError`` when the gate would not keep ``args``' attempts for the cache, or for a
    ``group`` / ``decode`` that does not match the cache."""

    def __init__(
        self,
        args: ServerArgs,
        cache: KVCache | None = None,
        model: PagedTransformer | None = None,
        clock: Clock | None = None,
        decode: DecodeBackend | None = None,
        cost_model: CostModel | None = None,
        decode_pool_size: int | None = None,
        group: TPGroup | None = None,
    ) -> None:
        self.max_attempts = resolved_attempts(args)
        if cache is None:
            from hicache_prefill.hicache.builder import build_kv_cache

            built = build_kv_cache(args, group=group)
            try:
                check_gate(args, built, self.max_attempts)
            except ValueError:
                built.close()
                raise
            cache = built
        else:
            check_gate(args, cache, self.max_attempts)
        if group is not None and group is not cache.group:
            raise ValueError("group: the cache was built on another group")
        self.group: TPGroup = cache.group
        self.clock: Clock = agreed_clock(
            clock if clock is not None else WallClock(), self.group, decode
        )
        if model is None:
            from hicache_prefill.prefill.model.factory import build_model

            model = build_model(args)
        self.args = args
        self.cache = cache
        self.model = model
        self.pool = cache.device_pool
        self.tree = cache.tree
        self.allocator = cache.allocator
        self.page_size = self.allocator.page_size
        mrr = args.max_running_requests
        self.max_running_requests = int(mrr) if mrr else DEFAULT_MAX_RUNNING_REQUESTS
        n_metadata = metadata_buffer_count(self.max_running_requests)
        if decode is None:
            decode = make_decode_backend(
                args,
                self.pool,
                self.clock,
                n_metadata,
                decode_pool_size=decode_pool_size or self.allocator.size,
            )
        self.decode: DecodeBackend = decode
        self.stats = ExecutorStats()
        self.requests: dict[str, PrefillRequest] = {}
        self.kv = RequestKV(cache, self.stats)
        self.storage_prefetch = StoragePrefetch(cache, self.clock)
        self.admission = AdmissionQueue(self.max_attempts, self.stats, n_metadata, self.group)
        if self.kv.l3_pages is not None:  # pages of attempts not finalized must not reach L3
            self.admission.on_finalize = self.kv.l3_pages.finalized
        self.pending = PendingKV(self.kv, self.admission, self.storage_prefetch)
        self.inflight = InflightQueue(
            self.pending, self.clock, self.max_running_requests, on_done=self._forget
        )
        self.batch_runner = BatchRunner(args, cache, model, cost_model, self.inflight)
        self.driver = TPDriver(
            self.group,
            self.clock,
            accept=self._accept,
            release=self.decode.release,
            drop_results=self.results.clear,
        )
        log_gate_once(args)

    @property
    def metadata(self) -> ReqToMetadataIdxAllocator:
        return self.admission.metadata

    @property
    def polls(self) -> PeerPolls:
        return self.admission.polls

    @property
    def unpublished_pending(self) -> bool:
        return self.pending.unpublished

    def submit(
        self, rid: str, token_ids: Sequence[int] | torch.Tensor, peer: DecodeLink | None = None
    ) -> None:
        """Queue a request; raises ``ValueError`` (nothing queued) for a ``rid`` in flight or
        not popped yet, bad ``token_ids``, a prompt the device pool cannot hold, or on rank > 0."""
        self.driver.check_submit()
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty string, got {rid!r}")
        if rid in self.requests or self.driver.pending(rid):
            raise ValueError(f"rid {rid!r} is already in flight")
        if rid in self.results:
            raise ValueError(f"rid {rid!r} has a result not popped yet (pop_results)")
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if not ids:
            raise ValueError("token_ids must not be empty")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"token_ids must be ints in [0, {vocab})")
        if len(ids) + self.page_size > self.allocator.size:
            self.stats.rejected += 1
            raise ValueError(
                f"token_ids has {len(ids)} tokens; the device pool holds {self.allocator.size}"
            )
        if peer is not None and peer.num_tokens != len(ids):
            raise ValueError(f"peer expects {peer.num_tokens} tokens, token_ids has {len(ids)}")
        self.driver.submit(rid, ids, peer)

    def _accept(
        self, rid: str, ids: list[int], peer: DecodeLink | None, submit_time: float
    ) -> None:
        if peer is None:
            peer = self.decode.create_peer(rid, len(ids), ids)
        req = PrefillRequest(
            rid=rid,
            token_ids=ids,
            peer=peer,
            submit_time=submit_time,
            force_not_ready=force_not_ready(rid, self.decode.force_not_ready_prob),
        )
        self.requests[rid] = req
        self.admission.add(req)
        self.storage_prefetch.on_arrival(req)  # the L3 lookup overlaps the bootstrap
        self.stats.submitted += 1

    def release_received(self, rid: str) -> None:
        """Free the decode side's kept KV of ``rid`` (under TP: on every rank, next step)."""
        self.driver.release(rid)

    def step(self) -> bool:
        """Returns whether anything changed."""
        self.driver.sync()
        try:
            return self._step()
        finally:
            self.driver.release_clock()

    def follow(self, after_step: Callable[[], object] | None = None) -> None:
        """Ranks other than 0: mirror rank 0's steps until it calls ``stop_followers``."""
        self.driver.follow(self._step, after_step)

    def stop_followers(self) -> None:
        self.driver.stop_followers()

    def _step(self) -> bool:
        before = self._progress_marker()
        self.tree.check_hicache_events()  # 1
        for req in self.admission.pop_bootstrapped():  # 2
            self.batch_runner.abort(req)
        for req in self.admission.resolve_waiting_bootstrap():  # 3
            self.batch_runner.abort(req)
        self.batch_runner.process_chunked_req()  # 4
        batch = self.batch_runner.get_new_batch()  # 5 (launches the loads its admissions queued)
        if batch:
            self.batch_runner.run_batch(batch)  # 5-6
        self.inflight.process_inflight_queue(int(self.chunked_req is not None))  # 7
        return bool(batch) or self._progress_marker() != before

    def run_until_idle(
        self,
        max_steps: int = 1_000_000,
        check: bool = False,
        after_step: Callable[[], object] | None = None,
    ) -> None:
        """Step until every request has its outcome. Raises ``RuntimeError`` when nothing can
        change any more or after ``max_steps``."""
        due_now = 0
        try:
            for _ in range(max_steps):
                self.driver.sync()
                if self.is_idle():
                    return
                progressed = self._step()
                if after_step is not None:
                    after_step()
                if check:
                    self.check_integrity()
                due_now = 0 if progressed else self.wait_for_next_event(due_now)
        finally:
            self.driver.release_clock()
        raise RuntimeError(f"not idle after {max_steps} steps: {self.describe()}")

    def wait_for_next_event(
        self, due_now: int, also: float | None = None, local: bool = False
    ) -> int:
        """After a step that changed nothing: wait for the first peer / copy / storage event
        (or ``also``) ahead; else allow two more steps for one due now. ``local``: no
        collective. Returns the new ``due_now``; raises ``RuntimeError`` when nothing can change."""
        now = self.clock.now()
        peer_t = self.decode.next_event_time() if local else self.polls.next_event_time(self.decode)
        copy_t = self._next_ack_time()
        storage = self.cache.storage
        deadline = storage.next_deadline() if storage is not None else None
        times = [t for t in (peer_t, also, copy_t, deadline) if t is not None]
        ahead = [t for t in times if t > now]
        copies = self.cache_copies_in_flight()
        if ahead:
            self.clock.wait_until(min(ahead), poll_s=0.0005 if copies else None)
            return 0
        if copies:
            time.sleep(0.0002)
            return due_now
        if times and due_now < 2:
            return due_now + 1  # the next step sees it
        raise RuntimeError(f"stalled at t={now:.6f}: nothing can progress; {self.describe()}")

    def _next_ack_time(self) -> float | None:
        controller = self.cache.controller
        return None if controller is None else controller.next_ack_time()

    def cache_copies_in_flight(self) -> int:
        storage = self.cache.storage
        return (
            len(getattr(self.tree, "ongoing_write_through", ()))
            + len(getattr(self.tree, "ongoing_load_back", ()))
            + (storage.ops_in_flight() if storage is not None else 0)
        )

    def drain_cache_events(self, timeout_s: float = 30.0) -> None:
        """Block until every cache copy is acked; ``TimeoutError`` (agreed) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self._next_ack_time()
            if ready is not None:  # timed copies: their acks come at their modelled end
                self.clock.wait_until(ready)
            self.tree.check_hicache_events()
            pending = self.cache_copies_in_flight()
            if pending == 0:
                return
            if self.group.agree_any(time.monotonic() > deadline, tag="drain_deadline"):
                raise TimeoutError(f"{pending} cache operations not acked after {timeout_s} s")
            time.sleep(0.0005)

    def is_idle(self) -> bool:
        return not (
            self.bootstrap_queue
            or self.waiting_queue
            or self.chunked_req
            or self.inflight_queue
            or self.draining_queue
        )

    def result(self, rid: str) -> RequestResult | None:
        return self.results.get(rid)

    def pop_results(self) -> list[RequestResult]:
        out = list(self.results.values())
        self.results.clear()
        return out

    def describe(self) -> str:
        return (
            f"bootstrap={[r.rid for r in self.bootstrap_queue]} "
            f"waiting={[r.rid for r in self.waiting_queue]} "
            f"chunked={self.chunked_req.rid if self.chunked_req else None} "
            f"inflight={[r.rid for r in self.inflight_queue]} "
            f"draining={[r.rid for r in self.draining_queue]}"
        )

    @property
    def bootstrap_queue(self) -> list[PrefillRequest]:
        return self.admission.bootstrap_queue

    @property
    def waiting_queue(self) -> list[PrefillRequest]:
        return self.admission.waiting_queue

    @property
    def chunked_req(self) -> PrefillRequest | None:
        return self.batch_runner.chunked_req

    @property
    def inflight_queue(self) -> list[PrefillRequest]:
        return self.inflight.inflight_queue

    @property
    def draining_queue(self) -> list[PrefillRequest]:
        return self.inflight.draining_queue

    @property
    def results(self) -> dict[str, RequestResult]:
        return self.inflight.results

    def _forget(self, req: PrefillRequest) -> None:
        self.storage_prefetch.on_outcome(req)
        if self.kv.l3_pages is not None:
            self.kv.l3_pages.forget(req)
        del self.requests[req.rid]

    def _progress_marker(self) -> tuple:
        s = self.stats
        return (
            s.successes,
            s.aborts,
            s.sends,
            s.admissions,
            s.finalized,
            s.yields,
            len(self.inflight_queue),
            len(self.bootstrap_queue),
            len(self.draining_queue),
        )

    def request_owned_slots(self) -> int:
        return sum(r.owned_slots() for r in self.requests.values())

    def check_integrity(self) -> None:
        check_executor(self)
