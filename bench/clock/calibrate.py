"""Calibration of the deterministic benchmark mode: what a forward pass, a KV copy, the KV
transfer to decode and the scheduler's host work cost on this machine, so the executor can be
scheduled on a virtual clock (``bench.clock.virtual_cost``).

- Forward passes: ``bench.clock.forward_table`` (a table of measured shapes, interpolated).
- Copies: ``bench.clock.copy_fit`` (the cache's H2D and D2H ops, and the decode side's read of a
  send, each fitted as ``calls * per_call + bytes / bytes_per_s``).
- Transfer to decode: ``bench.clock.transport`` (the read's fit, or a given rate).
- Co-run slowdown: ``bench.clock.corun`` (the forward alone and beside a copy).
- Host time: ``bench.clock.host_cost`` (fitted on a calibration trace that each benchmark runs,
  ``Calibration.host``; ``None`` until then).

Every benchmark run writes its calibration (``as_dict``) to ``calibration.json``
(``bench.clock.calibration_file``), and ``--calibration FILE`` replays one (``from_dict``)
instead of measuring: the virtual clock then charges exactly what it charged in the run that
wrote the file, so the schedule, and every ratio, is the same on any machine.

Times are seconds (``bench.common.call_timer``; ``timer``): by default wall time on CUDA
(around a device synchronization) and on a CPU the calling thread's CPU time, which other jobs
on a shared machine, descheduling the thread, do not inflate; ``timer="wall"`` where the
calibration is compared with wall-clock runs (``bench.fidelity``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.clock.copy_fit import (
    CopyFit,
    calibrate_copies,
    calibrate_transfer_copy,
    fit_copy,
)
from bench.clock.corun import CorunSlowdown, corun_shapes, measure_corun
from bench.clock.forward_table import (
    ForwardTable,
    Shape,
    calibrate_forward,
    forward_grid,
    table_from,
)
from bench.clock.host_cost import HostCosts
from bench.clock.transport import TransferModel
from bench.common import default_timer
from hicache.memory.allocator import page_ceil

__all__ = [
    "FORMAT",
    "Calibration",
    "CopyFit",
    "CorunSlowdown",
    "ForwardTable",
    "HostCosts",
    "Shape",
    "TransferModel",
    "calibrate_copies",
    "calibrate_forward",
    "calibrate_run",
    "describe",
    "fit_copy",
    "forward_curve",
    "forward_grid",
    "model_geometry",
    "table_from",
]

logger = logging.getLogger(__name__)

FORMAT = "hicache-bench-calibration/2"
"""The calibration's format tag (``as_dict``); ``from_dict`` refuses another."""


def _free_transfer() -> TransferModel:
    return TransferModel(0.0, math.inf, "flag")


@dataclass
class Calibration:
    """Everything the virtual clock charges (see the module docstring). ``model``: the model
    geometry it was measured on (``ServerArgs`` fields); ``machine``: where; ``timer``:
    ``cpu`` or ``wall``; ``source``: ``measured`` or the file it was replayed from."""

    forward: ForwardTable
    h2d: CopyFit
    d2h: CopyFit
    num_layers: int
    wall_s: float = 0.0
    transfer: TransferModel = field(default_factory=_free_transfer)
    corun: CorunSlowdown = field(default_factory=lambda: CorunSlowdown(1.0, "flag"))
    host: HostCosts | None = None
    timer: str = "cpu"
    model: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    source: str = "measured"

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "forward": self.forward.as_dict(),
            "forward_curve": forward_curve(self.forward),
            "h2d": self.h2d.as_dict(),
            "d2h": self.d2h.as_dict(),
            "transfer": self.transfer.as_dict(),
            "corun": self.corun.as_dict(),
            "host": None if self.host is None else self.host.as_dict(),
            "num_layers": self.num_layers,
            "timer": self.timer,
            "model": self.model,
            "machine": self.machine,
            "wall_s": self.wall_s,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "replayed") -> Calibration:
        """The inverse of ``as_dict``; ``ValueError`` naming what is missing or of another
        format."""
        if d.get("format") != FORMAT:
            raise ValueError(f"calibration format {d.get('format')!r}, expected {FORMAT!r}")
        try:
            f = d["forward"]
            table = ForwardTable(list(f["ns"]), list(f["ps"]), [list(r) for r in f["single_s"]],
                                 float(f["pair_saving_s"]), list(f.get("points", [])))  # fmt: skip
            return cls(
                forward=table,
                h2d=CopyFit.from_dict(d["h2d"]),
                d2h=CopyFit.from_dict(d["d2h"]),
                num_layers=int(d["num_layers"]),
                wall_s=float(d.get("wall_s", 0.0)),
                transfer=TransferModel.from_dict(d["transfer"]),
                corun=CorunSlowdown.from_dict(d["corun"]),
                host=None if d.get("host") is None else HostCosts.from_dict(d["host"]),
                timer=str(d["timer"]),
                model=dict(d.get("model") or {}),
                machine=dict(d.get("machine") or {}),
                source=source,
            )
        except KeyError as exc:
            raise ValueError(f"calibration lacks {exc}") from None


