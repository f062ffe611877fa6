"""``storage_hooks.insert_host`` on the tree's packed-byte keys: the walk stamps and splits as
``insert`` does, the new host-only node takes the rest with its page keys, and the
``children`` map stays keyed by first pages."""

from __future__ import annotations

import pytest
import torch

from hicache.storage.hash_keys import page_hashes
from hicache.tree.lru_queues import HOST, LRUQueue, is_host_candidate
from hicache.tree.radix_cache import RadixCache
from hicache.tree.storage_hooks import host_chain_tokens, insert_host


def _tree(page_size: int) -> RadixCache:
    tree = RadixCache(None, page_size)
    tree._host_queue = LRUQueue(HOST, is_host_candidate)  # what insert_host needs of a host tier
    return tree


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_host_splits_the_shared_prefix_and_adds_the_rest_host_only(ps: int) -> None:
    tree = _tree(ps)
    held = list(range(100, 100 + 3 * ps))
    tree.insert(held)
    key = held[: 2 * ps] + list(range(500, 500 + 2 * ps))  # 2 pages held, 2 pages fetched
    host = torch.arange(1000, 1000 + len(key))
    hashes = page_hashes(key, ps)
    before = tree.match_prefix(held).last_device_node.last_access_time
    present = insert_host(tree, tree.root_node, key, host, hashes)
    assert present == 2 * ps
    upper = tree.root_node.children[torch.tensor(held[:ps]).numpy().tobytes()]
    assert upper.key == held[: 2 * ps] and upper.last_access_time > before  # split, stamped
    lower, new = sorted(upper.children.values(), key=lambda x: x.value is None)
    assert lower.key == held[2 * ps :] and lower.value is not None
    assert new.key == key[2 * ps :] and new.value is None
    assert torch.equal(new.host_value, host[2 * ps :])
    assert new.hash_value == hashes[2:] and new.parent is upper
    assert tree._host_queue.pop() is new
    assert host_chain_tokens(new) == 2 * ps
    tree.check_integrity()


def test_insert_host_of_pages_already_held_adds_nothing() -> None:
    tree = _tree(2)
    tree.insert([1, 2, 3, 4])
    key = [1, 2, 3, 4]
    n = insert_host(tree, tree.root_node, key, torch.arange(4), page_hashes(key, 2))
    assert n == 4 and len(tree.all_nodes()) == 1 and len(tree._host_queue) == 0
    with pytest.raises(ValueError, match="whole pages"):
        insert_host(tree, tree.root_node, [1, 2, 3], torch.arange(3), ["k"])
