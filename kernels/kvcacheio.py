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

Each op is a thin wrapper: it names its arguments' roles in a :class:`kernels.addressing.KVCopy`,
which one validator checks and one launcher (:mod:`kernels.copy_kernel`) or the reference runs.
"""

from __future__ import annotations

import logging

import torch

from kernels import _checks, reference
from kernels.addressing import (
    LAYER_FIRST,
    LF_TO_LF,
    PAGE_FIRST,
    PF_TO_LF,
    TABLE,
    TABLE_TO_PF,
    TABLE_TO_TABLE,
    KVCopy,
    Layout,
    Side,
)
from kernels.copy_kernel import launch_kv_copy, resolve_num_warps, word_bytes
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


def _arg_names(side: str, layout: Layout, n_buffers: int) -> tuple[str, ...]:
    """SGLang's argument names for one side: ``src_k``, ``src_v`` (MHA) or ``src`` (MLA), with
    ``_layers`` for a pointer table (``src_k_layers``, ``src_layers``)."""
    suffix = "_layers" if layout == TABLE else ""
    return tuple(f"{side}{kv}{suffix}" for kv in (("_k", "_v") if n_buffers == 2 else ("",)))


def _page_first_layers(call: KVCopy, side: str, name: str, t: torch.Tensor) -> None:
    """A page_first side ``[T, L, ...]`` holds the layers the op copies."""
    layout_dim_name = f"{side}_layout_dim"
    _, n_layers = _checks.page_first(name, t, call.item_size, call.layout_dim, layout_dim_name)
    if not call.how.all_layers:
        _checks.layer_id_in_range(call.layer_id, n_layers)
    elif call.num_layers != n_layers:
        raise ValueError(
            f"num_layers={call.num_layers} does not match {name}: it holds {n_layers} layers"
        )


def _validate(call: KVCopy, block_quota: int, num_warps_per_block: int) -> tuple[Side, Side]:
    """Raise ``ValueError`` naming the first bad argument; else return the sides to launch."""
    device = _checks.index_pair(call.src_indices, call.dst_indices)
    _checks.positive_int("item_size", call.item_size)
    _checks.positive_int("block_quota", block_quota)
    _checks.positive_int("num_warps_per_block", num_warps_per_block)
    ends = [  # (side, layout, argument names, buffers or tables, indices)
        (side, layout, _arg_names(side, layout, len(refs)), refs, idx)
        for side, layout, refs, idx in (
            ("src", call.how.src, call.src, call.src_indices),
            ("dst", call.how.dst, call.dst, call.dst_indices),
        )
    ]
    for side, layout, *_ in ends:
        if layout == PAGE_FIRST:
            _checks.positive_int(f"{side}_layout_dim", call.layout_dim)
    if call.how.all_layers:
        _checks.positive_int("num_layers", call.num_layers)
    for _, layout, names, refs, _ in ends:
        if layout != TABLE:
            for name, t in zip(names, refs, strict=True):
                _checks.data_tensor(name, t, device)
            if len(refs) == 2:
                _checks.same_shape(names[0], refs[0], names[1], refs[1])
    for side, layout, names, refs, _ in ends:
        if layout == LAYER_FIRST:
            _checks.layer_first(names[0], refs[0], call.item_size)
        elif layout == PAGE_FIRST:
            _page_first_layers(call, side, names[0], refs[0])
    src, dst = call.sides()
    for (side, *_, idx), addressed in zip(ends, (src, dst), strict=True):
        if not addressed.is_table:
            _checks.indices_in_range(f"{side}_indices", idx, addressed.n_slots)
    word = word_bytes(call.item_size, src, dst)
    for (_, _, names, refs, _), addressed in zip(ends, (src, dst), strict=True):
        if addressed.is_table:
            for name, table in zip(names, refs, strict=True):
                _checks.ptr_table(name, table, call.num_layers, device, word)
    return src, dst


def _transfer(call: KVCopy, block_quota: int, num_warps_per_block: int) -> None:
    """Validate ``call``, then queue the kernel (or, off the Triton path, run the reference)."""
    src, dst = _validate(call, block_quota, num_warps_per_block)
    if not _runs_triton(call.src_indices.device):
        reference.copy_kv(call)
        return
    launch_kv_copy(
        src, dst, call.src_indices, call.dst_indices,
        item_size=call.item_size, layer_begin=call.layer_id, num_layers=call.num_layers,
        block_quota=block_quota, num_warps=resolve_num_warps(num_warps_per_block),
    )  # fmt: skip


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
