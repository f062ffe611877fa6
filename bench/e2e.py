"""Shared machinery of the end-to-end benchmarks: one executor on wall time, a request driver,
latency statistics and the integrity audit every run ends with.

On CUDA every configuration of a benchmark shares one model (the 8B-shaped model is ~14.5 GB),
and what a configuration allocated (device, decode and pinned host pools) is given back before
the next one is built: ``release_executor`` then ``free_memory``. ``time_left`` reads the
deadline that ``bench/gpu_check.sh`` gives each step, so a benchmark skips configurations it can
no longer finish instead of being killed half-way.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefill.bootstrap import PeerConfig
from prefill.clock import WallClock
from prefill.executor import OptimisticPrefillExecutor
from prefill.harness import decode_kv_and_reference, kv_max_rel_error, make_executor
from prefill.model import ModelConfig, PagedTransformer
from prefill.request import Outcome, RequestResult
from server_args import ServerArgs

KV_SAMPLE_EVERY = 4
"""Every this many successful requests, one keeps its decode-side KV for the recompute check."""

KV_REL_TOL = 0.2
"""bf16 / fp16 KV check: largest relative error of one (layer, token) row vs a full recompute.
Rounding noise is a few percent (``prefill.harness.kv_max_rel_error``); corruption is ~1."""

DEADLINE_ENV = "HICACHE_BENCH_DEADLINE"
"""Unix time by which a benchmark should have written its results (set by gpu_check.sh)."""


def time_left() -> float:
    """Seconds until ``$HICACHE_BENCH_DEADLINE`` (infinite when unset)."""
    deadline = os.environ.get(DEADLINE_ENV)
    return float("inf") if not deadline else float(deadline) - time.time()


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
    """What one configuration's run produced."""

    label: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    executor: OptimisticPrefillExecutor | None = None
    sampled: list[str] = field(default_factory=list)
    kv_max_rel_err: float | None = None  # set by ``audit``


def new_executor(
    args: ServerArgs,
    peer: PeerConfig,
    decode_pool_tokens: int,
    model: PagedTransformer | None = None,
) -> Any:
    """An executor on wall time whose decode side keeps received KV (sampled, see
    ``Driver``) in a pool of ``decode_pool_tokens``; ``model`` (``shared_model``) or a new one."""
    return make_executor(
        args,
        peer_config=peer,
        clock=WallClock(),
        keep_received=True,
        decode_pool_size=decode_pool_tokens,
        model=model,
    )


class Driver:
    """Feeds requests to an executor at their times and collects results.

    ``next_request(now)`` returns ``(rid, tokens)`` or None; ``on_result(result)`` is told of
    each finished request (multi-turn clients queue their next round there).
    """

    def __init__(self, executor: OptimisticPrefillExecutor, max_parallel: int) -> None:
        self.ex = executor
        self.max_parallel = max_parallel
        self.inflight: set[str] = set()
        self.run = TraceRun(label="", executor=executor)
        self._successes = 0

    def _collect(self, on_result: Callable[[RequestResult], None]) -> None:
        for rid in list(self.inflight):
            res = self.ex.result(rid)
            if res is None:
                continue
            self.inflight.discard(rid)
            self.run.results.append(res)
            if res.outcome == Outcome.SUCCESS:
                self._successes += 1
                if self._successes % KV_SAMPLE_EVERY == 1:
                    self.run.sampled.append(rid)
                else:
                    self.ex.decode.release(rid)
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
        request may be submitted (None: nothing queued); ``pop_request()`` takes it."""
        start = time.perf_counter()
        while True:
            now = self.ex.clock.now()
            due = next_due()
            while due is not None and due <= now and len(self.inflight) < self.max_parallel:
                rid, tokens = pop_request()
                self.ex.submit(rid, tokens)
                self.inflight.add(rid)
                due = next_due()
            progressed = self.ex.step()
            self._collect(on_result)
            if progress is not None:
                progress(len(self.run.results))
            if done() and not self.inflight and self.ex.is_idle():
                break
            if not progressed:
                waits = [t for t in (due, self.ex.decode.next_event_time()) if t is not None]
                target = min(waits) if waits else now + 0.0005
                self.ex.clock.wait_until(max(now + 1e-4, min(target, now + 0.01)))
        self.run.wall_s = time.perf_counter() - start
        return self.run


def latency_stats(values: list[float]) -> dict[str, float | None]:
    """Mean / p50 / p90 / p99 in seconds (None when empty)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def audit(run: TraceRun) -> dict[str, int]:
    """The integrity every run ends with: slots that are neither free nor in the tree (the
    executor is idle, so requests own none), decode-side KV of sampled successes that differs
    from a full recompute, and sends for attempts that were never finalized (aborted or rolled
    back); nodes still locked; ``integrity_errors`` counts failed ``check_integrity`` calls.

    KV check: fp32 element-wise (``kv_tolerance``); bf16 / fp16 per (layer, token) row, relative
    error at most ``KV_REL_TOL`` (an element-wise bf16 tolerance fails on plain rounding noise of
    a 32-layer model). The largest relative error is left in ``run.kv_max_rel_err``."""
    ex = run.executor
    assert ex is not None
    ex.drain_cache_events()
    errors = 0
    try:
        ex.check_integrity()
    except (AssertionError, ValueError):
        errors += 1
    tree_tokens = ex.tree.evictable_size() + ex.tree.protected_size()
    leaked = ex.allocator.size - ex.allocator.available_size() - tree_tokens
    leaked_locks = sum(1 for n in ex.tree.all_nodes() if n.lock_ref != 0)
    mismatches = 0
    exact = ex.pool.dtype == torch.float32
    worst = 0.0
    for rid in run.sampled:
        pairs = decode_kv_and_reference(ex, rid)
        err = kv_max_rel_error(pairs)
        worst = max(worst, err)
        if not exact:
            mismatches += int(err > KV_REL_TOL)
        elif not all(_close(got, ref, kv_tolerance(ex)) for got, ref in pairs):
            mismatches += 1
        del pairs
        ex.decode.release(rid)
    run.kv_max_rel_err = worst if run.sampled else None
    aborted_sends = sum(
        1 for s in ex.decode.send_log if ex.requests[s.rid].peer.finalized_attempt != s.attempt
    )
    return {
        "leaked_slots": int(leaked),
        "leaked_locks": leaked_locks,
        "kv_mismatches": mismatches,
        "aborted_sends": aborted_sends,
        "integrity_errors": errors,
        "kv_checked_requests": len(run.sampled),
    }


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    try:
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    except AssertionError:
        return False
    return True


