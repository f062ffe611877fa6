"""Smoke test of the single-leaf eviction profile of ``bench_cache_ops`` at its smallest size."""

from __future__ import annotations

import hicache.tree.lru_queues as lru_queues
from bench.cache_ops.evict_profile import profile_evict


def test_evict_profile_counts_the_work_of_each_single_leaf_eviction() -> None:
    saved = lru_queues.heapq
    r = profile_evict(10_000, page_size=16, steps=60, evict_tokens=96)
    assert lru_queues.heapq is saved  # the counting heap is removed again
    assert r["evictions"] >= 2 and r["evict_tokens"] == 96
    assert r["tokens_freed"] >= 16 and r["tokens_freed"] % 16 == 0
    assert r["pops"] >= 1 and r["total"] >= r["free"] > 0
    assert r["check_free_cold"] > 0 and r["check_free_warm"] > 0
