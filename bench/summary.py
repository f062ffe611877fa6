"""The suite's summary: machine description and the one table printed at the end of a run."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"commit": sha or "unknown", "dirty": bool or None}`` of the checkout at ``root``
    (``dirty``: tracked files outside ``results/`` differ from the commit)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        # Outputs of earlier runs (results/) do not make the code dirty.
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                 ".", ":(exclude)results"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": sha or "unknown", "dirty": bool(status.strip())}


def run_info() -> dict[str, Any]:
    """When and on what this run happened: commit (``git rev-parse``; ``"unknown"`` outside a
    repository), local timestamp (ISO 8601) and the 1/5/15-minute load averages."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux
        load = None
    return {
        **git_commit(),
        "timestamp": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "loadavg_1_5_15": load,
    }


def machine_info() -> dict[str, Any]:
    """Device, torch and triton versions, CPU count: recorded in every result file."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": "cpu",
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["device_count"] = torch.cuda.device_count()
    return info


# (metric, unit label, scale) rows of the final table's end-to-end sections.
_ROWS = {
    "multiturn": [
        ("ttft_mean_s", "TTFT mean ms", 1e3), ("ttft_p50_s", "TTFT p50 ms", 1e3),
        ("ttft_p90_s", "TTFT p90 ms", 1e3), ("device_hit_tokens", "device hit tok", 1),
        ("host_hit_tokens", "host hit tok", 1), ("prefill_tokens_computed", "computed tok", 1),
        ("ttft_mean_speedup_vs_device_only", "vs device-only", 1),
    ],
    "optimistic": [
        ("ttft_mean_s", "TTFT mean ms", 1e3), ("ttft_p50_s", "TTFT p50 ms", 1e3),
        ("ttft_p90_s", "TTFT p90 ms", 1e3), ("yields", "yields", 1), ("parks", "parks", 1),
        ("aborts", "aborts", 1), ("recomputed_tokens_per_yield", "recomputed/yield", 1),
        ("ttft_mean_speedup_vs_0", "vs 0 attempts", 1),
    ],
}  # fmt: skip
_ROWS["optimistic_write_through"] = _ROWS["optimistic"]


W = 17
"""Width of one configuration's column in the final table."""


def _cell(value: Any, scale: float, exact: bool = False) -> str:
    if value is None:
        return f"{'-':>{W}}"
    if not exact and (isinstance(value, int) or (scale == 1 and float(value).is_integer())):
        return f"{int(value):>{W}d}"
    return f"{value * scale:>{W}.2f}"


def print_summary_table(summary: dict[str, Any]) -> None:
    """Print one fixed-width table per section that has per-configuration results, with the
    spread over seeds of each headline ratio."""
    print()
    print("=" * 78)
    run = summary.get("run", {})
    device = summary.get("machine", {}).get("device", "?")
    print(f"summary on {device}; commit {str(run.get('commit', '?'))[:12]}; "
          f"load average {run.get('loadavg_1_5_15')}")  # fmt: skip
    for section, rows in _ROWS.items():
        configs = summary.get(section)
        if not isinstance(configs, dict):
            continue
        # Headline configurations only; each benchmark prints its variants in its own table.
        names = [
            k
            for k, v in configs.items()
            if isinstance(v, dict) and "ttft_mean_s" in v and "_with" not in k and "_util" not in k
        ]
        if not names:
            continue
        print(f"\n{section} ({configs.get('mode', 'wall')} clock, seeds {configs.get('seeds')})")
        print(f"{'metric':<18}" + "".join(f"{n[:W - 2]:>{W}}" for n in names))
        for metric, label, scale in rows:
            exact = metric.startswith("ttft_mean_speedup")
            print(f"{label:<18}" + "".join(_cell(configs[n].get(metric), scale, exact)
                                           for n in names))  # fmt: skip
        ratio = rows[-1][0]
        spreads = [configs[n].get(ratio + "_spread") for n in names]
        if any(spreads):
            print(f"{'  min..max':<18}" + "".join(
                f"{'-':>{W}}" if s is None else f"{s['min']:>{W - 7}.2f}..{s['max']:<5.2f}"
                for s in spreads))  # fmt: skip
        curve = configs.get("forward_curve")
        if curve:
            print(f"  calibration ({configs.get('calibration_source', '?')}): forward "
                  f"{curve['intercept_ms']:.2f} ms + {curve['slope_us_per_token']:.1f} us/token; "
                  f"{curve['long_n']} / {curve['short_n']} tokens after {curve['prefix']}: "
                  f"x{curve['long_over_short']:.2f}"
                  + (f"; zero-load ceiling {configs['ceiling_zero_load']:.3f}"
                     if configs.get("ceiling_zero_load") else ""))  # fmt: skip
        for axis, points in (configs.get("sweeps") or {}).items():
            if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
                continue
            cells = []
            for pt in points:
                x = pt.get(axis if axis in pt else {"load": "load",
                           "working_set": "working_set_ratio"}.get(axis, axis))  # fmt: skip
                r = "/".join(f"{v:.2f}" for v in pt["ratios"].values())
                cells.append(f"{x:g}: {r}" + (f" (ceil {pt['ceiling']:.2f})"
                                              if "ceiling" in pt else ""))  # fmt: skip
            print(f"  sweep {axis}: " + ", ".join(cells))
    fidelity = summary.get("fidelity")
    if isinstance(fidelity, dict) and fidelity.get("entries"):
        print(f"\nfidelity (virtual vs wall clock; target |gap| <= "
              f"{fidelity.get('gap_target', 0.15):.0%}; load average "
              f"{fidelity.get('loadavg_before')} -> {fidelity.get('loadavg_after')})")  # fmt: skip
        for name, e in fidelity["entries"].items():
            u = e.get("virtual_uncharged")
            extra = "" if u is None else f"   uncharged {u:.3f} ({e['gap_uncharged']:+.1%})"
            print(f"  {name:<36} virtual {e['virtual']:.3f}  wall {e['wall']:.3f}  "
                  f"gap {e['gap']:+.1%}{extra}")  # fmt: skip
    transfer = summary.get("transfer")
    if isinstance(transfer, dict) and transfer.get("headline"):
        print("\ntransfer")
        for name, value in transfer["headline"].items():
            print(f"  {name:<40} {value}")
    integrity = summary.get("integrity", {})
    print(
        "\nintegrity: "
        + ", ".join(f"{k}={v}" for k, v in integrity.items())
        + ("  (all zero)" if not any(integrity.values()) else "  (VIOLATIONS)")
    )
    print("=" * 78)
