"""Smoke test of the tree microbenchmark at its smallest size (keeps it from rotting)."""

from __future__ import annotations

from bench.bench_cache_ops import OPS, bench_size


def test_bench_size_runs_and_reports_every_op() -> None:
    row = bench_size(10_000, page_size=16, reps=3)
    assert row["nodes"] > 0
    for op in OPS:
        assert row[op]["median_us"] > 0
