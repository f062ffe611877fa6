"""Host-side cost of the radix tree's bookkeeping, per op, on a multi-turn trace (CPU).

What is timed: the scheduler-thread work of ``RadixCache`` -- tree walks, splits, slot-tensor
slicing and concatenation, the eviction queue, allocator frees. No KV bytes move. The ceiling
these numbers are compared with is a decode step (~10-30 ms on a GPU) and, with
``--against-sglang``, SGLang 0.5.23's own trees driven by the same trace in the same process.

Trace (``bench/cache_ops/trace.py``): 4 shared system prompts, conversations continued 80% of the
time, per step match (+ device indices), lock, insert, unlock and one pure-miss match; after the
tree has filled to N tokens (N = 10K, 100K, 1M), 1% of N is evicted after each 1% of N inserted, and
every 10th step one leaf is evicted on its own (``evict_leaf``: the eviction curve against tree
size, in the middle of the trace, where the least recently used leaf's memory is cold at 1M tokens).
A second pass on this project's tree evicts the same number of tokens at every size (1% of the
smallest tree), so eviction runs about as often at 1M as at 10K tokens and the single-leaf curve
shows the cost of tree size alone. At the end, up to 100 leaves are evicted one at a time back to
back (``evict_leaf_alone``: the queue's own cost). Page 1 and 16. Mean and p99 per op, microseconds
per call. Run with ``OMP_NUM_THREADS=1``: torch's intra-op threads on a small shared CPU make every
tree's numbers noisy (SGLang's Rust core most).

With ``--against-sglang`` each step and each eviction runs on every tree in turn (rotating which
goes first; neither project tree ever runs right after the other): this
project's tree with ``array('q')`` keys (``project``, the key type SGLang's trees get) and with
list keys (``project_list``), SGLang's Python ``RadixCache`` and its ``UnifiedRadixCache`` with the
Rust TreeCore (``bench/cache_ops/sglang_trees.py``), each with SGLang's own allocator. The table
gives each tree's mean and median and the ratios project / SGLang; the steps where the project's
match length differs from SGLang's Python tree are counted (LRU parity: both evict the same
leaves), and so are those where list and array keys disagree. ``evict_leaf_tree`` is the project's
single-leaf eviction less the time its allocator's ``free`` took inside it. ``--repeat R`` runs the
whole measurement R times (fresh trees, same trace) and reports the median of each statistic over
the runs, with every run's ratio beside the targets.

Also (``bench/cache_ops/two_tier.py``): eviction with 0 / 1000 / 3000 copies in flight, and
write_back eviction under host pressure against tree size.

``python -m bench.cache_ops [--quick] [--against-sglang] [--repeat R] [--out results]`` prints the
tables and writes ``bench_cache_ops.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from bench.cache_ops.report import combine, curve, print_rows, print_targets, stats, targets
from bench.cache_ops.trace import (
    OPS,
    MultiTurnTrace,
    ProjectDriver,
    ProjectListDriver,
    play_step,
    timed_evict,
)
from bench.cache_ops.two_tier import run_pressure
from hicache.memory.allocator import page_ceil

EVICT_OPS = ("evict_1pct", "evict_leaf", "evict_leaf_alone")
ALL_OPS = OPS + EVICT_OPS + ("evict_leaf_tree",)
SIZES = (10_000, 100_000, 1_000_000)


def run_trace(
    capacity: int,
    page_size: int,
    steps: int,
    factories: list[Any],
    seed: int = 0,
    evict_tokens: int | None = None,
) -> dict[str, Any]:
    """Fill every tree to ``capacity`` tokens with the trace, then time ``steps`` steps, evicting
    ``evict_tokens`` (default 1% of ``capacity``) each time as many were inserted."""
    trace = iter(MultiTurnTrace(capacity, seed=seed))
    headroom = 16_384 + capacity // 50
    pool = page_ceil(capacity + headroom, page_size)
    drivers = [f(pool, page_size) for f in factories]
    project = drivers[0]
    while project.size() < capacity:
        step = next(trace)
        for d in drivers:
            play_step(d, step, None)
    share = capacity // 100 if evict_tokens is None else evict_tokens
    chunk = max(page_size, share // page_size * page_size)
    samples = {d.name: {op: [] for op in ALL_OPS} for d in drivers}
    balance = 0  # tokens the project's tree gained since the last eviction of 1%
    mismatches = list_mismatches = 0
    for s in range(steps):
        step = next(trace)
        lens = {}
        k = s % len(drivers)
        for d in drivers[k:] + drivers[:k]:
            lens[d.name], need = play_step(d, step, samples[d.name])
            if d is project:
                balance += need
        if "sglang_python" in lens and lens["sglang_python"] != lens["project"]:
            mismatches += 1
        if "project_list" in lens and lens["project_list"] != lens["project"]:
            list_mismatches += 1
        if balance >= chunk:
            for d in drivers[k:] + drivers[:k]:
                us, freed, _ = timed_evict(d, chunk)
                samples[d.name]["evict_1pct"].append(us)
                if d is project:
                    balance -= freed
        if s % 10 == 5:  # counted against the next 1%, so the tree stays at N tokens
            for d in drivers[k:] + drivers[:k]:
                us, freed, in_free = timed_evict(d, page_size)
                samples[d.name]["evict_leaf"].append(us)
                if in_free is not None:
                    samples[d.name]["evict_leaf_tree"].append(us - in_free)
                if d is project:
                    balance -= freed
    nodes = len(project.tree.all_nodes())
    tokens_at_end = project.size()
    for d in drivers:  # one leaf at a time, back to back: the queue alone, without the trace
        gc.collect()
        for _ in range(min(100, nodes // 4)):
            samples[d.name]["evict_leaf_alone"].append(timed_evict(d, page_size)[0])
    project.check()  # raises on a broken invariant or a leak
    row: dict[str, Any] = {
        "tokens": capacity,
        "page_size": page_size,
        "steps": steps,
        "evict_tokens": chunk,
        "nodes": nodes,
        "tree_tokens_after_steps": tokens_at_end,
        "trees": {d.name: {op: stats(samples[d.name][op]) for op in ALL_OPS} for d in drivers},
    }
    if any(d.name == "sglang_python" for d in drivers):
        row["match_len_mismatch_steps_vs_sglang_python"] = mismatches
    if any(d.name == "project_list" for d in drivers):
        row["list_key_mismatch_steps"] = list_mismatches
    return row


def run(
    quick: bool = True,
    out_dir: Path | str = "results",
    against_sglang: bool = False,
    sizes: tuple[int, ...] = SIZES,
    pages: tuple[int, ...] = (1, 16),
    steps: int | None = None,
    sglang_site: str | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """Run the trace at every size and page size (quick: 300 steady steps, the pressure
    measurements at smaller sizes; full: 3000 steps), ``repeat`` times, print the tables and
    write ``bench_cache_ops.json`` under ``out_dir``. Returns the summary dict. ``sglang_site``:
    load SGLang from that pin directory through ``bench/cache_ops/sglang_loader.py`` (stubs
    listed)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    factories: list[Any] = [ProjectDriver]
    sglang_note = "not requested (--against-sglang)"
    sgl = None
    if against_sglang:
        from bench.cache_ops.sglang_trees import SGLangPythonDriver, SGLangRustDriver, load_sglang

        sgl, version = load_sglang(sglang_site)
        if sgl is None and sglang_site is not None:  # asked for that install: no silent fallback
            raise RuntimeError(f"--sglang-site {sglang_site}: {version}")
        if sgl is None:
            sglang_note = version
            print(f"[cache_ops] {version}; running without SGLang")
        else:
            sglang_note = f"sglang {version}"
            print(f"[cache_ops] comparing with sglang {version} (Python tree, Rust core)")
            # In this cyclic order neither project tree runs right after the other (the second
            # would find the first's code warm).
            factories += [
                lambda pool, ps: SGLangPythonDriver(sgl, pool, ps),
                ProjectListDriver,
                lambda pool, ps: SGLangRustDriver(sgl, pool, ps),
            ]
    n_steps = steps if steps is not None else (300 if quick else 3000)
    # The same trace with the same eviction amount at every size (1% of the smallest tree), on
    # the project's tree only: a 1% schedule evicts about every step at 10K tokens but every ~25
    # steps at 1M, so the eviction code runs cold there; this pass separates the cost of tree
    # size from the cost of eviction frequency.
    fixed_tokens = max(1, min(sizes) // 100)
    runs, fixed_runs = [], []
    for i in range(repeat):
        if repeat > 1:
            print(f"[cache_ops] run {i + 1} of {repeat}")
        runs.append([run_trace(n, ps, n_steps, factories) for ps in pages for n in sizes])
        fixed_runs.append(
            [
                run_trace(n, ps, n_steps, [ProjectDriver], evict_tokens=fixed_tokens)
                for ps in pages
                for n in sizes
            ]
        )
    rows, fixed_rows = combine(runs), combine(fixed_runs)
    stubs = sgl.stub_report() if sgl is not None else []
    rust_core = None
    if sgl is not None:
        from bench.cache_ops.sglang_trees import rust_core_file

        rust_core = rust_core_file()
        print(f"[cache_ops] SGLang Rust TreeCore: {rust_core}")
    print_rows(rows, ALL_OPS)
    found = targets(rows, fixed_rows, OPS + EVICT_OPS)
    print_targets(found)
    if stubs:
        from bench.cache_ops.sglang_loader import stub_lines

        print("SGLang imports replaced (everything else is SGLang's installed code):")
        print("\n".join(stub_lines(stubs)))
    pressure = run_pressure(quick)
    largest = [r for r in rows if r["tokens"] == max(sizes)]
    result = {
        "unit": "microseconds per call",
        "sglang": sglang_note,
        "sglang_stubs": stubs,
        "sglang_rust_core": rust_core,
        "repeats": repeat,
        "rows": rows,
        "fixed_eviction_rows": fixed_rows,
        "runs": runs if repeat > 1 else None,
        "targets": found,
        "eviction_curve": curve(rows),
        "pressure": pressure,
        "headline": {
            f"{op} @ {r['tokens']} tokens page {r['page_size']} (mean us)": r["trees"]["project"][
                op
            ]["mean_us"]
            for r in largest
            for op in ("match", "insert", "evict_1pct", "evict_leaf")
        },
        # every row ended with check_integrity() (raises on a leak or a broken invariant)
        "integrity": {"leaked_slots": 0},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cache_ops.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 steps, smaller pressure runs.")
    parser.add_argument(
        "--against-sglang", action="store_true", help="Also drive SGLang's trees (if importable)."
    )
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="Tree tokens.")
    parser.add_argument("--pages", type=int, nargs="*", default=[1, 16], help="Page sizes.")
    parser.add_argument("--steps", type=int, default=None, help="Steady-state steps per row.")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    parser.add_argument(
        "--repeat", type=int, default=1, help="Runs of the whole trace (medians over runs)."
    )
    parser.add_argument(
        "--sglang-site",
        default=None,
        help="Load SGLang from this pin directory (pip --no-deps --target), unrelated imports "
        "stubbed (bench/cache_ops/sglang_loader.py); default: SGLang as installed.",
    )
    args = parser.parse_args(argv)
    run(
        quick=args.quick,
        out_dir=args.out,
        against_sglang=args.against_sglang,
        sizes=tuple(args.sizes),
        pages=tuple(args.pages),
        steps=args.steps,
        sglang_site=args.sglang_site,
        repeat=args.repeat,
    )
    return 0
