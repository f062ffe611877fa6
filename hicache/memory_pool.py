"""Device KV pools (SGLang ``MHATokenToKVPool`` / ``MLATokenToKVPool``).

A pool is memory only: it does not know which slots are free (see ``allocator.py``) nor which
tokens they hold (see the radix tree). Both pools make ONE contiguous allocation and expose
per-layer views of it, plus per-layer ``data_ptr()`` tables (int64, on the pool's device) that the
all-layer copy kernels take.

Slot layout: ``size + page_size`` slots per layer; slots ``0 .. page_size-1`` (page 0) are padding
that the allocator never hands out, so writes to slot 0 by padded batches are harmless.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from server_args import ServerArgs

logger = logging.getLogger(__name__)


def _check_geometry(size: int, page_size: int, layer_num: int, **dims: int) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if size < page_size or size % page_size != 0:
        raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size}")
    if layer_num < 1:
        raise ValueError(f"layer_num must be >= 1, got {layer_num}")
    for name, value in dims.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_loc(loc: torch.Tensor, n_slots: int, device: torch.device) -> None:
    """Validate a slot index tensor; the range check only runs for CPU tensors (no GPU sync)."""
    if not isinstance(loc, torch.Tensor) or loc.dim() != 1 or loc.dtype != torch.int64:
        raise ValueError("loc must be a 1-D torch.int64 tensor")
    if loc.device.type != device.type:
        raise ValueError(f"loc is on {loc.device}, pool is on {device}")
    if loc.device.type == "cpu" and loc.numel() > 0:
        lo, hi = int(loc.min()), int(loc.max())
        if lo < 0 or hi >= n_slots:
            raise ValueError(f"loc out of range [0, {n_slots}): min {lo}, max {hi}")


class MHATokenToKVPool:
    """Per-layer K and V buffers of a multi-head-attention model, in one allocation.

    Memory: ``kv_buffer`` of shape ``(2, L, size + page_size, H, D)``, dtype ``dtype``, on
    ``device`` (not pinned; device memory). ``k_buffer[l] = kv_buffer[0, l]`` and
    ``v_buffer[l] = kv_buffer[1, l]`` are contiguous ``[size + page_size, H, D]`` views.
    ``k_data_ptrs`` / ``v_data_ptrs``: int64 ``[L]`` on ``device``, the ``data_ptr()`` of each
    layer's view; ``data_ptrs`` is their concatenation ``[2L]`` (K first), as in SGLang.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str,
    ) -> None:
        _check_geometry(size, page_size, layer_num, head_num=head_num, head_dim=head_dim)
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.kv_buffer = torch.zeros(
            (2, layer_num, size + page_size, head_num, head_dim), dtype=dtype, device=self.device
        )
        self.k_buffer: list[torch.Tensor] = [self.kv_buffer[0, i] for i in range(layer_num)]
        self.v_buffer: list[torch.Tensor] = [self.kv_buffer[1, i] for i in range(layer_num)]
        self.k_data_ptrs = torch.tensor(
            [b.data_ptr() for b in self.k_buffer], dtype=torch.int64, device=self.device
        )
        self.v_data_ptrs = torch.tensor(
            [b.data_ptr() for b in self.v_buffer], dtype=torch.int64, device=self.device
        )
        self.data_ptrs = torch.cat([self.k_data_ptrs, self.v_data_ptrs])
        logger.info(
            "MHATokenToKVPool: %d slots x %d layers, %.3f GB on %s",
            size, layer_num, self.mem_bytes() / 1e9, self.device,
        )

    @classmethod
    def from_server_args(cls, args: ServerArgs, size: int | None = None) -> MHATokenToKVPool:
        """Build from ``ServerArgs``; ``size`` defaults to ``args.max_total_tokens``."""
        return cls(
            size=args.max_total_tokens if size is None else size,
            page_size=args.page_size,
            dtype=args.torch_dtype(),
            head_num=args.head_num,
            head_dim=args.head_dim,
            layer_num=args.num_layers,
            device=args.resolved_device(),
        )

    # --- geometry ------------------------------------------------------------------------------
    @property
    def item_size(self) -> int:
        """Bytes of one token, one layer, K or V (the kernels' ``item_size``)."""
        return self.head_num * self.head_dim * self.kv_buffer.element_size()

    def get_size_per_token(self) -> int:
        """Bytes of one token across all layers, K and V (SGLang's name)."""
        return 2 * self.layer_num * self.item_size

    def mem_bytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    # --- access --------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> None:
        """Write ``cache_k`` / ``cache_v`` (``[n, H, D]``) into slots ``loc`` (int64 ``[n]``).

        Runs on the current stream, does not synchronize. Values are cast to the pool dtype.
        """
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")
        _check_loc(loc, self.size + self.page_size, self.device)
        want = (loc.numel(), self.head_num, self.head_dim)
        for name, t in (("cache_k", cache_k), ("cache_v", cache_v)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)


class MLATokenToKVPool:
    """One latent buffer per layer of a multi-head-latent-attention model, in one allocation.

    Memory: ``kv_buffer_all`` of shape ``(L, size + page_size, 1, C)`` with
    ``C = kv_lora_rank + qk_rope_head_dim``; ``kv_buffer[l]`` is a contiguous
    ``[size + page_size, 1, C]`` view. ``kv_data_ptrs`` (alias ``data_ptrs``): int64 ``[L]``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: torch.device | str,
    ) -> None:
        _check_geometry(
            size, page_size, layer_num, kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.kv_buffer_all = torch.zeros(
            (layer_num, size + page_size, 1, self.kv_cache_dim), dtype=dtype, device=self.device
        )
        self.kv_buffer: list[torch.Tensor] = [self.kv_buffer_all[i] for i in range(layer_num)]
        self.kv_data_ptrs = torch.tensor(
            [b.data_ptr() for b in self.kv_buffer], dtype=torch.int64, device=self.device
        )
        self.data_ptrs = self.kv_data_ptrs
        logger.info(
            "MLATokenToKVPool: %d slots x %d layers, %.3f GB on %s",
            size, layer_num, self.mem_bytes() / 1e9, self.device,
        )

    @classmethod
    def from_server_args(cls, args: ServerArgs, size: int | None = None) -> MLATokenToKVPool:
        """Build from ``ServerArgs``; ``size`` defaults to ``args.max_total_tokens``."""
        return cls(
            size=args.max_total_tokens if size is None else size,
            page_size=args.page_size,
            dtype=args.torch_dtype(),
            kv_lora_rank=args.kv_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            layer_num=args.num_layers,
            device=args.resolved_device(),
        )

    @property
    def item_size(self) -> int:
        """Bytes of one token, one layer (the kernels' ``item_size``)."""
        return self.kv_cache_dim * self.kv_buffer_all.element_size()

    def get_size_per_token(self) -> int:
        return self.layer_num * self.item_size

    def mem_bytes(self) -> int:
        return self.kv_buffer_all.numel() * self.kv_buffer_all.element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The value part of the latent: the first ``kv_lora_rank`` columns (a view)."""
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_kv: torch.Tensor) -> None:
        """Write ``cache_kv`` (``[n, 1, C]``) into slots ``loc`` (int64 ``[n]``); no sync."""
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")
        _check_loc(loc, self.size + self.page_size, self.device)
        want = (loc.numel(), 1, self.kv_cache_dim)
        if tuple(cache_kv.shape) != want:
            raise ValueError(f"cache_kv must have shape {want}, got {tuple(cache_kv.shape)}")
        self.kv_buffer[layer_id][loc] = cache_kv.to(self.dtype)


KVPool = MHATokenToKVPool | MLATokenToKVPool
