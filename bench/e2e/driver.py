"""Shared machinery of the end-to-end benchmarks: the executor on a virtual or a wall clock, and
the request driver.

Two clocks (``--clock``):

- ``virtual`` (default, the headline mode): the executor's ``VirtualClock``, charged by
  ``bench.clock.virtual_cost.CostAccountant`` from a calibration measured in the same run
  (``bench.clock.calibrate``). The real model computes every forward and the cache moves every byte;
  after each scheduler step the driver waits for the cache's real copies and pops their acks
  (``drain_cache_events``), so what happens depends only on the trace's seed and the
  calibration, never on thread timing or other jobs on the machine.
- ``wall``: monotonic wall time; copies overlap for real, and results move with the machine's
  load.

TTFT is measured from the moment a request is *sent*: its arrival time, or later when the
client was waiting for its previous round or for a free slot under ``max_parallel`` (as a
benchmark client measures it), to the decode side's transfer ``Success``.

On CUDA every configuration of a benchmark shares one model (the 8B-shaped model is ~14.5 GB),
and what a configuration allocated is given back before the next one is built:
``release_executor`` then ``free_memory``. ``time_left`` reads the deadline that
``bench/gpu_check.sh`` gives each step, so a benchmark skips what it can no longer finish.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.clock.calibrate import Calibration
from bench.clock.virtual_cost import CostAccountant, RecordingModel
from bench.common import DEADLINE_ENV, time_left
from hicache.tp.group import TPGroup
from prefill.clock import VirtualClock, WallClock
from prefill.disagg.sim_config import PeerConfig
from prefill.executor import OptimisticPrefillExecutor
from prefill.model.paged import ModelConfig, PagedTransformer
from prefill.request.state import Outcome, RequestResult
from prefill.testing.harness import make_executor
from prefill.tp.driver import agreed_clock
from server_args import ServerArgs

logger = logging.getLogger(__name__)

__all__ = ["DEADLINE_ENV", "Driver", "TraceRun", "model_args", "new_executor", "settle",
           "time_left"]  # fmt: skip

# Model geometry of the CPU runs: small enough for minutes on 2 cores, heavy enough that a
# prefill costs more than copying its KV back from host memory (as on a GPU with a real model:
# on this CPU recomputing a token costs ~10x loading its 4 KiB of KV back, measured in the run).
CPU_MODEL = dict(num_layers=4, num_attention_heads=8, head_num=4, head_dim=32, hidden_size=256,
                 intermediate_size=768, vocab_size=1024, dtype="float32")  # fmt: skip
GPU_MODEL = dict(model_preset="llama3-8b-shape", dtype="bfloat16")

CLOCKS = ("virtual", "wall")

def model_args() -> dict[str, Any]:
    """``ServerArgs`` fields of the end-to-end benchmarks' model: the Llama-3-8B-shaped preset
    in bf16 on CUDA, ``CPU_MODEL`` on a CPU. ``vocab_size`` is always present."""
    if on_cuda():
        return {**GPU_MODEL, "vocab_size": 32000}
    return dict(CPU_MODEL)


def shared_model(args: ServerArgs) -> PagedTransformer:
    """The model every configuration of a benchmark runs (same geometry, dtype and seed)."""
    return PagedTransformer(ModelConfig.from_server_args(args), args.resolved_device())


def release_executor(ex: OptimisticPrefillExecutor) -> None:
    """Finish the cache's copies and unregister its pinned host pool (the executor is unusable
    afterwards). The memory itself returns once the last reference is gone: ``free_memory``."""
    ex.cache.close()
    if ex.cache.host_pool is not None:
        ex.cache.host_pool.destroy()


def free_memory() -> None:
    """Collect reference cycles (decode peers and their side point at each other, holding the
    device and decode pools) and return cached CUDA blocks, between configurations."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def on_cuda() -> bool:
    return torch.cuda.is_available()


def cpu_note() -> str | None:
    """What a reader must know about CPU numbers, or None on CUDA."""
    if on_cuda():
        return None
    return (
        "CPU run: the model and all copies run on the CPU; the kernel io backend uses the torch "
        "reference of the kvcacheio ops (Triton kernels are timed on CUDA only). Times are CPU "
        "times, not GPU times."
    )


@dataclass
class TraceRun:
    """What one configuration's run produced. ``ttft`` is keyed by rid (seconds from send)."""

    label: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    executor: OptimisticPrefillExecutor | None = None
    sampled: list[str] = field(default_factory=list)
    ttft: dict[str, float] = field(default_factory=dict)
    cost: CostAccountant | None = None
    unfinalized_sends: int = 0  # results whose sends name an attempt that was not finalized
    kv_max_rel_err: float | None = None  # set by ``audit``


def new_executor(
    args: ServerArgs,
    peer: PeerConfig,
    decode_pool_tokens: int,
    model: PagedTransformer,
    calibration: Calibration | None = None,
    group: TPGroup | None = None,
) -> tuple[OptimisticPrefillExecutor, CostAccountant | None]:
    """An executor whose decode side keeps received KV (sampled, see ``Driver``) in a pool of
    ``decode_pool_tokens``. With ``calibration``: on a ``VirtualClock`` charged by a
    ``CostAccountant`` (returned), else on wall time (``None`` returned). ``group``: the
    tensor-parallel cache group (this rank's cache and decode side; the clock wrapped so every
    rank reads rank 0's time)."""
    clock = WallClock() if calibration is None else VirtualClock()
    if group is not None:
        clock = agreed_clock(clock, group, None)
    common = dict(peer_config=peer, clock=clock, keep_received=True, send_log_size=None,
                  decode_pool_size=decode_pool_tokens, group=group)  # fmt: skip
    if calibration is None:
        return make_executor(args, model=model, **common), None
    recording = RecordingModel(model)
    cost = CostAccountant(calibration, clock, recording)
    ex = make_executor(args, model=recording, cost_model=cost, **common)
    if ex.cache.controller is not None:
        cost.install(ex.cache.controller)
    return ex, cost


