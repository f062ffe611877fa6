"""One Triton gather/scatter kernel for every kernel-backend KV copy, and its launcher.

Each side of a copy (source, destination), a :class:`kernels.addressing.Side`, is addressed in
one of two ways, in bytes:

- tensor: ``base + slot * token_stride + layer * layer_stride``. A layer_first layer has
  ``token_stride = item_size`` and ``layer_stride = 0``; a page_first buffer ``[T, L, ...]`` has
  ``token_stride = layout_dim`` and ``layer_stride = item_size``.
- table: ``table[layer] + slot * token_stride``, ``table`` an int64/uint64 tensor of
  per-layer ``data_ptr()``s (SGLang's ``k_data_ptrs``).

The kernel copies raw words (the widest of 8/4/2/1 bytes that divides every size, stride and base
address), so every dtype works. Work split: the items (index pairs) are cut into tiles of ``ROWS``
items, about ``BYTES_PER_THREAD`` bytes per thread; at most ``block_quota`` programs walk the
tiles in a grid-stride loop and, for each tile, copy every layer (K, then V) as one
``[ROWS, COLS]`` block of words, so each program keeps a whole tile of bytes in flight. Address
math is in 64 bits (indices are int64, layer offsets are cast). Pairs with a negative index are
skipped (as upstream), and so are indices past the end of a tensor side: bad input never makes
the kernel touch memory past the end of a tensor it was given.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels._env import cuda_available
from kernels.addressing import Side

logger = logging.getLogger(__name__)

BYTES_PER_THREAD = 32
"""Bytes each thread holds per tile: two 16-byte vectors. A program of 32 warps thus keeps a
32 KiB tile in flight (DESIGN.md section 8: bandwidth is bytes in flight / round trip)."""
MAX_WORDS_PER_THREAD = 8
"""Cap for narrow words (odd item sizes): each word costs two 64-bit pointers in registers, and
a 1024-thread program has only 64 registers per thread."""
MAX_COLS_BYTES = 4096
"""Widest row chunk of one item per block; larger items loop over column chunks."""

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


@triton.jit
def _side_base(ref, layer, layer_stride, IS_TABLE: tl.constexpr, WORD: tl.constexpr):
    """Pointer to layer ``layer`` of one side (word-typed)."""
    if IS_TABLE:
        base = tl.load(ref + layer).to(tl.pointer_type(WORD))
    else:
        base = ref + layer * layer_stride
    return base


@triton.jit
def _copy_tile(
    src,
    dst,
    layer,
    s_off,
    d_off,
    ok,
    src_layer_stride,
    dst_layer_stride,
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    WORD: tl.constexpr,
    ITEM_WORDS: tl.constexpr,
    COLS: tl.constexpr,
    CACHE_HINTS: tl.constexpr,
):
    """Copy ``ITEM_WORDS`` words for every row of a tile where ``ok``, for one layer."""
    src_rows = _side_base(src, layer, src_layer_stride, SRC_TABLE, WORD) + s_off
    dst_rows = _side_base(dst, layer, dst_layer_stride, DST_TABLE, WORD) + d_off
    cols = tl.arange(0, COLS)
    for c0 in tl.static_range(0, ITEM_WORDS, COLS):
        c = c0 + cols
        mask = ok[:, None] & (c < ITEM_WORDS)[None, :]
        src_ptrs = src_rows[:, None] + c[None, :]
        dst_ptrs = dst_rows[:, None] + c[None, :]
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
    src_k,
    dst_k,
    src_v,
    dst_v,
    src_idx_ptr,
    dst_idx_ptr,
    n_items,
    layer_begin,
    n_layers,
    src_token_stride,
    dst_token_stride,
    src_layer_stride,
    dst_layer_stride,
    src_slots,
    dst_slots,
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    HAS_V: tl.constexpr,
    WORD: tl.constexpr,
    ITEM_WORDS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    VEC: tl.constexpr,
    CACHE_HINTS: tl.constexpr,
):
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``n_layers`` layers from ``layer_begin``.

    Strides are in words of type ``WORD``; ``src_*``/``dst_*`` are word-typed data pointers, or
    int64/uint64 ``data_ptr()`` tables when ``*_TABLE``. ``VEC`` is a divisibility hint (in
    words) for row offsets, set only when every row start is 16-byte aligned.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_items, ROWS)
    rows = tl.arange(0, ROWS)
    for tile in range(pid, n_tiles, n_programs):
        item = tile * ROWS + rows
        in_range = item < n_items
        s = tl.load(src_idx_ptr + item, mask=in_range, other=-1)
        d = tl.load(dst_idx_ptr + item, mask=in_range, other=-1)
        ok = in_range & (s >= 0) & (d >= 0) & (s < src_slots) & (d < dst_slots)
        s_off = tl.multiple_of(s.to(tl.int64) * src_token_stride, VEC)
        d_off = tl.multiple_of(d.to(tl.int64) * dst_token_stride, VEC)
        for j in range(n_layers):
            layer = (layer_begin + j).to(tl.int64)
            _copy_tile(
                src_k, dst_k, layer, s_off, d_off, ok, src_layer_stride, dst_layer_stride,
                SRC_TABLE, DST_TABLE, WORD, ITEM_WORDS, COLS, CACHE_HINTS,
            )  # fmt: skip
            if HAS_V:
                _copy_tile(
                    src_v, dst_v, layer, s_off, d_off, ok, src_layer_stride, dst_layer_stride,
                    SRC_TABLE, DST_TABLE, WORD, ITEM_WORDS, COLS, CACHE_HINTS,
                )  # fmt: skip


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _alignment(*values: int) -> int:
    """Largest power of two (up to 16) dividing every value."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return 16 if g == 0 else min(16, g & -g)


