"""Do two runs agree? ``python -m bench.compare A.json B.json [--tolerance 0.05]``.

Reads two suite summaries (``results/summary.json`` of two ``make bench`` runs) and prints every
headline ratio both contain (``multiturn``: mean TTFT of device-only / each configuration;
``optimistic`` and ``optimistic_write_through``: mean TTFT with 0 attempts / each), and every
point of their sweeps (``section/sweep/axis=x/config``), with its relative difference
``|b - a| / a``. Baselines (ratio 1 by definition) are left out. Exits 1 when any difference
exceeds the tolerance, 2 when the files share no ratio. Two runs on one replayed calibration
(``--calibration``) agree exactly; two that each measured their own differ by as much as their
calibrations do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RATIOS = {
    "multiturn": "ttft_mean_speedup_vs_device_only",
    "optimistic": "ttft_mean_speedup_vs_0",
    "optimistic_write_through": "ttft_mean_speedup_vs_0",
}
BASELINES = ("device_only", "attempts_0")


def headline_ratios(summary: dict[str, Any]) -> dict[str, float]:
    """``{"section/config": ratio}`` of every non-baseline configuration with a ratio."""
    out: dict[str, float] = {}
    for section, key in RATIOS.items():
        configs = summary.get(section)
        if not isinstance(configs, dict):
            continue
        for name, res in configs.items():
            if not isinstance(res, dict) or res.get(key) is None:
                continue
            if any(name == b or name.startswith(b + "_") for b in BASELINES):
                continue
            out[f"{section}/{name}"] = float(res[key])
        for axis, points in (configs.get("sweeps") or {}).items():
            if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
                continue
            x_key = {"working_set": "working_set_ratio"}.get(axis, axis)
            for pt in points:
                for name, r in pt.get("ratios", {}).items():
                    if r is not None:
                        out[f"{section}/sweep/{axis}={pt.get(x_key)}/{name}"] = float(r)
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """``(name, ratio in a, ratio in b, |b - a| / a)`` for every ratio both summaries hold."""
    ra, rb = headline_ratios(a), headline_ratios(b)
    return [(n, ra[n], rb[n], abs(rb[n] - ra[n]) / ra[n]) for n in ra if n in rb]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--tolerance", type=float, default=0.05, help="Largest relative difference.")
    args = p.parse_args(argv)
    a, b = (json.loads(path.read_text()) for path in (args.a, args.b))
    rows = compare(a, b)
    if not rows:
        print("no headline ratio in both files")
        return 2
    for label, doc in (("a", a), ("b", b)):
        run = doc.get("run", {})
        print(f"{label}: commit {str(run.get('commit'))[:12]}, {run.get('timestamp')}, "
              f"load average {run.get('loadavg_1_5_15')}, "
              f"suite {run.get('suite_wall_s')} s")  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'ratio':<{width}} {'a':>8} {'b':>8} {'|b-a|/a':>9}")
    for name, x, y, d in rows:
        flag = "  > tolerance" if d > args.tolerance else ""
        print(f"{name:<{width}} {x:>8.3f} {y:>8.3f} {d:>8.2%}{flag}")
    worst = max(rows, key=lambda r: r[3])
    print(f"largest difference: {worst[3]:.2%} ({worst[0]}); tolerance {args.tolerance:.0%}")
    return 0 if worst[3] <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
