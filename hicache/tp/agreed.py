"""Allocations every tensor-parallel rank takes alike: on every rank or on none."""

from __future__ import annotations

from typing import Any

import torch

from hicache_prefill.hicache.tp.group import TPGroup


def agreed_alloc(
    group: TPGroup, allocator: Any, n: int, *, pool: str, tag: str
) -> torch.Tensor | None:
    """``n`` slots of ``allocator`` if every rank has room, else ``None`` on every rank;
    ``RuntimeError`` when the allocators diverged."""
    if not group.agree_all(allocator.can_alloc(n), tag=tag):
        return None
    slots = allocator.alloc(n)
    if slots is None:
        raise RuntimeError(
            f"rank {group.rank}: the {pool} pool has {allocator.available_size()} free slots "
            f"for {n} after the group agreed there was room (allocators diverged)"
        )
    return slots
