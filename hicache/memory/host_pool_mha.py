"""The host copy of an MHA device pool (SGLang ``MHATokenToKVPoolHost``): K and V buffers, their
``kernel`` copies, and per-slot test access. Layouts, sizing and the ``direct`` copies are in
``host_pool_base``."""

from __future__ import annotations

import logging
from typing import Any

import torch

import kernels
from hicache.memory.host_pool_base import _HostKVPoolBase, require_fields

logger = logging.getLogger(__name__)

MHA_FIELDS = ("head_num", "head_dim", "k_buffer", "v_buffer", "k_data_ptrs", "v_data_ptrs")
"""What an MHA host pool reads of its device pool (SGLang's names; ``v_head_dim`` optional)."""


class MHATokenToKVPoolHost(_HostKVPoolBase):
    """Host copy of an MHA device pool: this project's ``MHATokenToKVPool`` or any pool with
    SGLang's attributes (:data:`MHA_FIELDS`), K heads ``head_dim`` and V heads ``v_head_dim``
    wide (see ``host_pool_base`` for layouts and ``host_ram`` for pinning).

    ``k_buffer`` / ``v_buffer``: the K and V parts (``kv_buffer[0]`` / ``kv_buffer[1]`` when the
    heads agree). For ``layer_first`` the per-layer views' ``data_ptr()`` tables
    ``k_data_ptrs`` / ``v_data_ptrs`` (uint64 ``[L]``, on the device pool's device) feed the
    all-layer kernel.
    """

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
        require_fields(device_pool, MHA_FIELDS, "MHA")
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        self.v_head_dim = getattr(device_pool, "v_head_dim", None) or self.head_dim
        super().__init__(
            device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory
        )
        self.k_buffer, self.v_buffer = self._host_parts
        self.v_item_size = self.part_item_sizes[1]
        if layout == "layer_first":
            self.k_data_ptrs = self._layer_data_ptrs(self.k_buffer)
            self.v_data_ptrs = self._layer_data_ptrs(self.v_buffer)

    def _token_shapes(self) -> list[tuple[int, ...]]:
        return [(self.head_num, self.head_dim), (self.head_num, self.v_head_dim)]

    def _token_shapes_of(self, device_pool: Any) -> list[tuple[int, ...]]:
        v_dim = getattr(device_pool, "v_head_dim", None) or device_pool.head_dim
        return [(device_pool.head_num, device_pool.head_dim), (device_pool.head_num, v_dim)]

    # --- copies --------------------------------------------------------------------------------
    def backup_from_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """D2H, all layers, K and V: ``host[host_indices[i]] = device[device_indices[i]]``.

        Launches on the current stream; does not synchronize. ``kernel``: indices on the device
        pool's device; ``direct``: indices on the CPU.
        """
        self.check_copy_args(host_indices, device_indices, io_backend)
        if host_indices.numel() == 0:
            return
        dp = device_pool
        if io_backend == "direct":
            self._backup_direct([dp.k_buffer, dp.v_buffer], host_indices, device_indices)
        elif self.layout == "layer_first" and self.v_item_size != self.item_size:
            # Tables alone carry no V size: each part with its own item size, as upstream does.
            parts = (
                (dp.k_data_ptrs, self.k_data_ptrs, self.item_size),
                (dp.v_data_ptrs, self.v_data_ptrs, self.v_item_size),
            )
            for src, dst, item in parts:
                kernels.transfer_kv_all_layer_mla(
                    src, dst, device_indices, host_indices, item, self.layer_num
                )
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
        else:  # page_first: V's size comes from the host V buffer
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
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        validate: bool = True,
    ) -> None:
        """H2D of one layer, K and V: ``device[device_indices[i]] = host[host_indices[i]]``.

        Launches on the current stream; does not synchronize. ``validate=False``: the caller
        ran ``check_copy_args`` on these indices already and ``layer_id`` is in range (the
        controller checks a load once for all its layers); the kernels still check their
        tensors.
        """
        if validate:
            self.check_copy_args(host_indices, device_indices, io_backend, layer_id)
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
        """Copies ``(k, v)``, ``[n, H, D]`` and ``[n, H, D_v]`` (CPU), of host slots ``indices``
        in a layer."""
        return self._get_slots(layer_id, indices)

    def set_kv_slots(
        self, layer_id: int, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k`` (``[n, H, D]``), ``v`` (``[n, H, D_v]``) into host slots ``indices`` of a
        layer (blocking)."""
        self._set_slots(layer_id, indices, (k, v), "k and v")
