"""The probe's Triton kernel: ``dst = src + 1`` (int32), ``src`` read from a tensor argument or
through an int64 or uint64 pointer table (the ways the kvcacheio kernels reach registered host
memory). Imported once the probe found triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _add_one(src, dst, n, TABLE: tl.constexpr, BLOCK: tl.constexpr):
    if TABLE:
        src = tl.load(src).to(tl.pointer_type(tl.int32))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) + 1, mask=mask)


def launch(src: torch.Tensor, dst: torch.Tensor, how: str = "tensor") -> None:
    """``dst = src + 1``, ``src`` passed as ``how``: ``tensor``, ``int64 table`` (SGLang's older
    pools) or ``uint64 table`` (``kernels.data_ptr_table``, this project's pools)."""
    if how == "uint64 table":
        import kernels

        src = kernels.data_ptr_table([src], dst.device)
    elif how == "int64 table":
        src = torch.tensor([src.data_ptr()], dtype=torch.int64, device=dst.device)
    n = dst.numel()
    _add_one[(triton.cdiv(n, BLOCK),)](src, dst, n, TABLE=how != "tensor", BLOCK=BLOCK)
