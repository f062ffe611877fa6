"""How the kernel-backend KV copy ops address their buffers, as plain data.

Every ``transfer_kv_*`` op of the kernel backend is ``dst[dst_indices[i]] = src[src_indices[i]]``
for each layer it covers, K and V (MHA) or the one latent buffer (MLA). The ops differ only in
how each side is laid out, which an :class:`Addressing` names (one constant per SGLang op pair,
shared by the MHA and MLA twins). A call's arguments by role form a :class:`KVCopy`; the
validator and launcher (:mod:`kernels.kvcacheio`) and the torch reference
(:mod:`kernels.reference`) all read that one description.

Addressing of token slot ``t`` of layer ``l``, in bytes (``item_size`` = one token, one layer,
K or V), which a :class:`Side` records as strides:

- layer_first tensor (one layer ``[T, ...]``): ``base + t * item_size``
- page_first tensor ``[T, L, ...]``: ``base + t * layout_dim + l * item_size``
- pointer table (``data_ptr()`` per layer, SGLang's ``k_data_ptrs``): ``table[l] + t * item_size``
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

Layout = Literal["layer_first", "page_first", "table"]
LAYER_FIRST: Layout = "layer_first"
PAGE_FIRST: Layout = "page_first"
TABLE: Layout = "table"

NO_BOUND = 1 << 62
"""``n_slots`` of a table side: its extent is unknown to the kernel."""


@dataclass(frozen=True)
class Addressing:
    """The layout of each side of an op, and whether it covers all layers or one."""

    src: Layout
    dst: Layout
    all_layers: bool  # num_layers layers from 0 (pointer tables); else the one layer layer_id


LF_TO_LF = Addressing(LAYER_FIRST, LAYER_FIRST, all_layers=False)  # transfer_kv_per_layer
PF_TO_LF = Addressing(PAGE_FIRST, LAYER_FIRST, all_layers=False)  # ..._per_layer_pf_lf
TABLE_TO_TABLE = Addressing(TABLE, TABLE, all_layers=True)  # transfer_kv_all_layer
TABLE_TO_PF = Addressing(TABLE, PAGE_FIRST, all_layers=True)  # ..._all_layer_lf_pf


@dataclass(frozen=True)
class Side:
    """How one side of a copy is addressed (all sizes in bytes).

    ``refs`` holds the K (and V) data tensors, or their per-layer ``data_ptr()`` tables when
    ``is_table``. ``n_slots`` bounds the slot index (``NO_BOUND`` for tables).
    """

    refs: tuple[torch.Tensor, ...]
    is_table: bool
    token_stride: int
    layer_stride: int
    n_slots: int


@dataclass(frozen=True)
class KVCopy:
    """The arguments of one kernel-backend op call, by role.

    ``src`` / ``dst``: ``(K, V)`` (MHA) or ``(buffer,)`` (MLA), tensors or ``data_ptr()`` tables
    as ``how`` says. ``layout_dim``: bytes of one token across all layers of the page_first side.
    Layers copied: ``layer_id`` (one) for a per-layer op, ``0 .. num_layers - 1`` for an
    all-layer op; the other field keeps its default.
    """

    how: Addressing
    src: tuple[torch.Tensor, ...]
    dst: tuple[torch.Tensor, ...]
    src_indices: torch.Tensor
    dst_indices: torch.Tensor
    item_size: int
    layout_dim: int = 0
    layer_id: int = 0
    num_layers: int = 1

    def sides(self) -> tuple[Side, Side]:
        """Source and destination :class:`Side` (a tensor side is read for its slot count)."""
        return self._side(self.how.src, self.src), self._side(self.how.dst, self.dst)

    def _side(self, layout: Layout, refs: tuple[torch.Tensor, ...]) -> Side:
        if layout == TABLE:
            return Side(refs, True, self.item_size, 0, NO_BOUND)
        if layout == PAGE_FIRST:
            return Side(refs, False, self.layout_dim, self.item_size, refs[0].shape[0])
        # One layer tensor: layer stride 0, whatever layer the op copies.
        return Side(refs, False, self.item_size, 0, refs[0].shape[0])
