"""An independent oracle of every op of ``kernels.KVCACHEIO_OPS``: one hand-written torch copy per
layout, written from the ops' documented meaning (SGLang's ``sgl_kernel.kvcacheio``), pair by pair
and slot by slot, with tensor indexing only.

It imports nothing of ``kernels`` (not the addressing description, not the torch reference, not
the validators), so a wrong stride or offset in the shared addressing code cannot pass both the
kernels and their check. Buffers are indexed by their shapes:

- layer_first: one layer ``[T, H, D]`` (MLA ``[T, 1, C]``): slot ``t`` is ``x[t]``;
- page_first: ``[T, L, H, D]``: slot ``t`` of layer ``l`` is ``x[t, l]``;
- page_head: ``[T / P, H, P, L, D]``: head ``h`` of slot ``t``, layer ``l`` is
  ``x[t // P, h, t % P, l]``; on the layer_first side it is head ``h`` of ``x[t]``;
- page_first_direct: ``[T / P, L, P, H, D]``: slot ``t`` of layer ``l`` is ``x[t // P, l, t % P]``;
- pointer tables: each entry is the ``data_ptr()`` of one layer ``[T, H, D]``; the oracle is told
  which tensors those are (``Oracle(layers)``) and finds each entry's tensor by its address.

Bytes are copied as bytes (``uint8`` views), so any dtype and NaN payload compares exactly. A pair
with a negative index is skipped by the kernel-backend ops (as upstream); the direct ops are only
called with valid pairs here. Slow (a Python loop per pair): for small test worlds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Oracle"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dimension in bytes (a view; ``t`` must be contiguous)."""
    assert t.is_contiguous(), "the oracle indexes contiguous buffers"
    return t.view(torch.uint8)


