"""Device KV pools (SGLang ``MHATokenToKVPool`` / ``MLATokenToKVPool``) and their choice.

Memory only: one allocation with per-layer views and ``data_ptr()`` tables. Each layer has
``size + page_size`` slots; page 0 is padding. A pool carries every attribute SGLang's host pools
read of a device pool; with a layer transfer counter registered, ``get_*_buffer`` wait for that
layer's load first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from hicache_prefill import kernels
from hicache_prefill.hicache.memory import host_ram
from hicache_prefill.hicache.memory.allocator import check_page_geometry
from hicache_prefill.kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)


def _check_geometry(size: int, page_size: int, layer_num: int, **dims: int) -> None:
    check_page_geometry(size, page_size)
    if layer_num < 1:
        raise ValueError(f"layer_num must be >= 1, got {layer_num}")
    for name, value in dims.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class _DevicePool:
    """Geometry and the SGLang ``KVCache`` fields both pools share (no layer sharding)."""

    layer_shard_enabled = False
    # Read by SGLang 0.5.23's ``build_kv_host_pool``: no separate host capacity, no staging.
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
        """SGLang 0.5.23's ``DevicePoolInfo`` of this pool; ``ImportError`` without SGLang."""
        from hicache_prefill.kernels.sglang.pool_info import sglang_device_pool_infos

        return sglang_device_pool_infos(self)

    def register_layer_transfer_counter(self, layer_transfer_counter: Any) -> None:
        """Make ``get_*_buffer`` call ``layer_transfer_counter.wait_until(layer_id)`` first."""
        self.layer_transfer_counter = layer_transfer_counter

    def _owned_local_layer_range(self) -> tuple[int, int]:
        return 0, self.layer_num

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")

    def _wait_for_layer(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)

    def mem_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def _log_built(self, heads: str) -> None:
        args = (type(self).__name__, self.size, self.layer_num, heads, self.mem_bytes() / 1e9)
        logger.info("%s: %d slots x %d layers%s, %.3f GB on %s", *args, self.device)


class MHATokenToKVPool(_DevicePool):
    """Per-layer K and V buffers of a multi-head-attention model, in one allocation.

    V heads may be narrower than K (``v_head_dim``); then there is no single ``kv_buffer``, only
    ``k_buffer_all`` / ``v_buffer_all``. ``data_ptrs`` is ``k_data_ptrs`` then ``v_data_ptrs``.
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
        self._log_built(f" (K head {head_dim}, V head {v_head_dim})")

    @classmethod
    def from_server_args(cls, args: ServerArgs, size: int | None = None) -> MHATokenToKVPool:
        """This tensor-parallel rank's KV heads; ``size`` defaults to ``max_total_tokens``."""
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
        if self._kv_buffer is None:
            raise AttributeError(
                f"kv_buffer: K and V heads differ ({self.head_dim} vs {self.v_head_dim}); "
                f"use k_buffer_all and v_buffer_all"
            )
        return self._kv_buffer

    @property
    def item_size(self) -> int:
        """Bytes of one token, one layer of K (the kernels' ``item_size``)."""
        return self.head_num * self.head_dim * self._storage.element_size()

    @property
    def v_item_size(self) -> int:
        return self.head_num * self.v_head_dim * self._storage.element_size()

    def get_size_per_token(self) -> int:
        """Bytes of one token across all layers, K and V (SGLang's name)."""
        return self.layer_num * (self.item_size + self.v_item_size)

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
        """Write ``cache_k`` / ``cache_v`` into slots ``loc`` on the current stream."""
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
    """One latent buffer (``kv_lora_rank + qk_rope_head_dim`` wide) per layer of an MLA model."""

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
        self._storage = self.kv_buffer_all
        self.kv_buffer: list[torch.Tensor] = list(self.kv_buffer_all)
        self.kv_data_ptrs = kernels.data_ptr_table(self.kv_buffer, self.device)
        self.data_ptrs = self.kv_data_ptrs
        self._log_built("")

    @classmethod
    def from_server_args(cls, args: ServerArgs, size: int | None = None) -> MLATokenToKVPool:
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
        """Write ``cache_kv`` (``[n, 1, C]``) into slots ``loc``; no sync."""
        self._check_layer(layer_id)
        slot_indices("loc", loc, n_slots=self.size + self.page_size, device=self.device)
        want = (loc.numel(), 1, self.kv_cache_dim)
        if tuple(cache_kv.shape) != want:
            raise ValueError(f"cache_kv must have shape {want}, got {tuple(cache_kv.shape)}")
        self.kv_buffer[layer_id][loc] = cache_kv.to(self.dtype)


KVPool = MHATokenToKVPool | MLATokenToKVPool


def device_pool_from_server_args(args: ServerArgs, size: int | None = None) -> KVPool:
    """The device pool ``args`` describe: MLA with ``--use-mla``, else MHA."""
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
    """``ValueError`` when the pool ``args`` describe is larger than its device can hold."""
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
