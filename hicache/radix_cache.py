"""Device-only radix tree over token ids (SGLang ``RadixCache``), page-aligned.

Each node owns the device slots (``value``: 1-D int64 tensor on the pool's device) of the
tokens on its edge (``key``). The tree never knows requests: a request owns slots until it
``insert``s them, after which the tree owns every slot of the newly created nodes and the caller
frees its duplicates of the prefix that was already present.

``HiRadixCache`` (``hiradix_cache.py``) extends this with a host tier; the node fields it needs
(``host_value``, ``host_ref``) live here so both trees share one node type and one walk.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.tree_integrity import check_tree

if TYPE_CHECKING:
    from hicache.allocator import TokenToKVPoolAllocator

logger = logging.getLogger(__name__)

_MATCH_STEP = 64  # tokens compared per C-level slice before a per-token scan


class TreeNode:
    """One edge of the radix tree.

    ``key``: token ids of the edge (a multiple of ``page_size`` long, never empty except root).
    ``value``: device slots, int64 ``[len(key)]``, or ``None`` when evicted to the host.
    ``host_value``: host slots, int64 ``[len(key)]`` on CPU, or ``None`` when not backed up.
    ``lock_ref``: number of locks held on this node or any descendant (path count, as SGLang).
    ``host_ref``: same path count for host protection (a host copy that must not be freed).
    ``hit_count``: inserts that created or touched the node; grows only in ``insert``.
    ``last_access_time``: logical clock of the last match or insert through the node (LRU key).
    """

    __slots__ = (
        "id",
        "key",
        "value",
        "host_value",
        "parent",
        "children",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access_time",
    )
    _ids = itertools.count()

    def __init__(self) -> None:
        self.id: int = next(TreeNode._ids)
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.parent: TreeNode | None = None
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access_time = 0

    @property
    def evicted(self) -> bool:
        """True when the node has no device copy (its KV lives on the host only)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """True when the node has a host copy (SGLang's spelling)."""
        return self.host_value is not None

    def __repr__(self) -> str:
        tiers = ("D" if self.value is not None else "") + ("H" if self.backuped else "")
        return f"TreeNode(id={self.id}, len={len(self.key)}, {tiers or '-'}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    """Result of ``match_prefix``.

    ``device_indices``: int64 ``[n]`` device slots of the device-resident matched prefix.
    ``last_device_node``: deepest matched node whose KV is on the device (root when none).
    ``last_host_node``: deepest matched node (device or host); equals ``last_device_node`` when
    nothing past the device prefix was matched.
    ``host_hit_length``: tokens matched past the device prefix, held on the host only.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


