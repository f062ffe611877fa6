"""The host copy of an MLA device pool (SGLang ``MLATokenToKVPoolHost``): the latent buffer, its
``kernel`` copies, and per-slot test access. Layouts, sizing and the ``direct`` copies are in
``host_pool_base``."""

from __future__ import annotations

import logging
from typing import Any

import torch

import kernels
from hicache.memory.host_pool_base import _HostKVPoolBase, require_fields

logger = logging.getLogger(__name__)

MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "kv_buffer", "data_ptrs")
"""What an MLA host pool reads of its device pool (SGLang's names; ``kv_cache_dim`` optional)."""


class MLATokenToKVPoolHost(_HostKVPoolBase):
    """Host copy of an MLA device pool (this project's ``MLATokenToKVPool`` or any pool with
    SGLang's attributes, :data:`MLA_FIELDS`); ``data_ptrs`` (uint64 ``[L]``) for
    ``layer_first``."""

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
        require_fields(device_pool, MLA_FIELDS, "MLA")
        self.kv_cache_dim = getattr(device_pool, "kv_cache_dim", None) or (
            device_pool.kv_lora_rank + device_pool.qk_rope_head_dim
        )
        super().__init__(
            device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory
        )
        if layout == "layer_first":
            self.data_ptrs = self._layer_data_ptrs(self.kv_buffer)

    def _token_shapes(self) -> list[tuple[int, ...]]:
        return [(1, self.kv_cache_dim)]

    def _token_shapes_of(self, device_pool: Any) -> list[tuple[int, ...]]:
        dim = getattr(device_pool, "kv_cache_dim", None) or (
            device_pool.kv_lora_rank + device_pool.qk_rope_head_dim
        )
        return [(1, dim)]

    def backup_from_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """D2H, all layers (see ``MHATokenToKVPoolHost.backup_from_device_all_layer``)."""
        self.check_copy_args(host_indices, device_indices, io_backend)
        if host_indices.numel() == 0:
            return
        dp = device_pool
        if io_backend == "direct":
            self._backup_direct([dp.kv_buffer], host_indices, device_indices)
        elif self.layout == "layer_first":
            kernels.transfer_kv_all_layer_mla(
                dp.data_ptrs,
                self.data_ptrs,
                device_indices,
                host_indices,
                self.item_size,
                self.layer_num,
            )
        else:  # page_first
            kernels.transfer_kv_all_layer_mla_lf_pf(
                dp.data_ptrs,
                self.kv_buffer,
                device_indices,
                host_indices,
                self.item_size,
                self.layout_dim,
                self.layer_num,
            )

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        validate: bool = True,
    ) -> None:
        """H2D of one layer (see ``MHATokenToKVPoolHost.load_to_device_per_layer``, and its
        ``validate``)."""
        if validate:
            self.check_copy_args(host_indices, device_indices, io_backend, layer_id)
        if host_indices.numel() == 0:
            return
        dst = device_pool.kv_buffer[layer_id]
        if io_backend == "direct":
            self._load_direct([dst], host_indices, device_indices, layer_id)
        elif self.layout == "layer_first":
            kernels.transfer_kv_per_layer_mla(
                self.kv_buffer[layer_id], dst, host_indices, device_indices, self.item_size
            )
        else:  # page_first
            kernels.transfer_kv_per_layer_mla_pf_lf(
                self.kv_buffer,
                dst,
                host_indices,
                device_indices,
                layer_id,
                self.item_size,
                self.layout_dim,
            )

    def get_kv_slots(self, layer_id: int, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A copy ``(kv,)`` of shape ``[n, 1, C]`` (CPU) of host slots ``indices`` in a layer."""
        return self._get_slots(layer_id, indices)

    def set_kv_slots(self, layer_id: int, indices: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` (``[n, 1, C]``) into host slots ``indices`` of a layer (blocking)."""
        self._set_slots(layer_id, indices, (kv,), "kv")
