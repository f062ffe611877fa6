"""What every end-to-end run ends with: the integrity audit (leaks, locks, KV of sampled
successes against a full recompute, sends of unfinalized attempts) and the per-configuration
numbers (TTFT statistics, cache traffic, executor counters)."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.e2e.driver import TraceRun
from hicache_prefill.prefill.request.state import Outcome
from tests.support.harness import decode_kv_and_reference, kv_max_rel_error

KV_REL_TOL = 0.2
"""bf16 / fp16: largest relative error of one (layer, token) row vs a full recompute (rounding
noise is a few percent, corruption ~1). fp32 is checked element-wise at 1e-4."""


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def audit(run: TraceRun) -> dict[str, int]:
    """Integrity counters (all zero when nothing is wrong): ``leaked_slots`` (neither free nor
    in the tree once idle), ``leaked_locks``, ``kv_mismatches`` (sampled successes whose decode
    KV differs from a recompute), ``aborted_sends`` (sends naming an unfinalized attempt),
    ``integrity_errors`` (a failed ``check_integrity``); ``kv_checked_requests`` counts checks."""
    ex = run.executor
    ex.drain_cache_events()
    errors = 0
    try:
        ex.check_integrity()
    except (AssertionError, ValueError):
        errors += 1
    tree_tokens = ex.tree.evictable_size() + ex.tree.protected_size()
    exact = ex.pool.dtype == torch.float32
    mismatches = 0
    for rid in run.sampled:
        pairs = decode_kv_and_reference(ex, rid)
        if exact:
            bad = any(not torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in pairs)
        else:
            bad = kv_max_rel_error(pairs) > KV_REL_TOL
        mismatches += int(bad)
        ex.decode.release(rid)
    return {
        "leaked_slots": int(ex.allocator.size - ex.allocator.available_size() - tree_tokens),
        "leaked_locks": sum(1 for n in ex.tree.all_nodes() if n.lock_ref != 0),
        "kv_mismatches": mismatches,
        "aborted_sends": run.unfinalized_sends,
        "integrity_errors": errors,
        "kv_checked_requests": len(run.sampled),
    }


def config_summary(run: TraceRun) -> dict[str, Any]:
    """Per-configuration numbers (TTFT from the client's send; times on the run's clock)."""
    ok = [r for r in run.results if r.outcome == Outcome.SUCCESS]
    ttft = sorted(run.ttft[r.rid] for r in ok if r.rid in run.ttft)
    stats = run.executor.cache.stats.as_dict()
    return {
        "requests": len(run.results),
        "successes": len(ok),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 0.5) if ttft else None,
        "ttft_p90_s": percentile(ttft, 0.9) if ttft else None,
        "device_hit_tokens": sum(r.cached_device_tokens for r in ok),
        "host_hit_tokens": sum(r.cached_host_tokens for r in ok),
        "prefill_tokens_computed": sum(r.total_computed_tokens for r in run.results),
        "prompt_tokens": sum(r.num_tokens for r in ok),
        "backed_up_tokens": stats["backed_up_tokens"],
        "loaded_tokens": stats["loaded_tokens"],
        "wall_s": run.wall_s,
        "executor": {k: v for k, v in run.executor.stats.to_dict().items() if k != "ttft_samples"},
    }
