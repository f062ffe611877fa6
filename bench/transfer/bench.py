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

Files: ``bench.transfer.methods`` (buffers, indices, the methods), ``bench.transfer.measure``
(grid, sweep, GEMM co-run), ``bench.transfer.report`` (table columns, headline, plot); this file
holds the configurations, ``run`` and the CLI.

Every row is printed and written to ``bench_transfer.json`` (``"partial": true`` until the end)
the moment it is measured, and no measurement starts within a few seconds of the deadline that
``bench/gpu_check.sh`` sets (``HICACHE_BENCH_DEADLINE``): what was skipped is listed under
``skipped_for_time``.

``python -m bench.transfer [--quick] [--out results]``: table, ``bench_transfer.json``,
``bench_transfer.png`` (matplotlib, if installed; one panel per direction and page size).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.common import Column, table_header, table_row, timer_name, write_json
from bench.transfer.measure import (
    GEMM_SIZE,
    Config,
    before_deadline,
    gemm_slowdown,
    measure_grid,
    sweep_block_quota,
)
from bench.transfer.methods import (
    LAYOUTS,
    NUM_LAYERS,
    Indices,
    Pools,
    ceiling_method,
    d2h_methods,
    h2d_methods,
    load_sgl_kernel,
    pool_slots,
)
from bench.transfer.report import CPU_NOTE, GRID_COLUMNS, headline, plot

__all__ = [
    "CPU_NOTE",
    "CPU_TINY",
    "GPU_FULL",
    "GPU_QUICK",
    "LAYOUTS",
    "NUM_LAYERS",
    "Config",
    "Indices",
    "Pools",
    "ceiling_method",
    "d2h_methods",
    "h2d_methods",
    "load_sgl_kernel",
    "main",
    "pool_slots",
    "run",
]

logger = logging.getLogger(__name__)