def kv_tolerance(ex: OptimisticPrefillExecutor) -> float:
    """Element-wise tolerance. fp32: reduction-order noise only. bf16/fp16: one rounding step,
    too tight for a deep model's accumulated noise (``audit`` checks those by row instead)."""
    dtype = ex.pool.dtype if hasattr(ex.pool, "dtype") else torch.float32
    return 1e-4 if dtype == torch.float32 else 3e-2


def config_summary(run: TraceRun) -> dict[str, Any]:
    """Per-configuration numbers every end-to-end benchmark reports."""
    ok = [r for r in run.results if r.outcome == Outcome.SUCCESS]
    ttft = latency_stats([r.ttft for r in ok if r.ttft is not None])
    ex = run.executor
    assert ex is not None
    prompt_tokens = sum(r.num_tokens for r in ok)
    cache_stats = ex.cache.stats.as_dict()
    gpu_peak = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    return {
        "requests": len(run.results),
        "successes": len(ok),
        "aborted": len(run.results) - len(ok),
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "ttft_p99_s": ttft["p99"],
        "device_hit_tokens": sum(r.cached_device_tokens for r in ok),
        "host_hit_tokens": sum(r.cached_host_tokens for r in ok),
        "prefill_tokens_computed": sum(r.total_computed_tokens for r in run.results),
        "prompt_tokens": prompt_tokens,
        "throughput_tok_s": prompt_tokens / run.wall_s if run.wall_s else None,
        "wall_s": run.wall_s,
        "d2h_bytes": cache_stats["d2h_bytes"],
        "h2d_bytes": cache_stats["h2d_bytes"],
        "backed_up_tokens": cache_stats["backed_up_tokens"],
        "loaded_tokens": cache_stats["loaded_tokens"],
        "evicted_device_tokens": cache_stats["evicted_device_tokens"],
        "executor": {k: v for k, v in ex.stats.to_dict().items() if k != "ttft_samples"},
        "ttft_samples_s": [r.ttft for r in ok],
        "gpu_peak_allocated_gb": gpu_peak,
    }


# ---------------------------------------------------------------------------- reporting
Column = tuple[str, str, float, str]
"""(header, result key, scale, format spec) of one table column."""


def sum_integrity(results: dict[str, Any]) -> dict[str, int]:
    """Integrity counters of every configuration, added up."""
    total: dict[str, int] = {}
    for res in results.values():
        for k, v in res["integrity"].items():
            if k != "kv_checked_requests":
                total[k] = total.get(k, 0) + int(v)
    return total


def print_config_table(results: dict[str, Any], cols: list[Column], width: int = 14) -> None:
    """One row per configuration, fixed-width columns with units in the headers."""
    name_w = max(24, max((len(n) for n in results), default=0) + 2)
    print(f"{'config':<{name_w}}" + "".join(f"{c[0]:>{width}}" for c in cols))
    for name, res in results.items():
        cells = []
        for _, key, scale, fmt in cols:
            v = res.get(key)
            cells.append(f"{'-':>{width}}" if v is None else f"{v * scale:>{width}{fmt}}")
        print(f"{name:<{name_w}}" + "".join(cells))


def plot_ttft(results: dict[str, Any], path: Path, title: str, labels: list[str]) -> None:
    """Box plot of the TTFT samples of each configuration, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot {path.name}")
        return
    data = [[t * 1e3 for t in res["ttft_samples_s"]] for res in results.values()]
    if not any(data):
        print(f"no TTFT samples: no plot {path.name}")
        return
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(data)), 4.5))
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(data) + 1), labels)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title + (" (CPU)" if cpu_note() else ""))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_result(out_dir: Path, name: str, doc: dict[str, Any]) -> Path:
    """``out_dir/NAME.json`` with the machine description added."""
    from bench.summary import machine_info

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine_info(), **doc}, indent=2,
                               default=str))  # fmt: skip
    return path


def bench_main(name: str, run: Callable[..., dict[str, Any]], argv: list[str] | None = None) -> int:
    """Command line of one end-to-end benchmark: ``--quick``, ``--out DIR``, and the
    benchmark's own flags; exits non-zero on any integrity violation."""
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results"))
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    summary = run(quick=known.quick, out_dir=known.out, argv=rest)
    bad = {k: v for k, v in summary["integrity"].items() if v}
    if bad:
        print(f"[{name}] INTEGRITY VIOLATIONS: {bad}", file=sys.stderr)
        return 1
    return 0
