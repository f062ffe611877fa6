"""What ``bench_cache_ops`` prints and checks: per-op statistics, runs combined, tables, targets.

- ``stats``: mean, median and p99 of one op's samples (microseconds per call).
- ``combine``: rows of repeated runs (same trace, fresh trees) as one row per size and page: each
  statistic is the median over the runs, and ``spread`` keeps every run's mean, so a reader sees
  how far a shared machine moved the numbers.
- ``print_rows``: per size and page, every tree's mean / median and the ratios of this project's
  trees to SGLang's (ratio of means, ratio of medians in brackets).
- ``targets``: the checks of this run (see ``targets``' docstring); ``print_targets`` prints them.
"""

from __future__ import annotations

import statistics
from typing import Any

# (project tree, SGLang tree) pairs whose ratios the table prints, when both ran.
RATIOS = (
    ("project", "sglang_rust"),
    ("project_list", "sglang_rust"),
    ("project", "sglang_python"),
)
SHORT = {
    "project": "array",
    "project_list": "list",
    "sglang_python": "python",
    "sglang_rust": "rust",
}


def stats(samples: list[float]) -> dict[str, Any]:
    """Mean, median, p99 and count of ``samples`` (microseconds)."""
    if not samples:
        return {"mean_us": 0.0, "median_us": 0.0, "p99_us": 0.0, "n": 0}
    s = sorted(samples)
    return {
        "mean_us": round(statistics.fmean(s), 2),
        "median_us": round(statistics.median(s), 2),
        "p99_us": round(s[min(len(s) - 1, int(0.99 * len(s)))], 2),
        "n": len(s),
    }


