"""LRU eviction of radix tree leaves, shared by the device-only and the two-tier tree.

``device_leaves`` and ``host_leaves`` collect the candidates of a device or a host eviction;
``evict_lru`` pops candidates oldest first (``last_access_time``, then node id), lets the
caller's ``evict_one`` free or skip each, and queues a parent once the caller's ``requeue`` says
it became a candidate. What an evicted leaf gives back, and to whom, is the caller's decision:
see the slot-ownership comment above each tree's ``evict`` / ``evict_host``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.tree_node import TreeNode

logger = logging.getLogger(__name__)


def _leaves(
    root: TreeNode,
    below: Callable[[TreeNode], list[TreeNode]],
    keep: Callable[[TreeNode], bool],
) -> list[TreeNode]:
    """Non-root nodes reached from ``root`` through ``below`` that have nothing ``below`` them
    and pass ``keep``."""
    out = []
    stack = [root]
    while stack:
        x = stack.pop()
        nodes = below(x)
        if nodes:
            stack.extend(nodes)
        elif x is not root and keep(x):
            out.append(x)
    return out


def device_leaves(root: TreeNode) -> list[TreeNode]:
    """Device-resident non-root nodes none of whose children is device-resident."""
    return _leaves(
        root, lambda x: [c for c in x.children.values() if not c.evicted], lambda x: True
    )


def host_leaves(root: TreeNode) -> list[TreeNode]:
    """Childless non-root nodes that are host-only and not host-protected (``host_ref == 0``)."""
    return _leaves(
        root, lambda x: list(x.children.values()), lambda x: x.evicted and x.host_ref == 0
    )


def evict_lru(
    root: TreeNode,
    leaves: list[TreeNode],
    num_tokens: int,
    evict_one: Callable[[TreeNode], int | None],
    requeue: Callable[[TreeNode], bool],
) -> int:
    """Evict from ``leaves`` in LRU order until ``num_tokens`` tokens are freed or none is left.

    ``evict_one(x)`` evicts ``x`` and returns the tokens it freed, or ``None`` to skip ``x``.
    After an eviction, ``x``'s parent (as it was before ``evict_one``) becomes a candidate when
    it is not ``root`` and ``requeue(parent)`` is true. Returns the tokens freed.
    """
    heap = [(x.last_access_time, x.id, x) for x in leaves]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        _, _, x = heapq.heappop(heap)
        parent = x.parent
        n = evict_one(x)
        if n is None:
            continue
        freed += n
        if parent is not root and requeue(parent):
            heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
    return freed