def forward_curve(f: ForwardTable) -> dict[str, float]:
    """The forward cost as a line over the single-request shapes without a prefix: ``t = a +
    b * new_tokens`` (least squares; ``intercept_ms``, ``slope_us_per_token``), and the shape
    ratio the multi-turn headline moves with: a forward of the longest ``n`` over one of the
    shortest, both after the longest prefix of the table."""
    ns, ts = [float(n) for n in f.ns], [row[0] for row in f.single]
    mn, mt = sum(ns) / len(ns), sum(ts) / len(ts)  # closed form: the same bits every time
    b1 = sum((n - mn) * (t - mt) for n, t in zip(ns, ts, strict=True)) / sum(
        (n - mn) ** 2 for n in ns
    )
    b0 = mt - b1 * mn
    p = f.ps[-1]
    return {"intercept_ms": b0 * 1e3, "slope_us_per_token": b1 * 1e6,
            "long_over_short": f.one(f.ns[-1], p) / f.one(f.ns[0], p),
            "long_n": f.ns[-1], "short_n": f.ns[0], "prefix": p}  # fmt: skip


def calibrate_run(
    args: Any,
    model: Any,
    max_new: int,
    max_prefix: int,
    rounds: int | None = None,
    timer: str | None = None,
    build_cache: Callable[[Any], Any] | None = None,
) -> Calibration:
    """The calibration of one benchmark run, without host costs: ``model``'s forward over
    ``forward_grid(max_new, max_prefix)``, the copies of a cache built from ``args``
    (hierarchical; it is closed before returning, and its host pool released unless
    ``build_cache`` built it: a benchmark's shared host pool,
    ``bench.e2e.setup.SharedHostPool.build``, stays for the run), the decode side's read of a
    send, and the co-run slowdown. ``rounds``: 5 on CUDA (GPU times repeat closely), 15 on a
    CPU (shared cores: the median needs more samples)."""
    from bench.summary import machine_info
    from hicache.builder import build_kv_cache
    from hicache.memory.device_pool import device_pool_from_server_args
    from prefill.clock import VirtualClock
    from prefill.disagg.sim_config import PeerConfig
    from prefill.disagg.sim_side import DecodeSide

    if rounds is None:
        rounds = 5 if torch.cuda.is_available() else 15
    device = torch.device(args.resolved_device())
    timer = timer or default_timer(device)
    t0 = time.perf_counter()
    page = args.page_size

    def make_pool(slots: int) -> Any:
        return device_pool_from_server_args(args, size=page_ceil(slots, page))

    grid = forward_grid(max_new, max_prefix, page)
    fwd = calibrate_forward(model, make_pool, grid, rounds, timer=timer)
    sizes = [s for s in (4 * page, 256, 1024, 4096)]
    src = make_pool(4096 + 2 * page)
    side = DecodeSide(src, VirtualClock(), PeerConfig(), size=4096 + 2 * page,
                      keep_received=False)  # fmt: skip
    transfer = calibrate_transfer_copy(side, sizes, timer=timer)
    del side
    cache = (build_cache or build_kv_cache)(args)
    try:
        slots = min(cache.device_pool.size, cache.host_pool.size)
        copy_sizes = [s for s in sizes if s <= slots] or [page, slots]
        h2d, d2h = calibrate_copies(cache, copy_sizes, timer=timer)
        corun = measure_corun(model, make_pool, cache, corun_shapes(fwd.ns, fwd.ps),
                              timer=timer)  # fmt: skip
    finally:
        cache.close()
        if build_cache is None:
            cache.host_pool.destroy()
    geometry = model_geometry(args)
    cal = Calibration(fwd, h2d, d2h, args.num_layers, time.perf_counter() - t0,
                      transfer=TransferModel.measured(transfer), corun=corun, timer=timer,
                      model=geometry, machine=machine_info())  # fmt: skip
    logger.info("calibration: %s", cal.as_dict())
    return cal


GEOMETRY = ("num_layers", "hidden_size", "num_attention_heads", "head_num", "head_dim",
            "intermediate_size", "dtype", "page_size", "tp_size", "use_mla", "kv_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # fmt: skip


def model_geometry(args: Any) -> dict[str, Any]:
    """The ``ServerArgs`` fields a calibration's costs belong to (a replay checks them)."""
    return {k: getattr(args, k, None) for k in GEOMETRY}


def describe(cal: Calibration) -> str:
    """One line for the console."""
    f = cal.forward
    c = forward_curve(f)
    tr = cal.transfer
    bw = "inf" if math.isinf(tr.bytes_per_s) else f"{tr.bytes_per_s / 1e9:.2f}"
    host = "" if cal.host is None else f"; {cal.host.describe()}"
    return (
        f"[{cal.source}, timer {cal.timer}] forward {c['intercept_ms']:.2f} ms + "
        f"{c['slope_us_per_token']:.1f} us/token ({f.one(f.ns[0], 0) * 1e3:.2f} ms at {f.ns[0]} "
        f"tokens .. {f.one(f.ns[-1], f.ps[-1]) * 1e3:.2f} ms at {f.ns[-1]} after {f.ps[-1]}; "
        f"{c['long_n']}/{c['short_n']} tokens after {c['prefix']}: x{c['long_over_short']:.2f}), "
        f"{len(f.points)} shapes; a second request in the batch saves "
        f"{f.pair_saving_s * 1e3:.2f} ms; H2D {cal.h2d.bytes_per_s / 1e9:.2f} GB/s + "
        f"{cal.h2d.per_call_s * 1e6:.0f} us/call, D2H {cal.d2h.bytes_per_s / 1e9:.2f} GB/s + "
        f"{cal.d2h.per_call_s * 1e6:.0f} us/call; transfer ({tr.source}) {bw} GB/s + "
        f"{tr.latency_s * 1e6:.0f} us; co-run {cal.corun.range_text()} ({cal.corun.source})"
        f"{host}; calibrated in {cal.wall_s:.1f} s"
    )