def combine(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (size, page) from ``runs`` (each a list of rows in the same order): every
    op's mean, median and p99 is the median over the runs, ``n`` their sum, ``spread`` every
    run's mean; the counts (nodes, mismatches) are the first run's (the trace is the same)."""
    if len(runs) == 1:
        return runs[0]
    out = []
    for same in zip(*runs, strict=True):
        row = dict(same[0])
        row["repeats"] = len(same)
        row["trees"] = {}
        for name in same[0]["trees"]:
            ops = {}
            for op in same[0]["trees"][name]:
                cells = [r["trees"][name][op] for r in same]
                ops[op] = {
                    k: round(statistics.median(c[k] for c in cells), 2)
                    for k in ("mean_us", "median_us", "p99_us")
                }
                ops[op]["n"] = sum(c["n"] for c in cells)
                ops[op]["spread"] = [c["mean_us"] for c in cells]
            row["trees"][name] = ops
        for key in ("match_len_mismatch_steps_vs_sglang_python", "list_key_mismatch_steps"):
            if key in row:
                row[key] = max(r[key] for r in same)
        out.append(row)
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    return a[key] / b[key] if b[key] else float("inf")


ORDER = ("project", "project_list", "sglang_python", "sglang_rust")  # columns, when present


def print_rows(rows: list[dict[str, Any]], ops: tuple[str, ...]) -> None:
    names = sorted(rows[0]["trees"], key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
    pairs = [(a, b) for a, b in RATIOS if a in names and b in names]
    runs = rows[0].get("repeats", 1)
    print(
        "per-op cost on the multi-turn trace (mean / median, microseconds per call"
        + (f"; median over {runs} runs" if runs > 1 else "")
        + "); ratios: of means [of medians]"
    )
    for r in rows:
        extra = ""
        if "match_len_mismatch_steps_vs_sglang_python" in r:
            extra = ", match-length mismatches vs SGLang Python: "
            extra += f"{r['match_len_mismatch_steps_vs_sglang_python']}/{r['steps']} steps"
        if "list_key_mismatch_steps" in r:
            extra += f", list vs array keys: {r['list_key_mismatch_steps']}"
        print(
            f"-- {r['tokens']} tokens (holding {r['tree_tokens_after_steps']} after the steps), "
            f"page {r['page_size']}, {r['nodes']} nodes{extra}"
        )
        head = f"{'op':>17}" + "".join(f"{n:>19}" for n in names)
        head += "".join(f"{SHORT[a] + '/' + SHORT[b]:>16}" for a, b in pairs)
        print(head)
        for op in ops:
            cells = ""
            for n in names:
                st = r["trees"][n][op]
                cells += (
                    f"{st['mean_us']:>10.1f} /{st['median_us']:>7.1f}"
                    if st["n"]
                    else (f"{'-':>19}")
                )
            for a, b in pairs:
                x, y = r["trees"][a][op], r["trees"][b][op]
                if x["n"] and y["n"]:
                    cells += f"{_ratio(x, y, 'mean_us'):>8.2f} [{_ratio(x, y, 'median_us'):.2f}]"
                else:
                    cells += f"{'-':>16}"
            print(f"{op:>17}" + cells)


def targets(
    rows: list[dict[str, Any]], fixed_rows: list[dict[str, Any]], compared_ops: tuple[str, ...]
) -> list[dict[str, Any]]:
    """The tree's targets, checked on this run (met on the ratio of means; the ratio of medians,
    which a few scheduler preemptions on a shared CPU do not move, is given beside it, and with
    repeated runs every run's ratio of means):

    - at the largest size, every op in ``compared_ops`` no slower than SGLang's Rust core and
      than its Python tree (this project's tree with ``array('q')`` keys, the key type SGLang's
      trees get); with list keys, no slower than the Rust core;
    - a single-leaf eviction within 2x across sizes: in the trace, in the trace with the same
      eviction amount at every size (``fixed_rows``), the tree's share of it in the trace
      (allocator ``free`` excluded), and alone (back to back)."""
    out: list[dict[str, Any]] = []
    largest = max(r["tokens"] for r in rows)
    for ps in sorted({r["page_size"] for r in rows}):
        page_rows = sorted((r for r in rows if r["page_size"] == ps), key=lambda r: r["tokens"])
        big = next(r for r in page_rows if r["tokens"] == largest)

        def line(what: str, a: dict, b: dict, limit: float = 1.0, ps: int = ps) -> None:
            mean = _ratio(a, b, "mean_us")
            t: dict[str, Any] = {
                "page": ps,
                "target": what,
                "mean_ratio": round(mean, 2),
                "median_ratio": round(_ratio(a, b, "median_us"), 2),
                "limit": limit,
                "met_on_mean": mean <= limit,
            }
            if "spread" in a and "spread" in b:
                t["run_mean_ratios"] = [
                    round(x / y, 2) if y else float("inf")
                    for x, y in zip(a["spread"], b["spread"], strict=True)
                ]
            out.append(t)

        trees = big["trees"]
        for mine, other, label in (
            ("project", "sglang_rust", "vs SGLang Rust"),
            ("project", "sglang_python", "vs SGLang Python"),
            ("project_list", "sglang_rust", "(list keys) vs SGLang Rust"),
        ):
            if mine in trees and other in trees:
                for op in compared_ops:
                    line(f"{op} {label} @ {largest}", trees[mine][op], trees[other][op])
        fixed = [r for r in fixed_rows if r["page_size"] == ps]
        for op, src, what in (
            ("evict_leaf", page_rows, "evict_leaf"),
            ("evict_leaf", fixed, "evict_leaf, fixed eviction amount,"),
            ("evict_leaf_tree", page_rows, "evict_leaf, tree's share,"),
            ("evict_leaf_alone", page_rows, "evict_leaf_alone"),
        ):
            # (a small tree has too few leaves for a mean of single evictions in a row)
            costs = [r["trees"]["project"][op] for r in src]
            costs = [c for c in costs if c["n"] >= 20]
            if len(costs) < 2:
                continue
            hi = max(costs, key=lambda c: c["mean_us"])
            lo = min(costs, key=lambda c: c["mean_us"])
            line(f"{what} largest / smallest across sizes", hi, lo, limit=2.0)
    return out


def print_targets(found: list[dict[str, Any]]) -> None:
    print("targets (ratio of means; median ratio in brackets; each run's ratio of means after)")
    for t in found:
        verdict = "met" if t["met_on_mean"] else "MISSED"
        runs = t.get("run_mean_ratios")
        tail = f"  runs {' '.join(f'{x:.2f}' for x in runs)}" if runs else ""
        print(
            f"  page {t['page']:>2}: {t['target']:<56} {t['mean_ratio']:>6.2f}x "
            f"[{t['median_ratio']:>5.2f}x] limit {t['limit']:.1f}x  {verdict}{tail}"
        )


def curve(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean cost of evicting one leaf / 1% of the tree against tree size, per page size."""
    out: dict[str, Any] = {}
    for r in rows:
        key = f"page{r['page_size']}"
        for name, tree in r["trees"].items():
            c = out.setdefault(key, {}).setdefault(name, {})
            c[str(r["tokens"])] = {
                "evict_leaf_mean_us": tree["evict_leaf"]["mean_us"],
                "evict_1pct_mean_us": tree["evict_1pct"]["mean_us"],
            }
    return out
