"""The copies ``bench.transfer.bench`` times: buffers, indices and one callable per method.

- ``Pools``: a bf16 device pool ``[2, L, T_dev, W]`` and host pools in each layout (pinned on
  CUDA); ``Indices``: random whole pages as the allocators hand them out (device page 0 is
  padding).
- ``h2d_methods`` (load one layer) and ``d2h_methods`` (back up all layers): for one host
  layout, a zero-argument callable per method that performs one copy: ``triton`` (this
  repository's kernels), ``sgl_kernel`` / ``sgl_direct`` (SGLang's, when ``sgl_kernel``
  imports), ``direct`` (one ``copy_`` per run or page), ``torch_gather`` (gather, one staged
  copy, scatter). Host-bound ones synchronize the stream first so their CPU work is timed.
- ``ceiling_method``: one contiguous copy of the same byte count (the link's ceiling).

Nothing here times anything; ``tests/bench/test_bench_transfer.py`` checks every method byte for
byte.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

import kernels
from hicache.memory.allocator import page_ceil
from kernels.ops.kernel_backend import DEFAULT_NUM_WARPS

logger = logging.getLogger(__name__)

NUM_LAYERS = 8
"""Layers in the benchmark pools (a real 8B model has 32; bandwidth does not depend on it)."""
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def load_sgl_kernel() -> ModuleType | None:
    """``sgl_kernel.kvcacheio`` when it imports and a CUDA device exists, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module("sgl_kernel.kvcacheio")
    except Exception as exc:  # ImportError, or a binary built for another torch/CUDA
        logger.info("sgl_kernel not usable: %s", exc)
        return None


# ---------------------------------------------------------------------------------------------
# Buffers and indices
# ---------------------------------------------------------------------------------------------


