"""The project's allocator calls over SGLang's token allocator (``TokenToKVPoolAllocator`` or
``PagedTokenToKVPoolAllocator``), so the tree and the controller free into the free list SGLang's
scheduler allocates from. SGLang keeps page 0 as padding: pages ``1..num_pages`` are real. A free
is validated (whole pages, in range, each page once, allocated) before SGLang sees it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from hicache_prefill.kernels.ops.checks import content_checks, debug_checks_enabled

logger = logging.getLogger(__name__)


class SGLangAllocatorView:
    """``TokenToKVPoolAllocator``'s interface (``alloc``, ``free``, ``check_free``,
    ``is_allocated``, ``page_table_size``, ``check_integrity``) over ``allocator``, SGLang's."""

    def __init__(self, allocator: Any) -> None:
        page_size = int(allocator.page_size)
        size = int(allocator.size)
        if page_size < 1 or size % page_size:
            raise ValueError(
                f"allocator: size {size} is not a whole number of pages of {page_size}"
            )
        self.sglang_allocator = allocator
        self.size = size
        self.page_size = page_size
        self.device = torch.device(allocator.device)
        self.num_pages = size // page_size

    @property
    def page_table_size(self) -> int:
        """Length of a per-page table indexed by page id (SGLang's padding page 0 included)."""
        return self.num_pages + 1

    def available_size(self) -> int:
        return int(self.sglang_allocator.available_size())

    def can_alloc(self, need_size: int) -> bool:
        return 0 <= need_size <= self.available_size()

    def group_freed_size(self) -> int:
        """Slots freed inside SGLang's open free group (not yet available)."""
        return sum(t.numel() for t in self._group_pending())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots (whole pages) from SGLang's free list; ``None`` when short."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int, got {need_size!r}")
        if need_size % self.page_size:
            raise ValueError(
                f"need_size must be a multiple of page_size={self.page_size}, got {need_size}"
            )
        if need_size == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        slots = self.sglang_allocator.alloc(need_size)
        return None if slots is None else slots.to(torch.int64).clone()

    def free(self, free_index: torch.Tensor) -> None:
        """Give whole pages back to SGLang's allocator; ``ValueError`` (nothing changes) when
        :meth:`check_free` refuses them."""
        if free_index.numel() == 0:
            return
        self.check_free(free_index)
        self.sglang_allocator.free(free_index.to(self.sglang_allocator.device))

    def check_free(self, free_index: torch.Tensor) -> None:
        """``ValueError`` unless ``free_index`` is whole pages, in range, each page once, and (on
        a CPU pool, or under debug checks) every page allocated now. Changes nothing."""
        if free_index.numel() == 0:
            return
        idx = free_index.cpu().to(torch.int64)
        ps = self.page_size
        lo, hi = int(idx.min()), int(idx.max())
        if lo < ps or hi >= (self.num_pages + 1) * ps:
            raise ValueError(
                f"free_index holds slots outside [{ps}, {(self.num_pages + 1) * ps}) "
                f"(min {lo}, max {hi})"
            )
        if idx.numel() % ps or (
            ps > 1 and not torch.equal(idx.view(-1, ps), idx[::ps, None] + torch.arange(ps))
        ):
            raise ValueError(f"free_index is not whole pages of {ps} slots")
        pages = idx[::ps] // ps
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError("free_index holds a page twice")
        if self._read_free_list(free_index) and bool(
            torch.isin(pages, self._free_page_ids()).any()
        ):
            raise ValueError("free_index holds pages that are free already (a double free)")

    def is_allocated(self, indices: torch.Tensor) -> bool:
        """True when every slot of ``indices`` lies in a page SGLang's allocator has handed out."""
        if indices.numel() == 0:
            return True
        pages = indices.cpu().to(torch.int64) // self.page_size
        if int(pages.min()) < 1 or int(pages.max()) > self.num_pages:
            return False
        return not bool(torch.isin(pages, self._free_page_ids()).any())

    def check_integrity(self) -> None:
        """``AssertionError`` unless SGLang's free pages are in range and each listed once."""
        listed = self.sglang_allocator.get_all_free_pages()
        free = torch.empty((0,), dtype=torch.int64) if listed is None else listed.cpu()
        if free.numel() != torch.unique(free).numel():
            raise AssertionError("SGLang allocator: a page is listed free twice")
        if free.numel() and (int(free.min()) < 1 or int(free.max()) > self.num_pages):
            raise AssertionError("SGLang allocator: padding or out-of-range page in the free list")
        if free.numel() * self.page_size != self.available_size():
            raise AssertionError(
                f"SGLang allocator: {free.numel()} free pages, available_size "
                f"{self.available_size()}"
            )

    def _read_free_list(self, t: torch.Tensor) -> bool:
        """Whether a check may read SGLang's free list: always on a CPU pool, on a GPU only under
        the kernels' debug checks (it costs a device-to-host copy of the list)."""
        return content_checks(t) and (self.device.type == "cpu" or debug_checks_enabled())

    def _group_pending(self) -> list[torch.Tensor]:
        a = self.sglang_allocator
        out = [t.cpu().to(torch.int64) for t in (getattr(a, "free_group", None) or [])]
        ids = getattr(a, "free_page_ids_group", None) or []
        out += [
            (
                t.cpu().to(torch.int64)[:, None] * self.page_size + torch.arange(self.page_size)
            ).reshape(-1)
            for t in ids
        ]
        return out

    def _free_page_ids(self) -> torch.Tensor:
        """Page ids free or freed in the open group (CPU int64)."""
        free = self.sglang_allocator.get_all_free_pages()
        free = torch.empty((0,), dtype=torch.int64) if free is None else free.cpu().to(torch.int64)
        pending = self._group_pending()
        if pending:
            free = torch.cat([free, torch.unique(torch.cat(pending) // self.page_size)])
        return free
