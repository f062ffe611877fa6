"""Plain torch reference of every ``sgl_kernel.kvcacheio`` op this package provides.

Same names, argument order and meaning as SGLang (docs/DESIGN.md section 4). Each op is
``dst[dst_indices[i]] = src[src_indices[i]]`` in that op's byte addressing, for every layer it
covers, K and V (or the single MLA buffer). Pairs where either index is negative are skipped, as
the CUDA kernels upstream skip them.

These functions exist to define the semantics (tests compare the Triton kernels with them bit for
bit) and to serve as a slow fallback. They favour clarity over speed, may synchronize (pointer
tables are resolved on the host), and raise ``IndexError`` from torch on out-of-range indices;
they do not do the argument validation of the real ops.

The kernel-backend ops are one function, :func:`copy_kv`, over the addressing that
:mod:`kernels.layout.addressing` describes (layer_first, page_first, page_head, pointer table), K
and V each with its own bytes per token, behind the signatures :mod:`kernels.ops.kernel_backend`
writes once for it and :mod:`kernels.ops.kvcacheio`. The direct-backend ops take lists of tensors; a
page_first_direct tensor ``[P, L, page_size, ...]`` holds token slot ``t`` of layer ``l`` at page
``t // page_size``, layer ``l``, row ``t % page_size``.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence

import torch

from kernels.layout.addressing import KVCopy, Side
from kernels.ops.kernel_backend import KernelBackendOps

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Byte views
# ---------------------------------------------------------------------------------------------


def token_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """A ``uint8`` view ``[nbytes // width, width]`` aliasing contiguous ``t``."""
    if not t.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {t.stride()}")
    flat = t.reshape(-1).view(torch.uint8)
    if width <= 0 or flat.numel() % width:
        raise ValueError(f"{flat.numel()} bytes are not a whole number of {width}-byte rows")
    return flat.view(-1, width)


class _CudaBytes:
    """Exposes raw device (or UVA host) memory through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor of ``nbytes`` aliasing the memory at address ``ptr`` (no copy).

    On CUDA the address may also be a pinned host address (unified addressing).
    """
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _valid_pairs(
    src_indices: torch.Tensor, dst_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"src_indices and dst_indices differ in length: "
            f"{src_indices.numel()} != {dst_indices.numel()}"
        )
    s = src_indices.reshape(-1).long()
    d = dst_indices.reshape(-1).long().to(s.device)
    keep = (s >= 0) & (d >= 0)
    return s[keep], d[keep]


def _copy_rows(
    src_rows: torch.Tensor, dst_rows: torch.Tensor, s: torch.Tensor, d: torch.Tensor
) -> None:
    """``dst_rows[d] = src_rows[s]``; each side indexed on its own device."""
    if s.numel() == 0:
        return
    vals = src_rows[s.to(src_rows.device)]
    dst_rows[d.to(dst_rows.device)] = vals.to(dst_rows.device)


def _table_base(table: torch.Tensor, layer: int) -> int:
    return int(table[layer].item()) & ((1 << 64) - 1)  # uint64 tables come back as signed ints


def byte_offsets(side: Side, slots: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """Byte offset of ``slots`` (int64, CPU), ``head``, ``layer`` from the layer's base (a table
    entry) or the buffer's base (a tensor), as :class:`kernels.layout.addressing.Side`
    defines it."""
    p = side.page_size
    off = (slots // p) * side.page_stride + (slots % p) * side.row_stride + head * side.head_stride
    return off if side.is_table else off + layer * side.layer_stride


def _flat_bytes(side: Side, ref: torch.Tensor, layer: int, extent: int) -> torch.Tensor:
    """The bytes a side addresses from: a tensor's own, or ``extent`` bytes at ``table[layer]``."""
    if side.is_table:
        return bytes_at(_table_base(ref, layer), extent, ref.device)
    if not ref.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {ref.stride()}")
    return ref.reshape(-1).view(torch.uint8)


def _word(chunk: int, *sides: Side) -> int:
    """The widest run of bytes that divides the chunk and every stride of both sides, so every
    copied chunk is a whole number of such words at word-aligned offsets (from the side's
    base): the copy then gathers words, not single bytes."""
    g = chunk
    for side in sides:
        for stride in side.strides():
            g = math.gcd(g, stride)
    return g


def _words(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` (1-D uint8) as ``[n, width]`` rows, the tail shorter than a row dropped."""
    return flat[: flat.numel() // width * width].view(-1, width)


def copy_kv(call: KVCopy) -> None:
    """Every kernel-backend op: ``dst[d] = src[s]`` in ``call``'s addressing, for each layer it
    covers, K then V (or the MLA buffer), head by head for the page_head ops. A table side spans
    the largest offset it is given. Bytes move in words of the width :func:`_word` finds (the
    whole chunk when every offset is a multiple of it)."""
    s, d = (t.cpu() for t in _valid_pairs(call.src_indices, call.dst_indices))
    if s.numel() == 0:
        return
    for part in call.parts():
        w = _word(part.chunk_bytes, part.src, part.dst)
        cols = torch.arange(part.chunk_bytes // w)
        for layer in range(call.layer_id, call.layer_id + call.num_layers):
            for head in range(part.heads):
                so = byte_offsets(part.src, s, layer, head)
                do = byte_offsets(part.dst, d, layer, head)
                si = ((so // w)[:, None] + cols).reshape(-1)
                di = ((do // w)[:, None] + cols).reshape(-1)
                s_end, d_end = int(so.max()) + part.chunk_bytes, int(do.max()) + part.chunk_bytes
                for src_ref, dst_ref in zip(part.src.refs, part.dst.refs, strict=True):
                    src = _words(_flat_bytes(part.src, src_ref, layer, s_end), w)
                    dst = _words(_flat_bytes(part.dst, dst_ref, layer, d_end), w)
                    dst[di.to(dst.device)] = src[si.to(src.device)].to(dst.device)


# ---------------------------------------------------------------------------------------------
# Kernel-backend ops: upstream's signatures (kernels.ops.kernel_backend) over copy_kv
# ---------------------------------------------------------------------------------------------


def _run(call: KVCopy, block_quota: int, num_warps_per_block: int) -> None:
    """The reference of one op call; the launch shape does not apply."""
    copy_kv(call)


_ops = KernelBackendOps(_run)

transfer_kv_per_layer = _ops.transfer_kv_per_layer
transfer_kv_per_layer_pf_lf = _ops.transfer_kv_per_layer_pf_lf
transfer_kv_per_layer_ph_lf = _ops.transfer_kv_per_layer_ph_lf
transfer_kv_all_layer = _ops.transfer_kv_all_layer
transfer_kv_all_layer_lf_pf = _ops.transfer_kv_all_layer_lf_pf
transfer_kv_all_layer_lf_ph = _ops.transfer_kv_all_layer_lf_ph
transfer_kv_per_layer_mla = _ops.transfer_kv_per_layer_mla
transfer_kv_per_layer_mla_pf_lf = _ops.transfer_kv_per_layer_mla_pf_lf
transfer_kv_per_layer_mla_lf_pf = _ops.transfer_kv_per_layer_mla_lf_pf
transfer_kv_all_layer_mla = _ops.transfer_kv_all_layer_mla
transfer_kv_all_layer_mla_lf_pf = _ops.transfer_kv_all_layer_mla_lf_pf


# ---------------------------------------------------------------------------------------------
# Direct-backend ops: lists of tensors instead of pointer tables
# ---------------------------------------------------------------------------------------------


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one slot (one index of dim 0) of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst_layers[j][d] = src_layers[j][s]`` for each layer tensor ``[T, ...]`` of the lists."""
    s, d = _valid_pairs(src_indices, dst_indices)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        _copy_rows(token_rows(src, row_bytes(src)), token_rows(dst, row_bytes(dst)), s, d)


def page_rows(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """``uint8`` view ``[P, L, page_size, row_bytes]`` of a page_first_direct buffer."""
    p, n_layers = buf.shape[0], buf.shape[1]
    return token_rows(buf, buf.nbytes // (p * n_layers * page_size)).view(
        p, n_layers, page_size, -1
    )


def _direct_pages(
    hosts: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    first_layer: int,
    page_size: int,
    to_host: bool,
) -> None:
    """Slots ``host_idx`` of page_first_direct ``hosts`` (layers ``first_layer, ...``) from
    (``to_host``) or to slots ``dev_idx`` of ``layers`` (all K layer tensors, then all V)."""
    n_layers = len(layers) if len(hosts) == 1 else len(layers) // 2
    for kv, host in enumerate(hosts):
        pages = page_rows(host, page_size)
        h = host_idx.to(pages.device)
        for j in range(n_layers):
            layer = layers[kv * n_layers + j]
            rows = token_rows(layer, row_bytes(layer))
            at = (h // page_size, first_layer + j, h % page_size)
            if to_host:
                pages[at] = rows[dev_idx.to(layer.device)].to(pages.device)
            else:
                rows[dev_idx.to(layer.device)] = pages[at].to(layer.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """page_first_direct host buffers ``[P, L, page_size, ...]`` -> device layer tensors.

    ``src_ptrs`` is ``[k_buffer, v_buffer]`` (MHA) or ``[kv_buffer]`` (MLA); ``dst_ptrs`` holds
    the K layer tensors then the V layer tensors, for layers ``layer_id, layer_id + 1, ...``.
    """
    s, d = _valid_pairs(src_indices, dst_indices)
    _direct_pages(src_ptrs, dst_ptrs, s, d, layer_id, page_size, to_host=False)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer tensors (all K layers, then all V layers) -> page_first_direct buffers."""
    s, d = _valid_pairs(src_indices, dst_indices)
    _direct_pages(dst_ptrs, src_ptrs, d, s, 0, page_size, to_host=True)