@dataclass
class Pools:
    """Device pool ``[2, L, T_dev, W]`` and host pools (pinned on CUDA), ``W = item / 2`` bf16."""

    device: torch.device
    item_size: int
    n_slots: int  # usable slots per pool (the device pool has one more padding page)
    dev: torch.Tensor
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # layout -> buffer
    page_size_pfd: int = 0

    @property
    def pinned(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def allocate(cls, device: torch.device, item_size: int, n_slots: int) -> Pools:
        width = item_size // 2
        dev = torch.zeros(2, NUM_LAYERS, n_slots + 64, width, dtype=torch.bfloat16, device=device)
        pools = cls(device, item_size, n_slots, dev)
        for layout in ("layer_first", "page_first"):
            shape = (2, NUM_LAYERS, n_slots, width) if layout == "layer_first" else (
                2, n_slots, NUM_LAYERS, width)  # fmt: skip
            pools.host[layout] = pools._host_buffer(shape)
        return pools

    def _host_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.bfloat16, pin_memory=self.pinned)

    def page_first_direct(self, page_size: int) -> torch.Tensor:
        """The ``[2, P, L, page_size, W]`` host pool for ``page_size`` (reallocated on change)."""
        if self.page_size_pfd != page_size:
            self.host.pop("page_first_direct", None)
            shape = (2, self.n_slots // page_size, NUM_LAYERS, page_size, self.item_size // 2)
            self.host["page_first_direct"] = self._host_buffer(shape)
            self.page_size_pfd = page_size
        return self.host["page_first_direct"]

    def flat_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous byte views of the device pool and the layer_first host pool (ceiling)."""
        return self.dev.view(-1).view(torch.uint8), self.host["layer_first"].view(-1).view(
            torch.uint8
        )


def pool_slots(max_tokens: int) -> int:
    """Pool size for ``max_tokens`` copied: 25 % spare, a multiple of every page size used."""
    return math.ceil(max_tokens * 1.25 / 64) * 64


def random_slots(n: int, n_slots: int, page_size: int, first_page: int, seed: int) -> torch.Tensor:
    """``n`` slots made of random whole pages from ``[first_page, n_slots // page_size)``."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = page_ceil(n, page_size) // page_size
    pages = torch.randperm(n_slots // page_size - first_page, generator=gen)[:n_pages] + first_page
    slots = pages[:, None] * page_size + torch.arange(page_size)
    return slots.flatten()[:n].contiguous()


@dataclass(frozen=True)
class Indices:
    host: torch.Tensor  # host slots, on the kernel device
    dev: torch.Tensor  # device slots, on the kernel device
    host_cpu: torch.Tensor
    dev_cpu: torch.Tensor

    @classmethod
    def make(cls, pools: Pools, n: int, page_size: int, seed: int) -> Indices:
        host = random_slots(n, pools.n_slots, page_size, 0, seed)
        dev = random_slots(n, pools.n_slots, page_size, 1, seed + 1)  # page 0 is padding
        return cls(host.to(pools.device), dev.to(pools.device), host, dev)


# ---------------------------------------------------------------------------------------------
# Methods: each returns a zero-argument callable that performs one copy
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def h2d_methods(
    p: Pools, layout: str, idx: Indices, page_size: int, layer: int, block_quota: int,
    sgl: ModuleType | None, num_warps: int = DEFAULT_NUM_WARPS,
) -> dict[str, Callable[[], None]]:  # fmt: skip
    """Load one layer (K and V) from the host pool in ``layout`` into the device pool
    (``num_warps``: the triton kernels' warps per program)."""
    item, dim = p.item_size, p.item_size * NUM_LAYERS
    dk, dv = p.dev[0, layer], p.dev[1, layer]
    s, d = idx.host, idx.dev
    m: dict[str, Callable[[], None]] = {}
    n = s.numel()
    if layout == "layer_first":
        hk, hv = p.host[layout][0, layer], p.host[layout][1, layer]
        m["triton"] = lambda: kernels.transfer_kv_per_layer(hk, dk, hv, dv, s, d, item,
                                                            block_quota, num_warps)  # fmt: skip
        if sgl is not None:
            m["sgl_kernel"] = lambda: sgl.transfer_kv_per_layer(hk, dk, hv, dv, s, d, item)

        def direct() -> None:
            _sync(p.device)
            kernels.transfer_kv_direct([hk, hv], [dk, dv], idx.host_cpu, idx.dev_cpu, page_size)

        m["direct"] = direct
        if sgl is not None:
            m["sgl_direct"] = lambda: sgl.transfer_kv_direct(
                [hk, hv], [dk, dv], idx.host_cpu, idx.dev_cpu, page_size
            )
    elif layout == "page_first":
        buf = p.host[layout]
        hk, hv = buf[0][:, layer], buf[1][:, layer]  # strided [T, W] views, for torch_gather
        m["triton"] = lambda: kernels.transfer_kv_per_layer_pf_lf(
            buf[0], dk, buf[1], dv, s, d, layer, item, dim, block_quota, num_warps)  # fmt: skip
        if sgl is not None:
            m["sgl_kernel"] = lambda: sgl.transfer_kv_per_layer_pf_lf(
                buf[0], dk, buf[1], dv, s, d, layer, item, dim)  # fmt: skip
    else:
        buf = p.page_first_direct(page_size)

        def direct_pf() -> None:
            _sync(p.device)
            kernels.transfer_kv_per_layer_direct_pf_lf(
                [buf[0], buf[1]], [dk, dv], idx.host_cpu, idx.dev_cpu, layer, page_size
            )

        m["direct"] = direct_pf
        if sgl is not None:
            m["sgl_direct"] = lambda: sgl.transfer_kv_per_layer_direct_pf_lf(
                [buf[0], buf[1]], [dk, dv], idx.host_cpu, idx.dev_cpu, layer, page_size
            )
    if layout != "page_first_direct":
        stage_h = torch.empty(2, n, item // 2, dtype=torch.bfloat16, pin_memory=p.pinned)
        stage_d = torch.empty(2, n, item // 2, dtype=torch.bfloat16, device=p.device)

        def torch_gather() -> None:
            _sync(p.device)
            torch.index_select(hk, 0, idx.host_cpu, out=stage_h[0])
            torch.index_select(hv, 0, idx.host_cpu, out=stage_h[1])
            stage_d.copy_(stage_h, non_blocking=True)
            dk.index_copy_(0, d, stage_d[0])
            dv.index_copy_(0, d, stage_d[1])

        m["torch_gather"] = torch_gather
    return m


def d2h_methods(
    p: Pools, layout: str, idx: Indices, page_size: int, block_quota: int,
    sgl: ModuleType | None,
) -> dict[str, Callable[[], None]]:  # fmt: skip
    """Back up all layers (K and V) from the device pool into the host pool in ``layout``."""
    item, dim, n_l = p.item_size, p.item_size * NUM_LAYERS, NUM_LAYERS
    s, d = idx.dev, idx.host
    dev_layers = [[p.dev[kv, layer] for layer in range(n_l)] for kv in (0, 1)]
    dev_tbl = [kernels.data_ptr_table(layers, p.device) for layers in dev_layers]
    m: dict[str, Callable[[], None]] = {}
    if layout == "layer_first":
        buf = p.host[layout]
        host_layers = [[buf[kv, layer] for layer in range(n_l)] for kv in (0, 1)]
        host_tbl = [kernels.data_ptr_table(layers, p.device) for layers in host_layers]
        args = (dev_tbl[0], host_tbl[0], dev_tbl[1], host_tbl[1], s, d, item, n_l)
        m["triton"] = lambda: kernels.transfer_kv_all_layer(*args, block_quota)
        if sgl is not None:
            m["sgl_kernel"] = lambda: sgl.transfer_kv_all_layer(*args)

        def direct() -> None:
            _sync(p.device)
            kernels.transfer_kv_direct(
                dev_layers[0] + dev_layers[1], host_layers[0] + host_layers[1],
                idx.dev_cpu, idx.host_cpu, page_size,
            )  # fmt: skip

        m["direct"] = direct
        if sgl is not None:
            m["sgl_direct"] = lambda: sgl.transfer_kv_direct(
                dev_layers[0] + dev_layers[1], host_layers[0] + host_layers[1],
                idx.dev_cpu, idx.host_cpu, page_size,
            )  # fmt: skip
    elif layout == "page_first":
        buf = p.host[layout]
        args_pf = (dev_tbl[0], buf[0], dev_tbl[1], buf[1], s, d, item, dim, n_l)
        m["triton"] = lambda: kernels.transfer_kv_all_layer_lf_pf(*args_pf, block_quota)
        if sgl is not None:
            m["sgl_kernel"] = lambda: sgl.transfer_kv_all_layer_lf_pf(*args_pf)
    else:
        buf = p.page_first_direct(page_size)

        def direct_pf() -> None:
            _sync(p.device)
            kernels.transfer_kv_all_layer_direct_lf_pf(
                dev_layers[0] + dev_layers[1], [buf[0], buf[1]], idx.dev_cpu, idx.host_cpu,
                page_size,
            )  # fmt: skip

        m["direct"] = direct_pf
        if sgl is not None:
            m["sgl_direct"] = lambda: sgl.transfer_kv_all_layer_direct_lf_pf(
                dev_layers[0] + dev_layers[1], [buf[0], buf[1]], idx.dev_cpu, idx.host_cpu,
                page_size,
            )  # fmt: skip
    if layout != "page_first_direct":
        n = s.numel()
        stage_h = torch.empty(2, n_l, n, item // 2, dtype=torch.bfloat16, pin_memory=p.pinned)
        host = p.host[layout]

        def torch_gather() -> None:
            _sync(p.device)
            stage_h.copy_(p.dev[:, :, s], non_blocking=True)
            _sync(p.device)
            if layout == "layer_first":
                host[:, :, idx.host_cpu] = stage_h
            else:
                host[:, idx.host_cpu] = stage_h.transpose(1, 2)

        m["torch_gather"] = torch_gather
    return m


def ceiling_method(p: Pools, direction: str, nbytes: int) -> Callable[[], None]:
    dev, host = p.flat_bytes()
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    return lambda: dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
