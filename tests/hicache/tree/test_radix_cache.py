"""Device-only radix tree stories: match, insert, split, locks, LRU eviction, bad calls."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.tree.radix_cache import RadixCache


def make(page_size: int = 1, size: int = 64) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    alloc = TokenToKVPoolAllocator(size, page_size, "cpu")
    return RadixCache(alloc, page_size), alloc


def cache(tree: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> torch.Tensor:
    """A request computes ``key`` from scratch and caches it; returns the slots it used."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    present = tree.insert(key, slots)
    alloc.free(slots[:present])
    return slots


def test_insert_match_and_split() -> None:
    tree, alloc = make()
    slots = cache(tree, alloc, [1, 2, 3, 4])
    r = tree.match_prefix([1, 2, 3, 4, 5])
    assert r.device_indices.tolist() == slots.tolist()
    assert r.host_hit_length == 0 and r.last_host_node is r.last_device_node

    # a partial match splits the node so the last node covers exactly the match
    r = tree.match_prefix([1, 2, 9])
    assert r.device_indices.tolist() == slots[:2].tolist()
    assert r.last_device_node.key == [1, 2]
    assert tree.match_prefix([1, 2, 3, 4]).device_indices.tolist() == slots.tolist()

    # a branching insert shares the prefix and reports it as already present
    other = alloc.alloc(4)
    assert tree.insert([1, 2, 7, 8], other) == 2
    alloc.free(other[:2])
    assert tree.match_prefix([1, 2, 7, 8]).device_indices.tolist() == (
        slots[:2].tolist() + other[2:].tolist()
    )
    assert tree.evictable_size() == 6 and tree.protected_size() == 0
    tree.check_integrity()


def test_insert_stores_a_copy_of_value() -> None:
    tree, alloc = make()
    slots = alloc.alloc(3)
    expected = slots.tolist()
    tree.insert([5, 6, 7], slots)
    slots.fill_(0)
    assert tree.match_prefix([5, 6, 7]).device_indices.tolist() == expected
    tree.check_integrity()


def test_paged_keys() -> None:
    tree, alloc = make(page_size=4)
    slots = cache(tree, alloc, list(range(8)))
    # match truncates to whole pages; a mismatch inside a page matches only the earlier pages
    assert tree.match_prefix(list(range(7))).device_indices.tolist() == slots[:4].tolist()
    assert tree.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).device_indices.numel() == 4
    second = alloc.alloc(8)
    assert tree.insert([0, 1, 2, 3, 4, 5, 9, 9], second) == 4
    alloc.free(second[:4])
    assert len(tree.root_node.children) == 1
    assert len(tree.match_prefix([0, 1, 2, 3]).last_device_node.children) == 2
    tree.check_integrity()


def test_locks_protect_from_eviction_in_lru_order() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2])
    cache(tree, alloc, [3, 4])
    cache(tree, alloc, [5, 6])
    tree.match_prefix([1, 2])  # refresh [1, 2]: [3, 4] is now least recently used
    locked = tree.match_prefix([5, 6]).last_device_node
    assert tree.inc_lock_ref(locked) == 2
    assert tree.protected_size() == 2 and tree.evictable_size() == 4
    tree.check_integrity()

    assert tree.evict(1) == 2
    assert tree.match_prefix([3, 4]).device_indices.numel() == 0
    assert tree.match_prefix([1, 2]).device_indices.numel() == 2
    assert tree.evict(100) == 2  # only [1, 2]; [5, 6] is locked
    assert tree.match_prefix([5, 6]).device_indices.numel() == 2
    assert tree.dec_lock_ref(locked) == 2
    assert tree.evict(100) == 2
    assert alloc.available_size() == alloc.size
    tree.check_integrity()


def test_eviction_climbs_to_parents() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2, 3])
    cache(tree, alloc, [1, 2, 4])
    assert tree.evict(3) == 4  # two leaves, then their shared parent [1, 2]
    assert tree.total_size() == 0 and not tree.root_node.children
    tree.check_integrity()


def test_lock_on_split_node_is_inherited() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2, 3, 4])
    leaf = tree.match_prefix([1, 2, 3, 4]).last_device_node
    tree.inc_lock_ref(leaf)
    top = tree.match_prefix([1, 2]).last_device_node  # split while locked
    assert top.lock_ref == 1 and leaf.lock_ref == 1
    assert tree.evict(10) == 0
    tree.dec_lock_ref(leaf)
    assert top.lock_ref == 0 and tree.evictable_size() == 4
    tree.check_integrity()


