"""The host copy of an MHA device pool (SGLang ``MHATokenToKVPoolHost``): K and V buffers, their
``kernel`` copies, and per-slot test access. Layouts, sizing and the ``direct`` copies are in
``memory_pool_host_base``."""

from __future__ import annotations

import logging

import torch

import kernels
from hicache.memory_pool import MHATokenToKVPool
from hicache.memory_pool_host_base import _HostKVPoolBase

logger = logging.getLogger(__name__)


class MHATokenToKVPoolHost(_HostKVPoolBase):
    """Host copy of an ``MHATokenToKVPool`` (see ``memory_pool_host_base`` for layouts and
    ``host_memory`` for pinning).

    ``k_buffer = kv_buffer[0]``, ``v_buffer = kv_buffer[1]``. For ``layer_first`` the per-layer
    views' ``data_ptr()`` tables ``k_data_ptrs`` / ``v_data_ptrs`` (int64 ``[L]``, on the device
    pool's device) feed the all-layer kernel.
    """

    _lead_dims = (2,)

    def __init__(
        self,
        device_pool: MHATokenToKVPool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
        if not isinstance(device_pool, MHATokenToKVPool):
            raise ValueError("device_pool must be an MHATokenToKVPool")
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        super().__init__(
            device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory
        )
        self.k_buffer = self.kv_buffer[0]
        self.v_buffer = self.kv_buffer[1]
        self._host_parts = [self.k_buffer, self.v_buffer]
        if layout == "layer_first":
            self.k_data_ptrs = self._layer_data_ptrs(self.k_buffer)
            self.v_data_ptrs = self._layer_data_ptrs(self.v_buffer)

    def _token_shape(self) -> tuple[int, ...]:
        return (self.head_num, self.head_dim)

    # --- copies --------------------------------------------------------------------------------
    def backup_from_device_all_layer(
        self,
        device_pool: MHATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """D2H, all layers, K and V: ``host[host_indices[i]] = device[device_indices[i]]``.

        Launches on the current stream; does not synchronize. ``kernel``: indices on the device
        pool's device; ``direct``: indices on the CPU.
        """
        self._check_copy_args(host_indices, device_indices, io_backend)
        if host_indices.numel() == 0:
            return
        dp = device_pool
        if io_backend == "direct":
            self._backup_direct([dp.k_buffer, dp.v_buffer], host_indices, device_indices)
        elif self.layout == "layer_first":
            kernels.transfer_kv_all_layer(
                dp.k_data_ptrs,
                self.k_data_ptrs,
                dp.v_data_ptrs,
                self.v_data_ptrs,
                device_indices,
                host_indices,
                self.item_size,
                self.layer_num,
            )
        else:  # page_first
            kernels.transfer_kv_all_layer_lf_pf(
                dp.k_data_ptrs,
                self.k_buffer,
                dp.v_data_ptrs,
                self.v_buffer,
                device_indices,
                host_indices,
                self.item_size,
                self.layout_dim,
                self.layer_num,
            )

    def load_to_device_per_layer(
        self,
        device_pool: MHATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """H2D of one layer, K and V: ``device[device_indices[i]] = host[host_indices[i]]``.

        Launches on the current stream; does not synchronize.
        """
        self._check_copy_args(host_indices, device_indices, io_backend, layer_id)
        if host_indices.numel() == 0:
            return
        dk, dv = device_pool.k_buffer[layer_id], device_pool.v_buffer[layer_id]
        if io_backend == "direct":
            self._load_direct([dk, dv], host_indices, device_indices, layer_id)
        elif self.layout == "layer_first":
            kernels.transfer_kv_per_layer(
                self.k_buffer[layer_id],
                dk,
                self.v_buffer[layer_id],
                dv,
                host_indices,
                device_indices,
                self.item_size,
            )
        else:  # page_first
            kernels.transfer_kv_per_layer_pf_lf(
                self.k_buffer,
                dk,
                self.v_buffer,
                dv,
                host_indices,
                device_indices,
                layer_id,
                self.item_size,
                self.layout_dim,
            )

    # --- test helpers --------------------------------------------------------------------------
    def get_kv_slots(self, layer_id: int, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies ``(k, v)``, each ``[n, H, D]`` (CPU), of host slots ``indices`` in a layer."""
        return self._get_slots(layer_id, indices)

    def set_kv_slots(
        self, layer_id: int, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` (``[n, H, D]``) into host slots ``indices`` of a layer (blocking)."""
        self._set_slots(layer_id, indices, (k, v), "k and v")
