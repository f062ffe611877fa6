"""Kernel-backend KV copy ops with SGLang's ``sgl_kernel.kvcacheio`` names and argument order.

Every op is ``dst[dst_indices[i]] = src[src_indices[i]]`` in its addressing (see
:mod:`kernels.addressing`), for each layer it covers, K and V (MHA) or the one latent buffer
(MLA). Common contract:

- ``src_indices`` / ``dst_indices``: int64, 1-D, equal length, on the device the op runs on
  (CUDA, or CPU under ``TRITON_INTERPRET=1``). A pair with a negative index is skipped, as
  upstream. ``dst_indices`` should not repeat a slot (which source wins is then unspecified).
- ``item_size``: bytes of one token of one layer of K; any positive size (upstream needs a
  multiple of 8). Raw bytes are copied, so the dtype is free (bf16, fp16, fp8, fp32, ...).
- K and V may differ in bytes per token (K head 192, V head 128): V is copied with its own size,
  read from the V tensors (their slot and layer dimensions must match K's); the layout dims scale
  with it. An op whose two sides are tables (``transfer_kv_all_layer``) has no V tensor to read:
  there K and V are one size, as upstream; copy other sizes with the MLA op, once per part.
- Data tensors: contiguous; on the indices' device, or on CUDA, pinned (or
  ``cudaHostRegister``-ed) host memory, which the kernel reads and writes directly.
- ``*_layers`` tables: 1-D int64/uint64 tensors of per-layer ``data_ptr()``s on the indices'
  device; entries may be pinned host addresses on CUDA. An entry must be aligned to the word
  ``item_size`` allows (any buffer of whole ``item_size`` rows is). Tables built by
  :func:`data_ptr_table` (or checked once by :func:`kernels.verify_ptr_table`) carry their
  alignment, which lets the kernel use 16-byte accesses on that side.
- page_head buffers ``[T / page_size, head_num, page_size, L, head_dim]``: the ``*_ph`` ops copy
  head by head (``item_size / head_num`` bytes), as upstream.
- ``block_quota`` caps the number of programs (CTAs); ``num_warps_per_block`` is rounded down to
  a power of two, at most 32 (16 on HIP).
- Only the destination is written. The op is queued on the current stream and never blocks the
  host; bad arguments raise ``ValueError`` naming the argument (index ranges and table entries are
  checked on CPU always, on CUDA with :func:`kernels.set_debug_checks`).

CPU tensors on a machine that compiles Triton for CUDA (no interpreter) run the torch reference.

Each op is a thin wrapper: it names its arguments' roles in a :class:`kernels.addressing.KVCopy`,
which :mod:`kernels.transfer` validates and launches (:mod:`kernels.launch`, the one kernel in
:mod:`kernels.copy_kernel`) or runs on the reference.
"""

from __future__ import annotations

import logging

import torch

from kernels.addressing import (
    LF_TO_LF,
    LF_TO_PF,
    PF_TO_LF,
    PH_TO_LF,
    TABLE_TO_PF,
    TABLE_TO_PH,
    TABLE_TO_TABLE,
    KVCopy,
)
from kernels.ptr_tables import data_ptr_table, get_device_accessible_ptr  # noqa: F401 (as upstream's)
from kernels.reference import DEFAULT_BLOCK_QUOTA, DEFAULT_NUM_WARPS
from kernels.transfer import transfer as _transfer

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# MHA ops
# ---------------------------------------------------------------------------------------------


