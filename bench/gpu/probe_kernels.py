"""The probe's Triton kernels (``bench.gpu.probe``): one trivial add, and a read of registered host
memory reached the ways the kvcacheio kernels reach it (a tensor argument; an int64 or uint64
pointer table). Imported only after the probe found a
CUDA torch and triton."""

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
    """``dst = host + 1`` where ``host`` is registered host memory, passed as a tensor argument
    (``how="tensor"``) or as its address in a device table: int64 (``how="int64 table"``, as
    SGLang's older pools) or uint64 built by ``kernels.data_ptr_table`` (``how="uint64 table"``,
    what this project's pools and SGLang's newer ones hold)."""
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
