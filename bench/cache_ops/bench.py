"""Host-side cost of the radix tree's bookkeeping per op on a multi-turn trace (CPU; no KV bytes).

Each tree is filled to N tokens by ``trace.py``, then plays ``--steps`` steps: 1% of N evicted
after each 1% inserted (``evict_1pct``), a leaf every 10th step (``evict_leaf``).
``--against-sglang`` also plays SGLang 0.5.23's trees (rotating which goes first): ratios and
match-length mismatches. Microseconds per call on this CPU; run with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import fmean, median
from typing import Any

from bench.cache_ops.sglang_loader import sglang_drivers
from bench.cache_ops.trace import OPS, MultiTurnTrace, ProjectDriver, play_step
from bench.common import positive
from hicache_prefill.hicache.memory.allocator import page_ceil

ALL_OPS = OPS + ("evict_1pct", "evict_leaf")
SIZES = (10_000, 100_000, 1_000_000)
UNITS = ("mean_us", "median_us")
RUST_CORE = "sglang.srt.mem_cache.rust_tree_core.mem_cache"  # its compiled TreeCore


def stats(samples: list[float]) -> dict[str, Any]:
    """Mean, median, p99 (microseconds) and count."""
    s = sorted(samples) or [0.0]
    q = [round(x, 2) for x in (fmean(s), median(s), s[int(0.99 * (len(s) - 1))])]
    return dict(mean_us=q[0], median_us=q[1], p99_us=q[2], n=len(samples))


def run_trace(capacity: int, page_size: int, steps: int, factories: list[Any]) -> dict[str, Any]:
    """Fill every tree to ``capacity`` tokens, then time ``steps`` steps (module docstring)."""
    trace = iter(MultiTurnTrace(capacity))
    pool = page_ceil(capacity + 16_384 + capacity // 50, page_size)
    drivers = [f(pool, page_size) for f in factories]
    project = drivers[0]
    while project.tree.total_size() < capacity:
        step = next(trace)
        for d in drivers:
            play_step(d, step, None)
    chunk = max(page_size, capacity // 100 // page_size * page_size)
    samples = {d.name: {op: [] for op in ALL_OPS} for d in drivers}
    balance = mismatches = 0  # tokens the project's tree gained since its last 1% eviction

    def evict(order: list[Any], n: int, op: str) -> None:
        nonlocal balance
        for d in order:
            t0 = time.perf_counter_ns()
            freed = d.evict(n)
            samples[d.name][op].append((time.perf_counter_ns() - t0) / 1e3)
            balance -= freed if d is project else 0

    for s in range(steps):
        step, k = next(trace), s % len(drivers)
        order = drivers[k:] + drivers[:k]
        lens = {}
        for d in order:
            lens[d.name], need = play_step(d, step, samples[d.name])
            balance += need if d is project else 0
        mismatches += lens.get("sglang_python", lens["project"]) != lens["project"]
        if balance >= chunk:
            evict(order, chunk, "evict_1pct")
        if s % 10 == 5:
            evict(order, page_size, "evict_leaf")
    project.tree.check_integrity()  # raises on a broken invariant or a leak
    trees = {d.name: {op: stats(samples[d.name][op]) for op in ALL_OPS} for d in drivers}
    row = dict(tokens=capacity, page_size=page_size, steps=steps, evict_tokens=chunk)
    row.update(nodes=len(project.tree.all_nodes()), trees=trees)
    if len(drivers) > 1:
        row["match_len_mismatch_steps_vs_sglang_python"] = mismatches
    return row


def print_rows(rows: list[dict[str, Any]]) -> None:
    names = list(rows[0]["trees"])
    print(
        "per-op cost on the multi-turn trace, measured on this CPU: mean / median microseconds "
        "per call; ratios project / SGLang of means [of medians]"
    )
    for r in rows:
        miss = r.get("match_len_mismatch_steps_vs_sglang_python", "-")
        print(f"-- {r['tokens']} tokens, page {r['page_size']}, {r['nodes']} nodes; ", end="")
        print(f"steps whose match length differs from SGLang Python: {miss}")
        print(f"{'op':>11}" + "".join(f"{n:>19}" for n in names + ["/" + n for n in names[1:]]))
        for op in ALL_OPS:
            t = {n: r["trees"][n][op] for n in names}
            cells = [f"{t[n]['mean_us']:>10.1f} /{t[n]['median_us']:>7.1f}" for n in names]
            for n in names[1:]:
                m, d = (t["project"][k] / t[n][k] if t[n][k] else 0.0 for k in UNITS)
                cells.append(f"{m:>12.2f} [{d:.2f}]")
            print(f"{op:>11}" + "".join(cells))


def run(
    quick: bool = True,
    out_dir: Path | str = "bench-out",
    against_sglang: bool = False,
    sizes: tuple[int, ...] = SIZES,
    pages: tuple[int, ...] = (1, 16),
    steps: int | None = None,
    sglang_site: str | None = None,
) -> dict[str, Any]:
    """Every size and page (steps: 300 quick, 3000 full); prints the table, writes
    ``bench_cache_ops.json`` under ``out_dir`` and returns the summary dict."""
    sgl, note, more = None, "not requested (--against-sglang)", {}
    if against_sglang:
        sgl, note, more = sglang_drivers(sglang_site)
        print(f"[cache_ops] SGLang: {note}")
    n_steps = steps if steps is not None else (300 if quick else 3000)
    rows = [run_trace(n, p, n_steps, [ProjectDriver, *more.values()]) for p in pages for n in sizes]
    stubs, rust = [], None
    if sgl is not None:
        stubs, rust = sgl.stub_report(), getattr(sys.modules.get(RUST_CORE), "__file__", None)
        print(f"[cache_ops] SGLang Rust TreeCore: {rust}")
        if stubs:
            print("SGLang imports replaced (the rest is SGLang's installed code):")
        for r in stubs:
            tail = f" [names imported: {', '.join(r.get('placeholders', [])) or 'none'}]"
            print(f"  - {r['module']} ({r['kind']}): {r['reason']}{tail * (r['kind'] == 'stub')}")
    print_rows(rows)
    result = {"unit": "microseconds per call, measured on this CPU", "sglang": note}
    result.update(sglang_stubs=stubs, sglang_rust_core=rust, rows=rows)
    result["integrity"] = {"leaked_slots": 0}  # every row ended with check_integrity()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cache_ops.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m bench.cache_ops", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 steps instead of 3000.")
    ap.add_argument("--against-sglang", action="store_true", help="Also drive SGLang's trees.")
    ap.add_argument("--sglang-site", help="SGLang pin dir (sglang_loader); default: installed.")
    ap.add_argument(
        "--sizes", type=positive(int), nargs="*", default=list(SIZES), help="Tree tokens."
    )
    ap.add_argument("--pages", type=positive(int), nargs="*", default=[1, 16], help="Page sizes.")
    ap.add_argument("--steps", type=positive(int), default=None, help="Steady-state steps per row.")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    a = ap.parse_args(argv)
    run(a.quick, a.out, a.against_sglang, tuple(a.sizes), tuple(a.pages), a.steps, a.sglang_site)
    return 0
