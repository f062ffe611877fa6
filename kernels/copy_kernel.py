"""One Triton gather/scatter kernel for every kernel-backend KV copy, and its launcher.

Each side of a copy (a :class:`kernels.addressing.Side`) is a tensor or a table of per-layer
``data_ptr()``s; slot ``t``, layer ``l``, head ``h`` lies at ``(t // P) * page_stride +
(t % P) * row_stride + l * layer_stride + h * head_stride`` bytes from the base (``table[l]`` for
a table, whose layer stride is 0). A row is one (slot, head) pair; it moves ``chunk`` bytes per
layer (the whole item, or one head of it for the page_head ops).

Words: the kernel moves raw words, the widest of 8/4/2/1 bytes dividing every size, stride, tensor
base and (verified) table entry, so every dtype works. When all of those are multiples of 16
bytes, offsets carry a 16-byte divisibility hint (and so do table entries whose alignment was
verified when the table was built, see :mod:`kernels.ptr_tables`), and the compiled loads and
stores are 16 bytes wide on both sides (checked ahead of time for sm_90 by
``tests/test_kernels_ptx.py``).

Work split: a tile is ``[NCHUNK, ROWS, COLS]`` words, ``ROWS`` rows of ``NCHUNK * COLS`` words
(``COLS`` at most one warp of 16-byte vectors, 512 bytes). Triton spreads a warp's lanes along
``COLS`` and the warps along ``ROWS``, so each thread holds ``NCHUNK`` vectors of ONE row (one
address register per row per side, the chunks at immediate offsets) times a couple of rows. At most
``block_quota`` programs walk the tiles in a grid-stride loop and copy, per tile, every layer (K,
then V): each program keeps one whole tile of loads in flight. Address math is 64-bit. Pairs with
a negative index are skipped (as upstream), and so are indices past the end of a tensor side.

Bytes in flight (DESIGN.md section 8: bandwidth = bytes in flight / round trip): PCIe Gen5 moves
about 50 GB/s one way with a 1-2 us round trip, so a copy needs 50 GB/s x 2 us = 100 KB, say
64-128 KiB, of loads outstanding, with margin for the slower host-memory reads of a load-back. At
the defaults (2 programs of 32 warps, SGLang's) a thread holds 8 vectors of 16 bytes (32 data
registers of the 64 a 1024-thread program may use), so a 2 KiB-item tile is 64 rows x 2 KiB =
128 KiB per program and 256 KiB in flight for the grid, while only 2 SMs are taken from the
forward pass. ``block_quota`` stays an upper bound on programs, as upstream.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._env import cuda_available
from kernels.addressing import Part, Side

logger = logging.getLogger(__name__)

VECTOR_BYTES = 16
"""Widest access one thread makes (``ld.global.v2.b64``)."""
VECTORS_PER_THREAD = 8
"""Loads (16-byte vectors, or single narrow words) each thread keeps in flight per tile."""
MAX_ROWS_PER_THREAD = 2
"""Rows a thread spans per tile: each costs a 64-bit offset per side in registers. At 4, the
576-byte tiles (two 512-byte chunks, the second mostly masked) spill at 1024 threads (measured
with ``tests/ptx_variants.py``); at 2 no variant spills."""

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


@triton.jit
def _slot_offsets(idx, head, PAGE: tl.constexpr, page_stride, row_stride, head_stride,
                  HEADS: tl.constexpr):  # fmt: skip
    """Word offset of slot ``idx`` (int64), head ``head``, layer 0, from the side's base."""
    if PAGE == 1:
        off = idx * page_stride
    else:
        off = (idx // PAGE) * page_stride + (idx % PAGE) * row_stride
    if HEADS > 1:
        off += head * head_stride
    return off


@triton.jit
def _row_pointers(ref, layer, off, layer_stride, IS_TABLE: tl.constexpr, WORD: tl.constexpr,
                  ALIGN: tl.constexpr):  # fmt: skip
    """Word pointers to the rows at word offsets ``off`` of layer ``layer`` of one side.

    ``ALIGN``: 16 when every row starts on 16 bytes (offsets and the base, which for a table
    means its entries were verified): the hint that lets the accesses be 16 bytes wide. It goes
    on the row pointers themselves (a hint on an integer does not survive the int-to-pointer
    cast of a table entry, nor every rewrite of the offset arithmetic).
    """
    if IS_TABLE:
        rows = tl.load(ref + layer).to(tl.pointer_type(WORD)) + off
    else:
        rows = ref + (off + layer * layer_stride)
    if ALIGN > 1:
        rows = tl.multiple_of(rows, ALIGN)
    return rows


@triton.jit
def _copy_layer(src, dst, layer, s_off, d_off, ok, src_layer_stride, dst_layer_stride,
                SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, SRC_ALIGN: tl.constexpr,
                DST_ALIGN: tl.constexpr, WORD: tl.constexpr, CHUNK_WORDS: tl.constexpr,
                NCHUNK: tl.constexpr, GROUPS: tl.constexpr, COLS: tl.constexpr,
                CACHE_HINTS: tl.constexpr):  # fmt: skip
    """Copy ``CHUNK_WORDS`` words of every row where ``ok``, for one layer of one buffer, as
    ``GROUPS`` blocks of ``[NCHUNK, ROWS, COLS]`` words."""
    src_rows = _row_pointers(src, layer, s_off, src_layer_stride, SRC_TABLE, WORD, SRC_ALIGN)
    dst_rows = _row_pointers(dst, layer, d_off, dst_layer_stride, DST_TABLE, WORD, DST_ALIGN)
    block = tl.arange(0, NCHUNK)[:, None, None] * COLS + tl.arange(0, COLS)[None, None, :]
    for g in tl.static_range(GROUPS):
        col = block + g * NCHUNK * COLS
        if GROUPS * NCHUNK * COLS == CHUNK_WORDS:
            mask = ok[None, :, None] & (col >= 0)
        else:
            mask = ok[None, :, None] & (col < CHUNK_WORDS)
        src_ptrs = src_rows[None, :, None] + col
        dst_ptrs = dst_rows[None, :, None] + col
        if CACHE_HINTS:
            # Streamed once: cache in L2 only (.cg). ptxas rejects .cg combined with an
            # .evict_first eviction policy, so none is given.
            x = tl.load(src_ptrs, mask=mask, cache_modifier=".cg")
            tl.store(dst_ptrs, x, mask=mask, cache_modifier=".cg")
        else:
            x = tl.load(src_ptrs, mask=mask)
            tl.store(dst_ptrs, x, mask=mask)


# Per-call sizes are not specialized on (value 1, multiple of 16): that would compile a new
# variant per call shape; strides stay specialized, their alignment feeds vectorization.
@triton.jit(do_not_specialize=["n_items", "layer_begin", "src_slots", "dst_slots"])
def kv_copy_kernel(
    src_k, dst_k, src_v, dst_v, src_idx_ptr, dst_idx_ptr,
    n_items, layer_begin, n_layers,
    src_page_stride, src_row_stride, src_layer_stride, src_head_stride,
    dst_page_stride, dst_row_stride, dst_layer_stride, dst_head_stride,
    src_slots, dst_slots,
    SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr,
    SRC_PAGE: tl.constexpr, DST_PAGE: tl.constexpr,
    SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr,
    HEADS: tl.constexpr, HAS_V: tl.constexpr, WORD: tl.constexpr, CHUNK_WORDS: tl.constexpr,
    ROWS: tl.constexpr, NCHUNK: tl.constexpr, GROUPS: tl.constexpr, COLS: tl.constexpr,
    CACHE_HINTS: tl.constexpr,
):  # fmt: skip
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``n_layers`` layers from ``layer_begin``,
    ``HEADS`` chunks of ``CHUNK_WORDS`` words per slot.

    Strides are in words of type ``WORD``; ``src_*``/``dst_*`` are word-typed data pointers, or
    int64/uint64 ``data_ptr()`` tables when ``*_TABLE``. ``*_ALIGN`` (16 or 0) says every row of
    that side starts on 16 bytes (see :func:`_row_pointers`).
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_items * HEADS, ROWS)
    rows = tl.arange(0, ROWS).to(tl.int64)  # 64-bit row numbers: ``n_items * HEADS`` may be big
    for tile in range(pid, n_tiles, n_programs):
        row = tile * ROWS + rows
        if HEADS == 1:
            item = row
            head = row  # unused
        else:
            item = row // HEADS
            head = row % HEADS
        in_range = item < n_items
        s = tl.load(src_idx_ptr + item, mask=in_range, other=-1)
        d = tl.load(dst_idx_ptr + item, mask=in_range, other=-1)
        ok = in_range & (s >= 0) & (d >= 0) & (s < src_slots) & (d < dst_slots)
        s_off = _slot_offsets(s.to(tl.int64), head, SRC_PAGE, src_page_stride, src_row_stride,
                              src_head_stride, HEADS)  # fmt: skip
        d_off = _slot_offsets(d.to(tl.int64), head, DST_PAGE, dst_page_stride, dst_row_stride,
                              dst_head_stride, HEADS)  # fmt: skip
        for j in range(n_layers):
            layer = (layer_begin + j).to(tl.int64)
            _copy_layer(
                src_k, dst_k, layer, s_off, d_off, ok, src_layer_stride, dst_layer_stride,
                SRC_TABLE, DST_TABLE, SRC_ALIGN, DST_ALIGN, WORD, CHUNK_WORDS, NCHUNK, GROUPS,
                COLS, CACHE_HINTS,
            )  # fmt: skip
            if HAS_V:
                _copy_layer(
                    src_v, dst_v, layer, s_off, d_off, ok, src_layer_stride, dst_layer_stride,
                    SRC_TABLE, DST_TABLE, SRC_ALIGN, DST_ALIGN, WORD, CHUNK_WORDS, NCHUNK, GROUPS,
                    COLS, CACHE_HINTS,
                )  # fmt: skip


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _alignment(*values: int) -> int:
    """Largest power of two (up to 16) dividing every value."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return 16 if g == 0 else min(16, g & -g)


def _table_alignment(side: Side, assumed: int) -> int:
    """Smallest known alignment of ``side``'s tables (from validation, else verified when the
    table was built); a table of unknown alignment counts as ``assumed``."""
    from kernels.ptr_tables import verified_alignment

    known = side.table_align or tuple(verified_alignment(t) for t in side.refs)
    return min(a or assumed for a in known)


@dataclass(frozen=True)
class Geometry:
    """How one :class:`Part` is launched: word size, hints and tile shape (all constexprs)."""

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
        """Bytes of one block actually copied: the loads a program keeps in flight."""
        return self.rows * min(self.chunk_words, self.nchunk * self.cols) * self.word


def plan_geometry(part: Part, num_warps: int) -> Geometry:
    """Word, hints and tile shape for ``part`` at ``num_warps`` warps per program."""
    chunk = part.chunk_bytes
    sizes = [chunk]
    for side in (part.src, part.dst):
        sizes += side.strides()
        if not side.is_table:
            sizes += [t.data_ptr() for t in side.refs]
    size_align = _alignment(*sizes)
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
    """1-D view of contiguous ``t``'s bytes as words of ``word`` bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).view(_WORD_DTYPES[word])


