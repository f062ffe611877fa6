"""LRU order of a radix tree's eviction candidates, one lazy heap of ``(last_access_time, node
id, node)`` per tier. A node that *may have become* a candidate is pushed, at most once per queue
(its bit in ``node.queued``); at the top, a non-candidate is dropped and a stale time refreshed.
Access times only grow, so the first current entry is the least recently used candidate."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache_prefill.hicache.tree.node import TreeNode

DEVICE = 1  # ``TreeNode.queued`` bit of the device queue
HOST = 2  # ... and of the host queue


def is_device_candidate(x: TreeNode) -> bool:
    return (
        x.value is not None and x.lock_ref == 0 and x.device_children == 0 and x.parent is not None
    )


def is_host_candidate(x: TreeNode) -> bool:
    return x.value is None and not x.children and x.host_ref == 0 and x.parent is not None


class LRUQueue:
    """One tier's candidates, LRU first: ``is_candidate`` is its O(1) test, ``mask`` its bit."""

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
        """The LRU candidate, left queued (``None``: none); drops or refreshes stale entries."""
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
        return (x for _, _, x in self.heap)
