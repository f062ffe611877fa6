"""The multi-turn ratio as curves (one seed, a smaller trace, the run's calibration): mean TTFT
of device-only / each cache configuration against the load (arrival rate as a fraction of
device-only capacity, ``request_rate``) at the headline's working set, and against the working
set (working set / device pool) at the headline's load. Written under ``sweeps`` of the
multi-turn summary and plotted to ``multiturn_sweeps.png``."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.clock.calibrate import Calibration
from bench.e2e.plots import plot_sweeps
from bench.e2e.report import sum_integrity
from bench.e2e.setup import free_memory
from bench.multiturn.trace import RATIO, add_ratios, pool_sizes, request_rate

SWEEP_TRACE = dict(num_clients=16, num_rounds=3, seeds=[0], kv_sample_every=10)
"""The sweeps' trace (quick size): the headline's prompt lengths, fewer clients and rounds."""
LOADS = (0.3, 0.5, 0.7, 0.9)
WORKING_SETS = (2.0, 4.0, 8.0)
CONFIGS = ("device_only", "write_through", "write_back")


def run_sweeps(
    opts: argparse.Namespace, model: Any, cal: Calibration, out_dir: Path,
    run_config: Callable[..., dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """Both curves (module docstring); returns the ``sweeps`` entry. ``run_config``:
    ``bench.multiturn.single.run_config`` (one configuration under one seed)."""
    base = argparse.Namespace(**{**vars(opts), **SWEEP_TRACE,
                                 "configs": [c for c in CONFIGS if c in opts.configs]})  # fmt: skip
    seed = base.seeds[0]
    t0 = time.perf_counter()
    cache: dict[tuple[float, float], dict[str, Any]] = {}

    def point(load: float, ws: float) -> dict[str, Any]:
        if (load, ws) in cache:
            return cache[(load, ws)]
        o = argparse.Namespace(**{**vars(base), "load": load, "working_set_ratio": ws})
        working_set, device_tokens = pool_sizes(o)
        rate = request_rate(o, cal)
        results = {name: run_config(name, seed, device_tokens, rate, o, model, cal, True,
                                    quiet=True) for name in o.configs}  # fmt: skip
        free_memory()
        add_ratios(results)
        row = {"load": load, "working_set_ratio": ws, "working_set_tokens": working_set,
               "device_pool_tokens": device_tokens, "request_rate_per_s": rate,
               "ratios": {n: r[RATIO] for n, r in results.items() if n != "device_only"},
               "ttft_mean_s": {n: r["ttft_mean_s"] for n, r in results.items()},
               "host_hit_tokens": {n: r["host_hit_tokens"] for n, r in results.items()},
               "integrity": sum_integrity(results)}  # fmt: skip
        ratios = ", ".join(f"{n} {v:.3f}" for n, v in row["ratios"].items())
        print(f"    sweep load {load:g}, working set {ws:g}x: {ratios}", flush=True)
        cache[(load, ws)] = row
        return row

    head_ws, head_load = opts.working_set_ratio, opts.load
    by_load = [point(x, head_ws) for x in LOADS]
    by_ws = [point(head_load, x) for x in WORKING_SETS]
    out = {
        "trace": {k: v for k, v in SWEEP_TRACE.items()},
        "configs": list(base.configs),
        "load": by_load,
        "working_set": by_ws,
        "integrity": sum_integrity(cache),
        "wall_s": time.perf_counter() - t0,
    }
    plot_sweeps(
        out_dir / "multiturn_sweeps.png",
        "Multi-turn: mean TTFT of device-only / configuration (virtual clock, one seed)",
        [("load (arrival rate / device-only capacity)", "load", by_load, None),
         ("working set / device pool", "working_set_ratio", by_ws, None)],
    )  # fmt: skip
    return out
