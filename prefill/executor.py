"""Optimistic prefill executor: the prefill side of PD disaggregation (SGLang
``SchedulerDisaggregationPrefillMixin`` + ``PrefillBootstrapQueue``), DESIGN.md section 7.

Queues: bootstrap -> waiting -> running (chunked prefill, one chunked request at a time) ->
inflight (parked or transferring). One ``step()`` is one scheduler iteration:

1. poll cache acks (``check_hicache_events``) and finish deferred releases whose reads acked;
2. ``pop_bootstrapped``: peers that failed abort; ready peers are finalized and admitted;
   bootstrapping peers are admitted optimistically while ``optimistic_attempts < N``
   (the attempt is counted at admission);
3. ``resolve_waiting_bootstrap``: waiting requests whose peer failed abort, ready ones finalize;
4. ``process_chunked_req`` (the chunk boundary of the running request): insert its computed
   pages; failed peer -> abort; ready -> finalize and send; still bootstrapping -> yield if a
   bootstrapped request is waiting, else keep computing without sending (adaptive yield);
5. build and run one extend batch of at most ``chunked_prefill_size`` tokens (the chunked
   request first, then waiting requests: bootstrapped ones before optimistic ones, queue order
   within each);
6. for each request whose prefill finished: insert its pages; forced-not-ready -> yield;
   pending -> park; finalized -> send the rest (last chunk);
7. ``process_inflight_queue``: parked + ready -> finalize and send; parked + failed -> abort;
   transfer ``Success`` -> release and report; ``Failed`` -> abort.

Nothing is sent, and ``peer.init`` (the metadata) is not called, before finalize. Yield =
insert computed pages, release slots and lock, reset, requeue at the head of waiting (another
optimistic attempt) or at the tail of bootstrap once attempts are used up. Abort releases
everything (deferred until in-flight reads of its slots ack) and sends nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prefill.bootstrap import DecodePeer, DecodeSide, KVPoll, PeerConfig, force_not_ready
from prefill.clock import Clock, WallClock
from prefill.integrity import check_executor
from prefill.model import ExtendInput, PagedTransformer
from prefill.req_kv import RequestKV
from prefill.request import Outcome, PrefillRequest, RequestResult, Stage
from prefill.stats import ExecutorStats

logger = logging.getLogger(__name__)

CostModel = Callable[[int, int], float]
"""``(new_tokens, prefix_tokens) -> seconds`` of one forward pass (charged to a virtual clock)."""


class OptimisticPrefillExecutor:
    """Runs prefill for submitted requests against a KV cache and simulated decode peers.

    Args:
        args: resolved ``ServerArgs``; reads ``optimistic_prefill_attempts`` (after the gate),
            ``chunked_prefill_size``, ``page_size``, ``max_total_tokens`` and the failure hooks.
        cache: ``hicache.cache.KVCache`` (``device_pool``, ``allocator``, ``tree``, ``stats``);
            built from ``args`` when omitted. Admission records prefix hits in ``cache.stats``.
        model: the paged model; built from ``args`` when omitted.
        clock: time source (``VirtualClock`` for tests); ``WallClock`` when omitted.
        decode: the simulated decode instance; built from ``args`` when omitted.
        cost_model: seconds charged to the clock per forward (virtual clocks only).
    """

    def __init__(
        self,
        args: Any,
        cache: Any = None,
        model: PagedTransformer | None = None,
        clock: Clock | None = None,
        decode: DecodeSide | None = None,
        cost_model: CostModel | None = None,
        decode_pool_size: int | None = None,
    ) -> None:
        if cache is None:
            from hicache.cache import build_kv_cache

            cache = build_kv_cache(args)
        if model is None:
            from prefill.model import build_model

            model = build_model(args)
        self.args = args
        self.cache = cache
        self.model = model
        self.pool = cache.device_pool
        self.tree = cache.tree
        self.allocator = cache.allocator
        self.kv = RequestKV(cache)
        self.clock: Clock = clock if clock is not None else WallClock()
        self.cost_model = cost_model
        self.page_size = self.allocator.page_size
        if decode is not None:
            self.peer_config = decode.config
        else:
            self.peer_config = PeerConfig.from_server_args(args)
            decode = DecodeSide(
                self.pool, self.clock, self.peer_config,
                size=decode_pool_size or self.allocator.size, keep_received=False,
            )
        self.decode = decode
        self.max_attempts = int(args.optimistic_prefill_attempts)
        cps = int(args.chunked_prefill_size)
        self.chunk_budget = cps if cps > 0 else None
        self.stats = ExecutorStats()
        self.requests: dict[str, PrefillRequest] = {}
        self.results: dict[str, RequestResult] = {}
        self.bootstrap_queue: list[PrefillRequest] = []
        self.waiting_queue: list[PrefillRequest] = []
        self.chunked_req: PrefillRequest | None = None
        self.inflight_queue: list[PrefillRequest] = []
        self.releasing: list[PrefillRequest] = []
        self._log_gate_once()

    def _log_gate_once(self) -> None:
        for r in getattr(self.args, "resolutions", []):
            if getattr(r, "field", None) == "optimistic_prefill_attempts" and r.new == 0:
                logger.warning(
                    "optimistic prefill disabled: %s (requested %s attempts); requests wait for "
                    "their decode peer before prefill", r.reason, r.old,
                )
                return

    # ================================================================== public API
    def submit(
        self, rid: str, token_ids: Sequence[int] | torch.Tensor, peer: DecodePeer | None = None
    ) -> None:
        """Queue a request (bootstrap queue). Creates its decode peer unless ``peer`` is given.

        Raises ``ValueError`` (nothing queued) for a duplicate ``rid``, empty or out-of-vocab
        ``token_ids``, or a prompt longer than the device pool.
        """
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty string, got {rid!r}")
        if rid in self.requests:
            raise ValueError(f"rid {rid!r} was already submitted")
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if not ids:
            raise ValueError("token_ids must not be empty")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"token_ids must be ints in [0, {vocab})")
        if len(ids) + self.page_size > self.allocator.size:
            raise ValueError(
                f"token_ids has {len(ids)} tokens; the device pool holds {self.allocator.size}"
            )
        if peer is None:
            peer = self.decode.create_peer(rid, len(ids))
        elif peer.num_tokens != len(ids):
            raise ValueError(f"peer expects {peer.num_tokens} tokens, token_ids has {len(ids)}")
        req = PrefillRequest(
            rid=rid, token_ids=ids, peer=peer, submit_time=self.clock.now(),
            force_not_ready=force_not_ready(rid, self.peer_config.force_not_ready_prob),
        )
        self.requests[rid] = req
        self.bootstrap_queue.append(req)
        self.stats.submitted += 1

    def step(self) -> bool:
        """One scheduler iteration (see the module docstring). Returns whether anything
        changed. Blocks only for the forward pass (and for write_back eviction copies)."""
        before = self._progress_marker()
        self.tree.check_hicache_events()
        self._process_releasing()
        self._pop_bootstrapped()
        self._resolve_waiting_bootstrap()
        self._process_chunked_req()
        batch = self._get_new_batch()
        self.tree.ready_to_load_host_cache()  # loads queued by this step's admissions
        if batch:
            self._run_batch(batch)
        self._process_inflight_queue()
        return bool(batch) or self._progress_marker() != before

    def run_until_idle(self, max_steps: int = 1_000_000, check: bool = False) -> None:
        """Step until every request has a result and every release is done. When nothing can
        progress, waits (virtual: jumps) to the next peer event. ``check`` runs
        ``check_integrity`` after every step. Raises ``RuntimeError`` after ``max_steps``."""
        for _ in range(max_steps):
            if self.is_idle():
                return
            progressed = self.step()
            if check:
                self.check_integrity()
            if not progressed:
                t = self.decode.next_event_time()
                if t is not None and t > self.clock.now():
                    self.clock.wait_until(t)
                else:
                    time.sleep(0.0002)  # a cache ack on a side stream
        raise RuntimeError(f"not idle after {max_steps} steps: {self.describe()}")

    def drain_cache_events(self, timeout_s: float = 30.0) -> None:
        """Block until the cache has acked every backup and load it started (their locks are
        released). For tests and shutdown; raises ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.tree.check_hicache_events()
            pending = len(getattr(self.tree, "ongoing_write_through", ())) + len(
                getattr(self.tree, "ongoing_load_back", ())
            )
            if pending == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pending} cache operations not acked after {timeout_s} s")
            time.sleep(0.0005)

    def is_idle(self) -> bool:
        return not (
            self.bootstrap_queue or self.waiting_queue or self.chunked_req
            or self.inflight_queue or self.releasing
        )

    def result(self, rid: str) -> RequestResult | None:
        return self.results.get(rid)

    def describe(self) -> str:
        return (
            f"bootstrap={[r.rid for r in self.bootstrap_queue]} "
            f"waiting={[r.rid for r in self.waiting_queue]} "
            f"chunked={self.chunked_req.rid if self.chunked_req else None} "
            f"inflight={[r.rid for r in self.inflight_queue]} "
            f"releasing={[r.rid for r in self.releasing]}"
        )

    # ================================================================== polling
    def _forced(self, req: PrefillRequest) -> bool:
        """Test hook: the peer looks not ready until the request's first attempt yielded."""
        return req.force_not_ready and self.max_attempts > 0 and not req.forced_yield_done

    def _poll(self, req: PrefillRequest) -> KVPoll:
        state = req.peer.poll()
        if state == KVPoll.WaitingForInput and req.pending_bootstrap and self._forced(req):
            return KVPoll.Bootstrapping
        return state

    def _finalize(self, req: PrefillRequest) -> None:
        """Bootstrap done: commit this attempt (``peer.init``); sends may follow."""
        assert req.pending_bootstrap
        req.peer.init(req.attempt)
        req.pending_bootstrap = False
        req.start_send_idx = req.peer.decode_prefix_len
        self.stats.finalized += 1

    # ================================================================== queues
    def _admit(self, req: PrefillRequest, optimistic: bool) -> None:
        req.attempt += 1
        req.stage = Stage.WAITING
        req.attempt_log.append((req.attempt, optimistic))
        self.stats.admissions += 1
        if optimistic:
            req.optimistic_attempts += 1
            self.stats.optimistic_admissions += 1
            if self._forced(req):
                self.stats.forced_not_ready += 1

    def _pop_bootstrapped(self) -> None:
        keep = []
        for req in self.bootstrap_queue:
            state = self._poll(req)
            if state == KVPoll.Failed:
                self._abort(req)
            elif state == KVPoll.Bootstrapping:
                if req.optimistic_attempts < self.max_attempts:
                    self._admit(req, optimistic=True)
                    self.waiting_queue.append(req)
                else:
                    keep.append(req)
            elif state == KVPoll.WaitingForInput:
                self._admit(req, optimistic=False)
                self._finalize(req)
                self.waiting_queue.append(req)
            else:
                raise RuntimeError(f"{req.rid}: unexpected {state.name} in the bootstrap queue")
        self.bootstrap_queue = keep

    def _resolve_waiting_bootstrap(self) -> None:
        keep = []
        for req in self.waiting_queue:
            state = self._poll(req)
            if state == KVPoll.Failed:
                self._abort(req)
                continue
            if state == KVPoll.WaitingForInput and req.pending_bootstrap:
                self._finalize(req)
            keep.append(req)
        self.waiting_queue = keep

    def _has_bootstrapped_waiting_req(self) -> bool:
        return any(not r.pending_bootstrap for r in self.waiting_queue)

    # ================================================================== chunk boundary
    def _process_chunked_req(self) -> None:
        req = self.chunked_req
        if req is None:
            return
        self.kv.cache_unfinished(req, chunked=True)
        state = self._poll(req)
        if state == KVPoll.Failed:
            self.chunked_req = None
            self._abort(req)
        elif req.pending_bootstrap:
            if state == KVPoll.WaitingForInput:
                self._finalize(req)
                self._send_kv_chunk(req, last=False)
            elif self._has_bootstrapped_waiting_req():
                self.chunked_req = None
                self._yield(req)
            # else: still bootstrapping, nobody ready is waiting: keep computing, send nothing
        else:
            self._send_kv_chunk(req, last=False)

    def _send_kv_chunk(self, req: PrefillRequest, last: bool) -> None:
        """Send ``[start_send_idx, end)``: whole pages of the computed KV, or all of it when
        ``last``. Only after finalize. The source slots stay owned (tree-locked or request-owned)
        until the request's release, which waits for every ack."""
        assert not req.pending_bootstrap and req.slots is not None
        end = req.num_tokens if last else req.computed_len // self.page_size * self.page_size
        if end <= req.start_send_idx and not last:
            return
        start = req.start_send_idx
        req.peer.send(req.attempt, start, end, req.slots[start:end], last=last)
        req.start_send_idx = end
        self.stats.sends += 1
        self.stats.sent_tokens += end - start

    # ================================================================== batch
    def _get_new_batch(self) -> list[tuple[PrefillRequest, int]]:
        """Pick ``(request, new_tokens)`` pairs within the token budget and allocate their
        slots; the continuing chunked request first, then waiting requests in order."""
        budget = self.chunk_budget
        batch: list[tuple[PrefillRequest, int]] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            n = self._chunk_len(req, budget)
            if n == 0 or not self.kv.alloc_extend(req, n):
                return []  # wait for memory (transfers / loads free it)
            batch.append((req, n))
            budget = None if budget is None else budget - n
        # Bootstrapped (finalized) requests first, so a yield really yields; queue order within
        # each class (a yielded request is at the head of the optimistic ones).
        candidates = sorted(self.waiting_queue, key=lambda r: r.pending_bootstrap)
        for req in candidates:
            if budget is not None and budget < self.page_size:
                break
            self.kv.match_and_lock(req)
            n = self._chunk_len(req, budget)
            if n == 0 or not self.kv.alloc_extend(req, n):
                self.kv.release(req)
                break
            self.waiting_queue.remove(req)
            req.stage = Stage.RUNNING
            self.stats.cached_device_tokens += req.cached_device
            self.stats.cached_host_tokens += req.cached_host
            # Prefix-hit accounting belongs to admission (SGLang's scheduler), once per attempt:
            # the tree's re-matches after chunk inserts are not hits.
            self.cache.stats.record_match(req.cached_device, req.cached_host)
            batch.append((req, n))
            budget = None if budget is None else budget - n
            if req.computed_len + n < req.num_tokens:
                break  # it becomes the chunked request; one at a time
        return batch

    def _chunk_len(self, req: PrefillRequest, budget: int | None) -> int:
        rest = req.num_tokens - req.computed_len
        if budget is None or rest <= budget:
            return rest
        return budget // self.page_size * self.page_size

    def _run_batch(self, batch: list[tuple[PrefillRequest, int]]) -> None:
        inputs = []
        for req, n in batch:
            assert req.slots is not None
            lo = req.computed_len
            ids = torch.tensor(req.token_ids[lo : lo + n], dtype=torch.int64)
            inputs.append(ExtendInput(ids, req.slots[: lo + n], lo))
        logits = self.model.forward_extend(self.pool, inputs, layer_wait=self.tree.layer_wait)
        n_new = sum(n for _, n in batch)
        if self.cost_model is not None:
            self.clock.advance(self.cost_model(n_new, sum(r.computed_len for r, _ in batch)))
        self.stats.forward_passes += 1
        self.stats.chunks += len(batch)
        self.stats.computed_tokens += n_new
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
        self.kv.cache_unfinished(req, chunked=False)
        req.prefill_done_time = self.clock.now()
        if req.pending_bootstrap and self._forced(req):
            self._yield(req)
            return
        req.stage = Stage.INFLIGHT
        self.inflight_queue.append(req)
        if req.pending_bootstrap:
            req.parked = req.was_parked = True
            self.stats.parks += 1
        else:
            self._send_kv_chunk(req, last=True)

    # ================================================================== inflight
    def _process_inflight_queue(self) -> None:
        keep = []
        for req in self.inflight_queue:
            state = self._poll(req)
            if state == KVPoll.Failed:
                self._abort(req)
                continue
            if req.pending_bootstrap:  # parked
                if state == KVPoll.WaitingForInput:
                    self._finalize(req)
                    req.parked = False
                    self._send_kv_chunk(req, last=True)
                keep.append(req)
            elif state == KVPoll.Success:
                self._complete(req)
            else:
                keep.append(req)
        self.inflight_queue = keep

    # ================================================================== yield / abort / done
    # Slot ownership at yield / abort / completion (see prefill/req_kv.py for the ranges):
    #   [0, tree_len)          tree-owned, locked by this request: the lock is dropped.
    #   [tree_len, len(slots)) request-owned: freed. Whole pages computed before the yield were
    #                          inserted first (cache_unfinished), so a retry hits them.
    #   sends in flight        read slots of either range: release waits until peer acks them
    #                          (only after finalize; a yield happens only before finalize, so
    #                          it never has reads in flight).
    def _yield(self, req: PrefillRequest) -> None:
        """Optimistic rollback: keep computed pages in the tree, release, reset, requeue."""
        assert req.pending_bootstrap and req.peer.inflight_reads() == 0
        self.kv.cache_unfinished(req, chunked=req.computed_len < req.num_tokens)
        self.kv.release(req)
        req.reset_attempt()
        req.yields += 1
        self.stats.yields += 1
        if self._forced(req):
            req.forced_yield_done = True
        if req.optimistic_attempts >= self.max_attempts:
            logger.info("%s used %d optimistic attempts: back to bootstrap", req.rid,
                        req.optimistic_attempts)
            req.stage = Stage.BOOTSTRAP
            self.bootstrap_queue.append(req)
            self.stats.fallbacks += 1
        else:
            self._admit(req, optimistic=True)
            self.waiting_queue.insert(0, req)
            self.stats.retries += 1

    def _abort(self, req: PrefillRequest) -> None:
        """The peer failed: drop the request from every queue (caller removes it from the one
        being iterated), release its KV once no send reads it, report the error."""
        before_finalize = req.pending_bootstrap
        self.stats.aborts += 1
        if before_finalize:
            self.stats.bootstrap_failures += 1
        else:
            self.stats.transfer_failures += 1
        if self.chunked_req is req:
            self.chunked_req = None
        req.stage = Stage.RELEASING
        self.releasing.append(req)
        self._process_releasing()
        self._report(req, Outcome.ABORTED, req.peer.failure or "decode peer failed")

    def _process_releasing(self) -> None:
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

    # ================================================================== integrity
    def _progress_marker(self) -> tuple:
        return (
            len(self.results), self.stats.sends, self.stats.admissions, self.stats.finalized,
            len(self.releasing), len(self.inflight_queue), self.stats.yields,
        )

    def request_owned_slots(self) -> int:
        """Device slots owned by requests (not the tree), including aborted ones whose
        release waits for in-flight reads."""
        return sum(r.owned_slots() for r in self.requests.values() if r.stage != Stage.DONE)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` on leaked slots or locks or inconsistent queues (see
        ``prefill.integrity.check_executor``). Cheap enough for tests to call every step."""
        check_executor(self)
