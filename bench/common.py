"""Helpers the benchmarks share: the deadline ``bench/gpu_check.sh`` gives a step
(``time_left``), timing one call (``time_ms``: CUDA events on a GPU, ``perf_counter`` on a CPU),
result files with the machine and commit (``write_json``) and fixed-width tables."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.summary import machine_info, run_info

DEADLINE_ENV = "HICACHE_BENCH_DEADLINE"
"""Unix time by which a benchmark should have written its results (set by gpu_check.sh)."""


def time_left() -> float:
    """Seconds until ``$HICACHE_BENCH_DEADLINE`` (infinite when unset)."""
    deadline = os.environ.get(DEADLINE_ENV)
    return float("inf") if not deadline else float(deadline) - time.time()


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th / 80th percentiles."""

    median: float
    p20: float
    p80: float

    def as_dict(self) -> dict[str, float]:
        return {"median_ms": self.median, "p20_ms": self.p20, "p80_ms": self.p80}


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], Any],
    device: torch.device,
    warmup_ms: float = 10.0,
    rep_ms: float = 50.0,
    min_reps: int = 3,
) -> Timing:
    """Time ``fn`` (which launches work on the current stream, or runs on the CPU)."""
    if device.type == "cuda":
        return _time_cuda(fn, warmup_ms, rep_ms, min_reps)
    fn()  # warm-up (first-call allocations, lazy initialization)
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(samples) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarize(samples)


def _summarize(samples: list[float]) -> Timing:
    samples = sorted(samples)

    def q(f: float) -> float:
        return samples[min(len(samples) - 1, int(f * len(samples)))]

    return Timing(statistics.median(samples), q(0.2), q(0.8))


def _time_cuda(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, min_reps: int) -> Timing:
    """``do_bench``, except for calls so slow that ``min_reps`` of them exceed ``rep_ms``: those
    get ``min_reps`` event-timed calls (do_bench would first spend 5 calls estimating)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once() -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    fn()
    torch.cuda.synchronize()
    if once() * min_reps > rep_ms:
        return _summarize([once() for _ in range(min_reps)])
    from triton.testing import do_bench

    q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return Timing(*(float(x) for x in q))


def write_json(name: str, payload: dict[str, Any], out_dir: Path) -> Path:
    """Write ``payload`` (plus ``machine`` and ``run``: commit, time) to ``out_dir/NAME.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    body = {"machine": machine_info(), "run": run_info(), **payload}
    path.write_text(json.dumps(body, indent=2, default=str))
    return path


@dataclass(frozen=True)
class Column:
    """One table column: dict key, header, width and format spec (e.g. ``.2f``)."""

    key: str
    header: str
    width: int = 10
    fmt: str = ""


def table_header(columns: Sequence[Column]) -> str:
    """The header line and the rule under it."""
    head = "".join(f"{c.header:>{c.width}}" for c in columns)
    return head + "\n" + "-" * sum(c.width for c in columns)


def table_row(row: dict[str, Any], columns: Sequence[Column]) -> str:
    """One fixed-width line; missing or None cells print as ``-``."""
    cells = []
    for c in columns:
        value = row.get(c.key)
        text = "-" if value is None else format(value, c.fmt)
        cells.append(f"{text:>{c.width}}")
    return "".join(cells)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> None:
    """Print ``rows`` as a fixed-width table; missing or None cells print as ``-``."""
    print(table_header(columns))
    for row in rows:
        print(table_row(row, columns))


def number(
    kind: type, low: float = 0.0, high: float = math.inf, low_ok: bool = False
) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind`` (int or float) parsed from the flag, refused unless finite
    and in (``low``, ``high``] (``low`` included when ``low_ok``): a run over nothing is an error,
    not an empty table."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        above = value >= low if low_ok else value > low
        if not math.isfinite(value) or not above or value > high:
            where = f"{'[' if low_ok else '('}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be {noun} in {where}, got {text!r}")
        return value

    parse.__name__ = noun
    return parse


def positive(kind: type) -> Callable[[str], Any]:
    """``number(kind)``: finite and above zero."""
    return number(kind)
