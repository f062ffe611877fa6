"""The L3 tier under a hierarchical cache, without the executor: page keys on the tree, backups
fed by L2 acks per write policy with host pages protected until the storage ack, 128-page
batches, a failed batch ending its backup, prefetch of the hit only into host-only nodes, the
threshold and capacity limit, attempt scoping, and ``buffer_only`` staging."""

from __future__ import annotations

import pytest

from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle
from tests.hicache.storage.io.io_helpers import build, compute, drain, tick_until
from tests.support.kv_content import check_device

A = list(range(100, 132))  # 8 pages of 4
H = CacheRequestHandle("r", 0)


def _stored(store, keys):
    return sum(1 for k in keys if any(name.startswith(k) for name in store.pages))


def _path_tokens(tree, node):
    parts = []
    while node is not tree.root_node:
        parts.append(node.key)
        node = node.parent
    return [t for p in reversed(parts) for t in p]


def test_nodes_carry_their_pages_keys_through_splits():
    kv, _ = build("keys")
    compute(kv, A)
    compute(kv, A[:12] + [7] * 8)  # splits A's node after 3 pages
    kv.tree.match_prefix(A[:4])  # and after 1 page
    for node in kv.tree.all_nodes():
        path = _path_tokens(kv.tree, node)
        assert node.hash_value == page_hashes(path, 4)[-len(node.key) // 4 :]
    drain(kv)
    kv.close()


def test_write_through_stores_after_the_l2_ack_and_protects_host_pages_until_the_storage_ack():
    kv, store = build("wt")
    store.gate.clear()  # the backup thread waits at the backend
    compute(kv, A)
    tick_until(kv, lambda: kv.storage.ops_in_flight() == 1 and not kv.tree.ongoing_write_through)
    node = kv.tree.match_prefix(A).last_device_node
    assert node.host_ref == 1  # protected by the storage backup
    assert kv.tree.evict(len(A)) == len(A)  # device copy gone, node host-only
    assert kv.tree.evict_host(len(A)) == 0  # its host pages stay
    store.gate.set()
    drain(kv)
    assert node.host_ref == 0 and _stored(store, node.hash_value) == 8
    assert kv.storage.stats.backup_tokens == 32
    assert kv.tree.evict_host(len(A)) == len(A)
    kv.check_integrity()
    kv.close()


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_other_policies_store_at_their_l2_backup(policy):
    kv, store = build(f"p-{policy}", policy=policy)
    compute(kv, A)
    drain(kv)
    keys = kv.tree.match_prefix(A).last_device_node.hash_value
    assert _stored(store, keys) == 0  # no L2 copy yet, so nothing for L3
    if policy == "write_through_selective":
        compute(kv, A)  # the second hit backs up to L2, then L3
    else:
        kv.tree.evict(len(A))  # write_back backs up at device eviction
    drain(kv)
    assert _stored(store, keys) == 8
    kv.close()


def test_backups_go_in_batches_of_128_pages_and_a_failed_batch_ends_the_backup():
    tokens = list(range(300))
    for fail, stored in ((set(), 300), ({1}, 128)):
        kv, store = build(f"b{sorted(fail)}", page=1, tokens=512, threshold=1)
        store.fail_set_batches = fail
        compute(kv, tokens)
        drain(kv)
        sets = [n for call, n in store.calls if call == "batch_set"]
        assert sets == ([128, 128, 44] if not fail else [128, 128])
        assert kv.storage.stats.backup_tokens == stored
        assert kv.storage.stats.backup_failed_ops == len(fail)
        kv.check_integrity()
        kv.close()


def test_prefetch_reserves_host_pages_for_the_hit_only_and_inserts_host_only_nodes():
    kv, _ = build("pf")
    compute(kv, A)
    drain(kv)
    kv.close()
    kv, store = build("pf")
    store.missing = set(page_hashes(A, 4)[5:])  # pages 5.. are not stored
    root = kv.tree.root_node
    free = kv.tree.host_allocator.available_size()
    assert kv.storage.prefetch(H, root, A, 0)
    tick_until(kv, lambda: kv.storage.prefetches.ongoing[H].op.host_indices is not None)
    assert free - kv.tree.host_allocator.available_size() == 5 * 4  # the hit, not the 8 asked
    drain(kv)
    assert kv.storage.take_loaded(H) == 20
    m = kv.tree.match_prefix(A)
    assert m.device_indices.numel() == 0 and m.host_hit_length == 20
    dev, node = kv.tree.init_load_back(m.last_host_node, m.host_hit_length)
    kv.tree.inc_lock_ref(node)
    kv.tree.ready_to_load_host_cache()
    for layer in range(2):
        kv.tree.layer_wait(layer)
    check_device(kv.device_pool, dev, A[:20], range(20))
    drain(kv)
    kv.tree.dec_lock_ref(node)
    kv.check_integrity()
    kv.close()


def test_prefetch_threshold_and_capacity_limit_decline():
    kv, _ = build("limits", threshold=16, hicache_ratio=1.0)
    root = kv.tree.root_node
    assert not kv.storage.prefetch(H, root, A[:12], 0)  # 12 < 16 tokens
    assert kv.storage.stats.prefetch_too_short == 1
    assert kv.storage.prefetch(H, root, A, 0)  # reserves 32 = half the 64-token host pool
    assert not kv.storage.prefetch(CacheRequestHandle("s", 0), root, A, 0)
    assert kv.storage.stats.prefetch_rate_limited == 1
    drain(kv)
    kv.close()


def test_a_released_attempt_gets_nothing_and_its_late_pages_are_freed():
    kv, _ = build("scope")
    compute(kv, A)
    drain(kv)
    kv.close()
    kv, store = build("scope")
    store.gate.clear()
    assert kv.storage.prefetch(H, kv.tree.root_node, A, 0)
    tick_until(kv, lambda: len(store.calls) == 0 and kv.storage.prefetches.ongoing)
    kv.storage.release(H)  # the attempt yields while its query is in flight
    store.gate.set()
    drain(kv)
    assert kv.storage.take_loaded(H) == 0
    assert kv.tree.match_prefix(A).host_hit_length == 0
    assert kv.tree.host_allocator.available_size() == kv.tree.host_allocator.size
    nxt = CacheRequestHandle("r", 1)  # the next attempt prefetches for itself
    assert kv.storage.prefetch(nxt, kv.tree.root_node, A, 0)
    drain(kv)
    assert kv.storage.take_loaded(nxt) == 32
    kv.check_integrity()
    kv.close()


def test_buffer_only_keeps_no_host_copies_and_frees_staging_at_the_acks():
    kv, store = build("buf", mode="buffer_only")
    compute(kv, A)
    drain(kv)
    assert all(x.host_value is None for x in kv.tree.all_nodes())
    assert kv.tree.host_allocator.available_size() == kv.tree.host_allocator.size
    assert _stored(store, page_hashes(A, 4)) == 8
    compute(kv, A)  # stored already: no second staging
    drain(kv)
    assert [c for c, _ in store.calls].count("batch_set") == 1
    kv.close()
    kv, _ = build("buf", mode="buffer_only")
    assert kv.storage.prefetch(H, kv.tree.root_node, A, 0)
    drain(kv)
    assert kv.tree.match_prefix(A).host_hit_length == 0  # nothing enters the tree
    assert kv.storage.attach_staged(H, A) == 32  # until the attempt is admitted
    m = kv.tree.match_prefix(A)
    dev, node = kv.tree.init_load_back(m.last_host_node, m.host_hit_length)
    assert all(x.host_value is None for x in kv.tree.all_nodes())
    kv.tree.inc_lock_ref(node)
    kv.tree.ready_to_load_host_cache()
    for layer in range(2):
        kv.tree.layer_wait(layer)
    check_device(kv.device_pool, dev, A, range(32))
    drain(kv)
    assert kv.tree.host_allocator.available_size() == kv.tree.host_allocator.size
    kv.tree.dec_lock_ref(node)
    kv.check_integrity()
    kv.close()


def test_a_page_missing_in_storage_ends_the_hit_there_never_wrong_kv():
    kv, _ = build("miss")
    compute(kv, A)
    drain(kv)
    kv.close()
    kv, store = build("miss")
    victim = next(k for k in store.pages if k.startswith(page_hashes(A, 4)[3]))
    store.pages[victim] = store.pages[victim][:-8]  # a short page: a miss on read
    assert kv.storage.prefetch(H, kv.tree.root_node, A, 0)
    drain(kv)
    assert kv.storage.take_loaded(H) == 12  # pages 0..2
    kv.check_integrity()
    kv.close()


@pytest.mark.parametrize("mode", ["cache", "buffer_only"])
def test_a_failed_l2_backup_sends_nothing_to_storage_and_the_tier_keeps_working(mode):
    """The D2H copy of a backup fails while it runs (thread streams): the node stays device-only,
    its host slots (or staging) are freed, no page of it reaches storage; the next insert of
    other tokens is stored as usual."""
    from tests.support.faults import CopyFaults

    kv, store = build(f"failed-{mode}", mode=mode)
    with CopyFaults().fail_calls("backup_from_device_all_layer", {0}) as faults:
        compute(kv, A)
        drain(kv)
        assert faults.failures == ["backup_from_device_all_layer"]
    assert _stored(store, page_hashes(A, 4)) == 0
    assert all(x.host_value is None for x in kv.tree.all_nodes())
    assert kv.tree.host_allocator.available_size() == kv.tree.host_allocator.size
    kv.check_integrity()
    other = list(range(300, 332))
    compute(kv, other)
    drain(kv)
    assert _stored(store, page_hashes(other, 4)) == 8
    kv.check_integrity()
    kv.close()
