"""Optimistic prefill executor: the prefill side of PD disaggregation (SGLang
``SchedulerDisaggregationPrefillMixin`` + ``PrefillBootstrapQueue``), see docs/DESIGN.md.

Queues: bootstrap -> waiting -> running (chunked prefill, one chunked request at a time) ->
inflight (parked or transferring). One ``step()`` is one scheduler iteration:

0. tensor parallelism only: rank 0's new requests, decode-side releases and clock reading
   reach every rank (``TPDriver.sync``);
1. poll cache acks (``check_hicache_events``);
2. ``pop_bootstrapped``: peers that failed abort; ready peers are finalized and admitted;
   bootstrapping peers are admitted optimistically while ``optimistic_attempts < N`` (the
   attempt is counted at admission); every admission takes a metadata buffer;
3. ``resolve_waiting_bootstrap``: waiting requests whose peer failed abort, ready ones finalize;
4. ``process_chunked_req`` (the chunk boundary of the running request): publish its computed
   pages; failed peer -> abort; ready -> finalize, publish and send; still bootstrapping ->
   yield if a bootstrapped request is waiting, else keep computing without sending (adaptive
   yield);
5. build and run one extend batch of at most ``chunked_prefill_size`` tokens (the chunked
   request first, then waiting requests: bootstrapped ones before optimistic ones, queue order
   within each) while fewer than ``max_running_requests`` requests hold KV; the host loads
   its admissions queued are launched before its forward (``ready_to_load_host_cache``); a load
   that fails (at its launch, or under the forward) sends its requests back to recompute their
   host hits (``prefill.scheduler.batch``);
6. for each request whose prefill finished: publish its pages; forced-not-ready -> yield;
   pending -> park; finalized -> send the rest (last chunk);
7. ``process_inflight_queue``: aborted requests whose transport reads none of their sends any
   more are released and reported (draining); parked + ready -> finalize, publish and send;
   parked + failed -> abort; parked + bootstrapping while every running slot is held and others
   wait -> yield; transfer ``Success`` -> release and report; ``Failed`` -> abort.

**Publishing a pending attempt's KV** follows what the tree declares of its write policy
(``tree.backs_up_on_insert``; ``prefill.scheduler.pending_kv``): without backups at insert (device
only, L2 ``write_back``) a pending attempt inserts its computed pages at chunk boundaries, at the
end of its prefill and at a yield, so a retry hits them; with them (L2 ``write_through*``) its KV
stays request-owned until finalize inserts it once, before the first send (SGLang 0.5.23
``advance_unpublished_req``), and a yield or abort frees it unpublished. No host page is ever
written from an attempt that is not finalized (``stats.speculative_l2_pages``, checked by
``check_integrity``). At build, optimism is refused (``ValueError`` naming the flags) unless the
gate keeps it for the policy the tree declares, so ServerArgs changed after resolution, or a
cache built from other flags, cannot run optimism the gate turned off.

Nothing is sent, and ``peer.init`` (the metadata) is not called, before finalize. Yield =
publish what the policy allows, release slots and lock, reset, requeue at the head of waiting
(another optimistic attempt) or at the tail of bootstrap once attempts are used up. Abort sends
nothing more and releases everything once the transport reads none of the request's sends (at
once with the simulation; with a real transport after its running call returned).

Long runs: a request is forgotten once its outcome is reported; results wait in ``results``
until ``pop_results()`` hands them out (``result(rid)`` reads one not yet popped), after which
the rid may be submitted again. Memory and the cost of a step depend on the requests in flight,
not on how many have finished.

This file owns the public API, the step order and the wiring of its delegates:
``prefill.scheduler.admission`` (steps 2-3: bootstrap and waiting queues, attempts, metadata
buffers, finalize, requeue after a yield), ``prefill.scheduler.chunked`` (steps 4-6: the running
(chunked) request, its chunk boundaries, the batch, the end of its prefill, yield),
``prefill.scheduler.batch`` (step 5's selection and forward pass), ``prefill.scheduler.pending_kv``
(what publish and yield do with a pending attempt's KV), ``prefill.scheduler.sends`` (sends, step 7,
abort, results), ``prefill.request.kv`` (a request's slots and lock) and ``prefill.tp.driver`` (rank
0's inputs and the follow protocol).

**Tensor parallelism** (``--tp-size N``, the cache's ``group``): every rank runs this executor
over its shard of the KV heads, with the tensor-parallel model and its own decode side (each
rank sends its own shard). Only rank 0 accepts ``submit``; each step starts with rank 0's
broadcast of new requests, decode-side releases and its clock reading (``prefill.tp.driver``
over ``prefill.tp.sync``), so every rank schedules the same batches from the same inputs; peer
polls are MIN-reduced and cache decisions agreed, and each batch is checked against rank 0's.
Every rank calls ``step`` / ``run_until_idle`` / ``drain_cache_events`` in the same order; a
driver on rank 0 alone (submitting as requests arrive) pairs with ``follow()`` on the other
ranks and ends with ``stop_followers()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.tp.group import SingleRankGroup, TPGroup
from prefill.clock import Clock, WallClock
from prefill.disagg.backends import make_decode_backend
from prefill.disagg.protocol import DecodeBackend, DecodeLink, force_not_ready
from prefill.integrity import check_executor
from prefill.model.paged import PagedTransformer
from prefill.request.kv import RequestKV
from prefill.request.state import PrefillRequest, RequestResult
from prefill.scheduler.admission import AdmissionQueue
from prefill.scheduler.batch import BatchRunner, CostModel
from prefill.scheduler.chunked import ChunkedPrefill
from prefill.scheduler.gate import check_gate, log_gate_once, resolved_attempts
from prefill.scheduler.l3_provenance import SpeculativeL3Pages
from prefill.scheduler.metadata_buffers import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    ReqToMetadataIdxAllocator,
    metadata_buffer_count,
)
from prefill.scheduler.pending_kv import PendingKV
from prefill.scheduler.sends import InflightQueue
from prefill.scheduler.storage_prefetch import StoragePrefetch
from prefill.stats import ExecutorStats
from prefill.tp.driver import TPDriver, agreed_clock
from prefill.tp.sync import PeerPolls

__all__ = ["CostModel", "OptimisticPrefillExecutor"]

logger = logging.getLogger(__name__)


class OptimisticPrefillExecutor:
    """Runs prefill for submitted requests against a KV cache and decode peers.

    Args:
        args: resolved ``ServerArgs``; reads ``optimistic_prefill_attempts`` (after the gate),
            ``optimistic_prefill_write_through`` and the other gate fields (checked against the
            cache, see the module docstring), ``max_running_requests``,
            ``chunked_prefill_size``, ``page_size``, ``max_total_tokens`` and the failure hooks.
        cache: ``hicache.builder.KVCache`` (``device_pool``, ``allocator``, ``tree``, ``stats``);
            built from ``args`` when omitted. Admission records prefix hits in ``cache.stats``.
        model: the paged model; built from ``args`` when omitted.
        clock: time source (``VirtualClock`` for tests); ``WallClock`` when omitted.
        decode: the decode instance (a ``prefill.disagg.protocol.DecodeBackend``); when
            omitted, the one ``--disaggregation-transfer-backend`` names, built from ``args``
            (``prefill.disagg.backends``; the in-process simulation by default).
        cost_model: seconds charged to the clock per forward (virtual clocks only); a cache
            built with a ``copy_timer`` pops each copy's ack at its modelled end.
        group: the tensor-parallel cache group (``hicache.tp.group.new_cache_group()``) when
            the cache is built here; otherwise the cache's. At more than one rank the clock is
            wrapped in an ``AgreedClock`` (a given ``decode`` must use that same clock object)
            and the model, when built here, is ``TPPagedTransformer``.

    Raises ``ValueError`` when ``args`` asks for optimistic attempts the gate would not keep for
    the write policy the cache's tree declares, or for a ``group`` / ``decode`` that does not
    match the cache.
    """

    def __init__(
        self,
        args: Any,
        cache: Any = None,
        model: PagedTransformer | None = None,
        clock: Clock | None = None,
        decode: DecodeBackend | None = None,
        cost_model: CostModel | None = None,
        decode_pool_size: int | None = None,
        group: TPGroup | None = None,
    ) -> None:
        max_attempts = resolved_attempts(args)
        if cache is None:
            from hicache.builder import build_kv_cache

            built = build_kv_cache(args, group=group)
            try:
                check_gate(args, built, max_attempts)
            except ValueError:
                built.close()
                raise
            cache = built
        else:
            check_gate(args, cache, max_attempts)
        cache_group = getattr(cache, "group", None) or SingleRankGroup()
        if group is not None and group is not cache_group:
            raise ValueError("group: the cache was built on another group")
        self.group: TPGroup = cache_group
        clock = agreed_clock(clock if clock is not None else WallClock(), self.group, decode)
        if model is None:
            from prefill.model.factory import build_model

            model = build_model(args)
        self.args = args
        self.cache = cache
        self.model = model
        self.pool = cache.device_pool
        self.tree = cache.tree
        self.allocator = cache.allocator
        self.clock: Clock = clock
        self.page_size = self.allocator.page_size
        mrr = getattr(args, "max_running_requests", None)
        self.max_running_requests = int(mrr) if mrr else DEFAULT_MAX_RUNNING_REQUESTS
        n_metadata = metadata_buffer_count(self.max_running_requests)
        if decode is None:
            decode = make_decode_backend(
                args, self.pool, self.clock, n_metadata,
                decode_pool_size=decode_pool_size or self.allocator.size,
            )  # fmt: skip
        self.decode: DecodeBackend = decode
        self.max_attempts = max_attempts
        # A pending attempt's KV is never inserted into a tree that backs up at insert.
        self.unpublished_pending = bool(self.tree.backs_up_on_insert)
        cps = int(args.chunked_prefill_size)
        self.chunk_budget = cps if cps > 0 else None
        self.stats = ExecutorStats()
        self.kv = RequestKV(cache, self.stats)
        self.storage_prefetch = StoragePrefetch(cache, self.clock)
        self.requests: dict[str, PrefillRequest] = {}
        self.metadata = ReqToMetadataIdxAllocator(n_metadata)
        self.polls = PeerPolls(self.group)
        self.driver = TPDriver(
            self.group, self.clock, accept=self._accept, release=self.decode.release,
            drop_results=lambda: self.results.clear(),
        )  # fmt: skip
        self.admission = AdmissionQueue(self.max_attempts, self.stats, self.metadata, self.polls)
        self.batch_runner = BatchRunner(
            cache, self.kv, model, self.chunk_budget, self.clock, cost_model, self.stats,
            prefetch=self.storage_prefetch,
        )  # fmt: skip
        self.pending = PendingKV(
            self.kv, self.admission, self.stats, self.unpublished_pending,
            prefetch=self.storage_prefetch,
        )  # fmt: skip
        self.l3_provenance: SpeculativeL3Pages | None = None
        storage = getattr(cache, "storage", None)
        if storage is not None:  # pages of attempts not finalized must not reach L3
            self.l3_provenance = SpeculativeL3Pages(self.page_size, self.stats)
            self.kv.on_pending_insert = self.l3_provenance.record
            self.admission.on_finalize.append(self.l3_provenance.finalized)
            storage.add_write_observer(self.l3_provenance.observe)
        self.inflight = InflightQueue(
            self.kv, self.admission, self.pending, self.clock, self.stats,
            on_done=self._forget, max_running_requests=self.max_running_requests,
        )  # fmt: skip
        self.chunked = ChunkedPrefill(
            self.admission, self.pending, self.inflight, self.batch_runner, self.clock,
            self.group, self.max_running_requests,
        )  # fmt: skip
        log_gate_once(args)

    # ================================================================== public API
    def submit(
        self, rid: str, token_ids: Sequence[int] | torch.Tensor, peer: DecodeLink | None = None
    ) -> None:
        """Queue a request (bootstrap queue). Creates its decode peer unless ``peer`` is given.

        Raises ``ValueError`` (nothing queued) for a ``rid`` in flight or whose result was not
        popped yet, empty or out-of-vocab ``token_ids``, or a prompt longer than the device pool
        (counted in ``stats.rejected``).

        Under tensor parallelism only rank 0 accepts requests (others raise ``ValueError``) and
        ``peer`` must be omitted (every rank creates its own); the request is queued at the
        next step on every rank, with rank 0's submit time.
        """
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
            rid=rid, token_ids=ids, peer=peer, submit_time=submit_time,
            force_not_ready=force_not_ready(rid, self.decode.force_not_ready_prob),
        )  # fmt: skip
        self.requests[rid] = req
        self.admission.add(req)
        self.storage_prefetch.on_arrival(req)  # the L3 lookup overlaps the bootstrap
        self.stats.submitted += 1

    def release_received(self, rid: str) -> None:
        """Free the decode side's kept KV of ``rid`` (``decode.release``); under tensor
        parallelism rank 0 asks and every rank frees its own at the next step (on the other
        ranks this call does nothing: rank 0's request reaches them)."""
        self.driver.release(rid)

    def step(self) -> bool:
        """One scheduler iteration (see the module docstring). Returns whether anything
        changed. Blocks only for the forward pass (and for write_back eviction copies; under
        tensor parallelism for the group's collectives)."""
        self.driver.sync()
        try:
            return self._step()
        finally:
            self.driver.release_clock()

    def follow(self, after_step: Any = None) -> None:
        """Ranks other than 0 of a tensor-parallel group, while rank 0 alone drives (submits,
        ``step``s): mirror rank 0's steps until it calls ``stop_followers``. ``after_step()``
        runs after every step, matching what rank 0 does between steps (e.g.
        ``drain_cache_events``). Results are rank 0's to hand out; a follower keeps none."""
        self.driver.follow(self._step, after_step)

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' ``follow`` (one more broadcast, no step)."""
        self.driver.stop_followers()

    def _step(self) -> bool:
        before = self._progress_marker()
        self.tree.check_hicache_events()  # 1
        for req in self.admission.pop_bootstrapped():  # 2
            self.chunked.abort(req)
        for req in self.admission.resolve_waiting_bootstrap():  # 3
            self.chunked.abort(req)
        self.chunked.process_chunked_req()  # 4
        batch = self.chunked.get_new_batch()  # 5 (launches the loads its admissions queued)
        if batch:
            self.chunked.run_batch(batch)  # 5-6
        self.inflight.process_inflight_queue(int(self.chunked.chunked_req is not None))  # 7
        return bool(batch) or self._progress_marker() != before

    def run_until_idle(
        self,
        max_steps: int = 1_000_000,
        check: bool = False,
        after_step: Callable[[], object] | None = None,
    ) -> None:
        """Step until every request has its outcome. When a step changes nothing, waits
        (virtual clock: jumps) to the next peer event, or for the cache's next ack while copies
        are in flight (``wait_for_next_event``); never steps in place. ``check`` runs
        ``check_integrity`` after every step, ``after_step()`` runs after every step (e.g.
        ``drain_cache_events``, so a virtual-clock run does not depend on thread timing).
        Raises ``RuntimeError`` when nothing can change any more (no step progress, no peer
        event ahead, no copy in flight) or after ``max_steps``. This is the project's one
        drive-until-idle loop; drivers that submit as they go call ``wait_for_next_event``."""
        try:
            self._run_until_idle(max_steps, check, after_step)
        finally:
            self.driver.release_clock()

    def _run_until_idle(
        self, max_steps: int, check: bool, after_step: Callable[[], object] | None
    ) -> None:
        due_now = 0
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
        raise RuntimeError(f"not idle after {max_steps} steps: {self.describe()}")

    def wait_for_next_event(
        self, due_now: int, also: float | None = None, local: bool = False
    ) -> int:
        """After a step that changed nothing: wait (virtual clock: jump) to the first time ahead
        among the next peer event (agreed over ranks), ``also`` (a caller's own next event,
        such as an arrival), the next timed copy's end (``HiCacheController.next_ack_time``)
        and the storage
        tier's next deadline (``cache.storage``, when it has one); else sleep
        briefly while the cache has copies in flight (an ack comes from a side stream); else
        allow two more steps for an event due now. Never steps in place. On a wall clock with
        copies in flight the wait is cut to 0.5 ms, so an ack is seen as it lands. ``local``:
        this rank's peer events only, no collective (rank 0 driving alone while the other ranks
        ``follow``). Returns the new count of steps taken for an event due now (``due_now``, 0
        after a step that progressed). Raises ``RuntimeError`` when nothing can change."""
        now = self.clock.now()
        peer_t = self.decode.next_event_time() if local else self.polls.next_event_time(self.decode)
        copy_t = self._next_ack_time()
        storage = getattr(self.cache, "storage", None)
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
        controller = getattr(self.cache, "controller", None)
        return None if controller is None else controller.next_ack_time()

    def cache_copies_in_flight(self) -> int:
        """Cache copies whose acks are not in: D2H backups, H2D loads and L3 operations."""
        storage = getattr(self.cache, "storage", None)
        return (
            len(getattr(self.tree, "ongoing_write_through", ()))
            + len(getattr(self.tree, "ongoing_load_back", ()))
            + (storage.ops_in_flight() if storage is not None else 0)
        )

    def drain_cache_events(self, timeout_s: float = 30.0) -> None:
        """Block until the cache has acked every backup and load it started (their locks are
        released). For tests and shutdown; raises ``TimeoutError`` after ``timeout_s`` (on every
        rank once any rank's deadline passed: the loop's exit is agreed)."""
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
        """The result of ``rid`` if it finished and was not popped yet."""
        return self.results.get(rid)

    def pop_results(self) -> list[RequestResult]:
        """Hand out every result not popped yet, in finish order, and forget them (their rids
        may be submitted again)."""
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

    # ================================================================== queues (read-only views)
    @property
    def bootstrap_queue(self) -> list[PrefillRequest]:
        return self.admission.bootstrap_queue

    @property
    def waiting_queue(self) -> list[PrefillRequest]:
        return self.admission.waiting_queue

    @property
    def chunked_req(self) -> PrefillRequest | None:
        """The running request whose prompt is not done yet (one at a time)."""
        return self.chunked.chunked_req

    @property
    def inflight_queue(self) -> list[PrefillRequest]:
        return self.inflight.inflight_queue

    @property
    def draining_queue(self) -> list[PrefillRequest]:
        """Aborted requests that keep their KV until the transport reads none of their sends."""
        return self.inflight.draining_queue

    @property
    def results(self) -> dict[str, RequestResult]:
        """Results not popped yet, by rid, in finish order."""
        return self.inflight.results

    def _forget(self, req: PrefillRequest) -> None:
        """``req`` has its outcome: the executor keeps nothing of it but the result."""
        self.storage_prefetch.on_outcome(req)
        if self.l3_provenance is not None:
            self.l3_provenance.forget(req)
        del self.requests[req.rid]

    # ================================================================== integrity
    def _progress_marker(self) -> tuple:
        s = self.stats
        return (
            s.successes, s.aborts, s.sends, s.admissions, s.finalized, s.yields,
            len(self.inflight_queue), len(self.bootstrap_queue), len(self.draining_queue),
        )  # fmt: skip

    def request_owned_slots(self) -> int:
        """Device slots owned by requests in flight (not the tree)."""
        return sum(r.owned_slots() for r in self.requests.values())

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` on leaked slots, locks or metadata buffers, inconsistent
        queues, or a host page written from an attempt that was not finalized (see
        ``prefill.integrity.check_executor``). Cheap enough for tests to call every step."""
        check_executor(self)
