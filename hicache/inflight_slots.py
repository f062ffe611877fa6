"""Slots that copies in flight use, and the frees held back because of them.

A backup reads device slots and writes host slots; a load writes device slots and reads host
slots; each from its launch (or queueing) until its ack is popped. ``InflightSlots`` lists those
slots (the controller builds it from its queues). ``DeferredFrees`` (one per tier) owns the slots
the tree evicted while a copy still uses them: they stay allocated, held here, until no copy uses
them, then return to the allocator. Holding is page-granular: a page with any busy slot is held
whole, so the allocator only ever sees whole pages.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from hicache.allocator import TokenToKVPoolAllocator

logger = logging.getLogger(__name__)

_EMPTY = torch.empty((0,), dtype=torch.int64)


def check_indices(name: str, t: object, page_size: int) -> torch.Tensor:
    """``t`` if it is a 1-D int64 tensor of whole pages; else ``ValueError``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
        raise ValueError(f"{name} must be a 1-D torch.int64 tensor")
    if t.numel() % page_size != 0:
        raise ValueError(f"{name} length {t.numel()} is not a multiple of page_size={page_size}")
    return t


def cat_cpu(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated on the CPU (an empty int64 tensor for none)."""
    return torch.cat([t.cpu() for t in ts]) if ts else _EMPTY


class InflightSlots(NamedTuple):
    """Slots that launched or queued copies use now (CPU int64, may repeat across copies)."""

    device_read: torch.Tensor  # by backups
    device_written: torch.Tensor  # by loads
    host_read: torch.Tensor  # by loads
    host_written: torch.Tensor  # by backups

    def device_slots(self) -> torch.Tensor:
        """Device slots read or written by a copy."""
        return torch.cat([self.device_read, self.device_written])

    def host_slots(self) -> torch.Tensor:
        """Host slots read or written by a copy."""
        return torch.cat([self.host_read, self.host_written])


class DeferredFrees:
    """One tier's slots that the tree freed while a copy used them (``held``: CPU int64 chunks).

    They count as allocated in ``allocator`` until ``release`` finds them unused.
    """

    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        self.held: list[torch.Tensor] = []

    def num_slots(self) -> int:
        return sum(t.numel() for t in self.held)

    def slots(self) -> torch.Tensor:
        """Every held slot (CPU int64)."""
        return cat_cpu(self.held)

    def validate(self, indices: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` (nothing changes) unless ``indices`` may be freed: whole pages,
        allocated, and not already held here."""
        check_indices(name, indices, self.allocator.page_size)
        self.allocator.check_free(indices)
        if self.held and bool(torch.isin(indices.cpu(), cat_cpu(self.held)).any()):
            raise ValueError(f"{name}: slots already freed (held until a copy's ack)")

    def free_or_defer(self, indices: torch.Tensor, busy: torch.Tensor) -> None:
        """Free the pages of ``indices`` that no slot of ``busy`` touches; hold the others.

        Works on one CPU copy of ``indices`` (the allocator's free list is on the CPU): no
        boolean indexing of device tensors, one device-to-host copy in all."""
        if indices.numel() == 0:
            return
        alloc = self.allocator
        idx = indices.cpu()
        if busy.numel() == 0:
            alloc.free(idx)
            return
        page_busy = torch.isin(idx, busy).view(-1, alloc.page_size).any(dim=1)
        slot_busy = page_busy.repeat_interleave(alloc.page_size)
        if bool(slot_busy.any()):
            self.held.append(idx[slot_busy])
            logger.debug("deferring the free of %d slots in use by a copy", int(slot_busy.sum()))
        if not bool(slot_busy.all()):
            alloc.free(idx[~slot_busy])

    def release(self, busy: torch.Tensor) -> None:
        """Free the held pages that no slot of ``busy`` touches any more."""
        if not self.held:
            return
        pending, self.held[:] = list(self.held), []
        for t in pending:
            self.free_or_defer(t, busy)
