"""The probe's Triton kernels: ``dst = src + 1``, with ``src`` read from a tensor argument or
through an int64 or uint64 pointer table (the ways the kvcacheio kernels reach registered host
memory). Imported once the probe found triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _add_one(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) + 1, mask=mask)


@triton.jit
def _add_one_from_table(table, dst, n, BLOCK: tl.constexpr):
    src = tl.load(table).to(tl.pointer_type(tl.int32))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) + 1, mask=mask)


def launch_add_one(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst = src + 1`` (int32, same length; ``src`` on the device or registered host memory)."""
    n = src.numel()
    _add_one[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK)


def launch_read_host(host: torch.Tensor, dst: torch.Tensor, how: str) -> None:
    """``dst = host + 1``, ``host`` passed as ``how``: ``tensor``, ``int64 table`` (SGLang's older
    pools) or ``uint64 table`` (``kernels.data_ptr_table``, this project's pools)."""
    if how == "tensor":
        launch_add_one(host, dst)
        return
    if how == "uint64 table":
        import kernels

        table = kernels.data_ptr_table([host], dst.device)
        assert table.dtype == torch.uint64
    else:
        table = torch.tensor([host.data_ptr()], dtype=torch.int64, device=dst.device)
    n = host.numel()
    _add_one_from_table[(triton.cdiv(n, BLOCK),)](table, dst, n, BLOCK=BLOCK)
