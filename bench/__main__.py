"""The benchmark suite: ``python -m bench`` (the README's ``make bench``).

Runs every benchmark family at its quick size (``--full``: full sizes), prints one summary
table and writes ``OUT/summary.json`` (default ``results/``). Each family exposes
``run(quick, out_dir) -> dict``; ``--only NAME ...`` runs those and merges them into the
existing summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.summary import (
    INTEGRITY_KEYS,
    machine_info,
    print_summary_table,
    run_info,
    write_results_readme,
)
from hicache_prefill.kernels._env import cuda_available, ensure_triton_interpret

ensure_triton_interpret()

SUITE = ["transfer", "cache_ops", "multiturn", "optimistic", "pd", "l3", "mooncake_store", "trace"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    parser.add_argument("--full", action="store_true", help="Full sizes (default: quick).")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"Run only these ({', '.join(SUITE)}), merged into the summary.",
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.only or () if n not in SUITE]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; valid names: {', '.join(SUITE)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "summary.json"
    summary: dict[str, Any] = load_summary(path) if args.only else {}
    summary.update(machine=machine_info(), run=run_info())
    failures: list[str] = []
    print(
        f"[bench] device: {'cuda' if cuda_available() else 'cpu'}; quick={not args.full}; "
        f"out={args.out}"
    )
    t_suite = time.perf_counter()
    for key in SUITE:
        if args.only and key not in args.only:
            continue
        print(f"[bench] {key}: running bench.{key} ...", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{key}.bench")
            summary[key] = module.run(quick=not args.full, out_dir=args.out)
        except Exception:
            traceback.print_exc()
            failures.append(key)
            continue
        summary[key]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"[bench] {key}: done in {summary[key]['seconds']} s", flush=True)
    summary["integrity"] = gather_integrity(summary)
    summary["run"]["suite_wall_s"] = round(time.perf_counter() - t_suite, 1)
    path.write_text(json.dumps(summary, indent=2, default=str))
    print_summary_table(summary)
    write_results_readme(summary, args.out / "README.md")
    print(f"[bench] wrote {path} ({summary['run']['suite_wall_s']} s)")
    bad = {k: v for k, v in summary["integrity"].items() if v}
    if bad:
        print(f"[bench] INTEGRITY VIOLATIONS: {bad}", file=sys.stderr)
    if failures:
        print(f"[bench] FAILED: {', '.join(failures)}", file=sys.stderr)
    return 1 if bad or failures else 0


def load_summary(path: Path) -> dict[str, Any]:
    """The summary file's sections, or nothing when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def gather_integrity(summary: dict[str, Any]) -> dict[str, int]:
    """The integrity counters every section reported, summed (each key shown, 0 when none)."""
    total = dict.fromkeys(INTEGRITY_KEYS, 0)
    for name, value in summary.items():
        counters = value.get("integrity") if isinstance(value, dict) else None
        if name == "integrity" or not isinstance(counters, dict):
            continue
        for k in INTEGRITY_KEYS:
            total[k] += int(counters.get(k, 0) or 0)
    return total


if __name__ == "__main__":
    sys.exit(main())