def test_request_owned_slots_balance_the_ledger() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2])
    held = alloc.alloc(3)
    tree.check_integrity(request_owned=3)
    with pytest.raises(AssertionError, match="device ledger"):
        tree.check_integrity()
    alloc.free(held)
    tree.check_integrity()


@pytest.mark.parametrize(
    "key, value, match",
    [
        ([1, 2, 3], torch.arange(2, dtype=torch.int64), "3 tokens but value has 2"),
        ([1, 2], torch.arange(2, dtype=torch.int32), "int64"),
        ([1, 2], [1, 2], "torch.Tensor"),
        ([1, 2], torch.zeros(2, 1, dtype=torch.int64), "1-D"),
    ],
)
def test_bad_insert_raises_and_changes_nothing(key, value, match) -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2])
    with pytest.raises(ValueError, match=match):
        tree.insert(key, value)
    assert tree.total_size() == 2 and len(tree.all_nodes()) == 1
    tree.check_integrity()


def test_unaligned_key_is_cut_to_whole_pages() -> None:
    """As SGLang's ``RadixKey.page_aligned``: the partial last page is not inserted and its
    slots stay the caller's."""
    tree, alloc = make(page_size=4)
    assert tree.insert([1, 2, 3], torch.arange(4, 7, dtype=torch.int64)) == 0
    assert not tree.root_node.children
    slots = alloc.alloc(8)
    assert tree.insert(list(range(10, 16)), slots[:6]) == 0
    assert tree.match_prefix(list(range(10, 18))).device_indices.tolist() == slots[:4].tolist()
    tree.check_integrity(request_owned=4)  # slots[4:8]: the partial page, still the caller's
    alloc.free(slots[4:])
    tree.check_integrity()


def test_insert_without_value_needs_a_simulated_tree() -> None:
    """SGLang's tests insert keys alone into ``RadixCache.create_simulated()``; token ids then
    stand in for slots. A tree with an allocator refuses: it would free token ids as slots."""
    sim = RadixCache(None, page_size=1)
    assert sim.insert([1, 2, 3]) == 0
    assert sim.insert([1, 2, 3]) == 3
    assert sim.insert([1, 2, 4, 5]) == 2
    assert sim.insert([1, 2, 4, 5, 6, 7]) == 4
    assert sim.insert([8, 9, 10, 11, 12]) == 0
    assert sim.match_prefix([1, 2, 3, 13, 14]).device_indices.tolist() == [1, 2, 3]
    assert sim.total_size() == 12
    sim.check_integrity()
    assert sim.evict(100) == 12 and not sim.root_node.children
    sim.check_integrity()

    tree, alloc = make()
    with pytest.raises(ValueError, match="value is required"):
        tree.insert([1, 2, 3])
    assert not tree.root_node.children
    tree.check_integrity()


def test_pure_miss_allocates_nothing_and_reuses_the_empty_result() -> None:
    tree, alloc = make(page_size=2)
    cache(tree, alloc, [1, 2, 3, 4])
    nodes = tree.all_nodes()
    stamp = tree.root_node.last_access_time
    key = [7, 8, 9, 10]
    r1 = tree.match_prefix(key)
    r2 = tree.match_prefix([5])  # shorter than a page
    assert r1 is r2 is tree.match_prefix([])
    assert r1.device_indices.numel() == 0 and r1.last_device_node is tree.root_node
    assert r1.host_hit_length == 0 and r1.last_host_node is tree.root_node
    assert tree.root_node.last_access_time == stamp  # no tick, no refresh
    assert tree.all_nodes() == nodes and key == [7, 8, 9, 10]
    tree.check_integrity()


def test_match_refreshes_the_whole_node_before_splitting_it() -> None:
    """SGLang's order: the node is refreshed, then split, so its lower half is as recent as the
    match. SGLang 0.5.23's own RadixCache, run on this trace, evicts [5, 6] first: [3, 4] was
    refreshed by the match that split [1, 2, 3, 4]."""
    tree, alloc = make()
    cache(tree, alloc, [1, 2, 3, 4])
    cache(tree, alloc, [5, 6])
    tree.match_prefix([1, 2, 9])  # ends inside [1, 2, 3, 4]: split into [1, 2] -> [3, 4]
    upper = tree.match_prefix([1, 2]).last_device_node
    lower = next(iter(upper.children.values()))
    assert lower.key == [3, 4] and lower.last_access_time >= upper.last_access_time - 1
    assert tree.evict(2) == 2
    assert tree.match_prefix([5, 6]).device_indices.numel() == 0
    assert tree.match_prefix([1, 2, 3, 4]).device_indices.numel() == 4
    tree.check_integrity()


