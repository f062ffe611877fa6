"""Slots that copies in flight use (``BusyPages``), and the frees held back because of them
(``DeferredFrees``). A page's count is the number of copies using it whose ack is not popped, so
whether a free touches a busy page costs O(freed pages).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.kernels.ops.checks import slot_indices

logger = logging.getLogger(__name__)

_EMPTY = torch.empty((0,), dtype=torch.int64)

# CopyUsage.state
_UNCOUNTED = 0  # launched or queued; its device pages are not in the counts yet
_COUNTED = 1
_DONE = 2  # ack popped: no longer counted anywhere


def cat_cpu(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated on the CPU (an empty int64 tensor for none)."""
    return torch.cat([t.cpu() for t in ts]) if ts else _EMPTY


class CopyUsage:
    """One copy's slots (``host`` on the CPU) and whether ``host_written`` (a backup)."""

    __slots__ = ("device", "host", "host_written", "state", "_device_pages")

    def __init__(self, device: torch.Tensor, host: torch.Tensor, host_written: bool) -> None:
        self.device = device
        self.host = host
        self.host_written = host_written
        self.state = _UNCOUNTED
        self._device_pages: np.ndarray | None = None


class BusyPages:
    """Per-page counts of the copies using each page of both tiers (only zero or not matters);
    ``host_written``: backups only. Device counts of GPU slots move at ``settle``."""

    def __init__(
        self, device_allocator: TokenToKVPoolAllocator, host_allocator: TokenToKVPoolAllocator
    ) -> None:
        self.device_page_size = device_allocator.page_size
        self.host_page_size = host_allocator.page_size
        self.device = np.zeros(device_allocator.page_table_size, dtype=np.int64)
        self.host = np.zeros(host_allocator.page_table_size, dtype=np.int64)
        self.host_written = np.zeros(host_allocator.page_table_size, dtype=np.int64)
        self._uncounted: list[CopyUsage] = []

    def _count_host(self, usage: CopyUsage, delta: int) -> None:
        pages = usage.host.numpy() // self.host_page_size
        np.add.at(self.host, pages, delta)
        if usage.host_written:
            np.add.at(self.host_written, pages, delta)

    def add(self, usage: CopyUsage) -> None:
        self._count_host(usage, 1)
        if usage.device.device.type == "cpu":
            self._count_device(usage)
        else:
            self._uncounted.append(usage)

    def _count_device(self, usage: CopyUsage) -> None:
        usage._device_pages = usage.device.cpu().numpy() // self.device_page_size
        np.add.at(self.device, usage._device_pages, 1)
        usage.state = _COUNTED

    def remove(self, usage: CopyUsage) -> None:
        if usage.state == _DONE:
            return
        self._count_host(usage, -1)
        if usage.state == _COUNTED:
            np.subtract.at(self.device, usage._device_pages, 1)
        usage.state = _DONE

    def settle(self) -> None:
        """Count the device slots of copies launched since the last call (a sync on CUDA)."""
        for usage in self._uncounted:
            if usage.state == _UNCOUNTED:
                self._count_device(usage)
        self._uncounted.clear()

    def device_busy(self, slots: np.ndarray) -> np.ndarray:
        """Per slot of ``slots`` (CPU int64): is its page used by a copy? (after ``settle``)"""
        return self.device[slots // self.device_page_size] > 0

    def host_busy(self, slots: np.ndarray) -> np.ndarray:
        return self.host[slots // self.host_page_size] > 0

    def host_being_written(self, slots: torch.Tensor) -> bool:
        if slots.numel() == 0:
            return False
        return bool((self.host_written[slots.numpy() // self.host_page_size] > 0).any())


class InflightSlots(NamedTuple):
    """Slots that launched or queued copies use now (CPU int64, may repeat across copies)."""

    device_read: torch.Tensor  # by backups
    device_written: torch.Tensor  # by loads
    host_read: torch.Tensor  # by loads
    host_written: torch.Tensor  # by backups

    def device_slots(self) -> torch.Tensor:
        return torch.cat([self.device_read, self.device_written])

    def host_slots(self) -> torch.Tensor:
        return torch.cat([self.host_read, self.host_written])


class DeferredFrees:
    """One tier's slots freed while a copy used them; allocated until ``release`` finds them
    unused. ``_held_pages`` catches a second free of them."""

    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        self.held: list[torch.Tensor] = []
        self._held_pages = np.zeros(allocator.page_table_size, dtype=bool)
        self._num_held = 0

    def num_slots(self) -> int:
        return self._num_held

    def slots(self) -> torch.Tensor:
        return cat_cpu(self.held)

    def validate(self, indices: torch.Tensor, name: str) -> torch.Tensor:
        """``indices`` on the CPU, or ``ValueError`` (nothing changes) unless they may be freed."""
        slot_indices(name, indices, page_size=self.allocator.page_size)
        idx = indices.cpu()
        self.allocator.check_free(idx)
        if self._num_held and idx.numel():
            if self._held_pages[idx.numpy() // self.allocator.page_size].any():
                raise ValueError(f"{name}: slots already freed (held until a copy's ack)")
        return idx

    def free_or_defer(self, idx: torch.Tensor, busy: np.ndarray | None) -> None:
        """Free the slots of ``idx`` whose page no copy uses (``busy``: per slot); hold the rest."""
        if idx.numel() == 0:
            return
        if busy is None or not busy.any():
            self.allocator.free(idx)
            return
        mask = torch.from_numpy(busy)
        held = idx[mask]
        self.held.append(held)
        self._num_held += held.numel()
        self._held_pages[held.numpy() // self.allocator.page_size] = True
        logger.debug("deferring the free of %d slots in use by a copy", held.numel())
        if not bool(mask.all()):
            self.allocator.free(idx[~mask])

    def release(self, busy_of) -> None:
        """Free the held pages that no copy uses any more; ``busy_of(slots)`` answers per slot."""
        if not self.held:
            return
        pending, self.held = self.held, []
        self._num_held = 0
        for t in pending:
            self._held_pages[t.numpy() // self.allocator.page_size] = False
        for t in pending:
            self.free_or_defer(t, busy_of(t.numpy()))
