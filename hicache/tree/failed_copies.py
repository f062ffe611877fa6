"""What a hierarchical tree does with a copy that failed (``hicache.transfer.errors``).

- **A failed backup** (its launch raised, or its ack reports that it failed while it ran): the
  node stays device-only, evictable and backed up again later exactly as if it had never been
  backed up. Its host slots go back to the host pool (``drop_failed_backup``); a split that
  happened while the copy ran left the upper halves with part of those slots: they lose them too.
- **A failed load back** (``start_loading`` raised, a layer's wait raised, or its ack reports a
  failure): its nodes become host-only again, as before ``init_load_back``, and their device slots
  are freed (``revert_loads``); whoever matched them recomputes. This needs every lock that callers
  took on those nodes released first (``check_revertable`` names the node still locked), because a
  locked node must stay device-resident.

The tree is seen through :class:`RevertTree` (the tree imports this module, never the other way).
Nothing here blocks; all of it is bookkeeping on the scheduler thread, and only error paths run it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from hicache.tree.lru_queues import LRUQueue
    from hicache.tree.node import TreeNode

logger = logging.getLogger(__name__)

__all__ = ["RevertTree", "check_revertable", "drop_failed_backup", "revert_loads"]


class RevertTree(Protocol):
    """What the undo of a failed copy reads and calls on its tree (``HiRadixCache``)."""

    root_node: TreeNode
    controller: Any  # HiCacheController: evict_device, evict_host
    write_locks: bool
    ongoing_write_through: dict[int, TreeNode]
    ongoing_load_back: dict[int, TreeNode]
    _load_ancestors: dict[int, TreeNode]
    _device_queue: LRUQueue
    _host_queue: LRUQueue
    evictable_size_: int
    protected_size_: int
    stats: Any

    def dec_lock_ref(self, node: TreeNode) -> int: ...

    def _disown(self, slots: torch.Tensor) -> None: ...


def drop_failed_backup(tree: RevertTree, node: TreeNode, host_slots: torch.Tensor) -> None:
    """``node``'s backup into ``host_slots`` failed: ``node`` and the upper halves split off it
    while the copy ran lose their host copy, and ``host_slots`` go back to the host pool (the
    copy's ack was popped, so none is busy). Locks are the caller's (the write-through lock is
    released as for a successful ack)."""
    x: TreeNode | None = node
    while x is not None and x is not tree.root_node and x.host_value is not None:
        if not bool(torch.isin(x.host_value.cpu(), host_slots.cpu()).all()):
            break
        x.host_value = None
        x = x.parent
    tree.controller.evict_host(host_slots)


def _chain(tree: RevertTree, node_id: int) -> list[TreeNode]:
    """The nodes a load wrote, deepest first: from its last node up to its device ancestor."""
    ancestor = tree._load_ancestors[node_id]
    out = []
    x = tree.ongoing_load_back[node_id]
    while x is not ancestor and x is not tree.root_node:
        out.append(x)
        x = x.parent
    return out


def _own_locks(tree: RevertTree) -> dict[int, int]:
    """Locks the tree itself holds, per node id (path counts): one per load in flight on its last
    node, and one per write-through backup in flight on its node."""
    holders = list(tree.ongoing_load_back.values())
    if tree.write_locks:
        holders += list(tree.ongoing_write_through.values())
    counts: dict[int, int] = {}
    for h in holders:
        x: TreeNode | None = h
        while x is not None and x is not tree.root_node:
            counts[x.id] = counts.get(x.id, 0) + 1
            x = x.parent
    return counts


def check_revertable(tree: RevertTree, node_ids: Iterable[int]) -> None:
    """``ValueError`` naming the first node of these loads that cannot become host-only again:
    one a caller still locks, or one with a device-resident child outside these loads (KV
    computed on top of the loaded prefix). Changes nothing."""
    ids = set(node_ids)
    chains = {nid: _chain(tree, nid) for nid in ids}
    reverted = {x.id for chain in chains.values() for x in chain}
    own = _own_locks(tree)
    for nid, chain in chains.items():
        for x in chain:
            if x.lock_ref != own.get(x.id, 0):
                raise ValueError(
                    f"the failed load of node {nid} cannot be undone: {x!r} holds "
                    f"{x.lock_ref - own.get(x.id, 0)} lock(s) of a caller; release the locks "
                    "taken on the nodes init_load_back returned first"
                )
            for c in x.children.values():
                if c.value is not None and c.id not in reverted:
                    raise ValueError(
                        f"the failed load of node {nid} cannot be undone: {c!r} below it is "
                        "device-resident (KV computed on the loaded prefix)"
                    )


def revert_loads(tree: RevertTree, node_ids: Iterable[int]) -> int:
    """Make the nodes of these loads host-only again, deepest load first; returns the tokens
    reverted. Their loads' tree locks are released and their device slots freed through the
    controller (the caller has dropped the loads from the controller: acked or cancelled). The
    caller ran ``check_revertable``."""
    ids = [nid for nid in node_ids if nid in tree.ongoing_load_back]
    depth = {nid: _depth(tree, tree.ongoing_load_back[nid]) for nid in ids}
    frees: list[torch.Tensor] = []
    total = 0
    for nid in sorted(ids, key=lambda i: -depth[i]):
        chain = _chain(tree, nid)
        ancestor = tree._load_ancestors.pop(nid)
        last = tree.ongoing_load_back.pop(nid)
        tree.dec_lock_ref(last)
        for x in chain:  # deepest first: each is a device leaf when it is reverted
            n = len(x.value)
            frees.append(x.value)
            if x.lock_ref > 0:
                tree.protected_size_ -= n
            else:
                tree.evictable_size_ -= n
            x.value = None
            x.parent.device_children -= 1
            tree._host_queue.push_if_candidate(x)
            total += n
        if ancestor is not tree.root_node:
            tree._device_queue.push_if_candidate(ancestor)
        logger.warning("load back of node %d undone: %d nodes host-only again", nid, len(chain))
    if frees:
        slots = frees[0] if len(frees) == 1 else torch.cat(frees)
        tree.controller.evict_device(slots)
        tree._disown(slots)
    if tree.stats is not None and total:
        tree.stats.record_load(-total)  # counted at init_load_back; these tokens never arrived
    return total


def _depth(tree: RevertTree, x: TreeNode) -> int:
    d = 0
    while x is not tree.root_node and x.parent is not None:
        d += 1
        x = x.parent
    return d
