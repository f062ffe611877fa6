"""How ``kv_copy_kernel`` is launched for one :class:`Part`: copy word, 16-byte alignment hints,
tile shape, grid and stream. :func:`plan_part` computes what does not depend on the indices
(cached by :mod:`kernels.ops.plans`); :func:`launch_for` adds the indices per call.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hicache_prefill.kernels._env import cuda_available, version_tuple
from hicache_prefill.kernels.layout.addressing import Part, Side
from hicache_prefill.kernels.layout.ptr_tables import alignment, verified_alignment
from hicache_prefill.kernels.triton.copy_kernel import kv_copy_kernel
from hicache_prefill.kernels.triton.index_record import LaunchSlot, launch_slot

logger = logging.getLogger(__name__)

VECTOR_BYTES = 16  # widest access one thread makes (ld.global.v2.b64)
VECTORS_PER_THREAD = 8  # loads each thread keeps in flight per tile

# Rows a thread spans per tile (sm_90, tests/kernels/ptx_variants.py): 4 spills; 2 does not with
# Triton 3.7+, but Triton 3.6 keeps a predicate per vector and spills, so it gets 1.
MAX_ROWS_PER_THREAD = 2 if version_tuple(triton.__version__) >= (3, 7) else 1

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


def _table_alignment(side: Side, assumed: int) -> int:
    """Smallest known alignment of ``side``'s tables; an unknown one counts as ``assumed``."""
    known = side.table_align or tuple(verified_alignment(t) for t in side.refs)
    return min(a or assumed for a in known)


@dataclass(frozen=True)
class Geometry:
    """Word size, hints and tile shape of one part's launch (all constexprs)."""

    word: int
    src_align: int  # 16: every source row starts on 16 bytes (the kernel's hint); else 0
    dst_align: int
    chunk_words: int
    cols: int
    nchunk: int  # column chunks per block
    groups: int  # blocks per row (a static loop; loads of one block are in flight at a time)
    rows: int

    @property
    def block_bytes(self) -> int:
        """Bytes one block copies: the loads a program keeps in flight."""
        return self.rows * min(self.chunk_words, self.nchunk * self.cols) * self.word