class TimeBudget:
    """Which configurations of a benchmark still fit its deadline (``time_left``): one runs
    while at least 1.5x the slowest so far plus 5 s is left. ``agree``: makes the answer the
    group's (tensor parallelism: every rank skips together). ``skipped``: labels not run."""

    def __init__(self, agree: Callable[[bool], bool] | None = None) -> None:
        self.slowest = 0.0
        self.skipped: list[str] = []
        self._agree = agree

    def allows(self, label: str) -> bool:
        ok = time_left() >= 1.5 * self.slowest + 5
        if self._agree is not None:
            ok = self._agree(ok)
        if not ok:
            self.skipped.append(label)
        return ok

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time one configuration (the slowest sets the margin)."""
        t0 = time.perf_counter()
        yield
        self.slowest = max(self.slowest, time.perf_counter() - t0)


def is_virtual(ex: OptimisticPrefillExecutor) -> bool:
    return bool(getattr(ex.clock, "is_virtual", False))


def settle(ex: OptimisticPrefillExecutor) -> bool:
    """One scheduler step; on a virtual clock also wait for the cache's copies and pop their
    acks, so the next step sees a state that does not depend on thread timing."""
    progressed = ex.step()
    if is_virtual(ex):
        ex.drain_cache_events()
    return progressed


def run_until_idle(ex: OptimisticPrefillExecutor) -> None:
    """The executor's own ``run_until_idle``; on a virtual clock every step is followed by the
    wait for the cache's copies (as ``settle`` does)."""
    ex.run_until_idle(after_step=ex.drain_cache_events if is_virtual(ex) else None)


class Driver:
    """Feeds requests to an executor at their times and collects results.

    Every ``kv_sample_every``-th success keeps its decode-side KV for ``audit``'s recompute
    check; the others release it at once. Results are collected in finish order after each
    step. Each result's sends are checked against the decode peer's finalized attempt: a
    success sent only its last attempt, which was finalized; an aborted request sent nothing or
    only its last attempt (``TraceRun.unfinalized_sends`` counts the others).
    """

    def __init__(
        self,
        executor: OptimisticPrefillExecutor,
        max_parallel: int,
        kv_sample_every: int = 4,
        cost: CostAccountant | None = None,
    ) -> None:
        self.ex = executor
        self.max_parallel = max_parallel
        self.kv_sample_every = kv_sample_every
        self.inflight: set[str] = set()
        self.sent_at: dict[str, float] = {}
        self.slot_free_at = float("-inf")
        self.run = TraceRun(label="", executor=executor, cost=cost)
        self._successes = 0
        self._sent: dict[str, set[int]] = {}
        self._log_seen = 0

    def _read_send_log(self) -> None:
        log = self.ex.decode.send_log
        for i in range(self._log_seen, len(log)):
            self._sent.setdefault(log[i].rid, set()).add(log[i].attempt)
        self._log_seen = len(log)

    def _check_sends(self, res: RequestResult) -> None:
        sent = self._sent.pop(res.rid, set())
        if res.outcome == Outcome.SUCCESS:
            peer = self.ex.decode.peers.get(res.rid)
            final = None if peer is None else peer.finalized_attempt
            bad = final != res.passes or sent != {res.passes}
        else:
            bad = bool(sent - {res.passes})
        self.run.unfinalized_sends += int(bad)

    def _collect(self, on_result: Callable[[RequestResult], None]) -> None:
        self._read_send_log()
        for res in self.ex.pop_results():
            rid = res.rid
            if rid not in self.inflight:
                continue
            self._check_sends(res)
            if len(self.inflight) >= self.max_parallel:
                self.slot_free_at = res.finish_time
            self.inflight.discard(rid)
            self.run.results.append(res)
            if res.outcome == Outcome.SUCCESS:
                self.run.ttft[rid] = res.finish_time - self.sent_at[rid]
                self._successes += 1
                if (self._successes - 1) % self.kv_sample_every == 0:
                    self.run.sampled.append(rid)
                else:
                    self.ex.release_received(rid)  # (every rank's decode side under TP)
            on_result(res)

    def drive(
        self,
        next_due: Callable[[], float | None],
        pop_request: Callable[[], tuple[str, list[int]]],
        on_result: Callable[[RequestResult], None],
        done: Callable[[], bool],
        progress: Callable[[int], None] | None = None,
    ) -> TraceRun:
        """Run until ``done()`` and the executor is idle. ``next_due()`` is when the next
        request may be sent (None: nothing queued); ``pop_request()`` takes it."""
        start = time.perf_counter()
        due_now = 0
        while True:
            now = self.ex.clock.now()
            due = next_due()
            while due is not None and due <= now and len(self.inflight) < self.max_parallel:
                rid, tokens = pop_request()
                self.ex.submit(rid, tokens)
                self.sent_at[rid] = max(due, self.slot_free_at)
                self.inflight.add(rid)
                due = next_due()
            progressed = settle(self.ex)
            self._collect(on_result)
            if progress is not None:
                progress(len(self.run.results))
            if done() and not self.inflight and self.ex.is_idle():
                break
            if progressed:
                due_now = 0
                continue
            # Rank 0 drives alone under tensor parallelism (the others follow): local events.
            free = len(self.inflight) < self.max_parallel
            due_now = self.ex.wait_for_next_event(due_now, also=due if free else None, local=True)
        self.run.wall_s = time.perf_counter() - start
        return self.run
