"""KV copies between device and host memory: GB/s per copy path, and what a copy costs a GEMM.

- ``headline``: 2 KiB items (one token's K or V in one layer of the Llama-3-8B shape), random
  pages, H2D of one layer on a high-priority stream (as the cache's load stream) and D2H of all
  layers: the Triton ``kernel`` (page_first host), ``copy_engine`` (gather, one contiguous copy,
  scatter), ``direct`` (one copy per page, layer_first host), and the kernel on host memory
  registered as the host pool registers it (``registered``: malloc + ``cudaHostRegister``; the
  others use ``pin_memory``). GB/s counts the bytes the indices name; each row also has one
  contiguous copy of the same bytes (``ceiling``). Times: median of repetitions after warm-up
  (CUDA events, a synchronize before each).
- ``corun``: a bf16 GEMM's TFLOP/s alone and while each copy path loops on a high-priority side
  stream (the kernel at each ``block_quota``), and each copy's GB/s alone and beside it.

On a CPU: tiny sizes, host memory on both sides, the kernel path is the torch reference of the
op and a thread stands in for the side stream: CPU numbers, labelled so. Rows are printed and
written to JSON as measured (``partial`` until the end); none starts within ``MARGIN_S`` of the
step's deadline (``HICACHE_BENCH_DEADLINE``). ``HICACHE_BENCH_STALL_AFTER_ROWS=N`` makes a run
hang after its N-th row (how the GPU check's dry run proves a killed step keeps its rows).

``python -m bench.transfer [--quick] [--out DIR] [--part headline|corun|all]``
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import kernels
from bench.common import Column, table_header, table_row, time_left, write_json
from hicache.memory import host_ram
from hicache.transfer.streams import HIGH_PRIORITY
from kernels.ops.kernel_backend import DEFAULT_BLOCK_QUOTA

MARGIN_S = 2.0
BUDGET_S = 0.3  # seconds of repetitions per measurement, at least 3
PATHS = ("kernel", "registered", "copy_engine", "direct")
CPU_NOTE = (
    "CPU numbers: no CUDA device; host memory on both sides (memcpy rates, not PCIe), "
    "the kernel path is the torch reference, a thread stands in for the side stream"
)


@dataclass(frozen=True)
class Sizes:
    tokens: tuple[int, ...]  # headline token counts
    item: int  # bytes per token, layer and K or V
    layers: int  # layers of the pools (GB/s does not depend on it)
    page: int
    reps: int  # most repetitions of one measurement
    corun_tokens: int
    gemm: int  # GEMM side (bf16 on CUDA, fp32 on a CPU)
    gemm_reps: int
    block_quotas: tuple[int, ...]


GPU_QUICK = Sizes((8192, 32768), 2048, 8, 16, 10, 16384, 8192, 40, (1, 2, 4, 8, 16, 32))
GPU_FULL = replace(GPU_QUICK, tokens=(1024, 8192, 32768, 131072), reps=30)
CPU_TINY = Sizes((256, 1024), 2048, 4, 16, 5, 256, 256, 8, (DEFAULT_BLOCK_QUOTA,))


class Pools:
    """Device pool ``[2, L, T, W]`` and host pools: layer_first ``lf`` and page_first ``pf``
    (pinned on CUDA) and page_first ``reg`` (the host pool's own allocation: registered)."""

    def __init__(
        self, device: torch.device, item: int, layers: int, max_tokens: int, page: int
    ) -> None:
        self.device, self.item, self.layers, self.page = device, item, layers, page
        self.cuda = device.type == "cuda"
        self.slots = math.ceil(max_tokens * 1.25 / page) * page + page  # page 0: padding
        w, bf = item // 2, torch.bfloat16
        self.dev = torch.zeros(2, layers, self.slots, w, dtype=bf, device=device)
        self.lf = torch.zeros(2, layers, self.slots, w, dtype=bf, pin_memory=self.cuda)
        self.pf = torch.zeros(2, self.slots, layers, w, dtype=bf, pin_memory=self.cuda)
        self.reg, self.registered = host_ram.alloc_host_buffer(self.pf.shape, bf, self.cuda)
        self.tables = [kernels.data_ptr_table(list(self.dev[kv]), device) for kv in (0, 1)]

    def close(self) -> None:
        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.reg.data_ptr())
            self.registered = False

    def indices(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(host, device)`` slots of ``n`` tokens in random whole pages (device page 0 is
        padding), on the CPU."""
        gen = torch.Generator().manual_seed(seed)
        out = []
        for first in (0, 1):
            pages = torch.randperm(self.slots // self.page - first, generator=gen) + first
            rows = pages[: math.ceil(n / self.page), None] * self.page + torch.arange(self.page)
            out.append(rows.flatten()[:n].contiguous())
        return out[0], out[1]

    def copy(
        self,
        direction: str,
        path: str,
        n: int,
        seed: int = 0,
        block_quota: int = DEFAULT_BLOCK_QUOTA,
    ) -> tuple[Callable[[], None], int]:
        """One copy of ``n`` tokens (``h2d``: one layer; ``d2h``: all layers) by ``path``
        (``PATHS`` or ``ceiling``) and the bytes it moves."""
        hc, dc = self.indices(n, seed)
        h, d = hc.to(self.device), dc.to(self.device)
        lay, item, ld = self.layers // 2, self.item, self.item * self.layers
        nbytes = n * 2 * item * (1 if direction == "h2d" else self.layers)
        dev, host = self.dev, self.reg if path == "registered" else self.pf
        if path == "ceiling":
            a, b = dev.view(-1).view(torch.uint8), self.pf.view(-1).view(torch.uint8)
            src, dst = (b, a) if direction == "h2d" else (a, b)
            return lambda: dst[:nbytes].copy_(src[:nbytes], non_blocking=True), nbytes
        if path in ("kernel", "registered") and direction == "h2d":
            return lambda: kernels.transfer_kv_per_layer_pf_lf(
                host[0], dev[0, lay], host[1], dev[1, lay], h, d, lay, item, ld, block_quota
            ), nbytes
        if path in ("kernel", "registered"):
            t = self.tables
            return lambda: kernels.transfer_kv_all_layer_lf_pf(
                t[0], host[0], t[1], host[1], d, h, item, ld, self.layers, block_quota
            ), nbytes
        if path == "direct":
            if direction == "h2d":
                srcs, dsts, si, di = [*self.lf[:, lay]], [*dev[:, lay]], hc, dc
            else:
                srcs, dsts, si, di = [*dev[0], *dev[1]], [*self.lf[0], *self.lf[1]], dc, hc
            return lambda: kernels.transfer_kv_direct(srcs, dsts, si, di, self.page), nbytes
        if direction == "h2d":  # copy_engine: gather on the host, one copy, scatter
            stage_h = torch.empty(2, n, item // 2, dtype=torch.bfloat16, pin_memory=self.cuda)
            stage_d = torch.empty_like(stage_h, device=self.device)

            def staged_h2d() -> None:
                torch.index_select(host[0][:, lay], 0, hc, out=stage_h[0])
                torch.index_select(host[1][:, lay], 0, hc, out=stage_h[1])
                stage_d.copy_(stage_h, non_blocking=True)
                dev[0, lay].index_copy_(0, d, stage_d[0])
                dev[1, lay].index_copy_(0, d, stage_d[1])

            return staged_h2d, nbytes
        stage = torch.empty(
            2, self.layers, n, item // 2, dtype=torch.bfloat16, pin_memory=self.cuda
        )

        def staged_d2h() -> None:
            stage.copy_(dev[:, :, d], non_blocking=True)
            _sync(self.device)  # the host scatters what the copy brought
            host[:, hc] = stage.transpose(1, 2)

        return staged_d2h, nbytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int, stream: Any = None) -> float:
    """Median milliseconds of ``fn`` on ``stream`` after two warm-up calls: up to ``reps``
    repetitions within about ``BUDGET_S``, each after a synchronize (so host-bound paths count
    their host time). CUDA events on CUDA, ``perf_counter`` on a CPU."""
    cuda = device.type == "cuda"
    with torch.cuda.stream(stream) if cuda and stream is not None else contextlib.nullcontext():
        samples: list[float] = []
        for i in range(reps + 2):
            if cuda:
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= 2:
                samples.append(ms)
                if len(samples) >= 3 and sum(samples) > BUDGET_S * 1e3:
                    break
    return statistics.median(samples)


COLUMNS = {
    "rows": [
        Column("direction", "dir", 5),
        Column("tokens", "tokens", 8),
        Column("path", "path", 12),
        Column("host", "host mem", 11),
        Column("ms", "ms", 10, ".3f"),
        Column("gbps", "GB/s", 9, ".2f"),
        Column("ceiling_gbps", "ceil GB/s", 10, ".2f"),
        Column("x_ceiling", "x ceil", 8, ".2f"),
    ],
    "corun": [
        Column("path", "copy beside", 12),
        Column("block_quota", "bq", 4),
        Column("copy_gbps_alone", "GB/s alone", 11, ".2f"),
        Column("copy_gbps_beside", "GB/s beside", 12, ".2f"),
        Column("gemm_tflops", "GEMM TFLOP/s", 13, ".1f"),
        Column("slowdown", "slowdown", 9, ".3f"),
        Column("covered", "covered", 8),
    ],
}


class Recorder:
    """Prints each row as measured and rewrites ``out_dir/<name>.json`` after it (``partial``
    until ``finish``); ``ok(what)``: whether a measurement may still start."""

    def __init__(self, name: str, out_dir: Path, key: str, payload: dict[str, Any]) -> None:
        self.name, self.out_dir, self.key, self.doc = name, out_dir, key, payload
        payload.update({key: [], "partial": True, "skipped_for_time": [], "window_left_s": None})

    def ok(self, what: str) -> bool:
        left = time_left()
        if self.doc["window_left_s"] is None:
            self.doc["window_left_s"] = None if math.isinf(left) else round(left, 1)
        if left > MARGIN_S:
            return True
        self.doc["skipped_for_time"].append(what)
        print(f"[bench_transfer] deadline near: skipping {what}", flush=True)
        return False

    def emit(self, row: dict[str, Any]) -> None:
        rows = self.doc[self.key]
        if not rows:
            print("\n" + table_header(COLUMNS[self.key]))
        rows.append(row)
        print(table_row(row, COLUMNS[self.key]), flush=True)
        self.write()
        if len(rows) == int(os.environ.get("HICACHE_BENCH_STALL_AFTER_ROWS", "0")):
            time.sleep(3600)

    def write(self) -> None:
        write_json(self.name, self.doc, self.out_dir)

    def finish(self, headline: dict[str, Any]) -> dict[str, Any]:
        self.doc.update(partial=False, headline=headline)
        self.write()
        return self.doc


def measure_paths(
    pools: Pools,
    tokens: tuple[int, ...],
    reps: int,
    emit: Callable[[dict[str, Any]], None] = lambda r: None,
    ok: Callable[[str], bool] = lambda w: True,
) -> list[dict[str, Any]]:
    """Every path in both directions at each token count, each beside the ceiling."""
    rows, dev = [], pools.device
    streams = {"h2d": _stream(dev, HIGH_PRIORITY), "d2h": _stream(dev, 0)}
    for n in tokens:
        for direction in ("h2d", "d2h"):
            if not ok(f"{direction} {n} tokens"):
                return rows
            fn, nbytes = pools.copy(direction, "ceiling", n)
            ceil = nbytes / time_ms(fn, dev, reps, streams[direction]) / 1e6
            for path in PATHS:
                if (path == "registered" and not pools.registered) or not ok(f"{direction} {path}"):
                    continue
                fn, nbytes = pools.copy(direction, path, n, seed=n)
                ms = time_ms(fn, dev, reps, streams[direction])
                host = "pinned" if pools.cuda else "pageable"
                row = dict(direction=direction, tokens=n, path=path, bytes=nbytes, ms=ms)
                gbps = nbytes / ms / 1e6
                row.update(host="registered" if path == "registered" else host, gbps=gbps)
                rows.append(dict(row, ceiling_gbps=ceil, x_ceiling=gbps / ceil))
                emit(rows[-1])
    return rows


def _stream(device: torch.device, priority: int) -> Any:
    return torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None


def measure_corun(
    pools: Pools, sz: Sizes, emit: Callable[[dict[str, Any]], None], ok: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """The GEMM alone, then beside each copy path (H2D of one layer, looping on a
    high-priority side stream long enough to cover the GEMMs)."""
    dev, cuda, n = pools.device, pools.cuda, sz.corun_tokens
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(sz.gemm, sz.gemm, dtype=dtype, device=dev)
    b, c = torch.randn_like(a), torch.empty_like(a)
    flop = 2 * sz.gemm**3 * sz.gemm_reps

    def gemm() -> None:
        for _ in range(sz.gemm_reps):
            torch.mm(a, b, out=c)

    side = _stream(dev, HIGH_PRIORITY)
    rows: list[dict[str, Any]] = []
    if not ok("gemm alone"):
        return rows
    alone = time_ms(gemm, dev, 5)
    rows.append(dict(path="none", gemm_tflops=flop / alone / 1e9, slowdown=1.0))
    emit(rows[-1])
    paths = [("ceiling", DEFAULT_BLOCK_QUOTA), ("copy_engine", None), ("direct", None)]
    paths += [("kernel", bq) for bq in sz.block_quotas]
    for path, bq in paths:
        if not ok(f"corun {path} bq={bq}"):
            return rows
        fn, nbytes = pools.copy("h2d", path, n, block_quota=bq or DEFAULT_BLOCK_QUOTA)
        copy_ms = time_ms(fn, dev, sz.reps, side)
        k = max(2, math.ceil(1.2 * alone / copy_ms))
        runs = sorted(_corun(gemm, fn, k, side, cuda) for _ in range(3))
        g_ms, c_ms = runs[1]
        row = dict(path=path, block_quota=bq, copy_gbps_alone=nbytes / copy_ms / 1e6)
        row.update(copy_gbps_beside=k * nbytes / c_ms / 1e6, gemm_tflops=flop / g_ms / 1e9)
        rows.append(dict(row, slowdown=g_ms / alone, covered=c_ms >= g_ms))
        emit(rows[-1])
    return rows


def _corun(
    gemm: Callable[[], None], copy: Callable[[], None], k: int, side: Any, cuda: bool
) -> tuple[float, float]:
    """``(GEMM ms, ms of k copies)`` with the copies beside the GEMMs."""
    if not cuda:
        end: list[float] = []

        def loop() -> None:
            for _ in range(k):
                copy()
            end.append(time.perf_counter())

        th, t0 = threading.Thread(target=loop), time.perf_counter()
        th.start()
        gemm()
        g = time.perf_counter() - t0
        th.join()
        return g * 1e3, (end[0] - t0) * 1e3
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    ev[0].record()
    gemm()  # queued first: the copies start beside it
    ev[1].record()
    with torch.cuda.stream(side):
        ev[2].record()
        for _ in range(k):
            copy()
        ev[3].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])


def headline(rows: list[dict[str, Any]], corun: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for direction in ("h2d", "d2h"):
        sel = [r for r in rows if r["direction"] == direction]
        if sel:
            n = max(r["tokens"] for r in sel)
            at = {r["path"]: r for r in sel if r["tokens"] == n}
            parts = [f"{p} {r['gbps']:.1f}" for p, r in at.items()]
            ceil = next(iter(at.values()))["ceiling_gbps"]
            out[f"{direction} {n} tok GB/s"] = ", ".join(parts) + f", ceiling {ceil:.1f}"
    for r in corun:
        if r["path"] == "none":
            out["GEMM TFLOP/s alone"] = round(r["gemm_tflops"], 1)
        elif r["path"] != "kernel" or r["block_quota"] == DEFAULT_BLOCK_QUOTA:
            out[f"GEMM slowdown beside {r['path']}"] = round(r["slowdown"], 3)
    return out


def run(quick: bool = True, out_dir: Path = Path("results"), part: str = "all") -> dict[str, Any]:
    """Measure ``part`` (headline, corun or all); print tables; write ``bench_transfer.json``
    and ``bench_transfer_corun.json``. Returns the headline part's document (corun under
    ``corun``)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sz = (GPU_QUICK if quick else GPU_FULL) if cuda else CPU_TINY
    base = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        cpu_note=None if cuda else CPU_NOTE,
        sizes=asdict(sz),
        timer="CUDA events" if cuda else "perf_counter",
    )
    print(f"[bench_transfer] {base['device']}; {CPU_NOTE if not cuda else 'GPU numbers'}")
    pools = Pools(device, sz.item, sz.layers, max(*sz.tokens, sz.corun_tokens), sz.page)
    docs: dict[str, Any] = {}
    try:
        if part in ("headline", "all"):
            rec = Recorder("bench_transfer", out_dir, "rows", dict(base))
            rows = measure_paths(pools, sz.tokens, sz.reps, rec.emit, rec.ok)
            docs["headline"] = rec.finish(headline(rows, []))
        if part in ("corun", "all"):
            rec = Recorder("bench_transfer_corun", out_dir, "corun", dict(base))
            docs["corun"] = rec.finish(headline([], measure_corun(pools, sz, rec.emit, rec.ok)))
    finally:
        pools.close()
    result = docs.get("headline") or {"headline": {}}
    if "corun" in docs:
        result = {**result, "corun": docs["corun"]["corun"]}
        result["headline"] = {**result["headline"], **docs["corun"]["headline"]}
    for k, v in result["headline"].items():
        print(f"  {k}: {v}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="Quick sizes (about a minute on a GPU).")
    p.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    p.add_argument("--part", choices=("headline", "corun", "all"), default="all")
    args = p.parse_args(argv)
    run(quick=args.quick, out_dir=args.out, part=args.part)
    return 0