def test_eviction_order_matches_a_full_scan() -> None:
    """The queue evicts exactly what a scan of every unlocked leaf by (access time, id) would,
    over random matches, inserts, locks and evictions."""
    import random

    rng = random.Random(0)
    tree, alloc = make(page_size=1, size=400)
    held = []
    for _ in range(400):
        op = rng.random()
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
        if op < 0.45:
            m = tree.match_prefix(key)
            need = len(key) - len(m.device_indices)
            if alloc.available_size() >= need:
                slots = torch.cat([m.device_indices, alloc.alloc(need)])
                present = tree.insert(key, slots)
                alloc.free(slots[len(m.device_indices) : present])
        elif op < 0.6:
            tree.match_prefix(key)
        elif op < 0.7:
            node = tree.match_prefix(key).last_device_node
            if node is not tree.root_node:
                tree.inc_lock_ref(node)
                held.append(node)
        elif op < 0.8 and held:
            tree.dec_lock_ref(held.pop(rng.randrange(len(held))))
        else:
            leaves = [x for x in tree.all_nodes() if not x.children and x.lock_ref == 0]
            if leaves:
                oldest = min(leaves, key=lambda x: (x.last_access_time, x.id))
                expected = (oldest.parent, len(oldest.key))
                assert tree.evict(1) == expected[1]
                assert oldest.parent is None  # deleted
        tree.check_integrity()


def test_integrity_holds_while_a_free_group_is_open() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2, 3])
    cache(tree, alloc, [4, 5])
    alloc.free_group_begin()
    assert tree.evict(1) == 3  # [1, 2, 3] freed into the group: not available, not in the tree
    assert alloc.available_size() == alloc.size - 5
    tree.check_integrity()
    alloc.free_group_end()
    tree.check_integrity()


def test_unlock_below_zero_raises_and_changes_nothing() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2, 3, 4])
    leaf = tree.match_prefix([1, 2, 3, 4]).last_device_node
    with pytest.raises(ValueError, match="below 0"):
        tree.dec_lock_ref(leaf)
    assert leaf.lock_ref == 0 and tree.evictable_size() == 4
    # a lock on a child does not make its parent unlockable twice
    top = tree.match_prefix([1, 2]).last_device_node
    tree.inc_lock_ref(top)
    with pytest.raises(ValueError, match="below 0"):
        tree.dec_lock_ref(leaf)
    assert top.lock_ref == 1 and tree.protected_size() == 2
    tree.dec_lock_ref(top)
    tree.check_integrity()


def test_lock_of_deleted_node_raises() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2])
    node = tree.match_prefix([1, 2]).last_device_node
    tree.evict(2)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.inc_lock_ref(node)
    tree.check_integrity()


def test_empty_and_miss() -> None:
    tree, alloc = make()
    r = tree.match_prefix([])
    assert r.device_indices.numel() == 0 and r.last_device_node is tree.root_node
    assert tree.insert([], torch.empty(0, dtype=torch.int64)) == 0
    assert tree.match_prefix([9]).last_device_node is tree.root_node
    assert tree.init_load_back(tree.root_node, 0)[0].numel() == 0
    tree.layer_wait(0)
    tree.check_hicache_events()
    tree.check_integrity()


def test_hit_count_grows_only_in_insert() -> None:
    tree, alloc = make()
    cache(tree, alloc, [1, 2])
    node = tree.match_prefix([1, 2]).last_device_node
    assert node.hit_count == 1
    tree.match_prefix([1, 2])
    assert node.hit_count == 1
    cache(tree, alloc, [1, 2])
    assert node.hit_count == 2
    cache_slots = alloc.alloc(2)
    tree.insert([1, 2], cache_slots, chunked=True)  # chunked inserts do not count (SGLang)
    alloc.free(cache_slots)
    assert node.hit_count == 2
    tree.check_integrity()
