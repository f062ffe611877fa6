"""One Triton gather/scatter kernel for every kernel-backend KV copy (sizing: ``docs/DESIGN.md``).

A row is one (slot, head) pair moving ``CHUNK_WORDS`` raw words per layer; a block is
``[NCHUNK, ROWS, COLS]`` words. At most ``block_quota`` programs walk the tiles in a grid-stride
loop, every layer (K, then V) per tile, with 64-bit address math. A pair with a negative index is
skipped (as upstream); one past its side's slot count is skipped and recorded, never accessed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_offsets(
    idx, head, PAGE: tl.constexpr, page_stride, row_stride, head_stride, HEADS: tl.constexpr
):
    """Word offset of slot ``idx`` (int64), head ``head``, layer 0, from the side's base."""
    if PAGE == 1:
        off = idx * page_stride
    else:
        off = (idx // PAGE) * page_stride + (idx % PAGE) * row_stride
    if HEADS > 1:
        off += head * head_stride
    return off


@triton.jit
def _record_bad(err_ptr, err_slot, err_code, bad_s, bad_d, s, d):
    """Store the launch's code and the offending index in its record slot, for each side with
    an out-of-range index in this tile (plain stores: any bad row's value wins)."""
    word = err_ptr + err_slot * 4 + tl.zeros_like(s)
    code = err_code + tl.zeros_like(s)
    tl.store(word, code, mask=bad_s)
    tl.store(word + 1, code, mask=bad_d)
    tl.store(word + 2, s, mask=bad_s)
    tl.store(word + 3, d, mask=bad_d)


@triton.jit
def _row_pointers(
    ref, layer, off, layer_stride, IS_TABLE: tl.constexpr, WORD: tl.constexpr, ALIGN: tl.constexpr
):
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
def _copy_layer(
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
    SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    WORD: tl.constexpr,
    CHUNK_WORDS: tl.constexpr,
    NCHUNK: tl.constexpr,
    GROUPS: tl.constexpr,
    COLS: tl.constexpr,
    CACHE_HINTS: tl.constexpr,
):
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


# Per-call sizes and the index tensors (slices start at any multiple of 8 bytes) are not
# specialized on: each value would compile a variant. Strides are; their alignment vectorizes.
@triton.jit(
    do_not_specialize=[
        "src_idx_ptr",
        "dst_idx_ptr",
        "n_items",
        "layer_begin",
        "src_slots",
        "dst_slots",
        "err_slot",
        "err_code",
    ]
)
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
    src_page_stride,
    src_row_stride,
    src_layer_stride,
    src_head_stride,
    dst_page_stride,
    dst_row_stride,
    dst_layer_stride,
    dst_head_stride,
    src_slots,
    dst_slots,
    err_ptr,
    err_slot,
    err_code,
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    SRC_PAGE: tl.constexpr,
    DST_PAGE: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    HEADS: tl.constexpr,
    HAS_V: tl.constexpr,
    WORD: tl.constexpr,
    CHUNK_WORDS: tl.constexpr,
    ROWS: tl.constexpr,
    NCHUNK: tl.constexpr,
    GROUPS: tl.constexpr,
    COLS: tl.constexpr,
    CACHE_HINTS: tl.constexpr,
):
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``n_layers`` layers from ``layer_begin``,
    ``HEADS`` chunks of ``CHUNK_WORDS`` words per slot.

    Strides are in words of type ``WORD``; ``src_*``/``dst_*`` are word-typed data pointers, or
    int64/uint64 ``data_ptr()`` tables when ``*_TABLE``. ``*_ALIGN`` (16 or 0) says every row of
    that side starts on 16 bytes (see :func:`_row_pointers`). ``src_slots`` / ``dst_slots``
    bound each side's indices; ``err_ptr`` (int64), ``err_slot``, ``err_code``: where and what
    a launch that skips an out-of-range pair records (:mod:`kernels.triton.index_record`).
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
        live = in_range & (s >= 0) & (d >= 0)  # a negative index: skipped, as upstream
        bad_s = live & (s >= src_slots)
        bad_d = live & (d >= dst_slots)
        _record_bad(err_ptr, err_slot, err_code, bad_s, bad_d, s, d)
        ok = live & (s < src_slots) & (d < dst_slots)
        s_off = _slot_offsets(
            s.to(tl.int64), head, SRC_PAGE, src_page_stride, src_row_stride, src_head_stride, HEADS
        )
        d_off = _slot_offsets(
            d.to(tl.int64), head, DST_PAGE, dst_page_stride, dst_row_stride, dst_head_stride, HEADS
        )
        for j in range(n_layers):
            layer = (layer_begin + j).to(tl.int64)
            _copy_layer(
                src_k,
                dst_k,
                layer,
                s_off,
                d_off,
                ok,
                src_layer_stride,
                dst_layer_stride,
                SRC_TABLE,
                DST_TABLE,
                SRC_ALIGN,
                DST_ALIGN,
                WORD,
                CHUNK_WORDS,
                NCHUNK,
                GROUPS,
                COLS,
                CACHE_HINTS,
            )
            if HAS_V:
                _copy_layer(
                    src_v,
                    dst_v,
                    layer,
                    s_off,
                    d_off,
                    ok,
                    src_layer_stride,
                    dst_layer_stride,
                    SRC_TABLE,
                    DST_TABLE,
                    SRC_ALIGN,
                    DST_ALIGN,
                    WORD,
                    CHUNK_WORDS,
                    NCHUNK,
                    GROUPS,
                    COLS,
                    CACHE_HINTS,
                )
