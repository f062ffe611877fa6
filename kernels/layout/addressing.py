"""How the kernel-backend KV copy ops address their buffers, as plain data: an :class:`Addressing`
names each side's layout, a :class:`KVCopy` a call's arguments by role; the validator, launcher
and torch reference all read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from hicache_prefill.kernels.layout.ptr_tables import table_bound

Layout = Literal["layer_first", "page_first", "page_head", "table"]
LAYER_FIRST: Layout = "layer_first"
PAGE_FIRST: Layout = "page_first"
PAGE_HEAD: Layout = "page_head"
TABLE: Layout = "table"

NO_BOUND = 1 << 62  # n_slots of a table side without a recorded bound


@dataclass(frozen=True)
class Addressing:
    src: Layout
    dst: Layout
    all_layers: bool  # num_layers layers from 0 (pointer tables); else the one layer layer_id

    @property
    def per_head(self) -> bool:
        return PAGE_HEAD in (self.src, self.dst)


LF_TO_LF = Addressing(LAYER_FIRST, LAYER_FIRST, all_layers=False)  # transfer_kv_per_layer
PF_TO_LF = Addressing(PAGE_FIRST, LAYER_FIRST, all_layers=False)  # ..._per_layer_pf_lf
LF_TO_PF = Addressing(LAYER_FIRST, PAGE_FIRST, all_layers=False)  # ..._per_layer_mla_lf_pf
PH_TO_LF = Addressing(PAGE_HEAD, LAYER_FIRST, all_layers=False)  # ..._per_layer_ph_lf
TABLE_TO_TABLE = Addressing(TABLE, TABLE, all_layers=True)  # transfer_kv_all_layer
TABLE_TO_PF = Addressing(TABLE, PAGE_FIRST, all_layers=True)  # ..._all_layer_lf_pf
TABLE_TO_PH = Addressing(TABLE, PAGE_HEAD, all_layers=True)  # ..._all_layer_lf_ph


@dataclass(frozen=True)
class Side:
    """How one side of a copy is addressed (bytes). Slot ``t`` of layer ``l``, head ``h`` starts
    at ``(t // page_size) * page_stride + (t % page_size) * row_stride + l * layer_stride
    + h * head_stride`` from the buffer base, or from ``table[l]`` when ``is_table``.
    ``refs``: the K (and V) tensors or their ``data_ptr()`` tables."""

    refs: tuple[torch.Tensor, ...]
    is_table: bool
    page_stride: int
    layer_stride: int
    n_slots: int
    page_size: int = 1
    row_stride: int = 0
    head_stride: int = 0
    table_align: tuple[int, ...] = ()  # per table: entries' known alignment in bytes (0: unknown)

    def strides(self) -> tuple[int, ...]:
        return (self.page_stride, self.row_stride, self.layer_stride, self.head_stride)


@dataclass(frozen=True)
class Part:
    """What one kernel launch copies: K and V together when they share a geometry, else each."""

    src: Side
    dst: Side
    item_size: int  # bytes of one token of one layer of this part
    heads: int  # pieces per token (head_num for the page_head ops, else 1)

    @property
    def chunk_bytes(self) -> int:
        return self.item_size // self.heads


@dataclass(frozen=True)
class KVCopy:
    """The arguments of one kernel-backend op call, by role. ``src`` / ``dst``: ``(K, V)`` or
    ``(buffer,)`` (MLA). ``item_size`` / ``layout_dim``: K's bytes per token of one layer / of
    all layers of the page_first or page_head side. ``op``: the SGLang name errors carry."""

    how: Addressing
    src: tuple[torch.Tensor, ...]
    dst: tuple[torch.Tensor, ...]
    src_indices: torch.Tensor
    dst_indices: torch.Tensor
    item_size: int
    layout_dim: int = 0
    layer_id: int = 0
    num_layers: int = 1
    page_size: int = 1
    head_num: int = 1
    op: str = ""

    @property
    def heads(self) -> int:
        return self.head_num if self.how.per_head else 1

    def parts(self) -> list[Part]:
        v_item = v_item_size(self) or self.item_size
        if len(self.src) == 1 or v_item == self.item_size:
            return [self._part(self.src, self.dst, self.item_size)]
        return [
            self._part(self.src[:1], self.dst[:1], self.item_size),
            self._part(self.src[1:], self.dst[1:], v_item),
        ]

    def _part(self, src: tuple, dst: tuple, item_size: int) -> Part:
        layout_dim = self.layout_dim * item_size // self.item_size
        return Part(
            self._side(self.how.src, src, item_size, layout_dim),
            self._side(self.how.dst, dst, item_size, layout_dim),
            item_size,
            self.heads,
        )

    def _side(self, layout: Layout, refs: tuple, item_size: int, layout_dim: int) -> Side:
        h = self.heads
        if layout == TABLE:
            return Side(refs, True, item_size, 0, tables_bound(refs), head_stride=item_size // h)
        if layout == PAGE_FIRST:
            return Side(
                refs, False, layout_dim, item_size, refs[0].shape[0], head_stride=item_size // h
            )
        if layout == PAGE_HEAD:
            p = self.page_size
            return Side(
                refs,
                False,
                p * layout_dim,
                item_size // h,
                refs[0].shape[0] * p,
                page_size=p,
                row_stride=layout_dim // h,
                head_stride=p * layout_dim // h,
            )
        # One layer tensor: layer stride 0, whatever layer the op copies.
        return Side(refs, False, item_size, 0, refs[0].shape[0], head_stride=item_size // h)


def buffer_names(side: str, layout: Layout, n_buffers: int) -> tuple[str, ...]:
    """SGLang's argument names for one side: ``src_k``, ``src_v`` or ``src``, + ``_layers`` for
    a pointer table."""
    suffix = "_layers" if layout == TABLE else ""
    return tuple(f"{side}{kv}{suffix}" for kv in (("_k", "_v") if n_buffers == 2 else ("",)))


def tables_bound(tables: tuple[torch.Tensor, ...]) -> int:
    """The smallest recorded bound of a side's tables, ``NO_BOUND`` if one has none."""
    bounds = [table_bound(t) if isinstance(t, torch.Tensor) else None for t in tables]
    return NO_BOUND if None in bounds else min(bounds)  # type: ignore[type-var]


def token_bytes(layout: Layout, t: torch.Tensor) -> int:
    """Bytes of one token of one layer of ``t``: ``[T, ...]`` (layer_first), ``[T, L, ...]``
    (page_first), ``[T / P, H, P, L, D]`` (page_head)."""
    elem = t.element_size()
    if layout == PAGE_HEAD:
        return t.shape[1] * t.shape[4] * elem
    first = 2 if layout == PAGE_FIRST else 1
    return math.prod(t.shape[first:]) * elem


def v_item_size(call: KVCopy) -> int | None:
    """V's bytes per token of one layer, from the first tensor side's V; ``None`` for MLA or
    when both sides are tables (then V is as K)."""
    for layout, refs in ((call.how.src, call.src), (call.how.dst, call.dst)):
        if layout != TABLE and len(refs) == 2:
            return token_bytes(layout, refs[1])
    return None
