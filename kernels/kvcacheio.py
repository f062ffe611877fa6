"""Kernel-backend KV copy ops with SGLang's ``sgl_kernel.kvcacheio`` names and argument order.

Every op is ``dst[dst_indices[i]] = src[src_indices[i]]`` in its addressing (see
:mod:`kernels.reference`), for each layer it covers, K and V (MHA) or the one latent buffer (MLA).
Common contract:

- ``src_indices`` / ``dst_indices``: int64, 1-D, equal length, on the device the op runs on
  (CUDA, or CPU under ``TRITON_INTERPRET=1``). A pair with a negative index is skipped, as
  upstream. ``dst_indices`` should not repeat a slot (which source wins is then unspecified).
- ``item_size``: bytes of one token of one layer of K (or V); any positive size (upstream needs a
  multiple of 8). Raw bytes are copied, so the dtype is free (bf16, fp16, fp8, fp32, ...).
- Data tensors: contiguous; on the indices' device, or on CUDA, pinned (or
  ``cudaHostRegister``-ed) host memory, which the kernel reads and writes directly.
- ``*_layers`` tables: 1-D int64/uint64 tensors of per-layer ``data_ptr()``s on the indices'
  device, each entry aligned to the copy word (a multiple of ``item_size``'s alignment, which any
  buffer of whole ``item_size`` rows satisfies); entries may be pinned host addresses on CUDA.
- ``block_quota`` caps the number of programs (CTAs); ``num_warps_per_block`` is rounded down to
  a power of two, at most 32 (16 on HIP).
- Only the destination is written. The op is queued on the current stream and never blocks the
  host; bad arguments raise ``ValueError`` naming the argument (index ranges and table entries are
  checked on CPU always, on CUDA with :func:`kernels.set_debug_checks`).

CPU tensors on a machine that compiles Triton for CUDA (no interpreter) run the torch reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kernels import _checks, reference
from kernels.copy_kernel import NO_BOUND, Side, launch_kv_copy, resolve_num_warps, word_bytes
from kernels.reference import DEFAULT_BLOCK_QUOTA, DEFAULT_NUM_WARPS

logger = logging.getLogger(__name__)

_fallback_logged = False


def _runs_triton(device: torch.device) -> bool:
    """Triton runs compiled on CUDA tensors, interpreted on CPU tensors; else the reference."""
    from kernels import TRITON_INTERPRETED

    global _fallback_logged
    if (device.type == "cuda") != TRITON_INTERPRETED and device.type in ("cuda", "cpu"):
        return True
    if not _fallback_logged:
        logger.info(
            "kvcacheio ops on %s tensors with TRITON_INTERPRET=%d: using the torch reference",
            device, int(TRITON_INTERPRETED),
        )  # fmt: skip
        _fallback_logged = True
    return False


def data_ptr_table(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """A uint64 table of ``t.data_ptr()`` for each tensor, on ``device`` (as SGLang builds them)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def _common(
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int,
    num_warps_per_block: int,
) -> torch.device:
    device = _checks.index_pair(src_indices, dst_indices)
    _checks.positive_int("item_size", item_size)
    _checks.positive_int("block_quota", block_quota)
    _checks.positive_int("num_warps_per_block", num_warps_per_block)
    return device


def _tensors(
    device: torch.device, named: list[tuple[str, torch.Tensor]]
) -> tuple[torch.Tensor, ...]:
    """Check each data tensor, and K against V (pairs ``(k, v)`` come in order)."""
    out = tuple(_checks.data_tensor(name, t, device) for name, t in named)
    if len(named) == 2:
        _checks.same_shape(named[0][0], out[0], named[1][0], out[1])
    return out


