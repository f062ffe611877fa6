"""Validate one kernel-backend op call (a ``KVCopy``) and run it: the Triton kernel or, off the
Triton path, the torch reference. Every failure is a ``ValueError`` naming the op and argument,
raised before anything is written; launch plans are cached, so a repeated call checks only its
indices.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from hicache_prefill.kernels.errors import KVIndexError
from hicache_prefill.kernels.layout.addressing import (
    LAYER_FIRST,
    NO_BOUND,
    PAGE_FIRST,
    PAGE_HEAD,
    TABLE,
    KVCopy,
    Layout,
    Part,
    buffer_names,
    token_bytes,
)
from hicache_prefill.kernels.ops import checks, reference
from hicache_prefill.kernels.ops.plans import Plan, cached_plan
from hicache_prefill.kernels.triton.index_record import launch_slot
from hicache_prefill.kernels.triton.launch import (
    cache_hints_supported,
    launch_for,
    launch_kv_copy,
    plan_part,
    resolve_num_warps,
)

logger = logging.getLogger(__name__)

_fallback_logged = False


def _runs_triton(device: torch.device) -> bool:
    """Compiled on CUDA tensors, interpreted on CPU tensors; anything else: the reference."""
    from hicache_prefill.kernels import TRITON_INTERPRETED

    global _fallback_logged
    if (device.type == "cuda") != TRITON_INTERPRETED and device.type in ("cuda", "cpu"):
        return True
    if not _fallback_logged:
        logger.info(
            "kvcacheio ops on %s tensors with TRITON_INTERPRET=%d: using the torch reference",
            device,
            int(TRITON_INTERPRETED),
        )
        _fallback_logged = True
    return False


# Leading dimensions K and V of one tensor side must share: slots (and layers, and pages' heads).
_SHARED_DIMS = {LAYER_FIRST: 1, PAGE_FIRST: 2, PAGE_HEAD: 4}


def _tensor_layers(call: KVCopy, side: str, layout: Layout, name: str, t: torch.Tensor) -> None:
    """The side's K tensor has ``item_size`` bytes per token and holds the layers copied."""
    if layout == LAYER_FIRST:
        checks.layer_first(name, t, call.item_size)
        return
    dim_name = f"{side}_layout_dim"
    if layout == PAGE_FIRST:
        _, n_layers = checks.page_first(name, t, call.item_size, call.layout_dim, dim_name)
    else:
        _, n_layers = checks.page_head(
            name, t, call.item_size, call.layout_dim, dim_name, call.page_size, call.head_num
        )
    if not call.how.all_layers:
        checks.layer_id_in_range(call.layer_id, n_layers)
    elif call.num_layers != n_layers:
        raise ValueError(
            f"num_layers={call.num_layers} does not match {name}: it holds {n_layers} layers"
        )


def _check_v_item_size(call: KVCopy, ends: list) -> None:
    """V's bytes per token (MHA, tensor sides): one value on every side, whole heads."""
    sizes = {
        names[1]: token_bytes(layout, refs[1])
        for _, layout, names, refs, _ in ends
        if layout != TABLE and len(refs) == 2
    }
    if len(set(sizes.values())) > 1:
        raise ValueError(f"V tensors differ in bytes per token: {sizes}")
    v_item = next(iter(sizes.values()), None)
    if v_item is not None and (v_item <= 0 or v_item % call.heads):
        raise ValueError(f"{next(iter(sizes))} holds {v_item} bytes per token, not whole heads")


def validate(call: KVCopy, block_quota: int, num_warps_per_block: int) -> tuple[KVCopy, list]:
    """Raise ``ValueError`` naming the first bad argument; else return the call and its parts."""
    parts = validate_buffers(call, block_quota, num_warps_per_block)
    check_index_ranges(call, _bounds(parts))
    return call, parts