def _as_key(key: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(key, torch.Tensor):
        if key.dim() != 1:
            raise ValueError(f"key must be 1-D, got shape {tuple(key.shape)}")
        return key.tolist()
    if isinstance(key, (str, bytes)):
        raise ValueError("key must be a sequence of token ids, not a string")
    return list(key)


class RadixCache:
    """Device-only prefix cache with LRU eviction of unlocked leaves.

    Args:
        allocator: the device slot allocator (``alloc``/``free``/``available_size``); the tree
            frees slots of evicted nodes into it.
        page_size: tokens per page; every stored key is a whole number of pages.
        device: device of the slot tensors (defaults to the allocator's).

    Nothing here blocks; all calls are host-side bookkeeping on the scheduler thread.
    """

    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        if device is None:
            device = getattr(allocator, "device", "cpu")
        self.device = torch.device(device)
        self._clock = itertools.count(1)
        self.reset()

    # ------------------------------------------------------------------ basics

    def reset(self) -> None:
        """Forget every node (does not free slots: only for a fresh or fully drained pool)."""
        self.root_node = TreeNode()
        self.root_node.value = self._empty()
        self.root_node.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        return next(self._clock)

    def _child_key(self, key: list[int], start: int = 0) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], start: int) -> int:
        """Length of the common prefix of ``node_key`` and ``key[start:]``, in whole pages."""
        n = min(len(node_key), len(key) - start)
        if node_key[:n] == key[start : start + n]:
            return n
        i = 0
        while (
            i + _MATCH_STEP <= n
            and node_key[i : i + _MATCH_STEP] == key[start + i : start + i + _MATCH_STEP]
        ):
            i += _MATCH_STEP
        while i < n and node_key[i] == key[start + i]:
            i += 1
        return i - i % self.page_size

    def evictable_size(self) -> int:
        """Device tokens held by the tree in unlocked nodes (free to evict)."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Device tokens held by the tree in locked nodes."""
        return self.protected_size_

    def total_size(self) -> int:
        """All device tokens held by the tree."""
        return self.evictable_size_ + self.protected_size_

    # ------------------------------------------------------------------ match

    def match_prefix(self, key: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest cached prefix of ``key`` (truncated to whole pages).

        Splits a node when the match ends inside it, so ``last_*_node`` covers exactly the match.
        Refreshes ``last_access_time`` along the path; never changes ``hit_count``.
        """
        key = _as_key(key)
        key = key[: len(key) - len(key) % self.page_size]
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        last_device = node
        host_hit_length = 0
        i = 0
        while i < len(key):
            child = node.children.get(self._child_key(key, i))
            if child is None:
                break
            n = self._match_len(child.key, key, i)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = now
            if child.evicted:
                host_hit_length += n
            else:
                values.append(child.value)
                last_device = child
            node = child
            i += n
        device_indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices, last_device, node, host_hit_length)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Split ``child`` into ``new -> child`` with ``new`` holding the first ``split_len``
        tokens of both tiers. Lock and host refs are path counts, so ``new`` inherits them."""
        new = TreeNode()
        new.parent = child.parent
        new.key = child.key[:split_len]
        new.lock_ref = child.lock_ref
        new.host_ref = child.host_ref
        new.hit_count = child.hit_count
        new.last_access_time = child.last_access_time
        if child.value is not None:
            new.value = child.value[:split_len]
            child.value = child.value[split_len:]
        if child.host_value is not None:
            new.host_value = child.host_value[:split_len]
            child.host_value = child.host_value[split_len:]
        child.key = child.key[split_len:]
        child.parent = new
        new.children = {self._child_key(child.key): child}
        new.parent.children[self._child_key(new.key)] = new
        return new

    # ------------------------------------------------------------------ insert

    def _validate_insert(self, key: Sequence[int] | torch.Tensor, value: torch.Tensor) -> list[int]:
        key = _as_key(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"value must be a torch.Tensor of slots, got {type(value).__name__}")
        if value.dim() != 1 or value.dtype != torch.int64:
            raise ValueError(
                f"value must be a 1-D int64 tensor, got shape {tuple(value.shape)} {value.dtype}"
            )
        if value.device.type != self.device.type:
            raise ValueError(f"value is on {value.device}, the tree's slots are on {self.device}")
        if len(key) != value.numel():
            raise ValueError(f"key has {len(key)} tokens but value has {value.numel()} slots")
        if len(key) % self.page_size:
            raise ValueError(
                f"key length {len(key)} is not a multiple of page_size {self.page_size}"
            )
        return key

    # Slot ownership during insert(key, value):
    #   value[:returned]            already device-resident in the tree; the caller still owns
    #                               these duplicates and frees them (those it did not get from
    #                               match_prefix in the first place).
    #   value[returned:]            now owned by the tree: either given to evicted nodes along
    #                               the path (HiRadixCache: recomputed KV revives host-only
    #                               nodes) or to the new leaf. The tree stores clones, so the
    #                               caller's tensor may be reused.
    # Device-resident nodes form a prefix of every path, so "already present" is one prefix.
    def insert(
        self, key: Sequence[int] | torch.Tensor, value: torch.Tensor, chunked: bool = False
    ) -> int:
        """Insert ``key`` with device slots ``value`` (int64 ``[len(key)]``, pool device).

        ``chunked`` marks an insert of an unfinished (chunk-prefilled) request.
        Returns the length of the prefix whose KV was already device-resident; the caller frees
        its own slots for that prefix. Raises ``ValueError`` (state unchanged) on mismatched
        lengths, an unaligned key or a non-int64 value.
        """
        key = self._validate_insert(key, value)
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        present = 0
        i = 0
        while i < len(key):
            child = node.children.get(self._child_key(key, i))
            if child is None:
                break
            n = self._match_len(child.key, key, i)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = now
            if child.evicted:
                self._revive(child, value[i : i + n].clone())
            else:
                present += n
                self._on_insert_touch(child, chunked)
            node = child
            i += n
        if i < len(key):
            new = TreeNode()
            new.parent = node
            new.key = key[i:]
            new.value = value[i:].clone()
            new.last_access_time = now
            node.children[self._child_key(new.key)] = new
            self._add_device_tokens(new, len(new.key))
            self._on_insert_create(new, chunked)
        return present

    def _add_device_tokens(self, node: TreeNode, n: int) -> None:
        if node.lock_ref > 0:
            self.protected_size_ += n
        else:
            self.evictable_size_ += n

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        raise AssertionError("device-only tree has no evicted nodes")  # pragma: no cover

    def _on_insert_touch(self, node: TreeNode, chunked: bool) -> None:
        """An insert passed through an existing device-resident node (SGLang skips chunked)."""
        if not chunked:
            node.hit_count += 1

    def _on_insert_create(self, node: TreeNode, chunked: bool) -> None:
        if not chunked:
            node.hit_count += 1

    # ------------------------------------------------------------------ locks

    def _check_attached(self, node: TreeNode, arg: str = "node") -> None:
        if not isinstance(node, TreeNode):
            raise ValueError(f"{arg} must be a TreeNode, got {type(node).__name__}")
        x = node
        while x is not self.root_node:
            parent = x.parent
            if parent is None or parent.children.get(self._child_key(x.key)) is not x:
                raise ValueError(f"{arg} {node!r} is not in this tree (deleted or foreign)")
            x = parent

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors against eviction; returns the tokens moved from
        evictable to protected. Raises ``ValueError`` for a host-only (evicted) node."""
        self._check_attached(node)
        if node.evicted:
            raise ValueError(f"node {node!r} is evicted; lock the last device node instead")
        delta = 0
        x = node
        while x is not self.root_node:
            if x.lock_ref == 0:
                self.evictable_size_ -= len(x.value)
                self.protected_size_ += len(x.value)
                delta += len(x.value)
            x.lock_ref += 1
            x = x.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock taken by ``inc_lock_ref(node)``; returns the tokens made evictable.
        Raises ``ValueError`` (state unchanged) when it would drop a count below zero."""
        self._check_attached(node)
        x = node
        while x is not self.root_node:
            if x.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref({node!r}): lock_ref of {x!r} would go below 0")
            x = x.parent
        delta = 0
        x = node
        while x is not self.root_node:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                self.evictable_size_ += len(x.value)
                self.protected_size_ -= len(x.value)
                delta += len(x.value)
            x = x.parent
        return delta

    # ------------------------------------------------------------------ evict

    def _device_leaves(self) -> list[TreeNode]:
        """Device-resident non-root nodes none of whose children is device-resident."""
        out = []
        stack = [self.root_node]
        while stack:
            x = stack.pop()
            device_children = [c for c in x.children.values() if not c.evicted]
            if device_children:
                stack.extend(device_children)
            elif x is not self.root_node:
                out.append(x)
        return out

    def _delete_leaf(self, node: TreeNode) -> None:
        del node.parent.children[self._child_key(node.key)]
        node.parent = None

    # Slot ownership during evict: every slot of an evicted leaf goes back to the allocator;
    # locked nodes (a request, a pending backup or a pending load holds them) are skipped.
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens from unlocked leaves in LRU order, or as
        many as are evictable. Returns the tokens freed."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        heap = [(x.last_access_time, x.id, x) for x in self._device_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if x.lock_ref > 0:
                continue
            self.allocator.free(x.value)
            freed += len(x.value)
            self.evictable_size_ -= len(x.value)
            parent = x.parent
            self._delete_leaf(x)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """No host tier: frees nothing."""
        return 0

    # ------------------------------------------------------------------ hierarchy hooks

    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int
    ) -> tuple[torch.Tensor, TreeNode]:
        """No host tier: nothing to load; returns ``(empty, last_host_node)``."""
        return self._empty(), last_host_node

    def ready_to_load_host_cache(self) -> int:
        """No host tier: nothing to start; returns -1."""
        return -1

    def check_hicache_events(self) -> None:
        """No host tier: no acks to poll."""

    def layer_wait(self, layer_id: int) -> None:
        """No host tier: KV of every layer is already on the device."""

    # ------------------------------------------------------------------ integrity

    def check_integrity(self, request_owned: int = 0) -> None:
        """Raise ``AssertionError`` when the tree, its allocators or (HiRadixCache) the controller
        is inconsistent; see ``hicache.tree_integrity`` for the list of invariants.

        ``request_owned``: device slots currently allocated by requests (not in the tree);
        the device ledger must balance: free + in tree + request-owned + in flight == total.
        """
        check_tree(self, request_owned=request_owned)

    def all_nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out = []
        stack = list(self.root_node.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out
