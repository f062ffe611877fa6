"""How ``bench.transfer.bench`` times the methods of ``bench.transfer.methods``.

- ``measure_grid``: every direction, layout, page size and token count; each method's median
  time and GB/s, also as a fraction of the ceiling measured on the same bytes.
- ``sweep_block_quota``: the triton page_first copies at each ``block_quota``.
- ``gemm_slowdown``: a bf16 GEMM on the compute stream alone, and while a copy loops on a side
  stream (CUDA only): the copy engine, then the triton copy at each warps-per-program of
  ``Config.warps`` at equal bytes in flight (``warp_points``: fewer warps, proportionally more
  programs), then the other ``block_quota`` values at the default warps; each row has the
  copy's GB/s alone and the GEMM's slowdown beside it, so the default warps can be chosen from
  a measurement.

Each returns plain row dicts for the report and hands every row to ``emit`` the moment it is
measured (the caller prints it and rewrites its JSON, so a run cut short keeps what it measured).
Before each measurement ``time_ok()`` is asked; once it says no, the rest is skipped (the caller
records that). ``Config`` says what one run measures.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from bench.common import time_left, time_ms
from bench.transfer.methods import (
    NUM_LAYERS,
    Indices,
    Pools,
    ceiling_method,
    d2h_methods,
    h2d_methods,
)

logger = logging.getLogger(__name__)

GEMM_SIZE = 8192

Emit = Callable[[dict[str, Any]], None]
TimeOk = Callable[[], bool]

DEADLINE_MARGIN_S = 5.0
"""Seconds a measurement may take: none starts closer than this to the step's deadline."""


def before_deadline() -> bool:
    """``time_ok`` default: more than ``DEADLINE_MARGIN_S`` left before the deadline."""
    return time_left() > DEADLINE_MARGIN_S


def _ignore(row: dict[str, Any]) -> None:
    pass


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
    warps: tuple[int, ...] = (32, 16, 8)  # warps per program swept in the GEMM co-run


BASE_WARPS, BASE_BLOCK_QUOTA = 32, 2
"""SGLang's launch shape; the warps sweep keeps its bytes in flight."""


