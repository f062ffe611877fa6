"""What ``bench.transfer.bench`` prints and draws: the grid table's columns, the headline numbers
the suite summary shows, and the GB/s-vs-tokens plot.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bench.common import Column

logger = logging.getLogger(__name__)

CPU_NOTE = (
    "CPU numbers: no CUDA device, so every buffer is in host memory and these are CPU memcpy "
    "rates, not PCIe rates; the Triton kernels (interpreted here) are not timed."
)

GRID_COLUMNS = [
    Column("direction", "dir", 5), Column("layout", "layout", 19), Column("item", "item B", 8),
    Column("page", "page", 6), Column("tokens", "tokens", 8), Column("method", "method", 14),
    Column("gbps", "GB/s", 9, ".2f"), Column("ratio", "x ceil", 8, ".2f"),
    Column("median_ms", "ms", 10, ".3f"), Column("note", "note", 32),
]  # fmt: skip


def _best(rows: list[dict], **match: Any) -> dict | None:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items()) and "gbps" in r]
    return max(found, key=lambda r: r["gbps"]) if found else None


def headline(rows: list[dict], sweep: list[dict], gemm: list[dict], cpu: bool) -> dict:
    """The few numbers the suite summary prints."""
    out: dict[str, Any] = {}
    if not any("gbps" in r for r in rows):
        out["note"] = "no rows measured"
        return out
    if cpu:
        out["note"] = CPU_NOTE
        n = max(r["tokens"] for r in rows)
        for method in ("ceiling", "torch_gather", "direct"):
            r = _best(rows, method=method, tokens=n, page=1, direction="h2d")
            if r:
                out[f"cpu h2d {method} ps1 {n}tok GB/s"] = round(r["gbps"], 2)
        return out
    item = 2048 if any(r["item"] == 2048 for r in rows) else rows[0]["item"]
    n = max(r["tokens"] for r in rows if r["item"] == item)
    for direction in ("h2d", "d2h"):
        key = dict(direction=direction, item=item, page=1)
        ceil = _best(rows, method="ceiling", tokens=n, **key)
        tri = _best(rows, method="triton", layout="page_first", tokens=n, **key)
        if ceil and tri:
            out[f"{direction} {item}B ps1 {n}tok ceiling GB/s"] = round(ceil["gbps"], 1)
            out[f"{direction} {item}B ps1 {n}tok triton page_first bq=2 GB/s"] = round(
                tri["gbps"], 1
            )
            out[f"{direction} triton / ceiling"] = round(tri["ratio"], 3)
        directs = [r for r in rows if r["method"] == "direct" and r["layout"] == "layer_first"
                   and "gbps" in r and all(r[k] == v for k, v in key.items())]  # fmt: skip
        if directs:
            d = max(directs, key=lambda r: r["tokens"])
            t = _best(rows, method="triton", layout="layer_first", tokens=d["tokens"], **key)
            if t:
                label = f"{direction} triton / direct (layer_first, ps1, {d['tokens']}tok)"
                out[label] = round(t["gbps"] / d["gbps"], 1)
    for direction in ("h2d", "d2h"):
        capped = [r for r in sweep if r["direction"] == direction and r["block_quota"] <= 16]
        if capped:
            best = max(capped, key=lambda r: r["gbps"])
            out[f"{direction} best bq<=16"] = (
                f"bq={best['block_quota']}: {best['gbps']:.1f} GB/s ({best['ratio']:.0%} of ceil)"
            )
    for r in gemm:
        if r["copy"].startswith("triton"):
            out[f"gemm slowdown, {r['copy']} copy"] = round(r["slowdown"], 3)
    return out


def ceiling_label(cpu: bool) -> str:
    """Legend text of the ceiling line: what it is and why nothing indexed can beat it."""
    if cpu:
        return ("ceiling: one contiguous memcpy of the same bytes\n"
                "(no gather/scatter; host memory on both sides)")  # fmt: skip
    return ("ceiling: one contiguous pinned copy_ of the same bytes\n"
            "(copy engine, no gather/scatter: the link's measured best)")  # fmt: skip


def plot(rows: list[dict], path: Path, title: str, cpu: bool = False) -> Path | None:
    """GB/s vs tokens, one line per method (and layout), item 2 KiB (or the first item), one
    panel per direction and page size present (page 1 and 16 at the quick size)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed: no plot")
        return None
    measured = [r for r in rows if "gbps" in r]
    if not measured:
        return None
    item = 2048 if any(r["item"] == 2048 for r in measured) else measured[0]["item"]
    pages = sorted({r["page"] for r in measured if r["item"] == item})
    fig, axes = plt.subplots(len(pages), 2, figsize=(12, 4.2 * len(pages)), squeeze=False)
    for row_axes, page in zip(axes, pages, strict=True):
        for ax, direction in zip(row_axes, ("h2d", "d2h"), strict=True):
            sel = [r for r in measured if r["direction"] == direction and r["item"] == item
                   and r["page"] == page]  # fmt: skip
            for key in sorted({(r["method"], r["layout"]) for r in sel}):
                pts = sorted(
                    (r["tokens"], r["gbps"]) for r in sel if (r["method"], r["layout"]) == key
                )
                if key[0] == "ceiling":
                    label, style = ceiling_label(cpu), "k--"
                else:
                    label, style = f"{key[0]} ({key[1]})", "-o"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel("GB/s")
            what = "H2D, one layer" if direction == "h2d" else "D2H, all layers"
            ax.set_title(f"{what}, item {item} B, page size {page}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
