"""Structural and accounting checks of a radix tree and its pools, O(tree size): ``check_tree``
raises ``AssertionError`` naming the first broken invariant (node shape, path counts, queues,
counters, slots owned once, both ledgers, unacked copies). The trees are seen through
``TreeView`` / ``HiTreeView``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from hicache_prefill.hicache.tree.keys import TOKEN_BYTES
from hicache_prefill.hicache.tree.lru_queues import (
    DEVICE,
    LRUQueue,
    is_device_candidate,
    is_host_candidate,
)

if TYPE_CHECKING:
    from hicache_prefill.hicache.tree.node import TreeNode


class TreeView(Protocol):
    """What the checks read of a device-only tree (``RadixCache`` provides it)."""

    page_size: int
    root_node: TreeNode
    allocator: Any  # TokenToKVPoolAllocator, or None for a simulated tree
    evictable_size_: int
    protected_size_: int
    owned_pages: torch.Tensor | None

    def all_nodes(self) -> list[TreeNode]: ...
    def eviction_queues(self) -> tuple[LRUQueue, ...]: ...


class HiTreeView(TreeView, Protocol):
    """What the checks also read of a tree with a host tier (``HiRadixCache`` provides it)."""

    controller: Any  # HiCacheController: its own check_integrity runs first
    host_allocator: Any
    write_locks: bool
    ongoing_write_through: dict[int, TreeNode]
    ongoing_load_back: dict[int, TreeNode]

    def device_in_flight(self) -> int: ...
    def host_in_flight(self) -> int: ...
    def unacked_write_host_slots(self) -> torch.Tensor: ...


def _fail(msg: str) -> None:
    raise AssertionError(f"tree integrity: {msg}")


def _check_node(tree: TreeView, x: TreeNode) -> None:
    ps = tree.page_size
    n = x.num_tokens
    if not n or n % ps or len(x.tokens) % TOKEN_BYTES:
        _fail(f"{x!r} key length {n} is empty or not a multiple of page_size {ps}")
    if x.parent is None or x.parent.children.get(x.tokens[: ps * TOKEN_BYTES]) is not x:
        _fail(f"{x!r} is not reachable from its parent under its first page")
    for name in ("value", "host_value"):
        v = getattr(x, name)
        if v is not None and (v.dtype != torch.int64 or v.dim() != 1 or v.numel() != n):
            _fail(f"{x!r}.{name} is not int64 [{n}]")
    if x.lock_ref < 0 or x.host_ref < 0:
        _fail(f"{x!r} has a negative ref (lock {x.lock_ref}, host {x.host_ref})")
    child_locks = sum(c.lock_ref for c in x.children.values())
    child_host = sum(c.host_ref for c in x.children.values())
    if x.lock_ref < child_locks or x.host_ref < child_host:
        _fail(f"{x!r} path counts below its children's ({child_locks} locks, {child_host} host)")
    if x.device_children != sum(1 for c in x.children.values() if c.value is not None):
        _fail(f"{x!r} counts {x.device_children} device-resident children")
    if x.lock_ref > 0 and x.evicted:
        _fail(f"{x!r} is locked but evicted")
    if x.evicted:
        if not x.backuped:
            _fail(f"{x!r} is evicted but has no host copy (KV lost while indexed)")
        if any(not c.evicted for c in x.children.values()):
            _fail(f"{x!r} is evicted but has a device-resident child")


def _check_unique_allocated(slots: list[torch.Tensor], allocator, tier: str) -> torch.Tensor:
    """The tier's slots in the tree (CPU), checked owned once and allocated."""
    if not slots:
        return torch.empty((0,), dtype=torch.int64)
    allv = torch.cat([s.cpu() for s in slots])
    if torch.unique(allv).numel() != allv.numel():
        _fail(f"a {tier} slot is owned by two nodes")
    if allocator is not None and not allocator.is_allocated(allv):
        _fail(f"a {tier} slot in the tree is free in its allocator")
    return allv


