"""What a ``HiRadixCache`` does for an L3 storage tier: page keys on its nodes, host-only nodes
for pages fetched from storage, and the ``StorageHooks`` it calls (the storage controller,
``hicache.storage.io.controller``, provides them; this module never imports it).

- ``assign_hashes(node, page_size)``: SGLang's ``compute_node_hash_values``: a new node's
  ``hash_value`` is the chain of its pages' keys continued from its parent's last key (a child of
  the root starts a new chain). The tree calls it at insert when storage is attached, so every
  node carries the keys its pages are stored and found under; splits keep them page-aligned
  (``node.split_node``).
- ``insert_host(tree, anchor, key, host_indices, hashes)``: SGLang's ``insert_host``: the
  fetched pages ``key`` (page-aligned tokens right after ``anchor``) enter the tree as one
  host-only node below what is already there. Returns how many tokens of ``key`` the tree
  already held: the caller frees ``host_indices[:returned]`` (duplicates); the rest now belongs
  to the new node, which the ordinary load back brings to the device.

Slot ownership of ``insert_host``: ``host_indices[:present]`` stay the caller's (the tree holds
that prefix already, on some tier); ``host_indices[present:]`` become the new node's
``host_value`` (a clone), readable at once (the storage read finished before this call).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from hicache.storage.hash_keys import page_hashes
from hicache.tree.node import TreeNode, child_key, match_len, split_node

if TYPE_CHECKING:
    from hicache.tree.lru_queues import LRUQueue

logger = logging.getLogger(__name__)


class StorageHooks(Protocol):
    """What the tree calls on its storage tier (all on the scheduler thread)."""

    buffer_only: bool

    def backup_node(self, node: TreeNode, host_indices: torch.Tensor, keys: list[str]) -> None:
        """Cache mode: the L2 copy ``host_indices`` (with ``keys``) of ``node`` was acked: store
        it, its host pages protected (``host_ref`` from ``node`` up) until the storage ack."""

    def backup_staged(self, node: TreeNode, host_indices: torch.Tensor, keys: list[str]) -> None:
        """``buffer_only``: the node's D2H staging was acked: store, then free the staging."""

    def believed_stored(self, keys: list[str]) -> bool:
        """``buffer_only``: every key was stored (or its write is on the way)."""

    def note_staging(self, keys: list[str]) -> None:
        """``buffer_only``: a write of these keys was started."""

    def check_events(self) -> None:
        """Agree and apply the storage threads' results (one tick)."""

    def host_slots_held(self) -> int:
        """Host slots the storage tier holds outside the tree (prefetch and staging)."""

    def ops_in_flight(self) -> int:
        """Prefetches and backups not acked yet."""


class HostInsertTree(Protocol):
    """What ``insert_host`` reads and changes of the tree."""

    page_size: int
    _host_queue: LRUQueue

    def _tick(self) -> int: ...


def assign_hashes(node: TreeNode, page_size: int) -> None:
    """Give ``node`` the keys of its pages, chained from its parent's last key."""
    parent = node.parent
    prior = parent.hash_value[-1] if parent is not None and parent.hash_value else None
    node.hash_value = page_hashes(node.key, page_size, prior)


def insert_host(
    tree: HostInsertTree,
    anchor: TreeNode,
    key: list[int],
    host_indices: torch.Tensor,
    hashes: list[str],
) -> int:
    """See the module docstring. ``ValueError`` (nothing changed) for a key that is not whole
    pages or does not match ``host_indices`` / ``hashes`` in length."""
    ps = tree.page_size
    if len(key) % ps or len(key) != host_indices.numel() or len(hashes) != len(key) // ps:
        raise ValueError(
            f"insert_host: {len(key)} tokens, {host_indices.numel()} host slots and "
            f"{len(hashes)} keys do not describe the same whole pages of {ps}"
        )
    if anchor.parent is None and anchor.key:
        raise ValueError(f"insert_host: anchor {anchor!r} is not in the tree")
    now = tree._tick()
    node, i, n = anchor, 0, len(key)
    while i < n:
        child = node.children.get(child_key(key, ps, i))
        if child is None:
            break
        m = match_len(child.key, key, i, n, ps)
        if m == 0:
            break
        child.last_access_time = now
        if m < len(child.key):
            child = split_node(child, m, ps)
        node, i = child, i + m
    if i < n:
        new = TreeNode()
        new.parent = node
        new.key = key[i:]
        new.host_value = host_indices[i:].clone()
        new.hash_value = list(hashes[i // ps :])
        new.last_access_time = now
        node.children[child_key(new.key, ps)] = new
        tree._host_queue.push_if_candidate(new)
    return i


def host_chain_tokens(last_host_node: TreeNode) -> int:
    """Tokens of the host-only nodes ending at ``last_host_node`` (up to its first device-resident
    ancestor)."""
    n, x = 0, last_host_node
    while x.parent is not None and x.value is None:
        n += len(x.key)
        x = x.parent
    return n


def check_storage_tree(tree: HostInsertTree, nodes: list[TreeNode], buffer_only: bool) -> None:
    """``AssertionError`` unless every node carries one key per page (a chain continued from its
    parent's last key, spot-checked at its first page) and, with ``buffer_only``, no node keeps
    a host copy."""
    ps = tree.page_size
    for x in nodes:
        if x.hash_value is None or len(x.hash_value) != len(x.key) // ps:
            raise AssertionError(f"storage: {x!r} lacks one page key per page")
        parent = x.parent
        prior = parent.hash_value[-1] if parent is not None and parent.hash_value else None
        if page_hashes(x.key[:ps], ps, prior)[0] != x.hash_value[0]:
            raise AssertionError(f"storage: {x!r}'s first key does not continue its parent's")
        if buffer_only and x.host_value is not None:
            raise AssertionError(f"storage: buffer_only, yet {x!r} keeps a host copy")
