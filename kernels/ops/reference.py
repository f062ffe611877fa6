"""Plain torch reference of the kernel-backend ``kvcacheio`` ops, with the same signatures: tests
compare the Triton kernels with it bit for bit, and the ops run it off the Triton path. Skips
pairs with a negative index; may synchronize; validates no arguments of its own.
"""

from __future__ import annotations

import ctypes
import math

import torch

from hicache_prefill.kernels.layout.addressing import KVCopy, Side
from hicache_prefill.kernels.ops.kernel_backend import build_ops


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
    """A ``uint8`` tensor aliasing ``nbytes`` at ``ptr`` (on CUDA also a pinned host address)."""
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


def _table_base(table: torch.Tensor, layer: int) -> int:
    return int(table[layer].item()) & ((1 << 64) - 1)  # uint64 tables come back as signed ints


def byte_offsets(side: Side, slots: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """Byte offsets of ``slots`` (int64, CPU) from the table entry or buffer base (``Side``)."""
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
    """The widest word dividing the chunk and every stride: the copy gathers words, not bytes."""
    g = chunk
    for side in sides:
        for stride in side.strides():
            g = math.gcd(g, stride)
    return g


def _words(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` (1-D uint8) as ``[n, width]`` rows, a partial tail dropped."""
    return flat[: flat.numel() // width * width].view(-1, width)


def copy_kv(call: KVCopy) -> None:
    """Every kernel-backend op: ``dst[d] = src[s]`` in ``call``'s addressing, per layer, K then V,
    head by head for the page_head ops. A table side spans the largest offset it is given."""
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


def _run(call: KVCopy, block_quota: int, num_warps_per_block: int) -> None:
    copy_kv(call)


globals().update(build_ops(_run, __name__))
