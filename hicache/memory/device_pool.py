"""Device KV pools (SGLang ``MHATokenToKVPool`` / ``MLATokenToKVPool``) and their choice.

A pool is memory only (free slots: ``allocator``; which tokens: the radix tree): one allocation
with per-layer views and per-layer ``data_ptr()`` tables for the all-layer copy ops. Each layer has
``size + page_size`` slots; page 0 is padding the allocator never hands out. A pool carries every
attribute SGLang's host pools and controller read of a device pool, so SGLang's host pools run on
it; with a layer transfer counter registered, ``get_*_buffer`` wait for that layer's load first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

import kernels
from hicache.memory import host_ram
from kernels.ops.checks import slot_indices

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


class _DevicePool:
    """Geometry and the SGLang ``KVCache`` fields both pools share.

    ``dtype`` is also ``store_dtype`` (values are stored as they are computed). Layers are local:
    ``start_layer = 0``, ``end_layer = layer_num - 1`` (inclusive, as SGLang), no layer sharding.
    """

    layer_shard_enabled = False
    # What SGLang 0.5.23's ``build_kv_host_pool`` reads besides the geometry: no separate
    # host capacity (the host pool is sized from ``size``) and no write-back staging buffers.
    host_capacity_tokens: int | None = None
    hicache_write_back_staging: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = dtype
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.start_layer = 0
        self.end_layer = layer_num - 1
        self.layer_shard_size = 1  # SGLang's meaning: shards the layers are split over
        self.model_layer_ids = tuple(range(layer_num))
        self.layer_transfer_counter: Any = None

    def get_device_pool_infos(self) -> tuple[Any, ...]:
        """SGLang 0.5.23's description of this pool for host assembly: one ``DevicePoolInfo``
        (the KV pool, its layer ids, an ``MHABufferInfo`` / ``MLABufferInfo`` over this pool's
        own tensors and pointer tables). Imports SGLang; ``ImportError`` without it."""
        from kernels.sglang.pool_info import sglang_device_pool_infos

        return sglang_device_pool_infos(self)

    def register_layer_transfer_counter(self, layer_transfer_counter: Any) -> None:
        """Make the ``get_*_buffer`` accessors wait for each layer's load (SGLang's hook):
        ``layer_transfer_counter.wait_until(layer_id)`` is called first."""
        self.layer_transfer_counter = layer_transfer_counter

    def _owned_local_layer_range(self) -> tuple[int, int]:
        """Layers this pool holds, ``[0, layer_num)`` (SGLang's sharded pools hold fewer)."""
        return 0, self.layer_num

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")

    def _wait_for_layer(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)


class MHATokenToKVPool(_DevicePool):
    """Per-layer K and V buffers of a multi-head-attention model, in one allocation.

    K heads are ``head_dim`` wide, V heads ``v_head_dim`` (default ``head_dim``; K 192 / V 128
    models differ). Memory, on ``device`` (not pinned): when the widths agree, ``kv_buffer`` of
    shape ``(2, L, size + page_size, H, D)`` with ``k_buffer_all = kv_buffer[0]`` and
    ``v_buffer_all = kv_buffer[1]``; otherwise one allocation split into ``k_buffer_all``
    ``(L, size + page_size, H, D)`` and ``v_buffer_all`` ``(L, size + page_size, H, D_v)`` (there
    is no single ``kv_buffer`` then). ``k_buffer[l]`` / ``v_buffer[l]`` are contiguous per-layer
    views (lists, as SGLang). ``k_data_ptrs`` / ``v_data_ptrs``: uint64 ``[L]`` on ``device``,
    each layer view's ``data_ptr()``; ``data_ptrs`` is their concatenation ``[2L]`` (K first).
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
        v_head_dim: int | None = None,
    ) -> None:
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        _check_geometry(
            size, page_size, layer_num, head_num=head_num, head_dim=head_dim, v_head_dim=v_head_dim
        )
        super().__init__(size, page_size, dtype, layer_num, device)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.row_dim = head_num * head_dim  # SGLang's per-token K width (elements)
        self.v_row_dim = head_num * v_head_dim
        self.kv_cache_layout = "nhd"
        self.k_scale_buffer = self.v_scale_buffer = None  # no quantization scales
        slots = size + page_size
        if v_head_dim == head_dim:
            self._kv_buffer: torch.Tensor | None = torch.zeros(
                (2, layer_num, slots, head_num, head_dim), dtype=dtype, device=self.device
            )
            self.k_buffer_all, self.v_buffer_all = self._kv_buffer[0], self._kv_buffer[1]
            self._storage = self._kv_buffer
        else:
            k_numel = layer_num * slots * head_num * head_dim
            self._storage = torch.zeros(
                k_numel + layer_num * slots * head_num * v_head_dim, dtype=dtype, device=self.device
            )
            self._kv_buffer = None
            self.k_buffer_all = self._storage[:k_numel].view(layer_num, slots, head_num, head_dim)
            self.v_buffer_all = self._storage[k_numel:].view(layer_num, slots, head_num, v_head_dim)
        self.k_buffer: list[torch.Tensor] = list(self.k_buffer_all)
        self.v_buffer: list[torch.Tensor] = list(self.v_buffer_all)
        self.k_data_ptrs = kernels.data_ptr_table(self.k_buffer, self.device)
        self.v_data_ptrs = kernels.data_ptr_table(self.v_buffer, self.device)
        self.data_ptrs = kernels.data_ptr_table(self.k_buffer + self.v_buffer, self.device)
        logger.info(
            "%s: %d slots x %d layers (K head %d, V head %d), %.3f GB on %s",
            type(self).__name__,
            size,
            layer_num,
            head_dim,
            v_head_dim,
            self.mem_bytes() / 1e9,
            self.device,
        )

    @classmethod
    def from_server_args(cls, args: ServerArgs, size: int | None = None) -> MHATokenToKVPool:
        """Build from ``ServerArgs``; ``size`` defaults to ``args.max_total_tokens``. Holds this
        tensor-parallel rank's KV heads (``args.kv_heads_per_rank()``: all of them at tp 1)."""
        return cls(
            size=args.max_total_tokens if size is None else size,
            page_size=args.page_size,
            dtype=args.torch_dtype(),
            head_num=args.kv_heads_per_rank(),
            head_dim=args.head_dim,
            layer_num=args.num_layers,
            device=args.resolved_device(),
        )

    @property
    def kv_buffer(self) -> torch.Tensor:
        """``(2, L, size + page_size, H, D)``: K and V in one tensor (same head widths only)."""
        if self._kv_buffer is None:
            raise AttributeError(
                f"kv_buffer: K and V heads differ ({self.head_dim} vs {self.v_head_dim}); "
                f"use k_buffer_all and v_buffer_all"
            )
        return self._kv_buffer

    # --- geometry ------------------------------------------------------------------------------
    @property
    def item_size(self) -> int:
        """Bytes of one token, one layer of K (the kernels' ``item_size``)."""
        return self.head_num * self.head_dim * self._storage.element_size()

    @property
    def v_item_size(self) -> int:
        """Bytes of one token, one layer of V."""
        return self.head_num * self.v_head_dim * self._storage.element_size()

    def get_size_per_token(self) -> int:
        """Bytes of one token across all layers, K and V (SGLang's name)."""
        return self.layer_num * (self.item_size + self.v_item_size)

    def mem_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    # --- access --------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait_for_layer(layer_id)
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> None:
        """Write ``cache_k`` (``[n, H, D]``) / ``cache_v`` (``[n, H, D_v]``) into slots ``loc``
        (int64 ``[n]``). Runs on the current stream, does not synchronize. Values are cast to
        the pool dtype."""
        self._check_layer(layer_id)
        slot_indices("loc", loc, n_slots=self.size + self.page_size, device=self.device)
        for name, t, width in (
            ("cache_k", cache_k, self.head_dim),
            ("cache_v", cache_v, self.v_head_dim),
        ):
            want = (loc.numel(), self.head_num, width)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)


