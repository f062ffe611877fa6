"""KV copies between device and host memory (``python -m bench.transfer [--quick] [--out DIR]
[--part headline|corun|all]``): GB/s of each copy path beside one contiguous copy of the same bytes
(the ceiling), and a GEMM's TFLOP/s alone and beside each path; on a CPU tiny sizes, labelled CPU
numbers. Rows go to JSON as measured, none within ``MARGIN_S`` of ``HICACHE_BENCH_DEADLINE``;
``HICACHE_BENCH_STALL_AFTER_ROWS=N`` hangs a run after its N-th row (the GPU check's test)."""

from __future__ import annotations

import argparse
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

from bench.common import Column, table_header, table_row, time_left, write_json
from hicache_prefill import kernels
from hicache_prefill.hicache.memory import host_ram
from hicache_prefill.hicache.transfer.streams import HIGH_PRIORITY
from hicache_prefill.kernels.ops.kernel_backend import DEFAULT_BLOCK_QUOTA

MARGIN_S, BUDGET_S = 2.0, 0.3  # no measurement this close to the deadline; seconds of reps
PATHS = ("kernel", "registered", "copy_engine", "direct")
CPU_NOTE = (
    "CPU numbers: no CUDA device; host memory on both sides (memcpy rates, not PCIe), "
    "the kernel path is the torch reference, a thread stands in for the side stream"
)
Row, Copy, BQ = dict[str, Any], tuple[Callable[[], None], int], DEFAULT_BLOCK_QUOTA


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
CPU_TINY = Sizes((256, 1024), 2048, 4, 16, 5, 256, 256, 8, (BQ,))


