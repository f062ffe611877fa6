"""Bandwidth of the KV copy ops between device and pinned host memory, against the link ceiling.

Two directions, as HiCache uses them:

- ``h2d``: load back one layer (K and V) from the host pool into the device pool
  (``transfer_kv_per_layer``, ``..._pf_lf``, ``..._direct_pf_lf``).
- ``d2h``: back up all layers (K and V) from the device pool into the host pool
  (``transfer_kv_all_layer``, ``..._lf_pf``, ``..._direct_lf_pf``).

Methods, all measured in the same run on the same buffers and indices:

- ``ceiling``: one contiguous pinned ``copy_`` of the same byte count (copy engine): the measured
  ceiling of this machine's link; every other number is also given as a fraction of it.
- ``triton``: this repository's kernels (``block_quota`` = SGLang's default 2 unless swept).
- ``sgl_kernel``: SGLang's CUDA kernels, where ``sgl_kernel`` imports.
- ``direct``: ``transfer_kv_direct`` / page_first_direct ops (one ``copy_`` per run or page;
  a Python loop here, a C++ loop in ``sgl_direct``, SGLang's, where it imports).
- ``torch_gather``: torch indexing: gather on the source side, one contiguous copy through a
  staging buffer, scatter on the destination side (the CPU does the host half).

Bandwidth = bytes named by the indices (``tokens * 2 * item_size`` per layer) / median time.
Host-bound methods (``direct``, ``torch_gather``) start with a stream synchronization so that
their CPU work is inside the timed window. Indices: random pages (page size 1: random slots),
consecutive slots within a page, device page 0 excluded, as the allocators hand them out.

Also: a ``block_quota`` sweep of the triton kernels, and the slowdown of a bf16 GEMM on the
compute stream while a copy of each ``block_quota`` runs on a side stream (kernel copies use SMs;
upstream saw co-running kernels slow by 1.6x and more with uncapped grids).

On a machine without CUDA only a tiny configuration of the torch paths runs (``ceiling``,
``direct``, ``torch_gather``), all in host memory: those are CPU memcpy numbers, not PCIe numbers,
and the Triton kernels (interpreted there) are not timed at all.

``python -m bench.bench_transfer [--quick] [--out results]``: table, ``bench_transfer.json``,
``bench_transfer.png`` (matplotlib, if installed).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import kernels
from bench.common import Column, print_table, time_ms, timer_name, write_json

logger = logging.getLogger(__name__)

NUM_LAYERS = 8
"""Layers in the benchmark pools (a real 8B model has 32; bandwidth does not depend on it)."""
GEMM_SIZE = 8192


@dataclass(frozen=True)
class Config:
    """What one run measures."""

    items: tuple[int, ...]  # item sizes (bytes) of the main grid
    tokens: tuple[int, ...]
    page_sizes: tuple[int, ...]
    layouts: tuple[str, ...]
    side_items: tuple[int, ...]  # extra item sizes, at side_tokens, page size 1
    side_tokens: int
    sweep_tokens: int  # block_quota sweep and GEMM co-run
    block_quotas: tuple[int, ...]
    max_direct_copies: int  # skip ``direct`` past this many copy_ calls per op (too slow)
    methods: tuple[str, ...]
    rep_ms: float


LAYOUTS = ("layer_first", "page_first", "page_first_direct")
GPU_QUICK = Config(
    items=(2048,), tokens=(1024, 8192, 32768), page_sizes=(1, 16), layouts=LAYOUTS,
    side_items=(256, 1024, 4096), side_tokens=8192, sweep_tokens=16384,
    block_quotas=(1, 2, 4, 8, 16, 32), max_direct_copies=150_000,
    methods=("ceiling", "triton", "sgl_kernel", "direct", "sgl_direct", "torch_gather"),
    rep_ms=25,
)  # fmt: skip
GPU_FULL = Config(
    items=(256, 1024, 2048, 4096), tokens=(1024, 4096, 16384, 65536), page_sizes=(1, 16, 64),
    layouts=LAYOUTS, side_items=(), side_tokens=0, sweep_tokens=32768,
    block_quotas=(1, 2, 4, 8, 16, 32), max_direct_copies=600_000,
    methods=("ceiling", "triton", "sgl_kernel", "direct", "sgl_direct", "torch_gather"),
    rep_ms=100,
)  # fmt: skip
CPU_TINY = Config(
    items=(2048,), tokens=(256, 1024), page_sizes=(1, 16), layouts=LAYOUTS,
    side_items=(), side_tokens=0, sweep_tokens=0, block_quotas=(),
    max_direct_copies=20_000, methods=("ceiling", "direct", "torch_gather"), rep_ms=30,
)  # fmt: skip
CPU_NOTE = (
    "CPU numbers: no CUDA device, so every buffer is in host memory and these are CPU memcpy "
    "rates, not PCIe rates; the Triton kernels (interpreted here) are not timed."
)


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
    n_pages = math.ceil(n / page_size)
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
    sgl: ModuleType | None,
) -> dict[str, Callable[[], None]]:  # fmt: skip
    """Load one layer (K and V) from the host pool in ``layout`` into the device pool."""
    item, dim = p.item_size, p.item_size * NUM_LAYERS
    dk, dv = p.dev[0, layer], p.dev[1, layer]
    s, d = idx.host, idx.dev
    m: dict[str, Callable[[], None]] = {}
    n = s.numel()
    if layout == "layer_first":
        hk, hv = p.host[layout][0, layer], p.host[layout][1, layer]
        m["triton"] = lambda: kernels.transfer_kv_per_layer(hk, dk, hv, dv, s, d, item, block_quota)
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
            buf[0], dk, buf[1], dv, s, d, layer, item, dim, block_quota)  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def _direct_copies(direction: str, layout: str, n: int, page_size: int) -> int:
    layers = 2 if direction == "h2d" else 2 * NUM_LAYERS
    per_op = n if layout == "layer_first" else n // page_size  # upper bound for direct runs
    return layers * per_op


def measure_grid(
    cfg: Config, device: torch.device, sgl: ModuleType | None, item: int, tokens: tuple[int, ...],
    page_sizes: tuple[int, ...], layouts: tuple[str, ...], pools: Pools, seed: int,
) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    for ps in page_sizes:
        for n in tokens:
            idx = Indices.make(pools, n, ps, seed + n + ps)
            for direction in ("h2d", "d2h"):
                layers = 1 if direction == "h2d" else NUM_LAYERS
                nbytes = n * 2 * item * layers
                ceiling = time_ms(
                    ceiling_method(pools, direction, nbytes), device, rep_ms=cfg.rep_ms
                )
                ceil_gbps = nbytes / ceiling.median / 1e6
                base = dict(direction=direction, item=item, page=ps, tokens=n, bytes=nbytes)
                rows.append(dict(base, layout="-", method="ceiling", gbps=ceil_gbps, ratio=1.0,
                                 **ceiling.as_dict()))  # fmt: skip
                for layout in layouts:
                    if direction == "h2d":
                        methods = h2d_methods(pools, layout, idx, ps, NUM_LAYERS // 2, 2, sgl)
                    else:
                        methods = d2h_methods(pools, layout, idx, ps, 2, sgl)
                    for name, fn in methods.items():
                        if name not in cfg.methods:
                            continue
                        row = dict(base, layout=layout, method=name)
                        if name in ("direct", "sgl_direct") and (
                            _direct_copies(direction, layout, n, ps) > cfg.max_direct_copies
                        ):
                            rows.append(dict(row, note="skipped: too many copy_ calls"))
                            continue
                        t = time_ms(fn, device, rep_ms=cfg.rep_ms)
                        gbps = nbytes / t.median / 1e6
                        rows.append(dict(row, gbps=gbps, ratio=gbps / ceil_gbps, **t.as_dict()))
                    del methods
    return rows


def sweep_block_quota(
    cfg: Config, device: torch.device, pools: Pools, seed: int
) -> list[dict[str, Any]]:
    """Triton page_first H2D (one layer) and D2H (all layers) at each ``block_quota``."""
    n, item = cfg.sweep_tokens, pools.item_size
    idx = Indices.make(pools, n, 1, seed)
    rows = []
    for direction in ("h2d", "d2h"):
        layers = 1 if direction == "h2d" else NUM_LAYERS
        nbytes = n * 2 * item * layers
        ceil = time_ms(ceiling_method(pools, direction, nbytes), device, rep_ms=cfg.rep_ms)
        for bq in cfg.block_quotas:
            if direction == "h2d":
                fn = h2d_methods(pools, "page_first", idx, 1, NUM_LAYERS // 2, bq, None)["triton"]
            else:
                fn = d2h_methods(pools, "page_first", idx, 1, bq, None)["triton"]
            t = time_ms(fn, device, rep_ms=cfg.rep_ms)
            rows.append(dict(direction=direction, layout="page_first", item=item, tokens=n,
                             block_quota=bq, gbps=nbytes / t.median / 1e6,
                             ratio=ceil.median / t.median, **t.as_dict()))  # fmt: skip
    return rows


def gemm_slowdown(cfg: Config, device: torch.device, pools: Pools, seed: int) -> list[dict]:
    """Time of ``reps`` bf16 GEMMs alone, and while a copy loops on a side stream."""
    n, item = cfg.sweep_tokens, pools.item_size
    idx = Indices.make(pools, n, 1, seed)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    reps = 10

    def gemms() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    copies: dict[str, Callable[[], None]] = {"copy_engine (ceiling)": ceiling_method(
        pools, "h2d", n * 2 * item)}  # fmt: skip
    for bq in cfg.block_quotas:
        fn = h2d_methods(pools, "page_first", idx, 1, NUM_LAYERS // 2, bq, None)["triton"]
        copies[f"triton bq={bq}"] = fn

    def window(copy: Callable[[], None] | None, copy_ms: float, gemm_ms: float) -> tuple:
        side = torch.cuda.Stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side_end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        if copy is not None:
            n_copies = max(4, math.ceil(2.0 * gemm_ms / max(copy_ms, 1e-3)))
            with torch.cuda.stream(side):
                for _ in range(n_copies):
                    copy()
                side_end.record()
        start.record()
        gemms()
        end.record()
        torch.cuda.synchronize(device)
        covered = copy is None or start.elapsed_time(side_end) >= start.elapsed_time(end)
        return start.elapsed_time(end), covered

    gemms()
    alone = sorted(window(None, 0, 0)[0] for _ in range(5))[2]
    rows = [dict(copy="none", gemm_ms=alone, slowdown=1.0, covered=True)]
    for name, fn in copies.items():
        copy_ms = time_ms(fn, device, rep_ms=cfg.rep_ms).median
        runs = [window(fn, copy_ms, alone) for _ in range(3)]
        t = sorted(r[0] for r in runs)[1]
        rows.append(dict(copy=name, gemm_ms=t, slowdown=t / alone,
                         covered=all(r[1] for r in runs), copy_alone_ms=copy_ms))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

GRID_COLUMNS = [
    Column("direction", "dir", 5), Column("layout", "layout", 19), Column("item", "item B", 8),
    Column("page", "page", 6), Column("tokens", "tokens", 8), Column("method", "method", 14),
    Column("gbps", "GB/s", 9, ".2f"), Column("ratio", "x ceil", 8, ".2f"),
    Column("median_ms", "ms", 10, ".3f"), Column("note", "note", 32),
]  # fmt: skip


def _best(rows: list[dict], **match: Any) -> dict | None:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items()) and "gbps" in r]
    return max(found, key=lambda r: r["gbps"]) if found else None


def headline(rows: list[dict], sweep: list[dict], gemm: list[dict], cpu: bool) -> dict:
    """The few numbers the suite summary prints."""
    out: dict[str, Any] = {}
    if cpu:
        out["note"] = CPU_NOTE
        n = max(r["tokens"] for r in rows)
        for method in ("ceiling", "torch_gather", "direct"):
            r = _best(rows, method=method, tokens=n, page=1, direction="h2d")
            if r:
                out[f"cpu h2d {method} ps1 {n}tok GB/s"] = round(r["gbps"], 2)
        return out
    item = 2048 if any(r["item"] == 2048 for r in rows) else rows[0]["item"]
    n = max(r["tokens"] for r in rows if r["item"] == item)
    for direction in ("h2d", "d2h"):
        key = dict(direction=direction, item=item, page=1)
        ceil = _best(rows, method="ceiling", tokens=n, **key)
        tri = _best(rows, method="triton", layout="page_first", tokens=n, **key)
        if ceil and tri:
            out[f"{direction} {item}B ps1 {n}tok ceiling GB/s"] = round(ceil["gbps"], 1)
            out[f"{direction} {item}B ps1 {n}tok triton page_first bq=2 GB/s"] = round(
                tri["gbps"], 1
            )
            out[f"{direction} triton / ceiling"] = round(tri["ratio"], 3)
        directs = [r for r in rows if r["method"] == "direct" and r["layout"] == "layer_first"
                   and "gbps" in r and all(r[k] == v for k, v in key.items())]  # fmt: skip
        if directs:
            d = max(directs, key=lambda r: r["tokens"])
            t = _best(rows, method="triton", layout="layer_first", tokens=d["tokens"], **key)
            if t:
                label = f"{direction} triton / direct (layer_first, ps1, {d['tokens']}tok)"
                out[label] = round(t["gbps"] / d["gbps"], 1)
    for direction in ("h2d", "d2h"):
        capped = [r for r in sweep if r["direction"] == direction and r["block_quota"] <= 16]
        if capped:
            best = max(capped, key=lambda r: r["gbps"])
            out[f"{direction} best bq<=16"] = (
                f"bq={best['block_quota']}: {best['gbps']:.1f} GB/s ({best['ratio']:.0%} of ceil)"
            )
    for r in gemm:
        if r["copy"].startswith("triton"):
            out[f"gemm slowdown, {r['copy']} copy"] = round(r["slowdown"], 3)
    return out


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """GB/s vs tokens, one line per method (and layout), item 2 KiB (or the first), page 1."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed: no plot")
        return None
    item = 2048 if any(r["item"] == 2048 for r in rows) else rows[0]["item"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, direction in zip(axes, ("h2d", "d2h"), strict=True):
        sel = [r for r in rows if r["direction"] == direction and r["item"] == item
               and r["page"] == 1 and "gbps" in r]  # fmt: skip
        for key in sorted({(r["method"], r["layout"]) for r in sel}):
            pts = sorted((r["tokens"], r["gbps"]) for r in sel if (r["method"], r["layout"]) == key)
            label = key[0] if key[1] == "-" else f"{key[0]} ({key[1]})"
            style = "k--" if key[0] == "ceiling" else "-o"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
        what = "H2D, one layer" if direction == "h2d" else "D2H, all layers"
        ax.set_title(f"{what}, item {item} B, page size 1")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(quick: bool = True, out_dir: Path = Path("results")) -> dict[str, Any]:
    """Run the benchmark; print the tables; write JSON (and PNG). Returns the summary dict."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = (GPU_QUICK if quick else GPU_FULL) if cuda else CPU_TINY
    sgl = load_sgl_kernel()
    print(f"[bench_transfer] device={device}; timer: {timer_name(device)}; "
          f"sgl_kernel={'yes' if sgl else 'no'}; layers={NUM_LAYERS}")  # fmt: skip
    threads = torch.get_num_threads()
    if not cuda:
        print(f"[bench_transfer] {CPU_NOTE}")
        # One torch thread: OpenMP threads on shared cores spin against other processes and
        # turn a 1 MiB memcpy from ~0.03 ms into ~10 ms.
        torch.set_num_threads(1)
    try:
        return _run(cfg, device, sgl, quick, out_dir)
    finally:
        torch.set_num_threads(threads)


def _run(
    cfg: Config, device: torch.device, sgl: ModuleType | None, quick: bool, out_dir: Path
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    seed = 0

    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    gemm: list[dict[str, Any]] = []
    for item in cfg.items:
        pools = Pools.allocate(device, item, pool_slots(max(cfg.tokens)))
        rows += measure_grid(cfg, device, sgl, item, cfg.tokens, cfg.page_sizes, cfg.layouts,
                             pools, seed)  # fmt: skip
        if cuda and item == 2048 and cfg.block_quotas:
            sweep = sweep_block_quota(cfg, device, pools, seed)
            gemm = gemm_slowdown(cfg, device, pools, seed)
        del pools
    for item in cfg.side_items:
        pools = Pools.allocate(device, item, pool_slots(cfg.side_tokens))
        rows += measure_grid(cfg, device, sgl, item, (cfg.side_tokens,), (1,),
                             ("layer_first", "page_first"), pools, seed)  # fmt: skip
        del pools

    print()
    print_table(rows, GRID_COLUMNS)
    if sweep:
        print("\nblock_quota sweep (triton, page_first, page size 1; x ceil = ceiling time / time)")
        print_table(sweep, [Column("direction", "dir", 5), Column("tokens", "tokens", 8),
                            Column("block_quota", "bq", 5), Column("gbps", "GB/s", 9, ".2f"),
                            Column("ratio", "x ceil", 8, ".2f"),
                            Column("median_ms", "ms", 10, ".3f")])  # fmt: skip
    if gemm:
        print(f"\nbf16 GEMM {GEMM_SIZE}^3 x10 on the compute stream, a copy looping on a side "
              "stream (H2D one layer, page_first)")  # fmt: skip
        print_table(gemm, [Column("copy", "copy", 24), Column("gemm_ms", "GEMM ms", 10, ".3f"),
                           Column("slowdown", "slowdown", 10, ".3f"),
                           Column("covered", "overlap", 9)])  # fmt: skip

    head = headline(rows, sweep, gemm, cpu=not cuda)
    payload = {
        "quick": quick,
        "timer": timer_name(device),
        "num_layers": NUM_LAYERS,
        "sgl_kernel": sgl is not None,
        "torch_threads": torch.get_num_threads(),
        "cpu_note": None if cuda else CPU_NOTE,
        "headline": head,
        "rows": rows,
        "block_quota_sweep": sweep,
        "gemm_corun": gemm,
    }
    path = write_json("bench_transfer", payload, out_dir)
    png = plot(
        rows,
        out_dir / "bench_transfer.png",
        f"bench_transfer on {device} ({'CPU memcpy numbers' if not cuda else 'PCIe'})",
    )
    print(f"\n[bench_transfer] wrote {path}" + (f" and {png}" if png else ""))
    for k, v in head.items():
        print(f"  {k}: {v}")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Under 2 minutes on one GPU.")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    args = parser.parse_args(argv)
    run(quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