def warp_points(warps: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(warps per program, block_quota)`` pairs with the bytes in flight of 32 warps x 2
    programs (a program's tile is proportional to its warps): 32 -> 2, 16 -> 4, 8 -> 8."""
    return [(w, max(1, BASE_BLOCK_QUOTA * BASE_WARPS // w)) for w in warps]


def bytes_in_flight(pools: Pools, idx: Indices, layer: int, block_quota: int,
                    num_warps: int) -> int:  # fmt: skip
    """Bytes of loads the page_first H2D launch keeps outstanding: programs x one block each
    (the planner's own numbers, :mod:`kernels.triton.launch`)."""
    from kernels.layout.addressing import PF_TO_LF, KVCopy
    from kernels.ops.dispatch import validate
    from kernels.triton.launch import plan_launch, resolve_num_warps

    buf, item = pools.host["page_first"], pools.item_size
    call = KVCopy(PF_TO_LF, (buf[0], buf[1]), (pools.dev[0, layer], pools.dev[1, layer]),
                  idx.host, idx.dev, item, layout_dim=item * NUM_LAYERS,
                  layer_id=layer)  # fmt: skip
    call, (part,) = validate(call, block_quota, num_warps)
    launch = plan_launch(part, idx.host, idx.dev, layer_begin=layer, num_layers=1,
                         block_quota=block_quota, num_warps=resolve_num_warps(num_warps),
                         cache_hints=False)  # fmt: skip
    return launch.grid[0] * launch.geometry.block_bytes


def _direct_copies(direction: str, layout: str, n: int, page_size: int) -> int:
    layers = 2 if direction == "h2d" else 2 * NUM_LAYERS
    per_op = n if layout == "layer_first" else n // page_size  # upper bound for direct runs
    return layers * per_op


def measure_grid(
    cfg: Config, device: torch.device, sgl: ModuleType | None, item: int, tokens: tuple[int, ...],
    page_sizes: tuple[int, ...], layouts: tuple[str, ...], pools: Pools, seed: int,
    emit: Emit = _ignore, time_ok: TimeOk = before_deadline,
) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        emit(row)

    for ps in page_sizes:
        for n in tokens:
            idx = Indices.make(pools, n, ps, seed + n + ps)
            for direction in ("h2d", "d2h"):
                if not time_ok():
                    return rows
                layers = 1 if direction == "h2d" else NUM_LAYERS
                nbytes = n * 2 * item * layers
                ceiling = time_ms(
                    ceiling_method(pools, direction, nbytes), device, rep_ms=cfg.rep_ms
                )
                ceil_gbps = nbytes / ceiling.median / 1e6
                base = dict(direction=direction, item=item, page=ps, tokens=n, bytes=nbytes)
                add(dict(base, layout="-", method="ceiling", gbps=ceil_gbps, ratio=1.0,
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
                            add(dict(row, note="skipped: too many copy_ calls"))
                            continue
                        if not time_ok():
                            return rows
                        t = time_ms(fn, device, rep_ms=cfg.rep_ms)
                        gbps = nbytes / t.median / 1e6
                        add(dict(row, gbps=gbps, ratio=gbps / ceil_gbps, **t.as_dict()))
                    del methods
    return rows


def sweep_block_quota(
    cfg: Config, device: torch.device, pools: Pools, seed: int, emit: Emit = _ignore,
    time_ok: TimeOk = before_deadline,
) -> list[dict[str, Any]]:  # fmt: skip
    """Triton page_first H2D (one layer) and D2H (all layers) at each ``block_quota``."""
    n, item = cfg.sweep_tokens, pools.item_size
    idx = Indices.make(pools, n, 1, seed)
    rows: list[dict[str, Any]] = []
    for direction in ("h2d", "d2h"):
        if not time_ok():
            return rows
        layers = 1 if direction == "h2d" else NUM_LAYERS
        nbytes = n * 2 * item * layers
        ceil = time_ms(ceiling_method(pools, direction, nbytes), device, rep_ms=cfg.rep_ms)
        for bq in cfg.block_quotas:
            if not time_ok():
                return rows
            if direction == "h2d":
                fn = h2d_methods(pools, "page_first", idx, 1, NUM_LAYERS // 2, bq, None)["triton"]
            else:
                fn = d2h_methods(pools, "page_first", idx, 1, bq, None)["triton"]
            t = time_ms(fn, device, rep_ms=cfg.rep_ms)
            rows.append(dict(direction=direction, layout="page_first", item=item, tokens=n,
                             block_quota=bq, gbps=nbytes / t.median / 1e6,
                             ratio=ceil.median / t.median, **t.as_dict()))  # fmt: skip
            emit(rows[-1])
    return rows


def gemm_slowdown(
    cfg: Config, device: torch.device, pools: Pools, seed: int, emit: Emit = _ignore,
    time_ok: TimeOk = before_deadline,
) -> list[dict]:  # fmt: skip
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

    layer = NUM_LAYERS // 2
    nbytes = n * 2 * item
    # name -> (copy, warps, block_quota); headline first: the copy engine, the warps sweep at
    # equal bytes in flight, then the rest of the block_quota sweep at the default warps.
    copies: dict[str, tuple[Callable[[], None], int | None, int | None]] = {
        "copy_engine (ceiling)": (ceiling_method(pools, "h2d", nbytes), None, None)}  # fmt: skip
    points = warp_points(cfg.warps) + [(BASE_WARPS, bq) for bq in cfg.block_quotas
                                        if bq != BASE_BLOCK_QUOTA]  # fmt: skip
    for warps, bq in points:
        fn = h2d_methods(pools, "page_first", idx, 1, layer, bq, None, warps)["triton"]
        copies[f"triton {warps}w bq={bq}"] = (fn, warps, bq)

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

    if not time_ok():
        return []
    gemms()
    alone = sorted(window(None, 0, 0)[0] for _ in range(5))[2]
    rows = [dict(copy="none", gemm_ms=alone, slowdown=1.0, covered=True)]
    emit(rows[-1])
    for name, (fn, warps, bq) in copies.items():
        if not time_ok():
            return rows
        copy_ms = time_ms(fn, device, rep_ms=cfg.rep_ms).median
        runs = [window(fn, copy_ms, alone) for _ in range(3)]
        t = sorted(r[0] for r in runs)[1]
        in_flight = bytes_in_flight(pools, idx, layer, bq, warps) if warps else None
        rows.append(dict(copy=name, warps=warps, block_quota=bq, gemm_ms=t, slowdown=t / alone,
                         covered=all(r[1] for r in runs), copy_alone_ms=copy_ms,
                         copy_gbps=nbytes / copy_ms / 1e6,
                         in_flight_kib=None if in_flight is None
                         else in_flight / 1024))  # fmt: skip
        emit(rows[-1])
    return rows