def _launch(
    src: Side,
    dst: Side,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    layer_begin: int,
    num_layers: int,
    block_quota: int,
    num_warps_per_block: int,
    table_names: tuple[tuple[str, ...], tuple[str, ...]],
    fallback: Callable[[], None],
) -> None:
    device = src_indices.device
    for side, n in ((src, "src_indices"), (dst, "dst_indices")):
        if not side.is_table:
            _checks.indices_in_range(n, src_indices if side is src else dst_indices, side.n_slots)
    word = word_bytes(item_size, src, dst)
    for side, names in zip((src, dst), table_names, strict=True):
        if side.is_table:
            for name, table in zip(names, side.refs, strict=True):
                _checks.ptr_table(name, table, num_layers, device, word)
    if not _runs_triton(device):
        fallback()
        return
    launch_kv_copy(
        src, dst, src_indices, dst_indices,
        item_size=item_size, layer_begin=layer_begin, num_layers=num_layers,
        block_quota=block_quota, num_warps=resolve_num_warps(num_warps_per_block),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Shared bodies: one per addressing pair, MHA passes (K, V), MLA passes one buffer.
# ---------------------------------------------------------------------------------------------


def _lf_to_lf(srcs, dsts, src_indices, dst_indices, item_size, bq, nw, fallback) -> None:
    device = _common(src_indices, dst_indices, item_size, bq, nw)
    src_t = _tensors(device, srcs)
    dst_t = _tensors(device, dsts)
    n_src = _checks.layer_first(srcs[0][0], src_t[0], item_size)
    n_dst = _checks.layer_first(dsts[0][0], dst_t[0], item_size)
    src = Side(src_t, False, item_size, 0, n_src)
    dst = Side(dst_t, False, item_size, 0, n_dst)
    _launch(src, dst, src_indices, dst_indices, item_size, 0, 1, bq, nw, ((), ()), fallback)


def _pf_to_lf(
    srcs, dsts, src_indices, dst_indices, layer_id, item_size, src_layout_dim, bq, nw, fallback
) -> None:
    device = _common(src_indices, dst_indices, item_size, bq, nw)
    _checks.positive_int("src_layout_dim", src_layout_dim)
    src_t = _tensors(device, srcs)
    dst_t = _tensors(device, dsts)
    n_src, n_layers = _checks.page_first(
        srcs[0][0], src_t[0], item_size, src_layout_dim, "src_layout_dim"
    )
    _checks.layer_id_in_range(layer_id, n_layers)
    n_dst = _checks.layer_first(dsts[0][0], dst_t[0], item_size)
    src = Side(src_t, False, src_layout_dim, item_size, n_src)
    dst = Side(dst_t, False, item_size, 0, n_dst)
    # The destination is one layer tensor: its layer stride is 0, whatever layer_id is.
    _launch(src, dst, src_indices, dst_indices, item_size, layer_id, 1, bq, nw, ((), ()), fallback)


def _tbl_to_tbl(
    srcs, dsts, src_indices, dst_indices, item_size, num_layers, bq, nw, fallback
) -> None:
    _common(src_indices, dst_indices, item_size, bq, nw)
    _checks.positive_int("num_layers", num_layers)
    src = Side(tuple(t for _, t in srcs), True, item_size, 0, NO_BOUND)
    dst = Side(tuple(t for _, t in dsts), True, item_size, 0, NO_BOUND)
    names = (tuple(n for n, _ in srcs), tuple(n for n, _ in dsts))
    _launch(src, dst, src_indices, dst_indices, item_size, 0, num_layers, bq, nw, names, fallback)


def _tbl_to_pf(
    srcs, dsts, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, bq, nw, fallback
) -> None:
    device = _common(src_indices, dst_indices, item_size, bq, nw)
    _checks.positive_int("dst_layout_dim", dst_layout_dim)
    _checks.positive_int("num_layers", num_layers)
    dst_t = _tensors(device, dsts)
    n_dst, n_layers = _checks.page_first(
        dsts[0][0], dst_t[0], item_size, dst_layout_dim, "dst_layout_dim"
    )
    if num_layers != n_layers:
        raise ValueError(
            f"num_layers={num_layers} does not match {dsts[0][0]}: it holds {n_layers} layers"
        )
    src = Side(tuple(t for _, t in srcs), True, item_size, 0, NO_BOUND)
    dst = Side(dst_t, False, dst_layout_dim, item_size, n_dst)
    names = (tuple(n for n, _ in srcs), ())
    _launch(src, dst, src_indices, dst_indices, item_size, 0, num_layers, bq, nw, names, fallback)


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
    _lf_to_lf(
        [("src_k", src_k), ("src_v", src_v)], [("dst_k", dst_k), ("dst_v", dst_v)],
        src_indices, dst_indices, item_size, block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_per_layer(
            src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size
        ),
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
    _pf_to_lf(
        [("src_k", src_k), ("src_v", src_v)], [("dst_k", dst_k), ("dst_v", dst_v)],
        src_indices, dst_indices, layer_id, item_size, src_layout_dim,
        block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_per_layer_pf_lf(
            src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
            layer_id, item_size, src_layout_dim,
        ),
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

    Each table entry points at one layer ``[T, H, D]`` (device or pinned host memory). The kernel
    cannot bound slots through a table: indices must be valid for every layer they address.
    Mutates the destination layers at ``dst_indices``.
    """
    _tbl_to_tbl(
        [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)],
        [("dst_k_layers", dst_k_layers), ("dst_v_layers", dst_v_layers)],
        src_indices, dst_indices, item_size, num_layers, block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_all_layer(
            src_k_layers, dst_k_layers, src_v_layers, dst_v_layers,
            src_indices, dst_indices, item_size, num_layers,
        ),
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
    _tbl_to_pf(
        [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)],
        [("dst_k", dst_k), ("dst_v", dst_v)],
        src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
        block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_all_layer_lf_pf(
            src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
            item_size, dst_layout_dim, num_layers,
        ),
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
    _lf_to_lf(
        [("src", src)], [("dst", dst)],
        src_indices, dst_indices, item_size, block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_per_layer_mla(
            src, dst, src_indices, dst_indices, item_size
        ),
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
    _pf_to_lf(
        [("src", src)], [("dst", dst)],
        src_indices, dst_indices, layer_id, item_size, src_layout_dim,
        block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_per_layer_mla_pf_lf(
            src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim
        ),
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
    _tbl_to_tbl(
        [("src_layers", src_layers)], [("dst_layers", dst_layers)],
        src_indices, dst_indices, item_size, num_layers, block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_all_layer_mla(
            src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers
        ),
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
    _tbl_to_pf(
        [("src_layers", src_layers)], [("dst", dst)],
        src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
        block_quota, num_warps_per_block,
        lambda: reference.transfer_kv_all_layer_mla_lf_pf(
            src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers
        ),
    )  # fmt: skip
