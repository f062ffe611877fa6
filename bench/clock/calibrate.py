"""Calibration of the deterministic benchmark mode: what a forward pass and a KV copy cost on this
machine, measured in the run, so the executor can be scheduled on a virtual clock
(``bench.clock.virtual_cost``).

- Forward passes: ``bench.clock.forward_table`` (a table of measured shapes, interpolated).
- Copies: ``calibrate_copies`` times the cache's own copy ops (``load_to_device_per_layer``,
  ``backup_from_device_all_layer``, the configured io backend and host layout) at a few sizes
  and fits ``t = calls * per_call + bytes / bytes_per_s`` per direction.

Times are seconds (``bench.common.call_timer``): on CUDA wall time around a device
synchronization; on a CPU the calling thread's CPU time, which other jobs on a shared machine,
descheduling the thread, do not inflate.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.clock.forward_table import (
    ForwardTable,
    Shape,
    calibrate_forward,
    forward_grid,
    table_from,
)
from bench.common import call_timer, sync_device
from hicache.memory.allocator import page_ceil

__all__ = [
    "Calibration",
    "CopyFit",
    "ForwardTable",
    "Shape",
    "calibrate_copies",
    "calibrate_forward",
    "calibrate_run",
    "describe",
    "fit_copy",
    "forward_grid",
    "table_from",
]

logger = logging.getLogger(__name__)


def _time_calls(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call (``call_timer``)."""
    clock = call_timer(device)
    fn()
    samples = []
    for _ in range(reps):
        sync_device(device)
        t0 = clock()
        fn()
        sync_device(device)
        samples.append(clock() - t0)
    return statistics.median(samples)


@dataclass
class CopyFit:
    """One copy direction: ``seconds(nbytes, calls) = calls * per_call_s + nbytes /
    bytes_per_s``."""

    direction: str
    per_call_s: float
    bytes_per_s: float
    points: list[dict[str, Any]] = field(default_factory=list)

    def seconds(self, nbytes: int, calls: int = 1) -> float:
        return calls * self.per_call_s + nbytes / self.bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return {"direction": self.direction, "per_call_s": self.per_call_s,
                "gb_per_s": self.bytes_per_s / 1e9, "points": self.points}  # fmt: skip


def fit_copy(direction: str, measured: Sequence[tuple[int, int, float]]) -> CopyFit:
    """Least squares of ``(nbytes, calls, seconds)`` as ``calls * a + nbytes / bw`` (``a >= 0``;
    relative error). Raises ``ValueError`` with fewer than two sizes or a non-positive time."""
    if len({b for b, _, _ in measured}) < 2 or any(s <= 0 for _, _, s in measured):
        raise ValueError("need at least two byte counts and positive times")
    x = torch.tensor([[c, b] for b, c, _ in measured], dtype=torch.float64)
    t = torch.tensor([s for _, _, s in measured], dtype=torch.float64)
    sol = torch.linalg.lstsq(x / t[:, None], torch.ones_like(t)[:, None]).solution[:, 0]
    per_call, per_byte = float(sol[0]), float(sol[1])
    if per_call < 0 or per_byte <= 0:  # no usable intercept: pure bandwidth through the points
        per_call = 0.0
        per_byte = float((x[:, 1] / t).sum() / (x[:, 1] ** 2 / t**2).sum())
    fit = CopyFit(direction, per_call, 1.0 / per_byte)
    for nbytes, calls, secs in measured:
        pred = fit.seconds(nbytes, calls)
        fit.points.append({"bytes": nbytes, "calls": calls, "median_s": secs, "fit_s": pred,
                           "rel_err": (pred - secs) / secs})  # fmt: skip
    return fit


