"""One device eviction of a hierarchical tree: the order it takes leaves in and its write-backs.

``HiRadixCache.evict`` pops least recently used device leaves from the tree's queue and hands
each to ``DeviceEviction.evict_one``, which applies the write policy: a backed-up leaf becomes
host-only; under write_back a leaf without a host copy gets a backup and is *host-bound* until
the eviction waits for it; otherwise the leaf is deleted. A parent whose every device child is
host-bound is a leaf for the rest of this eviction (``parents``, merged with the tree's queue by
access time), as SGLang's write_back evicts it in the same pass.

The tree is seen through :class:`EvictionTree`, the few calls this module needs of it (the tree
imports this module, never the other way round).

When a write_back backup finds no host room even after host eviction while this eviction's own
earlier backups hold the host, those are finished first (their older nodes become host-only and
host-evictable) and the backup is tried again, so the most recently used leaves keep a host copy.

A write-back backup that fails (its launch: ``write_backup`` returns 0, as for a full host; or
while it ran: its ack says so) leaves the leaf as if it had never been backed up: it is deleted
when it may be (KV lost, as for a full host), else it stays on the device, is not tried again in
this eviction, and is an eviction candidate again afterwards (``kept``); a host-bound parent of a
leaf that stays stays too.
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hicache.tree.lru_queues import LRUQueue
    from hicache.tree.node import TreeNode

logger = logging.getLogger(__name__)


class _Controller(Protocol):
    def wait_write(self, node_ids: list[int]) -> None: ...

    def evict_device(self, device_indices: torch.Tensor) -> int: ...


class EvictionTree(Protocol):
    """What a device eviction reads and calls on its tree (``HiRadixCache`` provides it)."""

    root_node: TreeNode
    write_policy: str
    controller: _Controller
    _device_queue: LRUQueue

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int: ...

    def _droppable(self, node: TreeNode) -> bool: ...

    def _evict_backuped(self, node: TreeNode, frees: list[torch.Tensor]) -> int: ...

    def _evict_regular(self, node: TreeNode, frees: list[torch.Tensor]) -> int: ...

    def _ack_write(self, node_id: int) -> bool: ...

    def _disown(self, slots: torch.Tensor) -> None: ...


class DeviceEviction:
    """The state of one ``HiRadixCache.evict`` call (see this module's docstring).

    ``host_bound``: nodes to move to the host at ``finish_host_bound`` (their write-back backups, if
    any, are waited for first), in the order they were taken, children before parents.
    ``parents``: parents whose every device child is host-bound; they are leaves for this call
    (SGLang's write_back evicts them in the same pass), ordered with the tree's queue by access
    time. ``frees``: device slots to give back at the end, in one call. ``kept``: host-bound
    nodes that stay on the device after all (a failed backup), skipped for the rest of this
    call and queued again at its end.
    """

    def __init__(self, tree: EvictionTree) -> None:
        self.tree = tree
        self.freed = 0
        self.host_bound: list[TreeNode] = []
        self.host_bound_ids: set[int] = set()
        self.backups: list[int] = []  # ids of the host-bound nodes with a backup in flight
        self.host_bound_children: dict[int, int] = {}
        self.parents: list[tuple[int, int, TreeNode]] = []
        self.frees: list[torch.Tensor] = []
        self.kept: list[TreeNode] = []
        self.kept_ids: set[int] = set()

    def _parent_ready(self, x: TreeNode) -> bool:
        return (
            x.parent is not None
            and x.value is not None
            and x.lock_ref == 0
            and x.device_children == self.host_bound_children.get(x.id, 0)
            and x.id not in self.host_bound_ids
            and x.id not in self.kept_ids
        )

    def next_leaf(self) -> TreeNode | None:
        """The least recently used device leaf of this call (tree queue or ``parents``)."""
        queue = self.tree._device_queue
        while True:
            x = queue.peek()
            while x is not None and (x.id in self.host_bound_ids or x.id in self.kept_ids):
                queue.pop()  # a host-bound node is no candidate until its backup is done
                x = queue.peek()
            parents = self.parents
            while parents and not self._parent_ready(parents[0][2]):
                heapq.heappop(parents)
            if parents and (
                x is None or (parents[0][0], parents[0][1]) < (x.last_access_time, x.id)
            ):
                return heapq.heappop(parents)[2]
            return queue.pop() if x is not None else None

    def evict_one(self, x: TreeNode) -> None:
        tree = self.tree
        if x.backuped:
            if x.device_children:  # its children are host-bound: it follows them to the host
                self._add_host_bound(x)
            else:
                self.freed += tree._evict_backuped(x, self.frees)
            return
        if tree.write_policy == "write_back":
            ok = tree.write_backup(x, write_back=True)
            if not ok and self.backups:
                # Host full of this call's own backups: finish them (older leaves become
                # host-only and host-evictable), then try again, so LRU order holds on the host.
                self.finish_host_bound()
                ok = x.parent is not None and tree.write_backup(x, write_back=True)
            if ok:
                self.backups.append(x.id)
                self._add_host_bound(x)
                return
        if tree._droppable(x) and x.parent is not None:
            self.freed += tree._evict_regular(x, self.frees)

    def _add_host_bound(self, x: TreeNode) -> None:
        self.host_bound.append(x)
        self.host_bound_ids.add(x.id)
        self.freed += len(x.value)
        parent = x.parent
        if parent is self.tree.root_node:
            return
        count = self.host_bound_children.get(parent.id, 0) + 1
        self.host_bound_children[parent.id] = count
        if count == parent.device_children and parent.lock_ref == 0:
            heapq.heappush(self.parents, (parent.last_access_time, parent.id, parent))

    def finish_host_bound(self) -> None:
        """Wait for this call's backups, ack them, and move every host-bound node to the host."""
        if not self.host_bound:
            return
        tree = self.tree
        if self.backups:
            tree.controller.wait_write(self.backups)
            for node_id in self.backups:
                tree._ack_write(node_id)  # a failed one leaves its node without a host copy
        for x in self.host_bound:  # children before parents
            if x.device_children == 0 and x.backuped:
                tree._evict_backuped(x, self.frees)
            elif x.device_children == 0 and tree._droppable(x) and x.parent is not None:
                tree._evict_regular(x, self.frees)  # its backup failed: as with a full host
            else:  # its backup failed and it may not be dropped, or a child of it stays
                self.freed -= len(x.value)
                self.kept.append(x)
                self.kept_ids.add(x.id)
        self.host_bound = []
        self.host_bound_ids.clear()
        self.backups = []
        self.host_bound_children.clear()

    def give_back(self) -> None:
        """Free this call's device slots in one call; queue the ``kept`` nodes again."""
        for x in self.kept:
            self.tree._device_queue.push_if_candidate(x)
        self.kept = []
        if self.frees:
            frees, self.frees = self.frees, []
            slots = frees[0] if len(frees) == 1 else torch.cat(frees)
            self.tree.controller.evict_device(slots)
            self.tree._disown(slots)
