"""Radix tree nodes, match results and the page-aligned key helpers both trees share.

``TreeNode`` is one edge of the tree: its tokens, its device and host slots and the path counts
that protect them; the node fields a host tier needs (``host_value``, ``host_ref``) live here too,
so ``RadixCache`` and ``HiRadixCache`` share one node type and one walk. ``split_node`` cuts an
edge in two (both tiers' slots follow their tokens; no accounting changes). ``MatchResult`` is
what ``match_prefix`` returns. The key helpers turn a caller's key into token ids (without a copy
when it already is a list), check an insert's arguments, name a child by its first page and
measure a match in whole pages. Nothing here owns slots or knows the pools.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

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
    ``device_children``: children that are device-resident (kept by the tree; O(1) leaf test).
    ``queued``: bit set of the eviction queues (``eviction.LRUQueue``) holding an entry for it.
    ``hash_value``: the L3 storage key of each page of the edge (``hicache.storage.hash_keys``,
    SGLang's field), ``None`` when no storage tier is attached; kept page-aligned by splits.
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
        "device_children",
        "queued",
        "hash_value",
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
        self.device_children = 0
        self.queued = 0
        self.hash_value: list[str] | None = None

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


def split_node(child: TreeNode, split_len: int, page_size: int) -> TreeNode:
    """Split ``child`` into ``new -> child`` with ``new`` holding the first ``split_len``
    tokens of both tiers. Lock and host refs are path counts, so ``new`` inherits them, and so
    does its access time (callers stamp ``child`` first: SGLang refreshes the whole node, then
    splits). ``child`` keeps its place in the eviction queues; ``new`` has a child, so it is no
    leaf of either tier and needs none."""
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
        new.device_children = 1
    if child.host_value is not None:
        new.host_value = child.host_value[:split_len]
        child.host_value = child.host_value[split_len:]
    if child.hash_value is not None:  # page keys follow their pages (L3 storage)
        pages = split_len // page_size
        new.hash_value = child.hash_value[:pages]
        child.hash_value = child.hash_value[pages:]
    child.key = child.key[split_len:]
    child.parent = new
    new.children = {child_key(child.key, page_size): child}
    new.parent.children[child_key(new.key, page_size)] = new
    return new


def as_key(key: Sequence[int] | torch.Tensor) -> list[int]:
    """``key`` as a list of token ids (a list is used as is, never copied); ``ValueError`` for a
    tensor that is not 1-D or a string."""
    if type(key) is list:
        return key
    if isinstance(key, torch.Tensor):
        if key.dim() != 1:
            raise ValueError(f"key must be 1-D, got shape {tuple(key.shape)}")
        return key.tolist()
    if isinstance(key, (str, bytes)):
        raise ValueError("key must be a sequence of token ids, not a string")
    return list(key)


def check_insert_args(
    key: Sequence[int] | torch.Tensor,
    value: torch.Tensor | None,
    device: torch.device,
    page_size: int,
    simulated: bool,
) -> tuple[list[int], torch.Tensor]:
    """``(key, value)`` cut to whole pages after checking ``insert``'s arguments (SGLang
    ``RadixKey.page_aligned``): ``value`` a 1-D int64 tensor on ``device``'s type with one slot
    per token of ``key``. ``value=None`` only in a simulated tree (no allocator), where the
    token ids stand in for slots as in SGLang's test fallback. ``ValueError`` otherwise."""
    key = as_key(key)
    if value is None:
        if not simulated:
            raise ValueError(
                "value is required: this tree frees its slots into an allocator, and token ids "
                "are not slots (only a simulated tree, allocator=None, takes keys alone)"
            )
        value = torch.tensor(key, dtype=torch.int64, device=device)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"value must be a torch.Tensor of slots, got {type(value).__name__}")
    if value.dim() != 1 or value.dtype != torch.int64:
        raise ValueError(
            f"value must be a 1-D int64 tensor, got shape {tuple(value.shape)} {value.dtype}"
        )
    if value.device.type != device.type:
        raise ValueError(f"value is on {value.device}, the tree's slots are on {device}")
    if len(key) != value.numel():
        raise ValueError(f"key has {len(key)} tokens but value has {value.numel()} slots")
    tail = len(key) % page_size
    if tail:
        key = key[: len(key) - tail]
        value = value[: len(key)]
    return key, value


def child_key(key: list[int], page_size: int, start: int = 0) -> int | tuple[int, ...]:
    """The ``children`` entry of the edge that starts at ``key[start]``: its first token when
    ``page_size`` is 1, else its first page as a tuple."""
    if page_size == 1:
        return key[start]
    return tuple(key[start : start + page_size])


def match_len(node_key: list[int], key: list[int], start: int, end: int, page_size: int) -> int:
    """Length of the common prefix of ``node_key`` and ``key[start:end]``, in whole pages."""
    n = min(len(node_key), end - start)
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
    return i - i % page_size