def calibrate_copies(cache: Any, sizes: Sequence[int], reps: int = 7) -> tuple[
    CopyFit, CopyFit
]:  # fmt: skip
    """``(h2d, d2h)`` fits from the cache's own copy ops (its io backend and host layout) at
    ``sizes`` tokens: H2D one call per layer (a load back), D2H one all-layer call (a backup).
    Overwrites pool contents: use a cache that holds nothing yet."""
    host, dev, io = cache.host_pool, cache.device_pool, cache.controller.io_backend
    page, layers = dev.page_size, dev.layer_num
    per_token = host.size_per_token
    gen = torch.Generator().manual_seed(0)
    h2d, d2h = [], []
    for tokens in sizes:
        pages = tokens // page
        if pages < 1 or pages > min(dev.size, host.size) // page:
            continue
        dpages = torch.randperm(dev.size // page, generator=gen)[:pages] + 1  # page 0: padding
        hpages = torch.randperm(host.size // page, generator=gen)[:pages]
        d_idx = (dpages[:, None] * page + torch.arange(page)).flatten()
        h_idx = (hpages[:, None] * page + torch.arange(page)).flatten()
        if io == "kernel":
            h_arg, d_arg = h_idx.to(dev.device), d_idx.to(dev.device)
        else:
            order = h_idx.argsort() if host.layout == "layer_first" else torch.arange(h_idx.numel())
            h_arg, d_arg = h_idx[order], d_idx[order]

        def load(h: torch.Tensor = h_arg, d: torch.Tensor = d_arg) -> None:
            for layer in range(layers):
                host.load_to_device_per_layer(dev, h, d, layer, io)

        def backup(h: torch.Tensor = h_arg, d: torch.Tensor = d_arg) -> None:
            host.backup_from_device_all_layer(dev, h, d, io)

        nbytes = tokens * per_token
        h2d.append((nbytes, layers, _time_calls(load, dev.device, reps)))
        d2h.append((nbytes, 1, _time_calls(backup, dev.device, reps)))
    return fit_copy("h2d", h2d), fit_copy("d2h", d2h)


@dataclass
class Calibration:
    """Everything the virtual clock charges: forward table, both copy fits, how long it took."""

    forward: ForwardTable
    h2d: CopyFit
    d2h: CopyFit
    num_layers: int
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"forward": self.forward.as_dict(), "h2d": self.h2d.as_dict(),
                "d2h": self.d2h.as_dict(), "num_layers": self.num_layers,
                "wall_s": self.wall_s}  # fmt: skip


def calibrate_run(
    args: Any, model: Any, max_new: int, max_prefix: int, rounds: int | None = None,
    build_cache: Callable[[Any], Any] | None = None,
) -> Calibration:  # fmt: skip
    """The calibration of one benchmark run: ``model``'s forward over ``forward_grid(max_new,
    max_prefix)`` and the copies of a cache built from ``args`` (hierarchical; it is closed
    before returning, and its host pool released unless ``build_cache`` built it: a benchmark's
    shared host pool, ``bench.e2e.setup.SharedHostPool.build``, stays for the run). ``rounds``:
    5 on CUDA (GPU times repeat closely), 15 on a CPU (shared cores: the median needs more
    samples)."""
    if rounds is None:
        rounds = 5 if torch.cuda.is_available() else 15
    from hicache.builder import build_kv_cache
    from hicache.memory.device_pool import device_pool_from_server_args

    t0 = time.perf_counter()
    page = args.page_size

    def make_pool(slots: int) -> Any:
        return device_pool_from_server_args(args, size=page_ceil(slots, page))

    fwd = calibrate_forward(model, make_pool, forward_grid(max_new, max_prefix, page), rounds)
    cache = (build_cache or build_kv_cache)(args)
    try:
        slots = min(cache.device_pool.size, cache.host_pool.size)
        sizes = [s for s in (4 * page, 256, 1024, 4096) if s <= slots] or [page, slots]
        h2d, d2h = calibrate_copies(cache, sizes)
    finally:
        cache.close()
        if build_cache is None:
            cache.host_pool.destroy()
    cal = Calibration(fwd, h2d, d2h, args.num_layers, time.perf_counter() - t0)
    logger.info("calibration: %s", cal.as_dict())
    return cal


def describe(cal: Calibration) -> str:
    """One line for the console."""
    f = cal.forward
    return (
        f"forward of one request: {f.one(f.ns[0], 0) * 1e3:.2f} ms ({f.ns[0]} tokens) .. "
        f"{f.one(f.ns[-1], f.ps[-1]) * 1e3:.2f} ms ({f.ns[-1]} tokens after a {f.ps[-1]}-token "
        f"prefix), {len(f.points)} shapes; a second request in the batch saves "
        f"{f.pair_saving_s * 1e3:.2f} ms; H2D {cal.h2d.bytes_per_s / 1e9:.2f} GB/s + "
        f"{cal.h2d.per_call_s * 1e6:.0f} us/call, D2H {cal.d2h.bytes_per_s / 1e9:.2f} GB/s + "
        f"{cal.d2h.per_call_s * 1e6:.0f} us/call; calibrated in {cal.wall_s:.1f} s"
    )
