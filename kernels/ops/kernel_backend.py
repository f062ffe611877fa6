"""The signatures of SGLang's kernel-backend ``kvcacheio`` ops, written once.

Each ``transfer_kv_*`` method of :class:`KernelBackendOps` takes upstream's arguments in
upstream's order, names their roles in a :class:`kernels.layout.addressing.KVCopy`, and hands it
(with ``block_quota`` and ``num_warps_per_block``) to the instance's runner. Two instances exist,
and their bound methods are the public ops: :mod:`kernels.ops.kvcacheio` runs the validating Triton
launcher (:func:`kernels.ops.dispatch.transfer`), :mod:`kernels.ops.reference` the torch reference.
The contract of the ops (index, dtype, device, pinning and table rules) is
:mod:`kernels.ops.kvcacheio`'s docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kernels.layout.addressing import (
    LF_TO_LF,
    LF_TO_PF,
    PF_TO_LF,
    PH_TO_LF,
    TABLE_TO_PF,
    TABLE_TO_PH,
    TABLE_TO_TABLE,
    KVCopy,
)

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_QUOTA = 2
DEFAULT_NUM_WARPS = 16 if torch.version.hip is not None else 32

Runner = Callable[[KVCopy, int, int], None]
"""Runs one op call: ``(call, block_quota, num_warps_per_block)``."""


class KernelBackendOps:
    """SGLang's kernel-backend ops over one runner (see the module docstring).

    ``dst[dst_indices[i]] = src[src_indices[i]]`` for each layer an op covers, K and V (MHA) or
    the one latent buffer (MLA), in the addressing its name says (:mod:`kernels.layout.addressing`).
    """

    def __init__(self, run: Runner) -> None:
        self._run = run

    # -----------------------------------------------------------------------------------------
    # MHA ops
    # -----------------------------------------------------------------------------------------

    def transfer_kv_per_layer(
        self,
        src_k: torch.Tensor,
        dst_k: torch.Tensor,
        src_v: torch.Tensor,
        dst_v: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """One layer, layer_first -> layer_first (H2D load of a layer_first host pool, or D2H).

        ``src_k``, ``src_v``: ``[T_src, H, D]``; ``dst_k``, ``dst_v``: ``[T_dst, H, D]``; one
        ``item_size`` (``H * D * itemsize``) per slot. Either side may be pinned host memory.
        Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                LF_TO_LF, (src_k, src_v), (dst_k, dst_v), src_indices, dst_indices, item_size,
                op="transfer_kv_per_layer",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_per_layer_pf_lf(
        self,
        src_k: torch.Tensor,
        dst_k: torch.Tensor,
        src_v: torch.Tensor,
        dst_v: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        item_size: int,
        src_layout_dim: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """Layer ``layer_id`` of a page_first host pool -> one device layer (H2D load).

        ``src_k``, ``src_v``: page_first ``[T_host, L, H, D]`` (usually pinned host memory);
        ``src_layout_dim = item_size * L``. ``dst_k``, ``dst_v``: ``[T_dev, H, D]``.
        Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                PF_TO_LF, (src_k, src_v), (dst_k, dst_v), src_indices, dst_indices, item_size,
                layout_dim=src_layout_dim, layer_id=layer_id,
                op="transfer_kv_per_layer_pf_lf",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_per_layer_ph_lf(
        self,
        src_k: torch.Tensor,
        dst_k: torch.Tensor,
        src_v: torch.Tensor,
        dst_v: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        item_size: int,
        src_layout_dim: int,
        page_size: int,
        head_num: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """Layer ``layer_id`` of a page_head host pool -> one device layer (H2D load), head by
        head.

        ``src_k``, ``src_v``: page_head ``[T_host / page_size, head_num, page_size, L, D]``
        (usually pinned host memory); ``src_layout_dim = item_size * L``. ``dst_k``, ``dst_v``:
        ``[T_dev, head_num, D]``. Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                PH_TO_LF, (src_k, src_v), (dst_k, dst_v), src_indices, dst_indices, item_size,
                layout_dim=src_layout_dim, layer_id=layer_id, page_size=page_size,
                head_num=head_num,
                op="transfer_kv_per_layer_ph_lf",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_all_layer(
        self,
        src_k_layers: torch.Tensor,
        dst_k_layers: torch.Tensor,
        src_v_layers: torch.Tensor,
        dst_v_layers: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        num_layers: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """All layers, layer_first -> layer_first, both sides as ``data_ptr()`` tables ``[L]``.

        Each table entry points at one layer ``[T, H, D]`` (device or pinned host memory); K and
        V rows are ``item_size`` bytes each (tables carry no shape to read V's from). Indices are
        bounded by the slots recorded with each table (:func:`kernels.data_ptr_table`); a table
        without a recorded bound cannot be bounded. Mutates the destination layers at
        ``dst_indices``.
        """
        self._run(
            KVCopy(
                TABLE_TO_TABLE, (src_k_layers, src_v_layers), (dst_k_layers, dst_v_layers),
                src_indices, dst_indices, item_size, num_layers=num_layers,
                op="transfer_kv_all_layer",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_all_layer_lf_pf(
        self,
        src_k_layers: torch.Tensor,
        dst_k: torch.Tensor,
        src_v_layers: torch.Tensor,
        dst_v: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        dst_layout_dim: int,
        num_layers: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """All device layers (``data_ptr()`` tables ``[L]``) -> a page_first host pool (D2H
        backup).

        ``dst_k``, ``dst_v``: page_first ``[T_host, L, H, D]`` (usually pinned host memory);
        ``dst_layout_dim = item_size * L``. Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                TABLE_TO_PF, (src_k_layers, src_v_layers), (dst_k, dst_v), src_indices,
                dst_indices, item_size, layout_dim=dst_layout_dim, num_layers=num_layers,
                op="transfer_kv_all_layer_lf_pf",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_all_layer_lf_ph(
        self,
        src_k_layers: torch.Tensor,
        dst_k: torch.Tensor,
        src_v_layers: torch.Tensor,
        dst_v: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        dst_layout_dim: int,
        num_layers: int,
        page_size: int,
        head_num: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """All device layers (``data_ptr()`` tables ``[L]``) -> a page_head host pool (D2H
        backup), head by head.

        ``dst_k``, ``dst_v``: page_head ``[T_host / page_size, head_num, page_size, L, D]``;
        ``dst_layout_dim = item_size * L``. Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                TABLE_TO_PH, (src_k_layers, src_v_layers), (dst_k, dst_v), src_indices,
                dst_indices, item_size, layout_dim=dst_layout_dim, num_layers=num_layers,
                page_size=page_size, head_num=head_num,
                op="transfer_kv_all_layer_lf_ph",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    # -----------------------------------------------------------------------------------------
    # MLA ops: one latent buffer ``[T, 1, C]`` per layer instead of K and V
    # -----------------------------------------------------------------------------------------

    def transfer_kv_per_layer_mla(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """MLA ``transfer_kv_per_layer``: ``src`` ``[T_src, 1, C]`` -> ``dst`` ``[T_dst, 1, C]``.

        Either side may be pinned host memory. Mutates ``dst`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                LF_TO_LF, (src,), (dst,), src_indices, dst_indices, item_size,
                op="transfer_kv_per_layer_mla",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_per_layer_mla_pf_lf(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        item_size: int,
        src_layout_dim: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """MLA ``transfer_kv_per_layer_pf_lf``: ``src`` page_first ``[T_host, L, 1, C]`` ->
        ``dst`` ``[T_dev, 1, C]``. Mutates ``dst`` at ``dst_indices``."""
        self._run(
            KVCopy(
                PF_TO_LF, (src,), (dst,), src_indices, dst_indices, item_size,
                layout_dim=src_layout_dim, layer_id=layer_id,
                op="transfer_kv_per_layer_mla_pf_lf",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_per_layer_mla_lf_pf(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        item_size: int,
        dst_layout_dim: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """One device layer ``[T_dev, 1, C]`` -> layer ``layer_id`` of a page_first host pool
        ``[T_host, L, 1, C]`` (D2H write-back of one layer, upstream's newest op). Mutates
        ``dst`` at ``dst_indices``."""
        self._run(
            KVCopy(
                LF_TO_PF, (src,), (dst,), src_indices, dst_indices, item_size,
                layout_dim=dst_layout_dim, layer_id=layer_id,
                op="transfer_kv_per_layer_mla_lf_pf",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_all_layer_mla(
        self,
        src_layers: torch.Tensor,
        dst_layers: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        num_layers: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """MLA ``transfer_kv_all_layer``: ``data_ptr()`` tables ``[L]`` on both sides.

        Mutates the destination layers at ``dst_indices``; indices are bounded by the tables'
        recorded bounds.
        """
        self._run(
            KVCopy(
                TABLE_TO_TABLE, (src_layers,), (dst_layers,), src_indices, dst_indices,
                item_size, num_layers=num_layers,
                op="transfer_kv_all_layer_mla",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip

    def transfer_kv_all_layer_mla_lf_pf(
        self,
        src_layers: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        dst_layout_dim: int,
        num_layers: int,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
        num_warps_per_block: int = DEFAULT_NUM_WARPS,
    ) -> None:
        """MLA ``transfer_kv_all_layer_lf_pf``: tables ``[L]`` -> page_first
        ``[T_host, L, 1, C]``.

        Mutates ``dst`` at ``dst_indices``.
        """
        self._run(
            KVCopy(
                TABLE_TO_PF, (src_layers,), (dst,), src_indices, dst_indices, item_size,
                layout_dim=dst_layout_dim, num_layers=num_layers,
                op="transfer_kv_all_layer_mla_lf_pf",
            ),
            block_quota, num_warps_per_block,
        )  # fmt: skip