def word_bytes(item_size: int, src: Side, dst: Side) -> int:
    """Widest copy word (8/4/2/1 bytes) that the sizes, strides and tensor bases allow.

    Table entries are not read here (that would synchronize on CUDA); they must be aligned to
    the same word, which :mod:`kernels._checks` verifies where that is free or when debugging.
    """
    values = [item_size]
    for side in (src, dst):
        values += [side.token_stride, side.layer_stride]
        if not side.is_table:
            values += [t.data_ptr() for t in side.refs]
    return min(8, _alignment(*values))


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


def launch_kv_copy(
    src: Side,
    dst: Side,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    item_size: int,
    layer_begin: int,
    num_layers: int,
    block_quota: int,
    num_warps: int,
) -> None:
    """Launch :func:`kv_copy_kernel` on the current stream; never synchronizes.

    Arguments are assumed validated (see :mod:`kernels.kvcacheio`). ``src.refs`` and
    ``dst.refs`` have the same length (1 for MLA, 2 for K and V).
    """
    n_items = src_indices.numel()
    if n_items == 0 or num_layers == 0:
        return
    word = word_bytes(item_size, src, dst)
    item_words = item_size // word
    cols = min(triton.next_power_of_2(item_words), MAX_COLS_BYTES // word)
    words_per_thread = max(1, min(MAX_WORDS_PER_THREAD, BYTES_PER_THREAD // word))
    tile_words = num_warps * 32 * words_per_thread
    rows = max(1, tile_words // cols)  # independent of n_items: one compile per shape
    row_aligned = _alignment(item_size, src.token_stride, dst.token_stride) == 16
    vec = 16 // word if row_aligned else 1
    n_tiles = triton.cdiv(n_items, rows)
    grid = (min(block_quota, n_tiles),)

    def arg(side: Side, i: int) -> torch.Tensor:
        t = side.refs[min(i, len(side.refs) - 1)]  # MLA: the V slot repeats K, unused
        return t if side.is_table else _word_view(t, word)

    args = (
        arg(src, 0), arg(dst, 0), arg(src, 1), arg(dst, 1),
        src_indices, dst_indices,
        n_items, layer_begin, num_layers,
        src.token_stride // word, dst.token_stride // word,
        src.layer_stride // word, dst.layer_stride // word,
        src.n_slots, dst.n_slots,
    )  # fmt: skip
    device = src_indices.device
    constexprs = dict(
        SRC_TABLE=src.is_table, DST_TABLE=dst.is_table, HAS_V=len(src.refs) == 2,
        WORD=_TL_WORDS[word], ITEM_WORDS=item_words, ROWS=rows, COLS=cols, VEC=vec,
        CACHE_HINTS=cache_hints_supported(device),
    )  # fmt: skip
    # Launch on the indices' device (and its current stream), whatever the current device is.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kv_copy_kernel[grid](*args, **constexprs, num_warps=num_warps)


def resolve_num_warps(num_warps_per_block: int) -> int:
    """``num_warps_per_block`` as Triton accepts it: a power of two, at most 32 (16 on HIP)."""
    cap = 16 if torch.version.hip is not None else 32
    warps = min(cap, _pow2_floor(num_warps_per_block))
    if warps != num_warps_per_block:
        logger.debug("num_warps_per_block=%d runs as %d warps", num_warps_per_block, warps)
    return warps


__all__: Sequence[str] = [
    "Side",
    "cache_hints_supported",
    "kv_copy_kernel",
    "launch_kv_copy",
    "resolve_num_warps",
    "word_bytes",
]
