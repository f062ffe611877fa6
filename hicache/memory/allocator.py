"""Page-granular free list over the slots of one pool (SGLang ``(Paged)TokenToKVPoolAllocator``).

Bookkeeping lives on the CPU (page states plus SGLang's sorted ``free_pages`` / unsorted
``release_pages``); returned slots are int64 on ``device``. Freeing GPU slots syncs once to
validate them. The device allocator reserves page 0 (padding); the host allocator
(``reserve_padding=False``) hands out every page.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from hicache_prefill.server_args import ServerArgs

# Page states in ``_state``.
_ALLOCATED = 0
_FREE = 1
_GROUP_FREED = 2  # freed inside a free group, returned at free_group_end()
_PADDING = 3


def page_ceil(tokens: int, page_size: int) -> int:
    """``tokens`` rounded up to whole pages of ``page_size`` tokens."""
    return -(-tokens // page_size) * page_size


def check_page_geometry(size: int, page_size: int) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if size < page_size or size % page_size != 0:
        raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size}")


class TokenToKVPoolAllocator:
    """Free list of ``size // page_size`` pages; ``alloc(n)`` returns whole pages of slots, each
    page's slots ascending, or ``None`` when short. Nothing blocks."""

    def __init__(
        self,
        size: int,
        page_size: int,
        device: torch.device | str,
        reserve_padding: bool = True,
    ) -> None:
        check_page_geometry(size, page_size)
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.reserve_padding = reserve_padding
        self.num_pages = size // page_size
        self.first_page = 1 if reserve_padding else 0
        self._end_page = self.first_page + self.num_pages  # exclusive
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self._np_offsets = np.arange(page_size, dtype=np.int64)
        # Scratch for the duplicate check of a free: stamp[p] = position of page p in the free.
        self._stamp = np.zeros(self._end_page, dtype=np.int32)
        self._positions = np.arange(1024, dtype=np.int32)
        self.clear()

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> TokenToKVPoolAllocator:
        return cls(args.max_total_tokens, args.page_size, args.resolved_device())

    def clear(self) -> None:
        """Every page free again (padding page excluded); ends any free group."""
        self._state = torch.full((self._end_page,), _FREE, dtype=torch.int8)
        self._np_state = self._state.numpy()  # a view: the same memory
        if self.reserve_padding:
            self._state[0] = _PADDING
        self.free_pages = torch.arange(self.first_page, self._end_page, dtype=torch.int64)
        self.release_pages: list[torch.Tensor] = []
        self._num_release = 0
        self._group: list[torch.Tensor] | None = None
        self._num_group = 0

    def available_size(self) -> int:
        """Free slots now (excludes pages freed inside an open free group)."""
        return (self.free_pages.numel() + self._num_release) * self.page_size

    def can_alloc(self, need_size: int) -> bool:
        return 0 <= need_size <= self.available_size()

    @property
    def page_table_size(self) -> int:
        """Length of a per-page table indexed by page id (padding included)."""
        return self._end_page

    def group_freed_size(self) -> int:
        """Slots freed inside the open free group: no longer anyone's, not yet available."""
        return self._num_group * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take ``need_size`` slots (a multiple of ``page_size``); ``None`` when short."""
        try:
            if isinstance(need_size, bool):
                raise TypeError
            need_size = operator.index(need_size)
        except TypeError:
            raise ValueError(f"need_size must be an integer, got {need_size!r}") from None
        if need_size < 0 or need_size % self.page_size != 0:
            raise ValueError(
                f"need_size must be a non-negative multiple of page_size={self.page_size}, "
                f"got {need_size}"
            )
        num = need_size // self.page_size
        if num > self.free_pages.numel() + self._num_release:
            return None
        if num > self.free_pages.numel():
            self._merge_release()
        pages = self.free_pages[:num]
        self.free_pages = self.free_pages[num:]
        self._state[pages] = _ALLOCATED
        # Pageable source: the copy is staged at once, so non_blocking only skips the stream sync.
        return self._pages_to_slots(pages).to(self.device, non_blocking=True)

    def free(self, free_index: torch.Tensor) -> None:
        """Return whole pages of slots; ``ValueError`` (nothing changes) for slots out of range,
        partial pages, or a page twice or not allocated. Inside a free group pages are validated
        now and returned at ``free_group_end``."""
        pages = self._validate_free(free_index)
        if pages.size == 0:
            return
        if self._group is not None:
            self._np_state[pages] = _GROUP_FREED
            self._group.append(torch.from_numpy(pages))
            self._num_group += pages.size
            return
        self._np_state[pages] = _FREE
        self.release_pages.append(torch.from_numpy(pages))
        self._num_release += pages.size

    def check_free(self, free_index: torch.Tensor) -> None:
        """Raise ``ValueError`` exactly when ``free(free_index)`` would; changes nothing."""
        self._validate_free(free_index)

    def free_group_begin(self) -> None:
        """Start batching frees; pages freed until ``free_group_end`` stay unavailable."""
        if self._group is not None:
            raise ValueError("free_group_begin: a free group is already open")
        self._group = []

    def free_group_end(self) -> None:
        if self._group is None:
            raise ValueError("free_group_end: no free group is open")
        group, self._group = self._group, None
        self._num_group = 0
        if group:
            pages = torch.cat(group)
            self._state[pages] = _FREE
            self.release_pages.append(pages)
            self._num_release += pages.numel()

    def check_integrity(self) -> None:
        """``AssertionError`` unless the free list and page states agree and add up."""
        free = torch.cat([self.free_pages, *self.release_pages])
        if free.numel() != torch.unique(free).numel():
            raise AssertionError("allocator: duplicate page in the free list")
        lo_hi = (int(free.min()), int(free.max())) if free.numel() else None
        if lo_hi and (lo_hi[0] < self.first_page or lo_hi[1] >= self._end_page):
            raise AssertionError("allocator: padding or out-of-range page in the free list")
        state_free = torch.nonzero(self._state == _FREE).flatten()
        if not torch.equal(torch.sort(free).values, state_free):
            raise AssertionError("allocator: free list disagrees with page states")
        n_alloc = int((self._state == _ALLOCATED).sum())
        n_group_freed = int((self._state == _GROUP_FREED).sum())
        if free.numel() + n_alloc + n_group_freed != self.num_pages:
            raise AssertionError(
                f"allocator: free {free.numel()} + allocated {n_alloc} + freed in the open "
                f"group {n_group_freed} != {self.num_pages} pages"
            )
        if self.reserve_padding and int(self._state[0]) != _PADDING:
            raise AssertionError("allocator: padding page 0 changed state")

    def is_allocated(self, indices: torch.Tensor) -> bool:
        """True when every slot in ``indices`` lies in an allocated page."""
        if indices.numel() == 0:
            return True
        pages = indices.cpu() // self.page_size
        if int(pages.min()) < 0 or int(pages.max()) >= self._end_page:
            return False
        return bool((self._state[pages] == _ALLOCATED).all())

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _merge_release(self) -> None:
        if self.release_pages:
            merged = torch.cat([self.free_pages, *self.release_pages])
            self.free_pages = torch.sort(merged).values
            self.release_pages = []
            self._num_release = 0

    def _validate_free(self, free_index: torch.Tensor) -> np.ndarray:
        """The pages ``free_index`` covers (a fresh int64 numpy array), or ``ValueError``.
        Duplicates are found by stamping each page with its position and reading it back."""
        if not isinstance(free_index, torch.Tensor) or free_index.dim() != 1:
            raise ValueError("free_index must be a 1-D tensor of slots")
        if free_index.dtype != torch.int64:
            raise ValueError(f"free_index must be torch.int64, got {free_index.dtype}")
        n = free_index.numel()
        if n == 0:
            return np.empty(0, dtype=np.int64)
        idx = (free_index if free_index.device.type == "cpu" else free_index.cpu()).numpy()
        ps = self.page_size
        if n % ps != 0:
            raise ValueError(f"free_index length {n} is not a multiple of page_size={ps}")
        nz = np.count_nonzero  # C-level; ndarray.any()/all() go through Python wrappers
        if ps == 1:
            pages = idx.copy()  # never alias the caller's tensor
        else:
            rows = idx.reshape(-1, ps)
            first = rows[:, 0]
            whole = not nz(first % ps) and not nz((rows - first[:, None]) != self._np_offsets)
            pages = first // ps
        k = pages.size
        ascending = k == 1 or not nz(pages[1:] <= pages[:-1])
        if ascending:
            lo, hi = int(pages[0]), int(pages[-1])
        else:
            lo, hi = int(pages.min()), int(pages.max())
        if lo < self.first_page or hi >= self._end_page:
            raise ValueError(
                f"free_index out of range [{self.first_page * ps}, {self._end_page * ps}): "
                f"min {int(idx.min())}, max {int(idx.max())}"
            )
        if ps > 1 and not whole:
            raise ValueError("free_index is not made of whole, ascending pages")
        if not ascending:
            if k > self._positions.size:
                self._positions = np.arange(max(k, 2 * self._positions.size), dtype=np.int32)
            pos = self._positions[:k]
            self._stamp[pages] = pos
            if nz(self._stamp[pages] != pos):
                raise ValueError("free_index frees a page twice")
        state = self._np_state[pages]
        if nz(state):  # every state but _ALLOCATED (0) is non-zero
            raise ValueError(
                f"free_index frees pages that are not allocated (double free?): "
                f"{pages[state != _ALLOCATED][:8].tolist()}"
            )
        return pages
