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


HEADLINES = {"multiturn": "mean TTFT speedup vs device-only",
             "optimistic": "mean TTFT speedup vs 0 attempts"}  # fmt: skip


def print_summary_table(summary: dict[str, Any]) -> None:
    """The end-to-end headline ratios per clock mode (measured or modelled, as labelled), the
    seconds each family took and the integrity counters."""
    print()
    print("=" * 78)
    run = summary.get("run", {})
    device = summary.get("machine", {}).get("device", "?")
    print(f"summary on {device}; commit {str(run.get('commit', '?'))[:12]}; "
          f"load average {run.get('loadavg_1_5_15')}")  # fmt: skip
    for section, label in HEADLINES.items():
        body = summary.get(section)
        if not isinstance(body, dict) or "headline" not in body:
            continue
        print(f"\n{section}: {label} (mean over seeds)")
        for mode, ratios in body["headline"].items():
            cells = ", ".join(f"{c} {v:.3f}" for c, v in ratios.items()
                              if v is not None and v != 1.0)  # fmt: skip
            print(f"  {body['modes'].get(mode, mode)}: {cells}")
    print()
    times = {k: v["seconds"] for k, v in summary.items() if isinstance(v, dict) and "seconds" in v}
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print(f"integrity: {summary.get('integrity')}")