# Quick: about a minute on one H100/H200. ``direct`` costs ~5-10 us of Python and launch per
# copy_ call and is timed 5 times: past 40K calls per op (~2 s a measurement) it is skipped.
GPU_QUICK = Config(
    items=(2048,), tokens=(1024, 8192, 32768), page_sizes=(1, 16), layouts=LAYOUTS,
    side_items=(256, 4096), side_tokens=8192, sweep_tokens=16384,
    block_quotas=(1, 2, 4, 8, 16, 32), max_direct_copies=40_000,
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


PARTS = ("all", "grid", "sweep")
"""``grid``: the method grid (``bench_transfer.json``); ``sweep``: the ``block_quota`` sweep and
the GEMM co-run, CUDA only (``bench_transfer_sweep.json``); ``all``: both, one file."""


def run(
    quick: bool = True, out_dir: Path = Path("results"), part: str = "all"
) -> dict[str, Any]:
    """Run the benchmark; print the tables; write JSON (and PNG). Returns the summary dict."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
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
        return _run(cfg, device, sgl, quick, out_dir, part)
    finally:
        torch.set_num_threads(threads)


SWEEP_COLUMNS = [Column("direction", "dir", 5), Column("tokens", "tokens", 8),
                 Column("block_quota", "bq", 5), Column("gbps", "GB/s", 9, ".2f"),
                 Column("ratio", "x ceil", 8, ".2f"), Column("median_ms", "ms", 10, ".3f")]
GEMM_COLUMNS = [Column("copy", "copy", 24), Column("copy_gbps", "copy GB/s", 10, ".2f"),
                Column("in_flight_kib", "KiB fly", 8, ".0f"),
                Column("gemm_ms", "GEMM ms", 10, ".3f"),
                Column("slowdown", "slowdown", 10, ".3f"), Column("covered", "overlap", 9)]


class Recorder:
    """Prints each row as it is measured (a header before the first row of each table) and
    rewrites ``bench_transfer.json`` after each one, marked ``partial`` until ``finish``."""

    TITLES = {
        "rows": ("", GRID_COLUMNS),
        "block_quota_sweep": ("block_quota sweep (triton, page_first, page size 1; x ceil = "
                              "ceiling time / time)", SWEEP_COLUMNS),
        "gemm_corun": (f"bf16 GEMM {GEMM_SIZE}^3 x10 on the compute stream, a copy looping on a "
                       "side stream (H2D one layer, page_first)", GEMM_COLUMNS),
    }  # fmt: skip

    def __init__(self, payload: dict[str, Any], out_dir: Path, name: str) -> None:
        self.payload = payload
        self.out_dir = out_dir
        self.name = name
        for key in self.TITLES:
            payload[key] = []
        payload["partial"] = True
        payload["skipped_for_time"] = []

    def emitter(self, key: str) -> Any:
        def emit(row: dict[str, Any]) -> None:
            title, cols = self.TITLES[key]
            if not self.payload[key]:
                print(("\n" + title + "\n" if title else "\n") + table_header(cols))
            self.payload[key].append(row)
            print(table_row(row, cols), flush=True)
            self.write()

        return emit

    def time_ok(self, what: str) -> Any:
        def ok() -> bool:
            if before_deadline():
                return True
            if what not in self.payload["skipped_for_time"]:
                self.payload["skipped_for_time"].append(what)
                print(f"[bench_transfer] deadline near: skipping {what}", flush=True)
            return False

        return ok

    def write(self) -> Path:
        return write_json(self.name, self.payload, self.out_dir)


def _run(
    cfg: Config, device: torch.device, sgl: ModuleType | None, quick: bool, out_dir: Path,
    part: str,
) -> dict[str, Any]:  # fmt: skip
    cuda = device.type == "cuda"
    seed = 0
    grid, sweep = part in ("all", "grid"), part in ("all", "sweep") and cuda
    payload: dict[str, Any] = {
        "part": part,
        "quick": quick,
        "timer": timer_name(device),
        "num_layers": NUM_LAYERS,
        "sgl_kernel": sgl is not None,
        "torch_threads": torch.get_num_threads(),
        "cpu_note": None if cuda else CPU_NOTE,
    }
    name = "bench_transfer_sweep" if part == "sweep" else "bench_transfer"
    rec = Recorder(payload, out_dir, name)
    if part in ("all", "sweep") and not cuda:
        payload["sweep_skipped"] = ("block_quota and warps sweeps and the GEMM co-run need CUDA: "
                                    "interpreted Triton kernels cannot be timed")  # fmt: skip
        print(f"[bench_transfer] skipped: {payload['sweep_skipped']}", flush=True)
    rows = rec.emitter("rows")
    for item in cfg.items:
        if not grid and not (sweep and item == 2048):
            continue
        pools = Pools.allocate(device, item, pool_slots(max(cfg.tokens)))
        if grid:
            measure_grid(cfg, device, sgl, item, cfg.tokens, cfg.page_sizes, cfg.layouts, pools,
                         seed, rows, rec.time_ok(f"grid item {item}"))  # fmt: skip
        if sweep and item == 2048 and cfg.block_quotas:
            sweep_block_quota(cfg, device, pools, seed, rec.emitter("block_quota_sweep"),
                              rec.time_ok("block_quota sweep"))  # fmt: skip
            gemm_slowdown(cfg, device, pools, seed, rec.emitter("gemm_corun"),
                          rec.time_ok("gemm co-run"))  # fmt: skip
        del pools
    for item in cfg.side_items if grid else ():
        pools = Pools.allocate(device, item, pool_slots(cfg.side_tokens))
        measure_grid(cfg, device, sgl, item, (cfg.side_tokens,), (1,),
                     ("layer_first", "page_first"), pools, seed, rows,
                     rec.time_ok(f"side item {item}"))  # fmt: skip
        del pools

    payload["headline"] = headline(payload["rows"], payload["block_quota_sweep"],
                                   payload["gemm_corun"], cpu=not cuda)  # fmt: skip
    payload["partial"] = False
    path = rec.write()
    png = plot(
        payload["rows"],
        out_dir / f"{name}.png",
        f"bench_transfer on {device} ({'CPU memcpy numbers' if not cuda else 'PCIe'})",
        cpu=not cuda,
    )
    print(f"\n[bench_transfer] wrote {path}" + (f" and {png}" if png else ""))
    for k, v in payload["headline"].items():
        print(f"  {k}: {v}")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Under 2 minutes on one GPU.")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    parser.add_argument("--part", choices=PARTS, default="all",
                        help="grid: the methods; sweep: block_quota sweep + GEMM co-run (CUDA); "
                        "all: both.")  # fmt: skip
    args = parser.parse_args(argv)
    run(quick=args.quick, out_dir=args.out, part=args.part)
    return 0

