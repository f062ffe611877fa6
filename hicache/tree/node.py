"""Radix tree nodes, match results, one step of the walk, the split, and insert's argument check.

``TreeNode`` is one edge; it carries the host tier's fields too, so ``RadixCache`` and
``HiRadixCache`` share one node type and one walk (``descend``). A split keeps both tiers' slots
and page keys with their tokens and changes no accounting. Nothing here owns slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from hicache.tree.keys import TOKEN_BYTES, key_bytes, match_bytes, token_list


class TreeNode:
    """One edge of the radix tree: ``tokens`` (packed, whole pages), device slots ``value`` and
    host slots ``host_value`` (``None`` when absent), path counts ``lock_ref`` / ``host_ref``,
    ``device_children`` (O(1) leaf test), ``queued`` (bits of the queues holding it),
    ``hash_value`` (one L3 key per page, with storage) and ``children`` by first page."""

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
    """``match_prefix``'s result: the device slots of the matched device prefix, its last
    node (root when none), the deepest matched node of either tier, and the tokens matched past
    the device prefix (host only)."""

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


def split_node(child: TreeNode, split: int, page_bytes: int) -> TreeNode:
    """Split ``child`` into ``new -> child``, ``new`` holding the first ``split`` bytes (whole
    pages) with both tiers' slots under them. ``new`` inherits the path counts, access time and
    hit count and takes ``child``'s entry in the parent; having a child, it needs no queue
    entry."""
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
    """One node of a walk: stamp ``child`` (found under ``key``'s page at ``start``) with
    ``now`` and return the node covering exactly the match of ``key[start:end]``: ``child``, or
    the upper half of its split (both halves stamped, as SGLang)."""
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
    """``(key bytes, value)`` cut to whole pages (SGLang ``RadixKey.page_aligned``) after
    checking ``value`` is 1-D int64 on ``device``'s type, one slot a token; ``None`` only in a
    simulated tree (token ids stand in for slots). ``ValueError`` otherwise."""
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
