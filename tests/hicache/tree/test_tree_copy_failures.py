"""HiRadixCache when a copy fails, in both CPU stream modes (``HiRadixCache``).

A failed backup leaves its node device-only, in the LRU queue and evictable as if it had never
been backed up; a failed load back raises ``LoadBackError`` (at its launch on inline streams, at
the failing layer's wait on thread streams) and ``cancel_load_back`` makes its nodes host-only
again once the caller released its locks. After every story the cache keeps working: the same
keys back up, evict and load back with the right KV.
"""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.transfer.errors import LoadBackError
from hicache_prefill.hicache.tree.lru_queues import DEVICE
from tests.hicache.tree.test_hiradix_cache import (
    A,
    B,
    Gate,
    compute,
    drain,
    load_back,
    make_cache,
)
from tests.support.faults import CopyFaults
from tests.support.kv_content import check_tree_content

BACKUP, LOAD = "backup_from_device_all_layer", "load_to_device_per_layer"


@pytest.fixture
def caches():
    made = []
    yield made
    for kv in made:
        kv.close()


def still_works(kv, key) -> None:
    """Back ``key`` up (twice for write_through_selective), evict it, load it back: right KV."""
    tree = kv.tree
    compute(kv, key)
    if kv.tree.write_policy != "write_back":
        compute(kv, key)
    drain(kv)
    assert tree.evict(len(key)) == len(key)
    drain(kv)
    assert tree.match_prefix(key).host_hit_length == len(key)
    load_back(kv, key)
    drain(kv)
    assert len(tree.match_prefix(key).device_indices) == len(key)
    check_tree_content(kv)
    kv.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_failed_backup_leaves_the_node_device_only(caches, policy, stream_mode) -> None:
    kv = make_cache(policy, streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    inserts = 1 if policy == "write_through" else 2  # the insert that starts the backup
    with CopyFaults().fail_calls(BACKUP, [0]) as faults:
        for _ in range(inserts):
            compute(kv, A)  # the insert completes although its backup failed
        drain(kv)
        assert faults.failures == [BACKUP]
    node = tree.match_prefix(A).last_device_node
    assert not node.backuped and node.lock_ref == 0 and node.queued & DEVICE
    assert not tree.ongoing_write_through and tree.evictable_size() == 8
    assert kv.host_pool.available_size() == kv.host_pool.size
    assert kv.stats.d2h_failed_copies == 1 and kv.stats.d2h_copies == 0
    kv.check_integrity()
    compute(kv, A)  # as if never backed up: the next insert through it backs it up
    drain(kv)
    assert node.backuped
    check_tree_content(kv)
    still_works(kv, B)


def test_failed_write_back_backup_drops_the_leaf_as_a_full_host_would(caches, stream_mode):
    kv = make_cache("write_back", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    with CopyFaults().fail_calls(BACKUP, [0]):
        assert tree.evict(8) == 8  # its backup failed: deleted, KV lost
    assert not tree.root_node.children and not tree.ongoing_write_through
    assert kv.host_pool.available_size() == kv.host_pool.size
    assert kv.allocator.available_size() == kv.allocator.size
    kv.check_integrity()
    still_works(kv, A)


@pytest.mark.parametrize("layer", [0, 1])
def test_failed_load_back_is_undone_and_its_nodes_stay_host_only(caches, layer, stream_mode):
    kv = make_cache("write_through", streams=stream_mode)
    caches.append(kv)
    tree = kv.tree
    compute(kv, A)
    drain(kv)
    assert tree.evict(8) == 8
    m = tree.match_prefix(A)
    with CopyFaults().fail_calls(LOAD, [layer]):
        dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
        tree.inc_lock_ref(last)  # a request holds the loaded prefix
        if stream_mode == "inline":
            with pytest.raises(LoadBackError, match=f"layer_id={layer}"):
                tree.ready_to_load_host_cache()
        else:
            tree.ready_to_load_host_cache()
            with pytest.raises(LoadBackError, match=f"layer_id={layer}"):
                for i in range(kv.device_pool.layer_num):
                    tree.layer_wait(i)
    kv.check_integrity()
    with pytest.raises(ValueError, match="lock"):
        tree.cancel_load_back()  # the request still locks the nodes: nothing changes
    assert not last.evicted and tree.ongoing_load_back
    kv.check_integrity()
    tree.dec_lock_ref(last)
    assert tree.cancel_load_back() == 8
    assert last.evicted and last.backuped and not tree.ongoing_load_back
    assert tree.match_prefix(A).host_hit_length == 8
    assert kv.allocator.available_size() == kv.allocator.size
    assert kv.stats.h2d_failed_copies == 1 and kv.stats.loaded_tokens == 0
    check_tree_content(kv)  # the host copy is intact
    kv.check_integrity()
    dev = load_back(kv, A)  # the same hit loads back now
    assert dev.numel() == 8
    drain(kv)
    still_works(kv, B)


def test_failed_load_seen_only_at_its_ack(caches) -> None:
    """Thread streams, a caller that never waits per layer: the ack reports the failure. An
    unlocked load is undone at once; a locked one raises until its locks are released."""
    kv = make_cache("write_through")
    caches.append(kv)
    tree = kv.tree
    for key in (A, B[8:]):
        compute(kv, key)
    drain(kv)
    assert tree.evict(16) == 16
    with CopyFaults().fail_calls(LOAD, [0, 2]):
        for locked, key in ((False, A), (True, B[8:])):
            m = tree.match_prefix(key)
            _, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
            if locked:
                tree.inc_lock_ref(last)
            tree.ready_to_load_host_cache()
            kv.controller.wait_loads()
            if locked:
                with pytest.raises(LoadBackError, match="cancel_load_back"):
                    tree.check_hicache_events()
                kv.check_integrity()
                tree.dec_lock_ref(last)
                assert tree.cancel_load_back() == 8
            else:
                tree.check_hicache_events()
            assert last.evicted and not tree.ongoing_load_back
            kv.check_integrity()
    check_tree_content(kv)
    still_works(kv, A)


def test_failed_backup_of_a_node_split_while_it_ran(caches) -> None:
    """Thread streams: a match splits the node while its backup is in flight; the backup
    fails; both halves are device-only afterwards and every host slot is free again."""
    gate = Gate(is_open=False)
    kv = make_cache("write_through", gate=gate)
    caches.append(kv)
    tree = kv.tree
    with CopyFaults().fail_calls(BACKUP, [0]):
        compute(kv, A)
        upper = tree.match_prefix(A[:4]).last_device_node  # splits the node being backed up
        assert upper.backuped and upper.lock_ref == 1
        gate.open()
        drain(kv)
    lower = tree.match_prefix(A).last_device_node
    assert lower.parent is upper
    assert not upper.backuped and not lower.backuped and upper.lock_ref == 0
    assert kv.host_pool.available_size() == kv.host_pool.size
    kv.check_integrity()
    assert tree.evict(8) == 8 and not tree.root_node.children
    still_works(kv, A)


def test_insert_with_slots_outside_the_pool_changes_nothing(caches, stream_mode) -> None:
    kv = make_cache("write_through", streams=stream_mode)
    caches.append(kv)
    with pytest.raises(ValueError, match="value out of range"):
        kv.tree.insert(A, torch.arange(1000, 1008))
    assert not kv.tree.root_node.children
    kv.check_integrity()