def transfer_kv_per_layer(
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
    _transfer(
        KVCopy(LF_TO_LF, (src_k, src_v), (dst_k, dst_v), src_indices, dst_indices, item_size),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_pf_lf(
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
    _transfer(
        KVCopy(
            PF_TO_LF, (src_k, src_v), (dst_k, dst_v), src_indices, dst_indices, item_size,
            layout_dim=src_layout_dim, layer_id=layer_id,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_ph_lf(
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
    """Layer ``layer_id`` of a page_head host pool -> one device layer (H2D load), head by head.

    ``src_k``, ``src_v``: page_head ``[T_host / page_size, head_num, page_size, L, D]`` (usually
    pinned host memory); ``src_layout_dim = item_size * L``. ``dst_k``, ``dst_v``:
    ``[T_dev, head_num, D]``. Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
    """
    _transfer(
        KVCopy(
            PH_TO_LF, (src_k, src_v), (dst_k, dst_v), src_indices, dst_indices, item_size,
            layout_dim=src_layout_dim, layer_id=layer_id, page_size=page_size, head_num=head_num,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer(
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

    Each table entry points at one layer ``[T, H, D]`` (device or pinned host memory); K and V
    rows are ``item_size`` bytes each (tables carry no shape to read V's from). The kernel
    cannot bound slots through a table: indices must be valid for every layer they address.
    Mutates the destination layers at ``dst_indices``.
    """
    _transfer(
        KVCopy(
            TABLE_TO_TABLE, (src_k_layers, src_v_layers), (dst_k_layers, dst_v_layers),
            src_indices, dst_indices, item_size, num_layers=num_layers,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_lf_pf(
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
    """All device layers (``data_ptr()`` tables ``[L]``) -> a page_first host pool (D2H backup).

    ``dst_k``, ``dst_v``: page_first ``[T_host, L, H, D]`` (usually pinned host memory);
    ``dst_layout_dim = item_size * L``. Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
    """
    _transfer(
        KVCopy(
            TABLE_TO_PF, (src_k_layers, src_v_layers), (dst_k, dst_v), src_indices, dst_indices,
            item_size, layout_dim=dst_layout_dim, num_layers=num_layers,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_lf_ph(
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
    """All device layers (``data_ptr()`` tables ``[L]``) -> a page_head host pool (D2H backup),
    head by head.

    ``dst_k``, ``dst_v``: page_head ``[T_host / page_size, head_num, page_size, L, D]``;
    ``dst_layout_dim = item_size * L``. Mutates ``dst_k`` and ``dst_v`` at ``dst_indices``.
    """
    _transfer(
        KVCopy(
            TABLE_TO_PH, (src_k_layers, src_v_layers), (dst_k, dst_v), src_indices, dst_indices,
            item_size, layout_dim=dst_layout_dim, num_layers=num_layers, page_size=page_size,
            head_num=head_num,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# MLA ops: one latent buffer ``[T, 1, C]`` per layer instead of K and V
# ---------------------------------------------------------------------------------------------


def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = DEFAULT_BLOCK_QUOTA,
    num_warps_per_block: int = DEFAULT_NUM_WARPS,
) -> None:
    """MLA :func:`transfer_kv_per_layer`: ``src`` ``[T_src, 1, C]`` -> ``dst`` ``[T_dst, 1, C]``.

    Either side may be pinned host memory. Mutates ``dst`` at ``dst_indices``.
    """
    _transfer(
        KVCopy(LF_TO_LF, (src,), (dst,), src_indices, dst_indices, item_size),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_mla_pf_lf(
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
    """MLA :func:`transfer_kv_per_layer_pf_lf`: ``src`` page_first ``[T_host, L, 1, C]`` -> ``dst``
    ``[T_dev, 1, C]``. Mutates ``dst`` at ``dst_indices``."""
    _transfer(
        KVCopy(
            PF_TO_LF, (src,), (dst,), src_indices, dst_indices, item_size,
            layout_dim=src_layout_dim, layer_id=layer_id,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_per_layer_mla_lf_pf(
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
    ``[T_host, L, 1, C]`` (D2H write-back of one layer, upstream's newest op). Mutates ``dst``
    at ``dst_indices``."""
    _transfer(
        KVCopy(
            LF_TO_PF, (src,), (dst,), src_indices, dst_indices, item_size,
            layout_dim=dst_layout_dim, layer_id=layer_id,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = DEFAULT_BLOCK_QUOTA,
    num_warps_per_block: int = DEFAULT_NUM_WARPS,
) -> None:
    """MLA :func:`transfer_kv_all_layer`: ``data_ptr()`` tables ``[L]`` on both sides.

    Mutates the destination layers at ``dst_indices``; indices must be valid for every layer.
    """
    _transfer(
        KVCopy(
            TABLE_TO_TABLE, (src_layers,), (dst_layers,), src_indices, dst_indices, item_size,
            num_layers=num_layers,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip


def transfer_kv_all_layer_mla_lf_pf(
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
    """MLA :func:`transfer_kv_all_layer_lf_pf`: tables ``[L]`` -> page_first ``[T_host, L, 1, C]``.

    Mutates ``dst`` at ``dst_indices``.
    """
    _transfer(
        KVCopy(
            TABLE_TO_PF, (src_layers,), (dst,), src_indices, dst_indices, item_size,
            layout_dim=dst_layout_dim, num_layers=num_layers,
        ),
        block_quota, num_warps_per_block,
    )  # fmt: skip
