"""The benchmark suite: ``python -m bench`` (the README's ``make bench``).

Runs every benchmark module that exists, at a size that fits the machine (``--quick`` on CPU by
default), shows progress, prints one summary table, and writes ``results/summary.json``.
Each benchmark module exposes ``run(quick: bool, out_dir: pathlib.Path) -> dict``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench.summary import machine_info, print_summary_table
from kernels._env import cuda_available, ensure_triton_interpret

ensure_triton_interpret()

# (module, summary key), in the order they run.
SUITE = [
    ("bench.bench_transfer", "transfer"),
    ("bench.bench_cache_ops", "cache_ops"),
    ("bench.bench_multiturn", "multiturn"),
    ("bench.bench_optimistic", "optimistic"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    parser.add_argument("--full", action="store_true", help="Full sizes (default: quick).")
    parser.add_argument("--only", nargs="*", default=None, help="Summary keys to run.")
    parser.add_argument(
        "--summary", default="summary.json", help="Summary file name in --out (one per step)."
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    quick = not args.full

    summary: dict = {"machine": machine_info()}
    failures: list[str] = []
    missing: list[str] = []
    print(f"[bench] device: {'cuda' if cuda_available() else 'cpu'}; quick={quick}; out={args.out}")
    for module_name, key in SUITE:
        if args.only is not None and key not in args.only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                print(f"[bench] {key}: {module_name} does not exist yet; skipped")
                missing.append(key)
                continue
            raise
        print(f"[bench] {key}: running {module_name} ...", flush=True)
        start = time.perf_counter()
        try:
            summary[key] = module.run(quick=quick, out_dir=args.out)
        except Exception:
            traceback.print_exc()
            failures.append(key)
            continue
        print(f"[bench] {key}: done in {time.perf_counter() - start:.1f} s", flush=True)

    if "integrity" not in summary:
        summary["integrity"] = _gather_integrity(summary)
    path = args.out / args.summary
    path.write_text(json.dumps(summary, indent=2, default=str))
    print_summary_table(summary)
    print(f"[bench] wrote {path}")
    if missing:
        print(f"[bench] not yet present: {', '.join(missing)}")
    bad = {k: v for k, v in summary["integrity"].items() if v}
    if bad:
        print(f"[bench] INTEGRITY VIOLATIONS: {bad}", file=sys.stderr)
        return 1
    if failures:
        print(f"[bench] FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


def _gather_integrity(summary: dict) -> dict:
    """Sum the integrity counters each benchmark reported."""
    total = {
        "leaked_slots": 0,
        "kv_mismatches": 0,
        "aborted_sends": 0,
        "leaked_locks": 0,
        "integrity_errors": 0,
    }
    for value in summary.values():
        if isinstance(value, dict) and isinstance(value.get("integrity"), dict):
            for name in total:
                total[name] += int(value["integrity"].get(name, 0))
    return total


if __name__ == "__main__":
    sys.exit(main())
