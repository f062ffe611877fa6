"""How much slower a forward pass runs while the cache copies beside it (the co-run slowdown).

HiCache's copies here are kernels (SM-based on a GPU, a worker thread on a CPU), not copy
engines, so compute that overlaps a copy may slow down. ``measure_corun`` times the benchmark's
own model on one batch shape alone and while the cache's own H2D load op loops beside it (CUDA:
on a side stream, enough copies queued to cover the forward; CPU: on a second thread, as the
cache's stream worker runs it), in alternating rounds; the slowdown is the ratio of the medians.
The virtual clock stretches compute that overlaps a modelled copy by ``CorunSlowdown.factor``
(``bench.clock.streams_model``). A measurement below 1 (noise) is charged as 1.

Other sources: ``--corun-slowdown X`` (``flag``), or ``--corun-from FILE``: the GPU check's
GEMM co-run measurement (``bench_transfer_sweep.json``, row ``triton bq=<block_quota>``;
``gpu_check``).
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import call_timer, sync_device

__all__ = ["CorunSlowdown", "corun_from_gpu_check", "measure_corun"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorunSlowdown:
    """``factor``: compute overlapping a copy takes ``factor`` times as long (>= 1)."""

    factor: float
    source: str  # "measured", "flag" or "gpu_check"
    measured: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"co-run slowdown must be >= 1, got {self.factor}")

    def as_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "source": self.source, "measured": self.measured}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorunSlowdown:
        try:
            return cls(float(d["factor"]), str(d["source"]), dict(d.get("measured") or {}))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"corun: missing or bad field ({exc!r}) in {sorted(d)}") from None


def corun_from_gpu_check(path: Path, block_quota: int = 2) -> CorunSlowdown:
    """The GPU check's GEMM co-run slowdown of the triton H2D copy at ``block_quota`` (SGLang's
    default 2) from ``bench_transfer_sweep.json`` (``ValueError`` naming what is missing)."""
    data = json.loads(Path(path).read_text())
    rows = data.get("gemm_corun") or []
    name = f"triton bq={block_quota}"
    for row in rows:
        if row.get("copy") == name and row.get("slowdown") is not None:
            factor = max(1.0, float(row["slowdown"]))
            return CorunSlowdown(factor, "gpu_check", {"file": str(path), "row": row})
    raise ValueError(f"--corun-from {path}: no gemm_corun row {name!r} with a slowdown")


def measure_corun(
    model: Any,
    pool: Any,
    cache: Any,
    shape: tuple[int, int],
    rounds: int = 9,
    timer: str | None = None,
) -> CorunSlowdown:
    """The forward of one request of ``shape`` (new, prefix tokens) on ``pool`` (the model's
    geometry; slots overwritten), alone and while ``cache``'s H2D per-layer load op copies
    1024 tokens (or what fits) again and again beside it; see the module docstring. ``cache``:
    a hierarchical ``KVCache`` holding nothing yet (its pools are overwritten)."""
    from prefill.model.paged import ExtendInput

    n, p = shape
    device = pool.device
    page = pool.page_size
    gen = torch.Generator().manual_seed(2)
    slots = torch.arange(page, page + n + p, device=device)
    ids = torch.randint(1, model.config.vocab_size, (n,), generator=gen)
    batch = [ExtendInput(ids, slots, p)]
    copy = _load_loop(cache)
    clock = call_timer(device, timer)

    def forward() -> float:
        if device.type == "cuda":  # events on the compute stream: copies queued elsewhere run on
            t0, t1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            t0.record()
            model.forward_extend(pool, batch)
            t1.record()
            t1.synchronize()
            return t0.elapsed_time(t1) / 1e3
        sync_device(device)
        t0 = clock()
        model.forward_extend(pool, batch)
        return clock() - t0

    forward()  # warm-up
    alone_s = statistics.median(forward() for _ in range(3))
    alone, beside = [], []
    for _ in range(rounds):
        alone.append(forward())
        beside.append(_with_copies(forward, copy, device, alone_s))
    ratio = statistics.median(beside) / statistics.median(alone)
    measured = {"alone_s": statistics.median(alone), "with_copy_s": statistics.median(beside),
                "ratio": ratio, "rounds": rounds, "shape": list(shape),
                "timer": timer or ("wall" if device.type == "cuda" else "cpu"),
                "copy": "cache H2D load_to_device_per_layer, every layer, in a loop"}  # fmt: skip
    return CorunSlowdown(max(1.0, ratio), "measured", measured)


def _load_loop(cache: Any) -> Callable[[], None]:
    """One pass of H2D loads of every layer with the cache's own op (indices prepared once)."""
    host, dev, io = cache.host_pool, cache.device_pool, cache.controller.io_backend
    page = dev.page_size
    tokens = max(page, min(1024, (min(dev.size, host.size) // page - 2) * page))
    d_idx = torch.arange(page, page + tokens)
    h_idx = torch.arange(tokens)
    if io == "kernel":
        h_idx, d_idx = h_idx.to(dev.device), d_idx.to(dev.device)

    def once() -> None:
        for layer in range(dev.layer_num):
            host.load_to_device_per_layer(dev, h_idx, d_idx, layer, io)

    return once


def _with_copies(
    forward: Callable[[], float], copy: Callable[[], None], device: torch.device, alone_s: float
) -> float:
    """``forward()`` while ``copy`` runs beside it: on CUDA queued on a side stream first
    (enough passes to outlast the forward), on a CPU looping on a thread until it ends."""
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            copy()
            end.record()
        end.synchronize()
        once_s = max(start.elapsed_time(end) / 1e3, 1e-6)
        torch.cuda.synchronize(device)
        with torch.cuda.stream(side):
            for _ in range(max(2, int(2 * alone_s / once_s) + 1)):
                copy()
        t = forward()
        torch.cuda.synchronize(device)
        return t
    stop = threading.Event()
    running = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            copy()
            running.set()

    worker = threading.Thread(target=loop, name="corun-copy", daemon=True)
    worker.start()
    running.wait(timeout=5.0)
    try:
        return forward()
    finally:
        stop.set()
        worker.join()
