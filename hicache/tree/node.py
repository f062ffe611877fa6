"""Radix tree nodes, match results, one step of the walk, the split, and insert's argument check.

``TreeNode`` is one edge of the tree: its tokens (packed int64 bytes, ``keys.py``), its device
and host slots and the path counts that protect them; the node fields a host tier needs
(``host_value``, ``host_ref``) live here too, so ``RadixCache`` and ``HiRadixCache`` share one node
type and one walk (``descend`` is one node of it). ``split_node`` cuts an edge in two (both
tiers' slots follow their tokens; no accounting changes). ``MatchResult`` is what
``match_prefix`` returns. Nothing here owns slots or knows the pools.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from hicache.tree.keys import TOKEN_BYTES, key_bytes, match_bytes, token_list

logger = logging.getLogger(__name__)


class TreeNode:
    """One edge of the radix tree.

    ``tokens``: token ids of the edge as native int64 bytes (8 per token; a multiple of
    ``page_size`` tokens, never empty except root); ``key`` reads them as a list.
    ``value``: device slots, int64 ``[len(key)]``, or ``None`` when evicted to the host.
    ``host_value``: host slots, int64 ``[len(key)]`` on CPU, or ``None`` when not backed up.
    ``lock_ref``: number of locks held on this node or any descendant (path count, as SGLang).
    ``host_ref``: same path count for host protection (a host copy that must not be freed).
    ``hit_count``: inserts that created or touched the node; grows only in ``insert``.
    ``last_access_time``: logical clock of the last match or insert through the node (LRU key).
    ``device_children``: children that are device-resident (kept by the tree; O(1) leaf test).
    ``queued``: bit set of the eviction queues (``lru_queues.LRUQueue``) holding an entry for it.
    ``hash_value``: the L3 storage key of each page of the edge (``hicache.storage.hash_keys``,
    SGLang's field), ``None`` when no storage tier is attached; kept page-aligned by splits.
    ``children``: child nodes by the bytes of their first page.

    Built in two places only, both with every field in one call: ``RadixCache.insert`` (a new
    leaf) and ``split_node``; a per-node field a tier adds (an optional one defaulting to
    ``None``) goes into ``__slots__`` and ``__init__`` and costs one store per new node.
    """

    __slots__ = (
        "id",
        "tokens",
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

    def __init__(
        self,
        tokens: bytes = b"",
        parent: TreeNode | None = None,
        value: torch.Tensor | None = None,
        last_access_time: int = 0,
    ) -> None:
        self.id: int = next(TreeNode._ids)
        self.tokens = tokens
        self.value = value
        self.host_value: torch.Tensor | None = None
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access_time = last_access_time
        self.device_children = 0
        self.queued = 0
        self.hash_value: list[str] | None = None

    @property
    def key(self) -> list[int]:
        """The edge's token ids as a list (a fresh list, O(len); the walk never uses it)."""
        return token_list(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

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
        return (
            f"TreeNode(id={self.id}, len={self.num_tokens}, {tiers or '-'}, lock={self.lock_ref})"
        )


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


def split_node(child: TreeNode, split: int, page_bytes: int) -> TreeNode:
    """Split ``child`` into ``new -> child`` with ``new`` holding the first ``split`` bytes of
    its tokens (whole pages) and the slots of both tiers under them. Lock and host refs are path
    counts, so ``new`` inherits them, and so does its access time (callers stamp ``child``
    first: SGLang refreshes the whole node, then splits) and its hit count. ``child`` keeps its
    place in the eviction queues; ``new`` has a child, so it is no leaf of either tier and needs
    none. ``new`` takes ``child``'s entry in the parent's children (same first page)."""
    n = split // TOKEN_BYTES
    tokens = child.tokens
    parent = child.parent
    new = TreeNode(tokens[:split], parent, None, child.last_access_time)
    new.lock_ref = child.lock_ref
    new.host_ref = child.host_ref
    new.hit_count = child.hit_count
    if child.value is not None:
        new.value = child.value[:n]
        child.value = child.value[n:]
        new.device_children = 1
    if child.host_value is not None:
        new.host_value = child.host_value[:n]
        child.host_value = child.host_value[n:]
    if child.hash_value is not None:  # page keys follow their pages (L3 storage)
        pages = split // page_bytes
        new.hash_value = child.hash_value[:pages]
        child.hash_value = child.hash_value[pages:]
    child.tokens = tokens[split:]
    child.parent = new
    new.children[child.tokens[:page_bytes]] = child
    parent.children[tokens[:page_bytes]] = new
    return new


def descend(
    child: TreeNode, key: bytes, start: int, end: int, now: int, page_bytes: int
) -> TreeNode:
    """One node of a walk: ``child`` was found under the page of ``key`` (packed bytes) at
    ``start``; stamp it with ``now`` and match as much of ``key[start:end]`` as it holds
    (whole pages, at least the first). Returns the node covering exactly the match: ``child``
    itself when all of it matched, else the upper half of its split (refreshed before the split,
    as SGLang does, so both halves carry ``now``); the match is ``len(returned.tokens)`` bytes.
    ``key`` must hold ``min(end, start + len(child.tokens))`` bytes at least. One ``memcmp``
    when the whole edge matches; nothing allocated then."""
    tokens = child.tokens
    child.last_access_time = now
    if start + len(tokens) <= end and key.startswith(tokens, start):
        return child
    return split_node(child, match_bytes(tokens, key, start, end, page_bytes), page_bytes)


def check_insert_args(
    key: Sequence[int] | torch.Tensor,
    value: torch.Tensor | None,
    device: torch.device,
    page_size: int,
    simulated: bool,
) -> tuple[bytes, torch.Tensor]:
    """``(key bytes, value)`` cut to whole pages after checking ``insert``'s arguments (SGLang
    ``RadixKey.page_aligned``): ``value`` a 1-D int64 tensor on ``device``'s type with one slot
    per token of ``key``. ``value=None`` only in a simulated tree (no allocator), where the
    token ids stand in for slots as in SGLang's test fallback. ``ValueError`` otherwise."""
    kb = key_bytes(key)
    n = len(kb) // TOKEN_BYTES
    if value is None:
        if not simulated:
            raise ValueError(
                "value is required: this tree frees its slots into an allocator, and token ids "
                "are not slots (only a simulated tree, allocator=None, takes keys alone)"
            )
        value = torch.frombuffer(bytearray(kb), dtype=torch.int64).to(device)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"value must be a torch.Tensor of slots, got {type(value).__name__}")
    if value.dim() != 1 or value.dtype != torch.int64:
        raise ValueError(
            f"value must be a 1-D int64 tensor, got shape {tuple(value.shape)} {value.dtype}"
        )
    if value.device.type != device.type:
        raise ValueError(f"value is on {value.device}, the tree's slots are on {device}")
    if n != value.numel():
        raise ValueError(f"key has {n} tokens but value has {value.numel()} slots")
    tail = n % page_size
    if tail:
        n -= tail
        kb = kb[: n * TOKEN_BYTES]
        value = value[:n]
    return kb, value
