"""The benchmark suite: ``python -m bench`` (the README's ``make bench``).

Runs every benchmark module that exists, at a size that fits the machine (quick by default),
shows progress, prints one summary table, and writes ``results/summary.json``.
Each benchmark module exposes ``run(quick: bool, out_dir: pathlib.Path) -> dict``; the
end-to-end ones also take ``argv`` (their own flags: ``--clock``, ``--seeds``, ...).

The end-to-end benchmarks (``multiturn``, ``optimistic``) write the calibration they ran on to
``results/calibration.json``; ``--calibration FILE`` makes them replay that file's instead of
measuring one (their ratios then repeat exactly, on any machine). ``fidelity`` (last) runs one
small trace of each on the virtual clock and on wall time and reports the gap per headline
ratio; it always measures its own calibration (it compares with wall time now).

``--only NAME [NAME ...]`` runs those sections (an unknown name is an error that lists the valid
ones) and merges them into the existing summary file: sections not run are kept as they were.
A full run writes the summary from scratch.
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

from bench.summary import machine_info, print_summary_table, run_info
from kernels._env import cuda_available, ensure_triton_interpret

ensure_triton_interpret()

# (module, summary key), in the order they run.
SUITE = [
    ("bench.transfer.bench", "transfer"),
    ("bench.cache_ops.bench", "cache_ops"),
    ("bench.multiturn.bench", "multiturn"),
    ("bench.optimistic.bench", "optimistic"),
    ("bench.pd.bench", "pd"),  # wall clock, real decode processes over Mooncake (or skipped)
    ("bench.l3.bench", "l3"),
    ("bench.mooncake_store.bench", "mooncake_store"),  # skipped (with the reason) without Mooncake
    ("bench.fidelity.bench", "fidelity"),
]
E2E = {"multiturn", "optimistic"}
"""Sections whose ``run`` takes the end-to-end flags (``--clock``, ``--calibration``, ...)."""

ALWAYS_REPORTED = ("leaked_slots", "kv_mismatches", "kv_strict_mismatches", "aborted_sends",
                   "leaked_locks", "integrity_errors")  # fmt: skip
"""Integrity counters the summary shows even when no section reported them (as 0)."""
INTEGRITY_KEYS = (*ALWAYS_REPORTED, "speculative_l2_pages", "speculative_l3_pages",
                  "attempt_budget_exceeded")


def main(argv: list[str] | None = None) -> int:
    names = [key for _, key in SUITE]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    parser.add_argument("--full", action="store_true", help="Full sizes (default: quick).")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help=f"Run only these sections ({', '.join(names)}) and merge them into "
                        "the summary file.")
    parser.add_argument("--clock", choices=("virtual", "wall"), default=None,
                        help="Clock of the end-to-end benchmarks (virtual, the default on a "
                        "CPU: deterministic given the calibration; wall, the default on CUDA: "
                        "real time).")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                        help="The end-to-end benchmarks replay this calibration.json instead "
                        "of measuring one.")
    parser.add_argument("--corun-from", type=Path, default=None, metavar="FILE",
                        help="The end-to-end benchmarks charge the co-run slowdown of this "
                        "bench_transfer_sweep.json (the GPU check's).")
    parser.add_argument("--no-sweeps", action="store_true",
                        help="Skip the end-to-end benchmarks' sweeps.")
    parser.add_argument("--summary", default="summary.json",
                        help="Summary file name in --out (one per step).")  # fmt: skip
    args = parser.parse_args(argv)
    if args.only is not None:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            parser.error(f"unknown benchmark {', '.join(unknown)}; valid names: {', '.join(names)}")
    args.out.mkdir(parents=True, exist_ok=True)
    quick = not args.full
    path = args.out / args.summary

    summary: dict[str, Any] = load_summary(path) if args.only is not None else {}
    summary["machine"] = machine_info()
    summary["run"] = run_info()
    failures: list[str] = []
    missing: list[str] = []
    e2e_argv = [] if args.clock is None else ["--clock", args.clock]
    if args.calibration is not None:
        e2e_argv += ["--calibration", str(args.calibration)]
    if args.corun_from is not None:
        e2e_argv += ["--corun-from", str(args.corun_from)]
    if args.no_sweeps:
        e2e_argv += ["--no-sweeps"]
    print(f"[bench] device: {'cuda' if cuda_available() else 'cpu'}; quick={quick}; "
          f"clock={args.clock or 'default'}; calibration="
          f"{args.calibration or 'measured'}; out={args.out}")  # fmt: skip
    t_suite = time.perf_counter()
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
            if key in E2E:
                result = module.run(quick=quick, out_dir=args.out, argv=list(e2e_argv))
            elif key == "fidelity":  # measures its own calibration, always
                corun = [] if args.corun_from is None else ["--corun-from", str(args.corun_from)]
                result = module.run(quick=quick, out_dir=args.out, argv=corun)
            else:
                result = module.run(quick=quick, out_dir=args.out)
        except Exception:
            traceback.print_exc()
            failures.append(key)
            continue
        extra = result.pop("extra_sections", None) if isinstance(result, dict) else None
        summary[key] = result
        summary.update(extra or {})
        print(f"[bench] {key}: done in {time.perf_counter() - start:.1f} s", flush=True)

    summary["integrity"] = gather_integrity(summary)
    summary["run"]["suite_wall_s"] = round(time.perf_counter() - t_suite, 1)
    path.write_text(json.dumps(summary, indent=2, default=str))
    print_summary_table(summary)
    print(f"[bench] wrote {path} ({summary['run']['suite_wall_s']} s)")
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


def load_summary(path: Path) -> dict[str, Any]:
    """The summary file's sections, or nothing when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def gather_integrity(summary: dict[str, Any]) -> dict[str, int]:
    """Sum the integrity counters every section reported (``INTEGRITY_KEYS``; a key no
    section reports is absent)."""
    total: dict[str, int] = {}
    for name, value in summary.items():
        if name == "integrity" or not isinstance(value, dict):
            continue
        counters = value.get("integrity")
        if not isinstance(counters, dict):
            continue
        for k in INTEGRITY_KEYS:
            if k in counters:
                total[k] = total.get(k, 0) + int(counters[k])
    for k in ALWAYS_REPORTED:
        total.setdefault(k, 0)
    return total


if __name__ == "__main__":
    sys.exit(main())