class Pools:
    """Device pool ``[2, L, T, W]`` and host pools: layer_first ``lf`` and page_first ``pf``
    (pinned on CUDA), and page_first ``reg`` (the host pool's own allocation: registered)."""

    def __init__(self, device: torch.device, item: int, layers: int, tokens: int, page: int):
        self.device, self.item, self.layers, self.page = device, item, layers, page
        self.cuda, bf, w = device.type == "cuda", torch.bfloat16, item // 2
        self.slots = math.ceil(tokens * 1.25 / page) * page + page  # device page 0: padding
        self.dev = torch.zeros(2, layers, self.slots, w, dtype=bf, device=device)
        self.lf = torch.zeros(2, layers, self.slots, w, dtype=bf, pin_memory=self.cuda)
        self.pf = torch.zeros(2, self.slots, layers, w, dtype=bf, pin_memory=self.cuda)
        self.reg, self.registered = host_ram.alloc_host_buffer(self.pf.shape, bf, self.cuda)
        self.tables = [kernels.data_ptr_table(list(self.dev[kv]), device) for kv in (0, 1)]

    def close(self) -> None:
        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.reg.data_ptr())

    def indices(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(host, device)`` CPU slots of ``n`` tokens in random whole pages."""
        gen, out = torch.Generator().manual_seed(seed), []
        for first in (0, 1):
            pages = torch.randperm(self.slots // self.page - first, generator=gen) + first
            rows = pages[: math.ceil(n / self.page), None] * self.page + torch.arange(self.page)
            out.append(rows.flatten()[:n].contiguous())
        return out[0], out[1]

    def copy(self, direction: str, path: str, n: int, seed: int = 0, bq: int = BQ) -> Copy:
        """One copy of ``n`` tokens (``h2d``: one layer; ``d2h``: all) by ``path`` (``PATHS`` or
        ``ceiling``), and the bytes it moves."""
        hc, dc = self.indices(n, seed)
        h, d, one = hc.to(self.device), dc.to(self.device), direction == "h2d"
        lay, item, ld, dev = self.layers // 2, self.item, self.item * self.layers, self.dev
        nbytes = n * 2 * item * (1 if one else self.layers)
        host = self.reg if path == "registered" else self.pf
        if path == "ceiling":
            a, b = dev.view(-1).view(torch.uint8), host.view(-1).view(torch.uint8)
            src, dst = (b, a) if one else (a, b)
            return lambda: dst[:nbytes].copy_(src[:nbytes], non_blocking=True), nbytes
        if path in ("kernel", "registered") and one:
            args = (host[0], dev[0, lay], host[1], dev[1, lay], h, d, lay, item, ld, bq)
            return lambda: kernels.transfer_kv_per_layer_pf_lf(*args), nbytes
        if path in ("kernel", "registered"):
            t, layers = self.tables, self.layers
            args = (t[0], host[0], t[1], host[1], d, h, item, ld, layers, bq)
            return lambda: kernels.transfer_kv_all_layer_lf_pf(*args), nbytes
        if path == "direct":
            src_l, dst_l = [*self.lf[:, lay]], [*dev[:, lay]]
            if not one:
                src_l, dst_l, hc, dc = [*dev[0], *dev[1]], [*self.lf[0], *self.lf[1]], dc, hc
            return lambda: kernels.transfer_kv_direct(src_l, dst_l, hc, dc, self.page), nbytes
        shape = (2, 1 if one else self.layers, n, item // 2)  # copy_engine
        stage = torch.empty(shape, dtype=torch.bfloat16, pin_memory=self.cuda)
        stage_d = torch.empty_like(stage, device=self.device)

        def staged() -> None:  # gather, one contiguous copy, scatter; the host's parts in order
            _sync(self.device)
            if one:
                torch.index_select(host[:, :, lay], 1, hc, out=stage[:, 0])
                stage_d.copy_(stage, non_blocking=True)
                dev[:, lay].index_copy_(1, d, stage_d[:, 0])
            else:
                stage.copy_(dev[:, :, d], non_blocking=True)
                _sync(self.device)
                host[:, hc] = stage.transpose(1, 2)

        return staged, nbytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def _stream(device: torch.device, priority: int) -> Any:
    return torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int, stream: Any = None) -> float:
    """Median ms of ``fn`` on ``stream`` after two warm-ups, up to ``reps`` in about ``BUDGET_S``,
    each after a synchronize (host-bound paths count their host time)."""
    cuda, samples = device.type == "cuda", []
    with torch.cuda.stream(stream):  # None: the current stream
        for i in range(reps + 2):
            _sync(device)
            if cuda:
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
            samples += [ms] if i >= 2 else []
            if len(samples) >= 3 and sum(samples) > BUDGET_S * 1e3:
                break
    return statistics.median(samples)


def _columns(spec: str) -> list[Column]:
    """Columns from ``key|header|width[|format]`` specs separated by commas."""
    return [Column(k, h, int(w), *f) for k, h, w, *f in (c.split("|") for c in spec.split(", "))]


COLUMNS = {
    "rows": _columns(
        "direction|dir|5, tokens|tokens|8, path|path|12, host|host mem|11, ms|ms|10|.3f, "
        "gbps|GB/s|9|.2f, ceiling_gbps|ceil GB/s|10|.2f, x_ceiling|x ceil|8|.2f"
    ),
    "corun": _columns(
        "path|copy beside|12, block_quota|bq|4, copy_gbps_alone|GB/s alone|11|.2f, "
        "copy_gbps_beside|GB/s beside|12|.2f, gemm_tflops|GEMM TFLOP/s|13|.3g, "
        "slowdown|slowdown|9|.3f, covered|covered|8"
    ),
}


class Recorder:
    """Prints each row and rewrites ``out_dir/<name>.json`` after it; ``ok(what)``: whether a
    measurement may still start."""

    def __init__(self, name: str, out_dir: Path, key: str, doc: dict[str, Any]) -> None:
        self.name, self.out_dir, self.key, self.doc = name, out_dir, key, doc
        doc.update({key: [], "partial": True, "skipped_for_time": [], "window_left_s": None})

    def ok(self, what: str) -> bool:
        left = time_left()
        if self.doc["window_left_s"] is None:
            self.doc["window_left_s"] = None if math.isinf(left) else round(left, 1)
        if left <= MARGIN_S:
            self.doc["skipped_for_time"].append(what)
            print(f"[bench_transfer] deadline near: skipping {what}", flush=True)
        return left > MARGIN_S

    def emit(self, row: Row) -> None:
        rows = self.doc[self.key]
        if not rows:
            print("\n" + table_header(COLUMNS[self.key]))
        rows.append(row)
        print(table_row(row, COLUMNS[self.key]), flush=True)
        write_json(self.name, self.doc, self.out_dir)
        if len(rows) == int(os.environ.get("HICACHE_BENCH_STALL_AFTER_ROWS", "0")):
            time.sleep(3600)


def measure_paths(pools: Pools, sz: Sizes, rec: Recorder) -> None:
    """Every path in both directions at each token count, each beside the ceiling."""
    dev, host = pools.device, "pinned" if pools.cuda else "plain"
    streams = {"h2d": _stream(dev, HIGH_PRIORITY), "d2h": _stream(dev, 0)}
    paths = [p for p in PATHS if pools.registered or p != "registered"]
    for n in sz.tokens:
        for direction in ("h2d", "d2h"):
            if not rec.ok(f"{direction} {n} tokens"):
                return
            fn, nbytes = pools.copy(direction, "ceiling", n)
            ceil = nbytes / time_ms(fn, dev, sz.reps, streams[direction]) / 1e6
            for path in (p for p in paths if rec.ok(f"{direction} {p}")):
                fn, nbytes = pools.copy(direction, path, n, seed=n)
                ms = time_ms(fn, dev, sz.reps, streams[direction])
                row = dict(direction=direction, tokens=n, path=path, host=host, bytes=nbytes)
                if path == "registered":
                    row["host"] = path
                row.update(ms=ms, gbps=(gbps := nbytes / ms / 1e6), ceiling_gbps=ceil)
                rec.emit(dict(row, x_ceiling=gbps / ceil))


def measure_corun(pools: Pools, sz: Sizes, rec: Recorder) -> None:
    """The GEMM alone, then beside each copy path (H2D of one layer looping on a high-priority
    side stream, enough copies to cover the GEMMs)."""
    dev, cuda, n = pools.device, pools.cuda, sz.corun_tokens
    a = torch.randn(sz.gemm, sz.gemm, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
    b, c, side = torch.randn_like(a), torch.empty_like(a), _stream(dev, HIGH_PRIORITY)
    flop = 2 * sz.gemm**3 * sz.gemm_reps

    def gemm() -> None:
        for _ in range(sz.gemm_reps):
            torch.mm(a, b, out=c)

    if not rec.ok("gemm alone"):
        return
    alone = time_ms(gemm, dev, 5)
    rec.emit(dict(path="none", gemm_tflops=flop / alone / 1e9, slowdown=1.0))
    paths = [(p, None) for p in ("ceiling", "copy_engine", "direct")]
    for path, bq in paths + [("kernel", bq) for bq in sz.block_quotas]:
        if not rec.ok(f"corun {path} bq={bq}"):
            return
        fn, nbytes = pools.copy("h2d", path, n, bq=bq or BQ)
        copy_ms = time_ms(fn, dev, sz.reps, side)
        k = max(2, math.ceil(1.2 * alone / copy_ms))
        g_ms, c_ms = sorted(_corun(gemm, fn, k, side, cuda) for _ in range(3))[1]
        row = dict(path=path, block_quota=bq, copy_gbps_alone=nbytes / copy_ms / 1e6)
        row.update(copy_gbps_beside=k * nbytes / c_ms / 1e6, gemm_tflops=flop / g_ms / 1e9)
        rec.emit(dict(row, slowdown=g_ms / alone, covered=c_ms >= g_ms))


def _corun(
    gemm: Callable[[], None], copy: Callable[[], None], k: int, side: Any, cuda: bool
) -> tuple[float, float]:
    """``(GEMM ms, ms of k copies)``, the copies beside the GEMMs."""
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


def headline(key: str, rows: list[Row]) -> dict[str, Any]:
    """The key numbers of ``rows`` (``key``: ``rows`` or ``corun``)."""
    out: dict[str, Any] = {}
    for direction in ("h2d", "d2h") if key == "rows" else ():
        if sel := [r for r in rows if r["direction"] == direction]:
            at = [r for r in sel if r["tokens"] == (n := max(r["tokens"] for r in sel))]
            parts = [(r["path"], r["gbps"]) for r in at] + [("ceiling", at[0]["ceiling_gbps"])]
            out[f"{direction} {n} tok GB/s"] = ", ".join(f"{k} {v:.1f}" for k, v in parts)
    for r in rows if key == "corun" else ():
        if r["path"] == "none":
            out["GEMM TFLOP/s alone"] = round(r["gemm_tflops"], 3)
        elif r["block_quota"] in (None, BQ):
            out[f"GEMM slowdown beside {r['path']}"] = round(r["slowdown"], 3)
    return out


PARTS = {
    "headline": ("bench_transfer", "rows", measure_paths),
    "corun": ("bench_transfer_corun", "corun", measure_corun),
}


def run(quick: bool = True, out_dir: Path = Path("bench-out"), part: str = "all") -> dict[str, Any]:
    """Measure ``part`` (headline, corun or all) into ``bench_transfer[_corun].json``."""
    cuda = torch.cuda.is_available()
    sz = (GPU_QUICK if quick else GPU_FULL) if cuda else CPU_TINY
    name = torch.cuda.get_device_name() if cuda else "cpu"
    base = dict(device=name, cpu_note=None if cuda else CPU_NOTE, sizes=asdict(sz))
    print(f"[bench_transfer] {name}; {'GPU numbers (CUDA events)' if cuda else CPU_NOTE}")
    device = torch.device("cuda" if cuda else "cpu")
    pools = Pools(device, sz.item, sz.layers, max(*sz.tokens, sz.corun_tokens), sz.page)
    result: dict[str, Any] = {"rows": [], "corun": [], "headline": {}}
    try:
        for file, key, measure in (PARTS[p] for p in PARTS if part in (p, "all")):
            rec = Recorder(file, out_dir, key, dict(base))
            measure(pools, sz, rec)
            result[key] = rec.doc[key]
            rec.doc.update(partial=False, headline=headline(key, result[key]))
            write_json(file, rec.doc, out_dir)
            result["headline"].update(rec.doc["headline"])
    finally:
        pools.close()
    print("\n".join(f"  {k}: {v}" for k, v in result["headline"].items()))
    return {**base, **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="Quick sizes (about a minute on a GPU).")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    p.add_argument("--part", choices=("headline", "corun", "all"), default="all")
    args = p.parse_args(argv)
    run(quick=args.quick, out_dir=args.out, part=args.part)
    return 0
