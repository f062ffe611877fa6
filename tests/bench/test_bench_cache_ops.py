"""Smoke tests of the tree benchmark at its smallest sizes (keep it from rotting)."""

from __future__ import annotations

from bench.cache_ops.bench import ALL_OPS, run_trace
from bench.cache_ops.sglang_trees import load_sglang
from bench.cache_ops.trace import ProjectDriver
from bench.cache_ops.two_tier import measure_inflight, measure_write_back


def test_trace_runs_and_reports_every_op() -> None:
    row = run_trace(10_000, page_size=16, steps=30, factories=[ProjectDriver])
    assert row["nodes"] > 0
    project = row["trees"]["project"]
    for op in ("match", "miss", "insert", "lock", "unlock"):
        assert project[op]["n"] == 30 and project[op]["mean_us"] > 0
    assert set(project) == set(ALL_OPS)


def test_pressure_measurements_run() -> None:
    r = measure_inflight(50, leaves=10, reps=1, max_copies=50)
    assert r["copies_in_flight"] == 50 and r["evict_ms"] > 0
    assert measure_write_back(4096, full=True, real=False, leaves=8) > 0
    assert measure_write_back(4096, full=True, real=True, leaves=8) > 0


def test_sglang_loader_says_why_when_absent() -> None:
    sgl, note = load_sglang()
    assert (sgl is None) == ("not importable" in note)
