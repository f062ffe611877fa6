"""Whole-page access to a host pool for L3 storage backends (SGLang 0.5.23's host-pool calls).

A page is ``page_size`` aligned host slots, every layer, every part. A flat page is the page in
the pool's byte order, named by ``storage_format_tag`` so a page stored in another format is a
miss, never wrong KV. Pointer and shape tables per layout: docs/CONTRACTS.md.
"""

from __future__ import annotations

import torch


class HostPoolPages:
    """Page access of ``HostKVPool`` (the attributes below are its)."""

    layout: str
    page_size: int
    size: int
    layer_num: int
    dtype: torch.dtype
    pinned: bool
    kv_buffer: torch.Tensor
    parts: list[torch.Tensor]
    part_item_sizes: list[int]  # bytes of one token of one layer, per part

    @property
    def storage_format_tag(self) -> str:
        """The flat page's byte format: ``"{dtype}-{layer-major|token-major}"``."""
        dtype = str(self.dtype).removeprefix("torch.")
        order = "token-major" if self.layout == "page_first" else "layer-major"
        return f"{dtype}-{order}"

    @property
    def page_nbytes(self) -> int:
        """Bytes of one flat page (every part, every layer)."""
        return self.page_size * self.layer_num * sum(self.part_item_sizes)

    def page_regions(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each host allocation ``get_page_buffer_meta`` points into:
        what a zero-copy backend registers."""
        regions: dict[int, int] = {}
        for part in self.parts:
            storage = part.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
        return list(regions.items())

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(ptrs, sizes)``: host addresses and byte counts of each page's pieces, in page
        order. ``ValueError`` unless ``indices`` are whole, aligned, in-range pages."""
        starts = self._page_starts(indices)
        widths = self.part_item_sizes
        bases = [part.data_ptr() for part in self.parts]
        page, n_l = self.page_size, self.layer_num
        ptrs: list[int] = []
        sizes: list[int] = []
        for start in starts:
            if self.layout == "layer_first":
                for layer in range(n_l):
                    for base, width in zip(bases, widths, strict=True):
                        ptrs.append(base + (layer * self.size + start) * width)
                        sizes.append(page * width)
            else:  # page_first / page_first_direct: one run of page * L rows per part
                for base, width in zip(bases, widths, strict=True):
                    ptrs.append(base + start * n_l * width)
                    sizes.append(page * n_l * width)
        return ptrs, sizes

    def get_data_page(
        self, index: int | torch.Tensor, flat: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The page starting at host slot ``index``. ``out`` (``flat=True`` only; this project's
        addition): a flat page buffer that receives a non-contiguous page, returned then."""
        sl = self._page_slice(self._check_page_start(index))
        if not flat:
            if len(self.parts) > 1 and not self._parts_share_buffer():
                raise NotImplementedError(
                    "get_data_page(flat=False) needs K and V of the same head width"
                )
            lead = (slice(None),) if len(self.parts) > 1 else ()
            return self.kv_buffer[lead + sl]
        views = [part[sl] for part in self.parts]
        if len(views) == 1 and (out is None or views[0].is_contiguous()):
            return views[0].flatten()
        if out is not None:
            offset = 0
            for v in views:
                out[offset : offset + v.numel()].view(v.shape).copy_(v)
                offset += v.numel()
            return out
        return torch.cat([v.flatten() for v in views])

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed flat page on the CPU, pinned when the pool is."""
        n = self.page_nbytes // self.dtype.itemsize
        return torch.zeros(n, dtype=self.dtype, device="cpu", pin_memory=self.pinned)

    def set_from_flat_data_page(self, index: int | torch.Tensor, data_page: torch.Tensor) -> None:
        """Write a flat page into the page starting at host slot ``index``."""
        sl = self._page_slice(self._check_page_start(index))
        want = self.page_nbytes // self.dtype.itemsize
        if not isinstance(data_page, torch.Tensor) or data_page.dtype != self.dtype:
            raise ValueError(f"data_page must be a {self.dtype} tensor")
        if data_page.numel() != want:
            raise ValueError(f"data_page has {data_page.numel()} elements, a page has {want}")
        flat = data_page.reshape(-1).cpu()
        offset = 0
        for part in self.parts:
            view = part[sl]
            n = view.numel()
            view.copy_(flat[offset : offset + n].view(view.shape))
            offset += n

    def _parts_share_buffer(self) -> bool:
        return self.kv_buffer.dim() > 1 and self.kv_buffer.shape[0] == len(self.parts)

    def _page_slice(self, start: int) -> tuple[slice, ...]:
        page = self.page_size
        if self.layout == "layer_first":
            return (slice(None), slice(start, start + page))
        if self.layout == "page_first":
            return (slice(start, start + page),)
        p = start // page
        return (slice(p, p + 1),)

    def _check_page_start(self, index: int | torch.Tensor) -> int:
        start = int(index)
        if not 0 <= start < self.size or start % self.page_size:
            raise ValueError(
                f"page start {start} must be a multiple of page_size={self.page_size} in "
                f"[0, {self.size})"
            )
        return start

    def _page_starts(self, indices: torch.Tensor) -> list[int]:
        """First slot of each page of ``indices`` (whole, contiguous, aligned, in range)."""
        idx = torch.as_tensor(indices).cpu()
        if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError("indices must be a 1-D integer tensor")
        page = self.page_size
        if idx.numel() % page:
            raise ValueError(f"{idx.numel()} indices are not whole pages of {page}")
        if idx.numel() == 0:
            return []
        rows = idx.to(torch.int64).view(-1, page)
        starts = rows[:, 0]
        if bool((rows - starts[:, None] != torch.arange(page)).any()):
            raise ValueError("each page's indices must be consecutive slots")
        for s in starts.tolist():
            self._check_page_start(s)
        return starts.tolist()