def cache_hints_supported(device: torch.device) -> bool:
    """PTX cache modifiers apply to compiled NVIDIA kernels only (not the interpreter, not HIP)."""
    from kernels import TRITON_INTERPRETED

    return (
        device.type == "cuda"
        and not TRITON_INTERPRETED
        and torch.version.hip is None
        and cuda_available()
    )


@dataclass(frozen=True)
class Launch:
    """Everything :func:`kv_copy_kernel` is launched with (also compiled ahead of time by the
    PTX test)."""

    grid: tuple[int]
    args: tuple
    constexprs: dict
    num_warps: int
    geometry: Geometry


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
) -> Launch:
    """The launch of one part (arguments assumed validated, see :mod:`kernels.kvcacheio`)."""
    g = plan_geometry(part, num_warps)
    src, dst = part.src, part.dst
    n_items = src_indices.numel()
    n_tiles = triton.cdiv(n_items * part.heads, g.rows)

    def arg(side: Side, i: int) -> torch.Tensor:
        t = side.refs[min(i, len(side.refs) - 1)]  # one buffer: the V slot repeats K, unused
        return t if side.is_table else _word_view(t, g.word)

    args = (
        arg(src, 0), arg(dst, 0), arg(src, 1), arg(dst, 1),
        src_indices, dst_indices,
        n_items, layer_begin, num_layers,
        *(s // g.word for s in src.strides()),
        *(s // g.word for s in dst.strides()),
        src.n_slots, dst.n_slots,
    )  # fmt: skip
    constexprs = dict(
        SRC_TABLE=src.is_table, DST_TABLE=dst.is_table,
        SRC_PAGE=src.page_size, DST_PAGE=dst.page_size,
        SRC_ALIGN=g.src_align, DST_ALIGN=g.dst_align,
        HEADS=part.heads, HAS_V=len(src.refs) == 2, WORD=_TL_WORDS[g.word],
        CHUNK_WORDS=g.chunk_words, ROWS=g.rows, NCHUNK=g.nchunk, GROUPS=g.groups, COLS=g.cols,
        CACHE_HINTS=cache_hints,
    )  # fmt: skip
    return Launch((max(1, min(block_quota, n_tiles)),), args, constexprs, num_warps, g)


def launch_kv_copy(
    part: Part,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer_begin: int,
    num_layers: int,
    block_quota: int,
    num_warps: int,
) -> None:
    """Launch :func:`kv_copy_kernel` for one part on the current stream; never synchronizes."""
    if src_indices.numel() == 0 or num_layers == 0:
        return
    device = src_indices.device
    launch = plan_launch(
        part, src_indices, dst_indices, layer_begin=layer_begin, num_layers=num_layers,
        block_quota=block_quota, num_warps=num_warps, cache_hints=cache_hints_supported(device),
    )  # fmt: skip
    # Launch on the indices' device (and its current stream), whatever the current device is.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kv_copy_kernel[launch.grid](*launch.args, **launch.constexprs, num_warps=num_warps)


def resolve_num_warps(num_warps_per_block: int) -> int:
    """``num_warps_per_block`` as Triton accepts it: a power of two, at most 32 (16 on HIP)."""
    cap = 16 if torch.version.hip is not None else 32
    warps = min(cap, _pow2_floor(num_warps_per_block))
    if warps != num_warps_per_block:
        logger.debug("num_warps_per_block=%d runs as %d warps", num_warps_per_block, warps)
    return warps


__all__: Sequence[str] = [
    "Geometry",
    "Launch",
    "Side",
    "cache_hints_supported",
    "kv_copy_kernel",
    "launch_kv_copy",
    "plan_geometry",
    "plan_launch",
    "resolve_num_warps",
]
