"""How much slower a forward pass runs while the cache copies beside it (the co-run slowdown).

HiCache's copies here are kernels (SM-based on a GPU, a worker thread on a CPU), not copy
engines, so compute that overlaps a copy may slow down, and the copy with it. ``measure_corun``
times the benchmark's own model on one batch shape alone and while the cache's own H2D load op
loops beside it (CUDA: on a side stream, enough copies queued to cover the forward; CPU: on a
second thread, as the cache's stream worker runs it), and the copy alone and while forwards
loop beside it, in alternating rounds; each slowdown is the ratio of the medians. The virtual
clock stretches compute that overlaps a modelled copy by ``CorunSlowdown.factor``
(``bench.clock.streams_model``) and charges every copy at its co-run speed
(``copy_factor``: in a busy server a copy runs beside the next forward). A measurement below 1
(noise) is charged as 1.

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
    """``factor``: compute overlapping a copy takes ``factor`` times as long; ``copy_factor``:
    a copy beside compute takes that many times as long (both >= 1)."""

    factor: float
    source: str  # "measured", "flag" or "gpu_check"
    measured: dict[str, Any] = field(default_factory=dict)
    copy_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (self.factor >= 1.0 and self.copy_factor >= 1.0):
            raise ValueError(f"co-run slowdowns must be >= 1, got {self.factor}, "
                             f"{self.copy_factor}")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "copy_factor": self.copy_factor, "source": self.source,
                "measured": self.measured}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorunSlowdown:
        try:
            return cls(float(d["factor"]), str(d["source"]), dict(d.get("measured") or {}),
                       float(d.get("copy_factor", 1.0)))  # fmt: skip
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

    def copy_once() -> float:
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            t0, t1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            with torch.cuda.stream(side):
                t0.record()
                copy()
                t1.record()
            t1.synchronize()
            return t0.elapsed_time(t1) / 1e3
        t0 = clock()
        copy()
        return clock() - t0

    def fwd_once() -> None:
        model.forward_extend(pool, batch)

    forward()  # warm-up
    copy_once()
    alone_s = statistics.median(forward() for _ in range(3))
    copy_s = statistics.median(copy_once() for _ in range(3))
    alone, beside, c_alone, c_beside = [], [], [], []
    for _ in range(rounds):
        alone.append(forward())
        beside.append(_beside(forward, copy, device, alone_s, copy_s))
        c_alone.append(copy_once())
        c_beside.append(_beside(copy_once, fwd_once, device, copy_s, alone_s))
    ratio = statistics.median(beside) / statistics.median(alone)
    copy_ratio = statistics.median(c_beside) / statistics.median(c_alone)
    measured = {"alone_s": statistics.median(alone), "with_copy_s": statistics.median(beside),
                "ratio": ratio, "copy_alone_s": statistics.median(c_alone),
                "copy_with_forward_s": statistics.median(c_beside), "copy_ratio": copy_ratio,
                "rounds": rounds, "shape": list(shape),
                "timer": timer or ("wall" if device.type == "cuda" else "cpu"),
                "copy": "cache H2D load_to_device_per_layer, every layer, in a loop"}  # fmt: skip
    return CorunSlowdown(max(1.0, ratio), "measured", measured, max(1.0, copy_ratio))


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


def _beside(
    timed: Callable[[], float], background: Callable[[], None], device: torch.device,
    timed_s: float, background_s: float,
) -> float:  # fmt: skip
    """``timed()`` while ``background`` runs beside it: on CUDA queued first on another stream
    (enough passes to outlast ``timed``), on a CPU looping on a thread until it ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        other = torch.cuda.Stream(device)
        with torch.cuda.stream(other):
            for _ in range(max(2, int(2 * timed_s / max(background_s, 1e-6)) + 1)):
                background()
        t = timed()
        torch.cuda.synchronize(device)
        return t
    stop = threading.Event()
    running = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            background()
            running.set()

    worker = threading.Thread(target=loop, name="corun-background", daemon=True)
    worker.start()
    running.wait(timeout=5.0)
    try:
        return timed()
    finally:
        stop.set()
        worker.join()
