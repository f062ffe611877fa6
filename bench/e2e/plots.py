"""The sweep plots of the end-to-end benchmarks: one panel per swept input, the headline ratio
of each configuration against it, and where there is one the analytic ceiling beside it
(matplotlib, when installed)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.e2e.setup import cpu_note

logger = logging.getLogger(__name__)

__all__ = ["plot_sweeps"]

Panel = tuple[str, str, Sequence[dict[str, Any]], str | None]
"""(x label, x key of each row, rows with ``ratios`` {config: ratio}, key of a ceiling or None)."""


def plot_sweeps(path: Path, title: str, panels: Sequence[Panel]) -> Path | None:
    """One panel per swept input; returns the file written (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot {path.name}")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (xlabel, xkey, rows, ceiling) in zip(axes[0], panels, strict=True):
        xs = [r[xkey] for r in rows]
        names = sorted({n for r in rows for n in r["ratios"]})
        for name in names:
            ax.plot(xs, [r["ratios"].get(name) for r in rows], marker="o", label=name)
        if ceiling is not None:
            ax.plot(xs, [r[ceiling] for r in rows], linestyle="--", marker="x", color="gray",
                    label="zero-load ceiling E[B+P]/E[max(B,P)]")  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean TTFT ratio (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + (" (CPU)" if cpu_note() else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
