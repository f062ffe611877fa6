"""Write-back eviction keeps LRU order when a parent's children leave in different ways: one
backed up during the eviction (host-bound), the other already backed up (freed at once). The
parent is then next in LRU order, before a newer leaf elsewhere (as SGLang's tree evicts; found
by the differential run of ``make sglang-check``, mode ``tree-backend``)."""

from __future__ import annotations

from tests.hicache.tree.test_hiradix_cache import caches, compute, drain, make_cache  # noqa: F401

P = list(range(100, 108))  # two pages: the shared parent
A = P + list(range(200, 204))
B = P + list(range(300, 304))
C = list(range(400, 404))


def test_parent_of_a_host_bound_and_a_freed_child_goes_before_newer_leaves(caches) -> None:  # noqa: F811
    kv = make_cache("write_back", device_tokens=64)
    caches.append(kv)
    tree = kv.tree
    compute(kv, B)
    compute(kv, A)  # splits: P -> {B, A}
    assert tree.evict(4) == 4  # B, the LRU leaf: backed up, host-only
    compute(kv, B)  # B again: device and host; P stamped with it; A is now the LRU leaf
    compute(kv, C)  # a newer leaf elsewhere
    by_first = {x.key[0]: x for x in tree.all_nodes()}  # no match: it would stamp them
    assert by_first[300].backuped and not by_first[200].backuped and not by_first[100].backuped
    assert tree.evict(9) == 16  # A (backed up now) + B (freed) + P: the run's next LRU node
    drain(kv)
    assert len(tree.match_prefix(C).device_indices) == 4  # the newer leaf stays on the device
    m = tree.match_prefix(B)
    assert len(m.device_indices) == 0 and m.host_hit_length == 12
    kv.check_integrity()
