"""Bad slots given to ``insert`` are refused before the tree changes; a refused free during
eviction leaves every leaf in the tree; a tree and an allocator must agree on the page size."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.builder import build_kv_cache
from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.tree.radix_cache import RadixCache
from hicache_prefill.server_args import ServerArgs

A = list(range(100, 108))
B = list(range(200, 208))


def snapshot(tree, alloc) -> tuple:
    return (
        sorted(tuple(x.key) for x in tree.all_nodes()),
        tree.evictable_size(),
        tree.protected_size(),
        alloc.available_size(),
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_bad_slots_are_refused_and_change_nothing(page_size) -> None:
    alloc = TokenToKVPoolAllocator(64, page_size, "cpu")
    tree = RadixCache(alloc, page_size)
    a_slots = alloc.alloc(8)
    assert tree.insert(A, a_slots) == 0
    held = alloc.alloc(8)  # a request's slots, not in the tree
    freed = alloc.alloc(8)
    alloc.free(freed)
    before = snapshot(tree, alloc)

    negative = held.clone()
    negative[-page_size:] = torch.arange(-page_size, 0)
    padding = held.clone()
    padding[:page_size] = torch.arange(page_size)  # page 0 is the allocator's padding
    duplicated = held[:page_size].repeat(8 // page_size)
    aliased = torch.cat([held[:4], a_slots[4:]])  # half of it is node A's
    for bad, match in [
        (negative, "value.*negative"),
        (padding, "value.*not allocated"),
        (freed, "value.*not allocated"),
        (duplicated, "value"),
        (a_slots, "value.*owned by the tree"),
        (aliased, "value.*owned by the tree"),
        (held[:4], "value has 4 slots"),
    ]:
        with pytest.raises(ValueError, match=match):
            tree.insert(B, bad)
        assert snapshot(tree, alloc) == before
        assert len(tree.match_prefix(B).device_indices) == 0
        tree.check_integrity(request_owned=8)

    # the usual insert of a request that matched A: its prefix holds A's own slots
    present = tree.insert(A + B, torch.cat([a_slots, held]))
    assert present == 8
    tree.check_integrity()
    assert tree.evict(100) == 16
    assert alloc.available_size() == alloc.size
    tree.check_integrity()


def test_refused_free_leaves_every_leaf_in_the_tree(monkeypatch) -> None:
    alloc = TokenToKVPoolAllocator(64, 4, "cpu")
    tree = RadixCache(alloc, 4)
    tree.insert(A, alloc.alloc(8))
    tree.insert(B, alloc.alloc(8))
    before = snapshot(tree, alloc)

    def refuse(slots: torch.Tensor) -> None:
        raise ValueError("free_index frees pages that are not allocated")

    monkeypatch.setattr(alloc, "free", refuse)
    with pytest.raises(ValueError, match="not allocated"):
        tree.evict(100)
    monkeypatch.undo()
    assert snapshot(tree, alloc) == before
    tree.check_integrity()
    assert tree.match_prefix(A).device_indices.numel() == 8

    assert tree.evict(100) == 16
    assert alloc.available_size() == alloc.size and tree.total_size() == 0
    tree.check_integrity()


def test_page_size_must_match_the_allocator() -> None:
    with pytest.raises(ValueError, match="page_size 8.*page_size 4"):
        RadixCache(TokenToKVPoolAllocator(64, 4, "cpu"), page_size=8)
    RadixCache(None, page_size=8)  # a simulated tree has no allocator to agree with


def test_hierarchical_tree_refuses_aliased_slots() -> None:
    args = ServerArgs(
        device="cpu",
        dtype="float32",
        num_layers=2,
        head_num=1,
        head_dim=4,
        max_total_tokens=32,
        page_size=4,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_write_policy="write_back",
    )
    kv = build_kv_cache(args)
    try:
        tree = kv.tree
        a_slots = kv.allocator.alloc(8)
        tree.insert(A, a_slots)
        assert tree.evict(8) == 8  # write_back: A is host-only now
        a_again = kv.allocator.alloc(8)
        tree.insert(B, a_again)  # B takes the pages A had on the device
        before = snapshot(tree, kv.allocator)
        # recomputing A would revive its host-only node with B's device slots
        with pytest.raises(ValueError, match="value.*owned by the tree"):
            tree.insert(A, a_again)
        assert snapshot(tree, kv.allocator) == before
        kv.check_integrity()
        assert tree.match_prefix(A).host_hit_length == 8

        assert tree.evict(100) == 8
        assert kv.allocator.available_size() == kv.allocator.size
        kv.check_integrity()
    finally:
        kv.close()
