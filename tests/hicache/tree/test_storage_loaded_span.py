"""The span a prefetch put in the tree, as SGLang 0.5.23's ``pop_prefetch_loaded_span`` answers
it: the tokens inserted and the position of the first, taken once, dropped with the attempt."""

from __future__ import annotations

from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle
from tests.hicache.storage.io.io_helpers import build, compute, drain

A = list(range(500, 532))  # 8 pages of 4


def _stored_a(store: str) -> None:
    kv, _ = build(store)
    compute(kv, A)
    drain(kv)
    kv.close()


def test_the_span_starts_after_the_matched_prefix_and_what_the_tree_already_held():
    _stored_a("span")
    kv, _ = build("span")
    compute(kv, A[:8])  # 2 pages on the device: the anchor ends at token 8
    drain(kv)
    m = kv.tree.match_prefix(A)
    assert m.device_indices.numel() == 8
    h = CacheRequestHandle("r", 0)
    assert kv.storage.prefetch(h, m.last_host_node, A[8:], 8)
    drain(kv)
    assert kv.storage.take_loaded_span(h) == (24, 8)
    assert kv.storage.take_loaded_span(h) == (0, None)  # taken once
    assert kv.tree.match_prefix(A).host_hit_length == 24
    kv.check_integrity()
    kv.close()


def test_a_released_attempt_has_no_span_and_a_miss_has_no_start():
    _stored_a("span-release")
    kv, _ = build("span-release")
    h, miss = CacheRequestHandle("r", 0), CacheRequestHandle("m", 0)
    assert kv.storage.prefetch(h, kv.tree.root_node, A, 0)
    drain(kv)
    kv.storage.release(h)
    assert kv.storage.take_loaded_span(h) == (0, None)
    assert kv.storage.prefetch(miss, kv.tree.root_node, [9] * 16, 0)
    drain(kv)
    assert kv.storage.take_loaded_span(miss) == (0, None)
    assert kv.tree.host_allocator.available_size() + 32 == kv.tree.host_allocator.size
    kv.check_integrity()
    kv.close()
