"""LRU order of a radix tree's eviction candidates, one queue per tier.

A heap of ``(last_access_time, node id, node)`` kept lazily: the tree pushes a node whenever it
*may have become* a candidate; a node holds at most one entry per queue (its bit in
``node.queued``); an entry whose node stopped being a candidate is dropped when it reaches the
top, and one older than its node's access time is pushed again with the new time. Access times
only grow, so the first current entry of a candidate is the least recently used candidate (ties:
older node first). Evicting k nodes pops k entries, O(k log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.tree.node import TreeNode

DEVICE = 1  # ``TreeNode.queued`` bit of the device queue
HOST = 2  # ... and of the host queue


def is_device_candidate(x: TreeNode) -> bool:
    """Device-resident, unlocked, attached, and no child on the device (a device leaf)."""
    return (
        x.value is not None and x.lock_ref == 0 and x.device_children == 0 and x.parent is not None
    )


def is_host_candidate(x: TreeNode) -> bool:
    """Host-only, childless, attached, and not protected by a load (``host_ref == 0``)."""
    return x.value is None and not x.children and x.host_ref == 0 and x.parent is not None


class LRUQueue:
    """Candidates of one tier's eviction, least recently used first. ``is_candidate`` is the
    tier's O(1) test, ``mask`` its bit in ``TreeNode.queued``; the tree decides what a popped
    node loses."""

    __slots__ = ("heap", "mask", "is_candidate")

    def __init__(self, mask: int, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.heap: list[tuple[int, int, TreeNode]] = []
        self.mask = mask
        self.is_candidate = is_candidate

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, x: TreeNode) -> None:
        """``x`` may be a candidate now (no-op when it already has an entry). O(log n)."""
        if not x.queued & self.mask:
            x.queued |= self.mask
            heapq.heappush(self.heap, (x.last_access_time, x.id, x))

    def push_if_candidate(self, x: TreeNode) -> None:
        if self.is_candidate(x):
            self.push(x)

    def peek(self) -> TreeNode | None:
        """The least recently used candidate, left in the queue; ``None`` when there is none.
        Drops and refreshes the stale entries above it (amortized O(log n))."""
        heap = self.heap
        is_candidate = self.is_candidate
        while heap:
            t, _, x = heap[0]
            if not is_candidate(x):
                heapq.heappop(heap)
                x.queued &= ~self.mask
            elif x.last_access_time != t:
                heapq.heapreplace(heap, (x.last_access_time, x.id, x))
            else:
                return x
        return None

    def pop(self) -> TreeNode | None:
        """Remove and return the least recently used candidate; ``None`` when there is none."""
        x = self.peek()
        if x is not None:
            heapq.heappop(self.heap)
            x.queued &= ~self.mask
        return x

    def compact(self) -> None:
        """Drop the entries of deleted nodes. O(n); the tree calls it when they pile up."""
        keep = []
        for e in self.heap:
            if e[2].parent is None:
                e[2].queued &= ~self.mask
            else:
                keep.append(e)
        heapq.heapify(keep)
        self.heap = keep

    def nodes(self) -> Iterator[TreeNode]:
        """Every node holding an entry (for integrity checks)."""
        return (x for _, _, x in self.heap)
