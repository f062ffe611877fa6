"""How much slower a forward pass runs while the cache copies beside it (the co-run slowdown).

HiCache's copies here are kernels (SM-based on a GPU, a worker thread on a CPU), not copy
engines, so compute that overlaps a copy may slow down, and the copy with it. ``measure_corun``
times the benchmark's own model alone and while the cache copies beside it, and the copies
alone and beside the forward, in alternating rounds; each slowdown is the ratio of the medians.
A measurement below 1 (noise) is charged as 1.

- CUDA: the cache's H2D load op queued on a side stream, enough copies to cover the forward,
  timed by events on each stream.
- CPU: backups of ``job_tokens`` tokens queued through the cache's own controller, enough to
  outlast the forward; its write stream's worker thread runs them beside the forward exactly as
  in a run (index moves, the op, the events), each copy timed by its own stream events. What
  slows a CPU forward is mostly the job's Python, which holds the interpreter: measured against
  the bare op looping on a private thread, a short forward's slowdown came out 1.3-1.4, where
  the forwards of a wall-clock run beside the cache's backups of a few pages were 1.5-2.0 times
  their table cost; beside these queued backups it is 1.6-2.4.

The slowdown depends on the forward: on a CPU a short forward (a few tokens after a long
prefix: many small ops, each taking the interpreter lock back from the copy thread) is slowed
by a half or more, a long one (a few large matmuls) by a fifth or less. So it is measured at
several shapes of the forward table (``corun_shapes``: the shortest forward after the longest
prefix, one in the middle, the longest without a prefix) and kept as ``points``:
``(forward seconds alone, factor, copy_factor)``; ``factor_at(seconds)`` and
``copy_factor_at(seconds)`` interpolate them linearly in the logarithm of the forward's cost
(clamped at both ends). The virtual clock stretches each forward's compute that overlaps a
modelled copy by the factor at that forward's cost (``bench.clock.streams_model``) and the copy
by the copy factor. On a CPU the co-run is timed on the wall clock whatever the calibration's
timer: what the copy thread takes from the forward (the interpreter lock, memory bandwidth) is
wall time, not the forward thread's CPU time.

Other sources (one factor for every forward): ``--corun-slowdown X`` (``flag``), or
``--corun-from FILE``: the GPU check's GEMM co-run measurement (``bench_transfer_sweep.json``,
row ``triton bq=<block_quota>``; ``gpu_check``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CorunSlowdown", "corun_from_gpu_check", "corun_shapes", "measure_corun"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorunSlowdown:
    """``factor``: compute overlapping a copy takes ``factor`` times as long; ``copy_factor``:
    a copy beside compute takes that many times as long (both >= 1). ``points``: per forward
    cost ``(alone_s, factor, copy_factor)``, sorted by ``alone_s`` (module docstring); without
    points every forward gets ``factor`` and ``copy_factor``, with them those two are the
    largest of the points (what the console prints beside the range)."""

    factor: float
    source: str  # "measured", "flag" or "gpu_check"
    measured: dict[str, Any] = field(default_factory=dict)
    copy_factor: float = 1.0
    points: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        values = [self.factor, self.copy_factor] + [x for p in self.points for x in p[1:]]
        if not all(v >= 1.0 for v in values):
            raise ValueError(f"co-run slowdowns must be >= 1, got {values}")
        if any(p[0] <= 0 for p in self.points) or list(self.points) != sorted(self.points):
            raise ValueError(f"co-run points must be sorted by a positive forward time, got "
                             f"{self.points}")  # fmt: skip

    def factor_at(self, seconds: float) -> float:
        """The compute slowdown of a forward that costs ``seconds`` alone."""
        return self._at(seconds, 1) if self.points else self.factor

    def copy_factor_at(self, seconds: float) -> float:
        """The slowdown of a copy beside a forward that costs ``seconds`` alone."""
        return self._at(seconds, 2) if self.points else self.copy_factor

    def _at(self, seconds: float, k: int) -> float:
        pts = self.points
        if seconds <= pts[0][0]:
            return pts[0][k]
        for lo, hi in zip(pts[:-1], pts[1:], strict=True):
            if seconds <= hi[0]:
                w = math.log(seconds / lo[0]) / math.log(hi[0] / lo[0])
                return lo[k] + w * (hi[k] - lo[k])
        return pts[-1][k]

    def range_text(self) -> str:
        """``compute x1.32..x1.02, copy x1.30..x1.05`` (shortest forward first)."""
        if not self.points:
            return f"compute x{self.factor:.3f}, copy x{self.copy_factor:.3f}"
        a, b = self.points[0], self.points[-1]
        return (f"compute x{a[1]:.3f}..x{b[1]:.3f}, copy x{a[2]:.3f}..x{b[2]:.3f} over "
                f"{a[0] * 1e3:.1f}..{b[0] * 1e3:.1f} ms forwards")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "copy_factor": self.copy_factor, "source": self.source,
                "points": [list(p) for p in self.points],
                "measured": self.measured}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorunSlowdown:
        try:
            points = tuple(tuple(float(x) for x in p) for p in d.get("points") or ())
            return cls(float(d["factor"]), str(d["source"]), dict(d.get("measured") or {}),
                       float(d.get("copy_factor", 1.0)), points)  # type: ignore[arg-type]
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


def corun_shapes(ns: list[int], ps: list[int]) -> list[tuple[int, int]]:
    """The shapes the co-run is measured at, from a forward table's ``ns`` and ``ps``: the
    shortest forward after the longest prefix, a middle one after it, and the longest without
    a prefix (duplicates dropped)."""
    mid = ns[len(ns) // 2]
    out: list[tuple[int, int]] = []
    for shape in ((ns[0], ps[-1]), (mid, ps[-1]), (ns[-1], 0)):
        if shape not in out:
            out.append(shape)
    return out


def measure_corun(
    model: Any,
    make_pool: Callable[[int], Any],
    cache: Any,
    shapes: list[tuple[int, int]],
    rounds: int = 9,
    timer: str | None = None,
    job_tokens: int = 64,
) -> CorunSlowdown:
    """The co-run slowdown at each of ``shapes`` (new, prefix tokens; one request), on a pool
    of ``make_pool(slots)`` (the model's geometry; slots overwritten), beside the cache's own
    copies (module docstring): on CUDA its H2D per-layer load op copying 1024 tokens (or what
    fits) again and again on a side stream; on a CPU its backups of ``job_tokens`` tokens,
    queued through its controller on its write stream, whose worker thread runs them as it
    does in a run. ``cache``: a hierarchical ``KVCache`` holding nothing yet (its pools are
    overwritten; every host slot the backups take is freed again). ``timer``: of CUDA runs (a
    CPU run times on the wall clock)."""
    if not shapes:
        raise ValueError("shapes: at least one forward shape is needed")
    cpu = cache.device_pool.device.type != "cuda"
    copy = None if cpu else _load_loop(cache)
    per_shape = []
    for n, p in shapes:
        pool = make_pool(n + p + 2 * cache.device_pool.page_size)
        if cpu:
            per_shape.append(_measure_queued(model, pool, cache, (n, p), job_tokens, rounds))
        else:
            assert copy is not None
            per_shape.append(_measure_one(model, pool, copy, (n, p), rounds, timer))
        del pool
    pts = sorted((max(m["alone_s"], 1e-9), max(1.0, m["ratio"]), max(1.0, m["copy_ratio"]))
                 for m in per_shape)  # fmt: skip
    what = (f"cache backups of {job_tokens} tokens queued on its write stream" if cpu else
            "cache H2D load_to_device_per_layer, every layer, in a loop")  # fmt: skip
    measured = {"shapes": per_shape, "rounds": rounds, "copy": what}
    return CorunSlowdown(max(p[1] for p in pts), "measured", measured,
                         max(p[2] for p in pts), tuple(pts))  # fmt: skip


def _measure_queued(
    model: Any, pool: Any, cache: Any, shape: tuple[int, int], tokens: int, rounds: int
) -> dict[str, Any]:
    """One shape of ``measure_corun`` on a CPU: the forward alone and right after enough
    backups of ``tokens`` tokens were queued to outlast it (the write stream's worker thread
    runs them beside the forward, as in a run); the backups alone and those that ran beside
    the forward, each timed by its own stream events. Wall time; medians and their ratios."""
    from prefill.model.paged import ExtendInput

    c = cache.controller
    page = pool.page_size
    tokens = max(page, min(tokens, (c.device_pool.size // page - 2) * page))
    d_idx = torch.arange(page, page + tokens)
    n, p = shape
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, model.config.vocab_size, (n,), generator=gen)
    batch = [ExtendInput(ids, torch.arange(page, page + n + p), p)]

    def forward() -> tuple[float, float]:
        t0 = time.perf_counter()
        model.forward_extend(pool, batch)
        return t0, time.perf_counter()

    def backups(k: int) -> tuple[list[Any], list[Any]]:
        hosts, acks = [], []
        for _ in range(k):
            h = c.write(d_idx)
            if h is None:  # the host pool is full: fewer backups
                break
            hosts.append(h)
            acks.append(c.ack_write_queue[-1])
        return hosts, acks

    def drain(hosts: list[Any], acks: list[Any]) -> list[tuple[float, float]]:
        c.wait_write()
        for h in hosts:
            c.evict_host(h)
        return [(_fired(a.copy_start_event or a.start_event), _fired(a.finish_event))
                for a in acks]  # fmt: skip

    forward()  # warm-up
    t0, t1 = forward()
    job = statistics.median(b - a for a, b in drain(*backups(4)))
    k = int(2 * (t1 - t0) / max(job, 1e-6)) + 2
    alone, beside, c_alone, c_beside, short = [], [], [], [], 0
    for _ in range(rounds):
        a0, a1 = forward()
        alone.append(a1 - a0)
        hosts, acks = backups(k)
        f0, f1 = forward()
        spans = drain(hosts, acks)
        beside.append(f1 - f0)
        short += int(not spans or spans[-1][1] < f1)  # the backups did not outlast the forward
        c_beside.extend(b - a for a, b in spans if f0 <= a and b <= f1)
        c_alone.extend(b - a for a, b in drain(*backups(3)))
    ratio = statistics.median(beside) / statistics.median(alone)
    copy_alone = statistics.median(c_alone)
    copy_beside = statistics.median(c_beside) if c_beside else copy_alone
    return {"shape": list(shape), "alone_s": statistics.median(alone),
            "with_copy_s": statistics.median(beside), "ratio": ratio,
            "copy_alone_s": copy_alone, "copy_with_forward_s": copy_beside,
            "copy_ratio": copy_beside / copy_alone, "job_tokens": tokens, "backups": k,
            "rounds_not_covered": short, "timer": "wall"}  # fmt: skip


def _fired(event: Any) -> float:
    """When a CPU stream event fired (``perf_counter``)."""
    return float(event.recorded_at)


def _measure_one(
    model: Any, pool: Any, copy: Callable[[], None], shape: tuple[int, int], rounds: int,
    timer: str | None,
) -> dict[str, Any]:  # fmt: skip
    """One shape of ``measure_corun`` on CUDA (each side timed by events on its own stream):
    the medians and their ratios."""
    from prefill.model.paged import ExtendInput

    n, p = shape
    device = pool.device
    page = pool.page_size
    gen = torch.Generator().manual_seed(2)
    slots = torch.arange(page, page + n + p, device=device)
    ids = torch.randint(1, model.config.vocab_size, (n,), generator=gen)
    batch = [ExtendInput(ids, slots, p)]

    def timed(fn: Callable[[], None], stream: Any) -> float:
        t0, t1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with torch.cuda.stream(stream):
            t0.record()
            fn()
            t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) / 1e3

    def fwd_once() -> None:
        model.forward_extend(pool, batch)

    compute, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)

    def forward() -> float:  # events on the compute stream: copies queued elsewhere run on
        return timed(fwd_once, compute)

    def copy_once() -> float:
        return timed(copy, side)

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
    return {"shape": list(shape), "alone_s": statistics.median(alone),
            "with_copy_s": statistics.median(beside),
            "ratio": statistics.median(beside) / statistics.median(alone),
            "copy_alone_s": statistics.median(c_alone),
            "copy_with_forward_s": statistics.median(c_beside),
            "copy_ratio": statistics.median(c_beside) / statistics.median(c_alone),
            "timer": timer or "cuda events"}  # fmt: skip


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
    """``timed()`` while ``background`` runs beside it, queued first on another CUDA stream
    (enough passes to outlast ``timed``)."""
    torch.cuda.synchronize(device)
    other = torch.cuda.Stream(device)
    with torch.cuda.stream(other):
        for _ in range(max(2, int(2 * timed_s / max(background_s, 1e-6)) + 1)):
            background()
    t = timed()
    torch.cuda.synchronize(device)
    return t
