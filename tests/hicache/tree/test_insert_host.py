"""``HiRadixCache.insert_host`` on the tree's packed-byte keys: the walk stamps and splits as
``insert`` does, the new host-only node takes the rest with its page keys, and the
``children`` map stays keyed by first pages."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.builder import KVCache, build_kv_cache
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.server_args import ServerArgs


def _cache(page_size: int) -> KVCache:
    args = ServerArgs(
        device="cpu",
        dtype="float32",
        num_layers=1,
        head_num=1,
        head_dim=4,
        max_total_tokens=16 * page_size,
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
    )
    return build_kv_cache(args)


def _insert(kv: KVCache, key: list[int]) -> None:
    kv.tree.insert(key, kv.allocator.alloc(len(key)))


def _host_slots(kv: KVCache, n: int) -> torch.Tensor:
    return kv.controller.host_allocator.alloc(n)


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_host_splits_the_shared_prefix_and_adds_the_rest_host_only(ps: int) -> None:
    kv = _cache(ps)
    tree = kv.tree
    held = list(range(100, 100 + 3 * ps))
    _insert(kv, held)
    key = held[: 2 * ps] + list(range(500, 500 + 2 * ps))  # 2 pages held, 2 pages fetched
    host = _host_slots(kv, len(key))
    hashes = page_hashes(key, ps)
    before = tree.match_prefix(held).last_device_node.last_access_time
    present = tree.insert_host(tree.root_node, key, host, hashes)
    assert present == 2 * ps
    upper = tree.root_node.children[torch.tensor(held[:ps]).numpy().tobytes()]
    assert upper.key == held[: 2 * ps] and upper.last_access_time > before  # split, stamped
    lower, new = sorted(upper.children.values(), key=lambda x: x.value is None)
    assert lower.key == held[2 * ps :] and lower.value is not None
    assert new.key == key[2 * ps :] and new.value is None
    assert torch.equal(new.host_value, host[2 * ps :])
    assert new.hash_value == hashes[2:] and new.parent is upper
    assert tree._host_queue.pop() is new
    tree._host_queue.push(new)  # back in its queue, for check_integrity
    assert tree._host_chain_tokens(new) == 2 * ps
    kv.controller.host_allocator.free(host[:present])  # the duplicates stay the caller's
    tree.check_integrity()
    kv.close()


def test_insert_host_of_pages_already_held_adds_nothing() -> None:
    kv = _cache(2)
    tree = kv.tree
    _insert(kv, [1, 2, 3, 4])
    key = [1, 2, 3, 4]
    n = tree.insert_host(tree.root_node, key, torch.arange(4), page_hashes(key, 2))
    assert n == 4 and len(tree.all_nodes()) == 1 and len(tree._host_queue) == 0
    with pytest.raises(ValueError, match="whole pages"):
        tree.insert_host(tree.root_node, [1, 2, 3], torch.arange(3), ["k"])
    kv.close()