class MLATokenToKVPool(_DevicePool):
    """One latent buffer per layer of a multi-head-latent-attention model, in one allocation.

    Memory: ``kv_buffer_all`` of shape ``(L, size + page_size, 1, C)`` with
    ``C = kv_lora_rank + qk_rope_head_dim``; ``kv_buffer[l]`` is a contiguous
    ``[size + page_size, 1, C]`` view. ``kv_data_ptrs`` (alias ``data_ptrs``): uint64 ``[L]``.
    """

    index_head_dim = None  # no DSA indexer cache
    dsa_kv_cache_store_fp8 = False
    kv_scale_buffer = None

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
            size, page_size, layer_num, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim
        )
        super().__init__(size, page_size, dtype, layer_num, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer_all = torch.zeros(
            (layer_num, size + page_size, 1, self.kv_cache_dim), dtype=dtype, device=self.device
        )
        self.kv_buffer: list[torch.Tensor] = list(self.kv_buffer_all)
        self.kv_data_ptrs = kernels.data_ptr_table(self.kv_buffer, self.device)
        self.data_ptrs = self.kv_data_ptrs
        logger.info(
            "%s: %d slots x %d layers, %.3f GB on %s",
            type(self).__name__,
            size,
            layer_num,
            self.mem_bytes() / 1e9,
            self.device,
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
        self._wait_for_layer(layer_id)
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The value part of the latent: the first ``kv_lora_rank`` columns (a view)."""
        self._wait_for_layer(layer_id)
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_kv: torch.Tensor) -> None:
        """Write ``cache_kv`` (``[n, 1, C]``) into slots ``loc`` (int64 ``[n]``); no sync."""
        self._check_layer(layer_id)
        slot_indices("loc", loc, n_slots=self.size + self.page_size, device=self.device)
        want = (loc.numel(), 1, self.kv_cache_dim)
        if tuple(cache_kv.shape) != want:
            raise ValueError(f"cache_kv must have shape {want}, got {tuple(cache_kv.shape)}")
        self.kv_buffer[layer_id][loc] = cache_kv.to(self.dtype)


KVPool = MHATokenToKVPool | MLATokenToKVPool


def device_pool_from_server_args(args: ServerArgs, size: int | None = None) -> KVPool:
    """The device pool ``args`` describe (``size`` tokens, default ``args.max_total_tokens``): an
    ``MLATokenToKVPool`` with ``--use-mla``, else an ``MHATokenToKVPool`` of this rank's KV
    heads. The one place the prefill side chooses between the two."""
    cls = MLATokenToKVPool if getattr(args, "use_mla", False) else MHATokenToKVPool
    _check_pool_fits_device(args, size)
    return cls.from_server_args(args, size=size)


def device_free_bytes(device: torch.device) -> int:
    """Bytes a new pool may take on ``device``: free CUDA memory (with what torch's caching
    allocator holds unused), else the available host RAM."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return host_ram.host_memory_available_bytes()


def _check_pool_fits_device(args: ServerArgs, size: int | None) -> None:
    """``ValueError`` naming ``--max-total-tokens`` (or ``size``) when the pool ``args``
    describe is larger than its device can hold, before anything is allocated."""
    device, dtype = args.resolved_device(), args.torch_dtype()
    if getattr(args, "use_mla", False):
        width = args.kv_lora_rank + args.qk_rope_head_dim
    else:
        width = 2 * args.kv_heads_per_rank() * args.head_dim  # K and V
    per_token = args.num_layers * width * torch.empty(0, dtype=dtype).element_size()
    tokens = args.max_total_tokens if size is None else size
    need, free = (tokens + args.page_size) * per_token, device_free_bytes(device)
    if need > free:
        name = "--max-total-tokens" if size is None else "size"
        raise ValueError(
            f"{name}={tokens}: the device pool needs {need / 1e9:.3f} GB ({per_token} bytes per "
            f"token), more than the {free / 1e9:.3f} GB free on {device}"
        )