def plan_geometry(part: Part, num_warps: int) -> Geometry:
    chunk = part.chunk_bytes
    sizes = [chunk]
    for side in (part.src, part.dst):
        sizes += side.strides()
        if not side.is_table:
            sizes += [t.data_ptr() for t in side.refs]
    size_align = alignment(*sizes)
    aligns = {}
    for name, side in (("src", part.src), ("dst", part.dst)):
        # An unverified table is assumed aligned to the sizes (the ops' contract), hint-free.
        aligns[name] = _table_alignment(side, min(8, size_align)) if side.is_table else 16
    word = min(8, size_align, aligns["src"], aligns["dst"])
    vec = VECTOR_BYTES // word if size_align == VECTOR_BYTES else 1
    chunk_words = chunk // word
    cols = min(triton.next_power_of_2(chunk_words), 32 * vec)  # at most one warp of vectors
    chunks = triton.cdiv(chunk_words, cols)
    nchunk = min(triton.next_power_of_2(chunks), VECTORS_PER_THREAD)
    groups = triton.cdiv(chunks, nchunk)
    rows_per_warp = 32 * vec // cols  # rows one warp covers per repetition
    reps = max(1, min(MAX_ROWS_PER_THREAD, VECTORS_PER_THREAD // nchunk))
    rows = num_warps * rows_per_warp * reps
    # A side's rows start on 16 bytes when the sizes, strides and tensor bases allow it and, for
    # a table, its entries were verified so (an assumed alignment is at most 8): the hint.
    src_hint = VECTOR_BYTES if vec > 1 and aligns["src"] >= VECTOR_BYTES else 0
    dst_hint = VECTOR_BYTES if vec > 1 and aligns["dst"] >= VECTOR_BYTES else 0
    return Geometry(word, src_hint, dst_hint, chunk_words, cols, nchunk, groups, rows)


def _word_view(t: torch.Tensor, word: int) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).view(_WORD_DTYPES[word])


def cache_hints_supported(device: torch.device) -> bool:
    """PTX cache modifiers apply to compiled NVIDIA kernels only (not the interpreter, not HIP)."""
    from hicache_prefill.kernels import TRITON_INTERPRETED

    return (
        device.type == "cuda"
        and not TRITON_INTERPRETED
        and torch.version.hip is None
        and cuda_available()
    )


class Launch(NamedTuple):
    """Everything ``kv_copy_kernel`` is launched with."""

    grid: tuple[int]
    args: tuple
    constexprs: dict
    num_warps: int
    geometry: Geometry
    device: torch.device  # the indices'


@dataclass(frozen=True)
class PartPlan:
    """One part's launch whatever its indices. ``refs``: the four buffer arguments (word views or
    tables); ``shape_args``: layer range, strides in words, the two sides' slot bounds."""

    geometry: Geometry
    refs: tuple
    shape_args: tuple
    constexprs: dict
    num_warps: int
    heads: int
    block_quota: int
    bounds: tuple[int, int]  # (src_slots, dst_slots)


def plan_part(
    part: Part,
    *,
    layer_begin: int,
    num_layers: int,
    block_quota: int,
    num_warps: int,
    cache_hints: bool,
) -> PartPlan:
    """Everything of one validated part's launch that does not depend on the indices."""
    g = plan_geometry(part, num_warps)
    src, dst = part.src, part.dst

    def arg(side: Side, i: int) -> torch.Tensor:
        t = side.refs[min(i, len(side.refs) - 1)]  # one buffer: the V slot repeats K, unused
        return t if side.is_table else _word_view(t, g.word)

    refs = (arg(src, 0), arg(dst, 0), arg(src, 1), arg(dst, 1))
    shape_args = (
        layer_begin,
        num_layers,
        *(s // g.word for s in src.strides()),
        *(s // g.word for s in dst.strides()),
        src.n_slots,
        dst.n_slots,
    )
    constexprs = dict(
        SRC_TABLE=src.is_table,
        DST_TABLE=dst.is_table,
        SRC_PAGE=src.page_size,
        DST_PAGE=dst.page_size,
        SRC_ALIGN=g.src_align,
        DST_ALIGN=g.dst_align,
        HEADS=part.heads,
        HAS_V=len(src.refs) == 2,
        WORD=_TL_WORDS[g.word],
        CHUNK_WORDS=g.chunk_words,
        ROWS=g.rows,
        NCHUNK=g.nchunk,
        GROUPS=g.groups,
        COLS=g.cols,
        CACHE_HINTS=cache_hints,
    )
    return PartPlan(
        g,
        refs,
        shape_args,
        constexprs,
        num_warps,
        part.heads,
        block_quota,
        (src.n_slots, dst.n_slots),
    )


def launch_for(
    plan: PartPlan, src_indices: torch.Tensor, dst_indices: torch.Tensor, record: LaunchSlot
) -> Launch:
    n_items = src_indices.numel()
    n_tiles = -(-n_items * plan.heads // plan.geometry.rows)  # (triton.cdiv: a slow JIT call)
    args = (
        *plan.refs,
        src_indices,
        dst_indices,
        n_items,
        *plan.shape_args,
        record.buffer,
        record.slot,
        record.code,
    )
    grid = (max(1, min(plan.block_quota, n_tiles)),)
    return Launch(grid, args, plan.constexprs, plan.num_warps, plan.geometry, src_indices.device)


def plan_launch(
    part: Part,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer_begin: int,
    num_layers: int,
    block_quota: int,
    num_warps: int,
    cache_hints: bool,
    record: LaunchSlot | None = None,
    op: str = "",
) -> Launch:
    """:func:`plan_part` then :func:`launch_for`; ``record`` defaults to ``launch_slot``'s."""
    plan = plan_part(
        part,
        layer_begin=layer_begin,
        num_layers=num_layers,
        block_quota=block_quota,
        num_warps=num_warps,
        cache_hints=cache_hints,
    )
    if record is None:
        record = launch_slot(src_indices.device, op, *plan.bounds)
    return launch_for(plan, src_indices, dst_indices, record)


def launch_kv_copy(launch: Launch) -> None:
    """Launch on the indices' device and its current stream; never synchronizes."""
    device = launch.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kv_copy_kernel[launch.grid](*launch.args, **launch.constexprs, num_warps=launch.num_warps)


def resolve_num_warps(num_warps_per_block: int) -> int:
    """``num_warps_per_block`` capped at 32 (16 on HIP); ``ValueError`` unless a power of two."""
    cap = 16 if torch.version.hip is not None else 32
    warps = min(cap, num_warps_per_block)
    if warps & (warps - 1):
        raise ValueError(f"num_warps_per_block={num_warps_per_block} is not a power of two")
    if warps != num_warps_per_block:
        logger.debug("num_warps_per_block=%d runs as %d warps", num_warps_per_block, warps)
    return warps