def check_tree(tree: TreeView | HiTreeView, request_owned: int = 0) -> None:
    if request_owned < 0:
        raise ValueError(f"request_owned must be >= 0, got {request_owned}")
    controller = getattr(tree, "controller", None)
    if controller is not None:
        controller.check_integrity()  # both allocators; no slot free while a copy uses it
    elif tree.allocator is not None:
        tree.allocator.check_integrity()
    nodes = tree.all_nodes()
    root = tree.root_node
    if root.device_children != sum(1 for c in root.children.values() if c.value is not None):
        _fail(f"the root counts {root.device_children} device-resident children")
    _check_queues(tree, nodes)
    evictable = protected = 0
    device_slots: list[torch.Tensor] = []
    host_slots: list[torch.Tensor] = []
    for x in nodes:
        _check_node(tree, x)
        if not x.evicted:
            device_slots.append(x.value)
            if x.lock_ref > 0:
                protected += len(x.value)
            else:
                evictable += len(x.value)
        if x.backuped:
            host_slots.append(x.host_value)
    if (evictable, protected) != (tree.evictable_size_, tree.protected_size_):
        _fail(
            f"evictable/protected {tree.evictable_size_}/{tree.protected_size_} != "
            f"recount {evictable}/{protected}"
        )
    if tree.root_node.lock_ref != 1 or tree.root_node.value is None:
        _fail("the root lost its sentinel lock or its (empty) device value")
    if tree.allocator is None:  # a simulated tree: no pool to balance
        return
    dev = _check_unique_allocated(device_slots, tree.allocator, "device")
    owned = tree.owned_pages
    if owned is not None and not torch.equal(
        torch.nonzero(owned.cpu()).flatten(), torch.unique(dev // tree.page_size)
    ):
        _fail("the map of owned device pages disagrees with the nodes' device slots")
    n_dev = dev.numel()
    in_flight = tree.device_in_flight() if hasattr(tree, "device_in_flight") else 0
    pending = tree.allocator.group_freed_size()
    allocated = tree.allocator.size - tree.allocator.available_size() - pending
    if allocated != n_dev + request_owned + in_flight:
        _fail(
            f"device ledger: allocated {allocated} != in tree {n_dev} + request-owned "
            f"{request_owned} + in flight {in_flight} (free {tree.allocator.available_size()}, "
            f"freed in the open group {pending}, total {tree.allocator.size})"
        )
    host_alloc = getattr(tree, "host_allocator", None)
    if host_alloc is None:
        if host_slots:
            _fail("a device-only tree holds host slots")
        return
    n_host = _check_unique_allocated(host_slots, host_alloc, "host").numel()
    host_in_flight = tree.host_in_flight()
    host_allocated = host_alloc.size - host_alloc.available_size()
    if host_allocated != n_host + host_in_flight:
        _fail(
            f"host ledger: allocated {host_allocated} != in tree {n_host} + in flight "
            f"{host_in_flight} (free {host_alloc.available_size()}, total {host_alloc.size})"
        )
    _check_unacked(tree, nodes)


def _check_queues(tree: TreeView, nodes: list[TreeNode]) -> None:
    """Each tier's candidates are all queued once, with entries no later than their nodes."""
    for queue in tree.eviction_queues():
        seen: set[int] = set()
        for t, node_id, x in queue.heap:
            if node_id in seen:
                _fail(f"{x!r} has two entries in queue {queue.mask}")
            seen.add(node_id)
            if not x.queued & queue.mask:
                _fail(f"{x!r} is in queue {queue.mask} without its bit")
            if node_id != x.id or t > x.last_access_time:
                _fail(f"{x!r} has an entry ({t}, {node_id}) later than its node")
        flagged = sum(1 for x in nodes if x.queued & queue.mask)
        flagged += sum(1 for x in queue.nodes() if x.parent is None and x.queued & queue.mask)
        if flagged != len(seen):
            _fail(f"queue {queue.mask}: {flagged} nodes carry its bit, {len(seen)} entries")
        test = is_device_candidate if queue.mask == DEVICE else is_host_candidate
        for x in nodes:
            if test(x) and not x.queued & queue.mask:
                _fail(f"{x!r} is an eviction candidate missing from queue {queue.mask}")
    if tree.root_node.queued:
        _fail("the root is in an eviction queue")


def _check_unacked(tree: HiTreeView, nodes: list[TreeNode]) -> None:
    """Writes not yet acked are not host hits; nodes awaiting acks are in the tree and held."""
    unacked = tree.unacked_write_host_slots()
    if unacked.numel():
        evicted = [x.host_value for x in nodes if x.evicted]
        if evicted and bool(torch.isin(torch.cat(evicted).cpu(), unacked.cpu()).any()):
            _fail("an evicted (host-only, matchable) node's host copy has not been acked yet")
    if not tree.write_locks and tree.ongoing_write_through:
        _fail("write_back backups outlived the eviction that waits for them")
    live = {x.id for x in nodes}
    for what, waiting in (("write", tree.ongoing_write_through), ("load", tree.ongoing_load_back)):
        for node_id, x in waiting.items():
            if node_id not in live:
                _fail(f"node {node_id} awaiting a {what} ack was removed from the tree")
            if x.evicted:
                _fail(f"{x!r} awaiting a {what} ack is evicted")
            if x.lock_ref <= 0 and (what == "load" or tree.write_locks):
                _fail(f"{x!r} awaiting a {what} ack is not locked")
