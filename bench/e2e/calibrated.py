"""Where an end-to-end benchmark's calibration comes from: measured now, or replayed from a
file (``--calibration FILE``), then the flags that override parts of it, and the file it is
written to (``calibration.json`` in the output folder, every run).

- Measured: ``bench.clock.calibrate.calibrate_run`` (forward, copies, transfer copy, co-run),
  then the host costs from the benchmark's own calibration trace (``host_trace(cal)``: a short
  run of its workload with host time measured and charged as measured, fitted per phase), and
  the copy fits of the real copies of that trace's wall-clock runs in place of the copy ops
  timed alone (``charge_trace_copies``).
- Replayed: the file's entry for the benchmark (``bench.clock.calibration_file``), host costs
  included; nothing is measured.
- Flags (both): ``--transfer-model FILE`` (the Mooncake transfer cost ``python -m bench.pd``
  measured: a ``bench_pd.json``, source ``mooncake``), ``--transfer-gbps`` /
  ``--transfer-latency-us`` (a transport's rate instead of the in-process copy's; they override
  the file's), ``--corun-slowdown`` or ``--corun-from`` (the GPU check's co-run
  measurement). What the run used, flags applied, is what is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.clock.calibrate import Calibration, calibrate_run, model_geometry
from bench.clock.calibration_file import load_calibration, write_calibration
from bench.clock.corun import CorunSlowdown, corun_from_gpu_check
from bench.clock.host_cost import HostCosts
from bench.clock.transport import TransferModel
from bench.pd.transfer_model import peer_transfer_kwargs

logger = logging.getLogger(__name__)

__all__ = ["add_calibration_args", "charge_trace_copies", "obtain_calibration"]


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    """The flags of the module docstring and ``--host-time``."""
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="Replay this calibration (a calibration.json a run wrote) instead of "
                   "measuring one.")
    p.add_argument("--host-time", choices=("model", "measured", "off"), default="model",
                   help="Host time of the scheduler's calls on the virtual clock: model (the "
                   "calibrated per-phase fit, deterministic), measured (as measured in this "
                   "run), off (not charged).")
    p.add_argument("--transfer-model", type=Path, default=None, metavar="FILE",
                   help="KV transfer to decode at the Mooncake cost a bench_pd.json (python -m "
                   "bench.pd) measured (its virtual_clock_transfer section).")
    p.add_argument("--transfer-gbps", type=float, default=None,
                   help="KV transfer to decode: bandwidth GB/s (default: the measured rate of "
                   "the in-process copy).")
    p.add_argument("--transfer-latency-us", type=float, default=None,
                   help="KV transfer to decode: latency per send, microseconds.")
    p.add_argument("--corun-slowdown", type=float, default=None,
                   help="Slowdown of compute and of a copy while they run beside each other "
                   "(default: measured).")
    p.add_argument("--corun-from", type=Path, default=None, metavar="FILE",
                   help="The co-run slowdown from the GPU check's bench_transfer_sweep.json "
                   "(row 'triton bq=2').")  # fmt: skip


def obtain_calibration(
    name: str,
    opts: argparse.Namespace,
    args: Any,
    model: Any,
    max_new: int,
    max_prefix: int,
    out_dir: Path | None,
    host_trace: Callable[[Calibration], HostCosts] | None = None,
    timer: str | None = None,
    rounds: int | None = None,
    build_cache: Callable[[Any], Any] | None = None,
) -> Calibration:
    """The calibration benchmark ``name`` runs on (module docstring); written to ``out_dir``
    unless it is ``None``. ``build_cache``: how the measured calibration builds its cache (a
    benchmark's ``SharedHostPool.build``; ``calibrate_run``)."""
    if opts.calibration is not None:
        cal = load_calibration(opts.calibration, name, model_geometry(args))
    else:
        cal = calibrate_run(args, model, max_new, max_prefix, rounds=rounds, timer=timer,
                            build_cache=build_cache)  # fmt: skip
        if host_trace is not None:
            cal.host = host_trace(cal)
            cal = charge_trace_copies(cal)
    if getattr(opts, "transfer_model", None) is not None:
        cal.transfer = mooncake_transfer(opts.transfer_model, cal.transfer)
    cal.transfer = cal.transfer.with_flags(opts.transfer_gbps, opts.transfer_latency_us)
    if opts.corun_slowdown is not None:
        cal.corun = CorunSlowdown(opts.corun_slowdown, "flag", {"measured": cal.corun.as_dict()},
                                  opts.corun_slowdown)  # fmt: skip
    elif opts.corun_from is not None:
        cal.corun = corun_from_gpu_check(opts.corun_from)
    if out_dir is not None:
        write_calibration(out_dir, name, cal)
    return cal


def charge_trace_copies(cal: Calibration) -> Calibration:
    """``cal`` charging the copy fits of its calibration trace's real copies (``cal.host.copies``,
    per direction where the trace had them) instead of the copy ops timed alone, whose fits are
    kept in the trace fit's ``points`` (``op_alone``). The trace's copies ran in wall-clock
    runs, beside the scheduler's work and the forwards, so their co-run slowdown is in the fit:
    the co-run ``copy_factor`` is then 1 (the measured points are kept in ``corun.measured``);
    compute's slowdown beside a copy stays charged as measured."""
    copies = {} if cal.host is None else cal.host.copies
    if not copies:
        return cal
    replaced = {}
    for direction in ("h2d", "d2h"):
        fit = copies.get(direction)
        if fit is not None:
            alone = {"op_alone": getattr(cal, direction).as_dict()}
            replaced[direction] = dataclasses.replace(fit, points=[*fit.points, alone])
    c = cal.corun
    corun = dataclasses.replace(
        c, copy_factor=1.0, points=tuple((a, f, 1.0) for a, f, _ in c.points),
        measured={**c.measured, "copy_factor_in_trace_fit": True,
                  "copy_factor_measured": c.copy_factor,
                  "copy_points_measured": [list(p) for p in c.points]},
    )  # fmt: skip
    return dataclasses.replace(cal, corun=corun, **replaced)


def mooncake_transfer(path: Path, base: TransferModel) -> TransferModel:
    """``base`` with the Mooncake cost of the ``bench_pd.json`` at ``path`` (source
    ``mooncake``: the simulated peer waits it; ``base``'s measured fit is kept beside it).
    ``ValueError`` naming ``--transfer-model`` and ``path`` for an unusable file."""
    kw = peer_transfer_kwargs(path)
    return dataclasses.replace(base, latency_s=kw.get("transfer_latency_s", 0.0),
                               bytes_per_s=kw.get("transfer_bandwidth", math.inf),
                               source="mooncake")  # fmt: skip


def without_host(cal: Calibration) -> Calibration:
    """``cal`` charging no host time (the host calibration trace measures it instead)."""
    return dataclasses.replace(cal, host=None)
