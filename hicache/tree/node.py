"""Radix tree nodes (both tiers' fields), match results, one step of the walk, the split, and
insert's argument check. Nothing here owns slots."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from hicache_prefill.hicache.tree.keys import TOKEN_BYTES, key_bytes, match_bytes, token_list


class TreeNode:
    """One edge: ``tokens`` (packed, whole pages), slots ``value`` / ``host_value`` (``None``:
    absent), path counts ``lock_ref`` / ``host_ref``, ``queued`` (bits of the queues holding it)."""

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
        """The edge's token ids as a fresh list (O(len))."""
        return token_list(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __repr__(self) -> str:
        tiers = ("D" if self.value is not None else "") + ("H" if self.backuped else "")
        return (
            f"TreeNode(id={self.id}, len={self.num_tokens}, {tiers or '-'}, lock={self.lock_ref})"
        )


class MatchResult(NamedTuple):
    """``match_prefix``'s result; ``host_hit_length``: tokens matched past the device prefix."""

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


def split_node(child: TreeNode, split: int, page_bytes: int) -> TreeNode:
    """Split ``child`` into ``new -> child``, ``new`` taking the first ``split`` bytes (whole
    pages), both tiers' slots and page keys under them, the path counts and the parent's entry."""
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
    if child.hash_value is not None:
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
    """One step of a walk: stamp ``child`` with ``now``; return it, or the upper half of its split
    when ``key[start:end]`` diverges or ends inside it."""
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
    """``(key bytes, value)`` cut to whole pages; ``ValueError`` unless ``value`` is 1-D int64 on
    ``device``'s type, one slot a token (``None`` only in a simulated tree)."""
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
    n -= n % page_size
    return kb[: n * TOKEN_BYTES], value[:n]
