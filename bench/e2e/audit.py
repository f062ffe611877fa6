"""What every end-to-end benchmark run ends with: the integrity audit and the per-configuration
numbers (latency statistics, cache traffic, executor counters, virtual-clock accounting)."""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch

from bench.e2e.driver import TraceRun
from bench.e2e.strict_audit import replay_matches
from prefill.executor import OptimisticPrefillExecutor
from prefill.request.state import Outcome
from prefill.testing.harness import decode_kv_and_reference, kv_max_rel_error

logger = logging.getLogger(__name__)

KV_REL_TOL = 0.2
"""bf16 / fp16 KV check: largest relative error of one (layer, token) row vs a full recompute.
Rounding noise is a few percent (``prefill.testing.harness.kv_max_rel_error``); corruption is ~1."""


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
    from a full recompute, and results whose sends name an attempt that was never finalized
    (``aborted_sends``, checked by the driver as results arrive); nodes still locked;
    ``integrity_errors`` counts failed ``check_integrity`` calls.
    ``speculative_l2_pages``: host pages written from an attempt that was not finalized when the
    copy was issued.

    Loose KV check (``kv_mismatches``): fp32 element-wise (``kv_tolerance``); bf16 / fp16 per
    (layer, token) row, relative error at most ``KV_REL_TOL`` (an element-wise bf16 tolerance
    fails on plain rounding noise of a 32-layer model). The largest relative error is left in
    ``run.kv_max_rel_err``. Strict KV check (``kv_strict_mismatches``), every sampled request:
    the tokens its final attempt computed, bit for bit against a replay of its forwards
    (``bench.e2e.strict_audit``); ``kv_strict_skipped`` counts requests it could not replay."""
    ex = run.executor
    assert ex is not None
    if run.cost is not None:
        run.cost.release_acks()  # the drain pops every ack, whatever its modelled time
    ex.drain_cache_events()
    errors = 0
    try:
        ex.check_integrity()
    except (AssertionError, ValueError):
        errors += 1
    tree_tokens = ex.tree.evictable_size() + ex.tree.protected_size()
    leaked = ex.allocator.size - ex.allocator.available_size() - tree_tokens
    leaked_locks = sum(1 for n in ex.tree.all_nodes() if n.lock_ref != 0)
    mismatches = strict_bad = strict_ok = strict_skipped = 0
    exact = ex.pool.dtype == torch.float32
    worst = 0.0
    for rid in run.sampled:
        strict = None if run.forward_log is None else replay_matches(ex, rid, run.forward_log)
        strict_skipped += strict is None
        strict_ok += strict is True
        strict_bad += strict is False
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
    aborted_sends = run.unfinalized_sends
    out = {
        "leaked_slots": int(leaked),
        "leaked_locks": leaked_locks,
        "kv_mismatches": mismatches,
        "aborted_sends": aborted_sends,
        "integrity_errors": errors,
        "kv_checked_requests": len(run.sampled),
        "kv_strict_mismatches": strict_bad,
        "kv_strict_checked": strict_ok + strict_bad,
        "kv_strict_skipped": strict_skipped,
    }
    out["speculative_l2_pages"] = ex.stats.speculative_l2_pages
    return out


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
    """Per-configuration numbers every end-to-end benchmark reports (TTFT from send time)."""
    ok = [r for r in run.results if r.outcome == Outcome.SUCCESS]
    samples = [run.ttft[r.rid] for r in ok if r.rid in run.ttft]
    ttft = latency_stats(samples)
    ex = run.executor
    assert ex is not None
    prompt_tokens = sum(r.num_tokens for r in ok)
    cache_stats = ex.cache.stats.as_dict()
    gpu_peak = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    span = (max(r.finish_time for r in run.results) - min(r.submit_time for r in run.results)
            if run.results else 0.0)  # fmt: skip
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
        "throughput_tok_s": prompt_tokens / span if span else None,
        "clock_span_s": span,
        "wall_s": run.wall_s,
        "d2h_bytes": cache_stats["d2h_bytes"],
        "h2d_bytes": cache_stats["h2d_bytes"],
        "backed_up_tokens": cache_stats["backed_up_tokens"],
        "loaded_tokens": cache_stats["loaded_tokens"],
        "evicted_device_tokens": cache_stats["evicted_device_tokens"],
        "executor": {k: v for k, v in ex.stats.to_dict().items() if k != "ttft_samples"},
        "virtual_clock": run.cost.as_dict() if run.cost is not None else None,
        "ttft_samples_s": samples,
        "gpu_peak_allocated_gb": gpu_peak,
    }
