"""The optimistic ratio as curves (write_back, one seed, a smaller trace, the run's calibration):
mean TTFT with 0 attempts / with 2 against the bootstrap delay scale (mean delay / calibrated
prefill time; delays uniform on [0.5, 1.5] of the mean) at the headline's utilization, and
against the utilization at the headline's scale, each point with the analytic ceiling beside
it.

The ceiling: at zero load and with a free transfer, a request without optimism waits for its
peer's bootstrap ``B`` and then prefills (``P``); with it, it prefills while the peer
bootstraps, so TTFT is ``max(B, P)``: the ratio is at most ``E[B + P] / E[max(B, P)]``
(``ceiling``), a number the delay distribution and ``P`` alone set (1.78 at scale 1). What the
measurement adds is everything else: queueing at the utilization, chunking, host time and the
transfer, all charged on the virtual clock. Written under ``sweeps`` of the optimistic summary
and plotted to ``optimistic_sweeps.png``."""

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
from bench.e2e.workload import poisson_arrivals
from prefill.disagg.sim_config import DelayDistribution

__all__ = ["DELAY_SCALES", "SWEEP_TRACE", "UTILIZATIONS", "ceiling", "delay_for", "run_sweeps"]

SWEEP_TRACE = dict(num_requests=60, seeds=[0], kv_sample_every=10)
DELAY_SCALES = (0.25, 0.5, 1.0, 2.0)
UTILIZATIONS = (0.1, 0.25, 0.5)
ATTEMPTS = 2


def delay_for(scale: float, prefill_s: float) -> DelayDistribution:
    """Bootstrap delays uniform on [0.5, 1.5] of ``scale`` times the prefill time."""
    mean = scale * prefill_s
    return DelayDistribution("uniform", 0.5 * mean, 1.5 * mean)


def ceiling(delay: DelayDistribution, prefill_s: float) -> float:
    """``E[B + P] / E[max(B, P)]`` for ``B`` of ``delay`` (fixed or uniform) and ``P``."""
    p = prefill_s
    if delay.kind == "fixed":
        return (delay.a + p) / max(delay.a, p)
    if delay.kind != "uniform":
        raise ValueError(f"ceiling: fixed or uniform delays only, got {delay.kind!r}")
    a, b = delay.a, delay.b
    mean_b = (a + b) / 2
    if p <= a:
        e_max = mean_b
    elif p >= b or b == a:
        e_max = p
    else:
        e_max = (p * (p - a) + (b * b - p * p) / 2) / (b - a)
    return (mean_b + p) / e_max


def run_sweeps(
    opts: argparse.Namespace, model: Any, cal: Calibration, prefill_s: float, out_dir: Path,
    make_trace: Callable[..., Any], run_config: Callable[..., dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """Both curves (module docstring); returns the ``sweeps`` entry. ``make_trace`` and
    ``run_config``: ``bench.optimistic.run``'s."""
    base = argparse.Namespace(**{**vars(opts), **SWEEP_TRACE})
    seed = base.seeds[0]
    t0 = time.perf_counter()
    points: dict[tuple[float, float], dict[str, Any]] = {}

    def point(scale: float, util: float) -> dict[str, Any]:
        if (scale, util) in points:
            return points[(scale, util)]
        delay = delay_for(scale, prefill_s)
        arrivals = poisson_arrivals(base.num_requests, util / prefill_s, seed)
        trace = make_trace(base, seed, arrivals, delay, 0.0)
        results = {a: run_config(trace, a, "write_back", model, cal, True) for a in (0, ATTEMPTS)}
        free_memory()
        base_ttft = results[0]["ttft_mean_s"]
        ratio = base_ttft / results[ATTEMPTS]["ttft_mean_s"]
        row = {"delay_scale": scale, "utilization": util, "ratios": {f"attempts_{ATTEMPTS}": ratio},
               "ceiling": ceiling(delay, prefill_s),
               "ttft_mean_s": {f"attempts_{a}": r["ttft_mean_s"] for a, r in results.items()},
               "bootstrap_delay": {"low_s": delay.a, "high_s": delay.b},
               "integrity": sum_integrity({a: r for a, r in results.items()})}  # fmt: skip
        print(f"    sweep delay scale {scale:g}, utilization {util:g}: {ratio:.3f} "
              f"(ceiling {row['ceiling']:.3f})", flush=True)  # fmt: skip
        points[(scale, util)] = row
        return row

    by_scale = [point(s, opts.utilization) for s in DELAY_SCALES]
    by_util = [point(opts.delay_scale, u) for u in UTILIZATIONS]
    out = {
        "trace": dict(SWEEP_TRACE),
        "policy": "write_back",
        "prefill_s": prefill_s,
        "delay_scale": by_scale,
        "utilization": by_util,
        "integrity": sum_integrity(points),
        "wall_s": time.perf_counter() - t0,
    }
    plot_sweeps(
        out_dir / "optimistic_sweeps.png",
        f"Optimistic prefill: mean TTFT with 0 / {ATTEMPTS} attempts (write_back, virtual clock)",
        [("bootstrap delay scale (mean delay / prefill time)", "delay_scale", by_scale,
          "ceiling"),
         ("utilization (arrival rate x prefill time)", "utilization", by_util, "ceiling")],
    )  # fmt: skip
    return out