def _pairs(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> list[tuple[int, int]]:
    """The (src, dst) pairs the kernel-backend ops copy: both indices non-negative."""
    s, d = src_indices.tolist(), dst_indices.tolist()
    assert len(s) == len(d)
    return [(a, b) for a, b in zip(s, d, strict=True) if a >= 0 and b >= 0]


class Oracle:
    """The ops, by name and argument order as upstream's. ``layers``: every per-layer tensor a
    pointer table given to an all-layer op may point at."""

    def __init__(self, layers: Sequence[torch.Tensor] = ()) -> None:
        self._by_address = {t.data_ptr(): t for t in layers}

    def _layer(self, table: torch.Tensor, layer: int) -> torch.Tensor:
        address = table.cpu().view(torch.int64)[layer].item() & ((1 << 64) - 1)
        return self._by_address[address]

    # --- layer_first <-> layer_first ------------------------------------------------------
    @staticmethod
    def _lf_lf(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        sb, db = _bytes(src), _bytes(dst)
        for s, d in pairs:
            db[d].copy_(sb[s])

    def transfer_kv_per_layer(self, src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
                              item_size, block_quota=2,
                              num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        self._lf_lf(src_k, dst_k, pairs)
        self._lf_lf(src_v, dst_v, pairs)

    def transfer_kv_per_layer_mla(self, src, dst, src_indices, dst_indices, item_size,
                                  block_quota=2, num_warps_per_block=32) -> None:  # fmt: skip
        self._lf_lf(src, dst, _pairs(src_indices, dst_indices))

    def transfer_kv_all_layer(self, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers,
                              src_indices, dst_indices, item_size, num_layers, block_quota=2,
                              num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        for layer in range(num_layers):
            for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
                self._lf_lf(self._layer(src, layer), self._layer(dst, layer), pairs)

    def transfer_kv_all_layer_mla(self, src_layers, dst_layers, src_indices, dst_indices,
                                  item_size, num_layers, block_quota=2,
                                  num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        for layer in range(num_layers):
            self._lf_lf(self._layer(src_layers, layer), self._layer(dst_layers, layer), pairs)

    # --- page_first <-> layer_first -------------------------------------------------------
    @staticmethod
    def _pf_to_lf(pf: torch.Tensor, lf: torch.Tensor, layer: int, pairs) -> None:  # noqa: ANN001
        pb, lb = _bytes(pf), _bytes(lf)
        for s, d in pairs:
            lb[d].copy_(pb[s, layer])

    @staticmethod
    def _lf_to_pf(lf: torch.Tensor, pf: torch.Tensor, layer: int, pairs) -> None:  # noqa: ANN001
        lb, pb = _bytes(lf), _bytes(pf)
        for s, d in pairs:
            pb[d, layer].copy_(lb[s])

    def transfer_kv_per_layer_pf_lf(self, src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
                                    layer_id, item_size, src_layout_dim, block_quota=2,
                                    num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        self._pf_to_lf(src_k, dst_k, layer_id, pairs)
        self._pf_to_lf(src_v, dst_v, layer_id, pairs)

    def transfer_kv_per_layer_mla_pf_lf(self, src, dst, src_indices, dst_indices, layer_id,
                                        item_size, src_layout_dim, block_quota=2,
                                        num_warps_per_block=32) -> None:  # fmt: skip
        self._pf_to_lf(src, dst, layer_id, _pairs(src_indices, dst_indices))

    def transfer_kv_per_layer_mla_lf_pf(self, src, dst, src_indices, dst_indices, layer_id,
                                        item_size, dst_layout_dim, block_quota=2,
                                        num_warps_per_block=32) -> None:  # fmt: skip
        self._lf_to_pf(src, dst, layer_id, _pairs(src_indices, dst_indices))

    def transfer_kv_all_layer_lf_pf(self, src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                    dst_indices, item_size, dst_layout_dim, num_layers,
                                    block_quota=2, num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        for layer in range(num_layers):
            self._lf_to_pf(self._layer(src_k_layers, layer), dst_k, layer, pairs)
            self._lf_to_pf(self._layer(src_v_layers, layer), dst_v, layer, pairs)

    def transfer_kv_all_layer_mla_lf_pf(self, src_layers, dst, src_indices, dst_indices,
                                        item_size, dst_layout_dim, num_layers, block_quota=2,
                                        num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        for layer in range(num_layers):
            self._lf_to_pf(self._layer(src_layers, layer), dst, layer, pairs)

    # --- page_head <-> layer_first --------------------------------------------------------
    @staticmethod
    def _ph_slot(ph: torch.Tensor, t: int, head: int, layer: int) -> torch.Tensor:
        page_size = ph.shape[2]
        return _bytes(ph)[t // page_size, head, t % page_size, layer]

    @staticmethod
    def _lf_head(lf: torch.Tensor, t: int, head: int, head_num: int) -> torch.Tensor:
        return _bytes(lf)[t].reshape(head_num, -1)[head]

    def transfer_kv_per_layer_ph_lf(self, src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
                                    layer_id, item_size, src_layout_dim, page_size, head_num,
                                    block_quota=2, num_warps_per_block=32) -> None:  # fmt: skip
        for ph, lf in ((src_k, dst_k), (src_v, dst_v)):
            assert ph.shape[1] == head_num and ph.shape[2] == page_size
            for s, d in _pairs(src_indices, dst_indices):
                for h in range(head_num):
                    self._lf_head(lf, d, h, head_num).copy_(self._ph_slot(ph, s, h, layer_id))

    def transfer_kv_all_layer_lf_ph(self, src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                    dst_indices, item_size, dst_layout_dim, num_layers, page_size,
                                    head_num, block_quota=2,
                                    num_warps_per_block=32) -> None:  # fmt: skip
        pairs = _pairs(src_indices, dst_indices)
        for layer in range(num_layers):
            for table, ph in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
                lf = self._layer(table, layer)
                for s, d in pairs:
                    for h in range(head_num):
                        self._ph_slot(ph, d, h, layer).copy_(self._lf_head(lf, s, h, head_num))

    # --- direct ops -----------------------------------------------------------------------
    def transfer_kv_direct(self, src_layers, dst_layers, src_indices, dst_indices,
                           page_size) -> None:  # fmt: skip
        pairs = list(zip(src_indices.tolist(), dst_indices.tolist(), strict=True))
        for src, dst in zip(src_layers, dst_layers, strict=True):
            self._lf_lf(src, dst, pairs)

    @staticmethod
    def _pfd_slot(pfd: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        page_size = pfd.shape[2]
        return _bytes(pfd)[t // page_size, layer, t % page_size]

    def transfer_kv_per_layer_direct_pf_lf(self, src_ptrs, dst_ptrs, src_indices, dst_indices,
                                           layer_id, page_size) -> None:  # fmt: skip
        per_buffer = len(dst_ptrs) // len(src_ptrs)
        pairs = list(zip(src_indices.tolist(), dst_indices.tolist(), strict=True))
        for kv, pfd in enumerate(src_ptrs):
            for j in range(per_buffer):
                lb = _bytes(dst_ptrs[kv * per_buffer + j])
                for s, d in pairs:
                    lb[d].copy_(self._pfd_slot(pfd, s, layer_id + j))

    def transfer_kv_all_layer_direct_lf_pf(self, src_ptrs, dst_ptrs, src_indices, dst_indices,
                                           page_size) -> None:  # fmt: skip
        per_buffer = len(src_ptrs) // len(dst_ptrs)
        pairs = list(zip(src_indices.tolist(), dst_indices.tolist(), strict=True))
        for kv, pfd in enumerate(dst_ptrs):
            for layer in range(per_buffer):
                lb = _bytes(src_ptrs[kv * per_buffer + layer])
                for s, d in pairs:
                    self._pfd_slot(pfd, d, layer).copy_(lb[s])

    def transfer_embedding_ranges_direct(self, src, dst, src_starts, dst_starts,
                                         lengths) -> None:  # fmt: skip
        for s0, d0, n in zip(src_starts, dst_starts, lengths, strict=True):
            for i in range(n):
                _bytes(dst)[d0 + i].copy_(_bytes(src)[s0 + i])

    # --- addresses ------------------------------------------------------------------------
    @staticmethod
    def get_device_accessible_ptr(tensor: torch.Tensor, device_index: int) -> int:
        """With unified addressing a pinned host tensor's device address is its host address;
        a device tensor's is its own (the only platforms the kernels support)."""
        return tensor.data_ptr()