def validate_buffers(call: KVCopy, block_quota: int, num_warps_per_block: int) -> list[Part]:
    """:func:`validate` without the index ranges; returns the parts to launch."""
    device = checks.index_pair(call.src_indices, call.dst_indices)
    checks.positive_int("item_size", call.item_size)
    checks.positive_int("block_quota", block_quota)
    checks.positive_int("num_warps_per_block", num_warps_per_block)
    resolve_num_warps(num_warps_per_block)
    if call.how.per_head:
        checks.positive_int("page_size", call.page_size)
        checks.positive_int("head_num", call.head_num)
    ends = [  # (side, layout, argument names, buffers or tables, indices)
        (side, layout, buffer_names(side, layout, len(refs)), refs, idx)
        for side, layout, refs, idx in (
            ("src", call.how.src, call.src, call.src_indices),
            ("dst", call.how.dst, call.dst, call.dst_indices),
        )
    ]
    for side, layout, *_ in ends:
        if layout in (PAGE_FIRST, PAGE_HEAD):
            checks.positive_int(f"{side}_layout_dim", call.layout_dim)
    if call.how.all_layers:
        checks.positive_int("num_layers", call.num_layers)
    for side, layout, names, refs, _ in ends:
        if layout == TABLE:
            continue
        for name, t in zip(names, refs, strict=True):
            checks.data_tensor(name, t, device)
        if len(refs) == 2:
            checks.same_slots(names[0], refs[0], names[1], refs[1], _SHARED_DIMS[layout])
        _tensor_layers(call, side, layout, names[0], refs[0])
    _check_v_item_size(call, ends)
    aligns = {}
    for _, layout, names, refs, _ in ends:
        if layout == TABLE:
            for name, table in zip(names, refs, strict=True):
                aligns[id(table)] = checks.ptr_table(name, table, call.num_layers, device)
    return [_with_table_aligns(p, aligns) for p in call.parts()]


def _bounds(parts: list[Part]) -> tuple[int, int]:
    return parts[0].src.n_slots, parts[0].dst.n_slots


def check_index_ranges(call: KVCopy, bounds: tuple[int, int], force: bool = False) -> None:
    """Every index below its side's bound, read where that is free or when ``force``."""
    for name, idx, n_slots in (
        ("src_indices", call.src_indices, bounds[0]),
        ("dst_indices", call.dst_indices, bounds[1]),
    ):
        if n_slots < NO_BOUND:
            checks.indices_in_range(name, idx, n_slots, call.op, force)


def _with_table_aligns(part: Part, aligns: dict[int, int]) -> Part:
    def side(s):  # noqa: ANN001, ANN202
        if not s.is_table:
            return s
        return dataclasses.replace(s, table_align=tuple(aligns[id(t)] for t in s.refs))

    return dataclasses.replace(part, src=side(part.src), dst=side(part.dst))


def transfer(call: KVCopy, block_quota: int, num_warps_per_block: int) -> None:
    """Validate ``call``, then queue the kernel (or run the reference). A bad argument raises
    ``ValueError`` prefixed with the op's name; a bad index, :class:`KVIndexError`."""
    try:
        device = checks.index_pair(call.src_indices, call.dst_indices)
        if not _runs_triton(device):
            parts = validate_buffers(call, block_quota, num_warps_per_block)
            check_index_ranges(call, _bounds(parts), force=True)  # the reference indexes with them
            reference.copy_kv(call)
            return
        plan = cached_plan(
            call,
            block_quota,
            num_warps_per_block,
            lambda: _plan(call, block_quota, num_warps_per_block),
        )
        check_index_ranges(call, plan.bounds)
    except KVIndexError:
        raise
    except ValueError as exc:
        raise ValueError(f"{call.op}: {exc}" if call.op else str(exc)) from None
    if call.src_indices.numel() == 0:
        return
    for part_plan in plan.launches:
        record = launch_slot(device, call.op, *part_plan.bounds)
        launch_kv_copy(launch_for(part_plan, call.src_indices, call.dst_indices, record))


def _plan(call: KVCopy, block_quota: int, num_warps_per_block: int) -> Plan:
    parts = validate_buffers(call, block_quota, num_warps_per_block)
    cache_hints = cache_hints_supported(call.src_indices.device)
    num_warps = resolve_num_warps(num_warps_per_block)
    launches = tuple(
        plan_part(
            part,
            layer_begin=call.layer_id,
            num_layers=call.num_layers,
            block_quota=block_quota,
            num_warps=num_warps,
            cache_hints=cache_hints,
        )
        for part in parts
    )
    layouts = [call.how.src] * len(call.src) + [call.how.dst] * len(call.dst)
    tables = frozenset(i for i, layout in enumerate(layouts) if layout == TABLE)
    return Plan(_bounds(parts), launches, tables)
