"""Reporting of the end-to-end benchmarks: the command-line options they share, statistics over
seeds, tables, the TTFT plot and the result files."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.e2e.calibrated import add_calibration_args
from bench.e2e.setup import CLOCKS, cpu_note, on_cuda

logger = logging.getLogger(__name__)

Column = tuple[str, str, float, str]
"""(header, result key, scale, format spec) of one table column."""


def add_common_args(p: argparse.ArgumentParser, seeds: Sequence[int], kv_every: int) -> None:
    """``--clock``, ``--seeds``, ``--kv-sample-every``, ``--use-mla``, ``--sweeps`` and the
    calibration's flags (``bench.e2e.calibrated``), with this size's defaults."""
    p.add_argument("--clock", choices=CLOCKS, default="wall" if on_cuda() else "virtual",
                   help="virtual (default on a CPU): scheduling on a clock charged from a "
                   "calibration measured in the run or replayed (deterministic given seed and "
                   "calibration); wall (default on CUDA): real time.")
    p.add_argument("--sweeps", action=argparse.BooleanOptionalAction, default=not on_cuda(),
                   help="Also run the sweeps (quick sizes, one seed; default on a CPU).")
    add_calibration_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=list(seeds),
                   help="Trace seeds; each configuration runs once per seed.")
    p.add_argument("--kv-sample-every", type=int, default=kv_every,
                   help="Every N-th success is checked against a full recompute.")  # fmt: skip
    p.add_argument("--use-mla", action="store_true",
                   help="DeepSeek-shaped multi-head latent attention over MLA pools "
                   "(CPU: bench.e2e.setup.CPU_MLA; CUDA: deepseek-v2-lite-shape).")  # fmt: skip


def spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Mean, min, max, sample stdev (0 for one value) and the values; None if any is None."""
    if not values or any(v is None for v in values):
        return None
    vals = [float(v) for v in values if v is not None]
    return {
        "mean": statistics.fmean(vals),
        "min": min(vals),
        "max": max(vals),
        "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "per_seed": vals,
    }


def aggregate_seeds(
    per_seed: dict[int, dict[str, dict[str, Any]]], keys: Sequence[str], ratio_key: str
) -> dict[str, dict[str, Any]]:
    """One entry per configuration, over the seeds it ran under (a run cut short by its
    deadline may lack some; ``seeds`` lists them): each of ``keys`` averaged (None if missing
    anywhere); ``ratio_key`` and ``ttft_mean_s`` also get ``*_spread`` (``spread``);
    ``integrity`` counters are summed."""
    names: list[str] = []
    for seed in sorted(per_seed):
        names += [n for n in per_seed[seed] if n not in names]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        seeds = [s for s in sorted(per_seed) if name in per_seed[s]]
        rows = [per_seed[s][name] for s in seeds]
        entry: dict[str, Any] = {}
        for k in keys:
            vals = [r.get(k) for r in rows]
            if any(v is None for v in vals):
                entry[k] = None
            elif all(isinstance(v, int) for v in vals):
                entry[k] = round(statistics.fmean(vals), 1)
            else:
                entry[k] = statistics.fmean(vals)
        for k in (ratio_key, "ttft_mean_s"):
            entry[k + "_spread"] = spread([r.get(k) for r in rows])
            if entry[k + "_spread"] is not None:
                entry[k] = entry[k + "_spread"]["mean"]
        entry["seeds"] = seeds
        by_seed = {s: r for s, r in zip(seeds, rows, strict=True)}
        entry["integrity"] = sum_integrity(by_seed)
        entry["checks"] = sum_checks(by_seed)
        out[name] = entry
    return out


CHECK_COUNTS = ("kv_checked_requests", "kv_strict_checked", "kv_strict_skipped")
"""Audit counters that count checks, not violations (``audit``)."""


def sum_integrity(results: dict[Any, Any]) -> dict[str, int]:
    """Integrity counters of every configuration, added up (violations only; the counts of
    checks made are summed under ``checks``)."""
    total: dict[str, int] = {}
    for res in results.values():
        for k, v in res["integrity"].items():
            if k not in CHECK_COUNTS and k != "checks":
                total[k] = total.get(k, 0) + int(v)
    return total


def add_counters(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two sets of integrity counters, added key by key."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


def sum_checks(results: dict[Any, Any]) -> dict[str, int]:
    """How many requests the audits checked, over every configuration (``CHECK_COUNTS``)."""
    total = dict.fromkeys(CHECK_COUNTS, 0)
    for res in results.values():
        counts = res.get("checks") or res["integrity"]
        for k in CHECK_COUNTS:
            total[k] += int(counts.get(k, 0))
    return total


def print_config_table(results: dict[str, Any], cols: list[Column], width: int = 14) -> None:
    """One row per configuration, fixed-width columns with units in the headers."""
    name_w = max(24, max((len(n) for n in results), default=0) + 2)
    print(f"{'config':<{name_w}}" + "".join(f"{c[0]:>{width}}" for c in cols))
    for name, res in results.items():
        cells = []
        for _, key, scale, fmt in cols:
            v = res.get(key)
            cells.append(f"{'-':>{width}}" if v is None else f"{v * scale:>{width}{fmt}}")
        print(f"{name:<{name_w}}" + "".join(cells))


def print_spread(results: dict[str, Any], ratio_key: str, label: str) -> None:
    """One line per configuration: the ratio's mean and spread over seeds."""
    for name, res in results.items():
        s = res.get(ratio_key + "_spread")
        if s is None:
            continue
        seeds = ", ".join(f"{v:.3f}" for v in s["per_seed"])
        print(f"  {name:<34} {label} {s['mean']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}, "
              f"stdev {s['stdev']:.3f}; seeds: {seeds})")  # fmt: skip


def plot_ttft(results: dict[str, Any], path: Path, title: str, labels: list[str]) -> None:
    """Box plot of the TTFT samples of each configuration, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot {path.name}")
        return
    data = [[t * 1e3 for t in res["ttft_samples_s"]] for res in results.values()]
    if not any(data):
        print(f"no TTFT samples: no plot {path.name}")
        return
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(data)), 4.5))
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(data) + 1), labels)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title + (" (CPU)" if cpu_note() else ""))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_result(out_dir: Path, name: str, doc: dict[str, Any]) -> Path:
    """``out_dir/NAME.json`` with the machine description and the run's provenance added."""
    from bench.summary import machine_info, run_info

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    body = {"benchmark": name, "machine": machine_info(), "run": run_info(), **doc}
    path.write_text(json.dumps(body, indent=2, default=str))
    return path


def bench_main(name: str, run: Callable[..., dict[str, Any]], argv: list[str] | None = None) -> int:
    """Command line of one end-to-end benchmark: ``--quick``, ``--out DIR``, and the
    benchmark's own flags; exits non-zero on any integrity violation."""
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results"))
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    summary = run(quick=known.quick, out_dir=known.out, argv=rest)
    bad = {k: v for k, v in summary["integrity"].items() if v}
    if bad:
        print(f"[{name}] INTEGRITY VIOLATIONS: {bad}", file=sys.stderr)
        return 1
    return 0
