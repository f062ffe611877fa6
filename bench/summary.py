"""The suite's summary: machine description and the one table printed at the end of a run."""

from __future__ import annotations

import platform
from typing import Any


def machine_info() -> dict[str, Any]:
    """Device, torch and triton versions, CPU count: recorded in every result file."""
    import os

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


# (summary key, metric, unit label, scale) rows of the final table.
_ROWS = [
    ("multiturn", "ttft_mean_s", "TTFT mean ms", 1e3),
    ("multiturn", "ttft_p50_s", "TTFT p50 ms", 1e3),
    ("multiturn", "ttft_p90_s", "TTFT p90 ms", 1e3),
    ("multiturn", "device_hit_tokens", "device hit tok", 1),
    ("multiturn", "host_hit_tokens", "host hit tok", 1),
    ("multiturn", "prefill_tokens_computed", "computed tok", 1),
    ("optimistic", "ttft_mean_s", "TTFT mean ms", 1e3),
    ("optimistic", "ttft_p50_s", "TTFT p50 ms", 1e3),
    ("optimistic", "ttft_p90_s", "TTFT p90 ms", 1e3),
    ("optimistic", "yields", "yields", 1),
    ("optimistic", "parks", "parks", 1),
    ("optimistic", "aborts", "aborts", 1),
]


def print_summary_table(summary: dict[str, Any]) -> None:
    """Print one fixed-width table per section that has per-configuration results."""
    print()
    print("=" * 78)
    print(f"summary on {summary.get('machine', {}).get('device', '?')}")
    for section in ("multiturn", "optimistic"):
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
        print(f"\n{section}")
        print(f"{'metric':<18}" + "".join(f"{n[:22]:>24}" for n in names))
        for sec, metric, label, scale in _ROWS:
            if sec != section:
                continue
            cells = []
            for n in names:
                value = configs[n].get(metric)
                if value is None:
                    cells.append(f"{'-':>24}")
                elif isinstance(value, int):
                    cells.append(f"{value:>24d}")
                else:
                    cells.append(f"{value * scale:>24.2f}")
            print(f"{label:<18}" + "".join(cells))
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
