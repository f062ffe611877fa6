"""``make sglang-check``: run the SGLang compatibility check for each pinned release.

``python -m tests.sglang_check [--venv .venv-sglang-check] [--pins 0.5.17 0.5.23] [--out DIR]``

Each pin is installed (``pip install --no-deps --target VENV/sglang-PIN``) by the Makefile; each
(pin, mode) runs in its own process (:mod:`tests.sglang_check.run_pin`). Prints one summary table
and the stub list, writes ``results/sglang_check.json``, and exits non-zero when any transfer
case fails, the round trip of the compat module is not exact, or the gate shows a difference
that is not a documented divergence.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("cpu", "cuda-shaped")
REAL_STACK_PINS = ("0.5.23",)
"""Pins also run in ``real-stack`` mode (:mod:`tests.sglang_check.real_stack`): SGLang imported
with its pure-Python dependencies, its own device pools, assembler and ``L2TransferEngine``; and
in ``tree-backend`` mode (:mod:`tests.sglang_check.tree_backend`): the project's tree as SGLang's
radix-cache backend, built, driven and compared with ``UnifiedRadixCache`` by SGLang's code."""
REAL_STACK_MODES = ("real-stack", "tree-backend")
PD_INTEROP_PINS = ("0.5.23",)
"""Pins also run in ``pd-interop`` mode (:mod:`tests.sglang_check.pd_interop`): SGLang's own
Mooncake PD connector in child processes against this project's prefill side and decode worker."""


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_one(venv: str, pin: str, mode: str, project_dir: str | None = None) -> dict[str, Any]:
    """One (pin, mode) run in its own process, from a folder outside the repository: only
    ``tests`` is linked there, so ``hicache_prefill`` comes from its install (``project_dir``: a
    non-editable copy put first on the path; else the venv's editable install) and ``kernels``
    is whatever the venv has (HuggingFace's, at SGLang's pin)."""
    site = os.path.abspath(os.path.join(venv, f"sglang-{pin}"))
    if not os.path.isdir(site):
        return {"mode": mode, "fatal": f"{site} missing: run make sglang-check"}
    with tempfile.TemporaryDirectory(prefix="sglang-check-") as outside:
        os.symlink(os.path.join(REPO, "tests"), os.path.join(outside, "tests"))
        out = os.path.join(outside, "result.json")
        # SGLANG_CHECK_PROJECT_PATH: a path holding ``hicache_prefill`` to check instead of the
        # venv's editable install (another checkout); a ``project_dir`` still goes first.
        extra = os.environ.get("SGLANG_CHECK_PROJECT_PATH")
        path = [outside, *([os.path.abspath(project_dir)] if project_dir else [])]
        path += [extra] if extra else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        # The loopback shim of this checkout (``make test`` / ``make sglang-check`` build it),
        # also for a non-editable copy of the project, whose default path is elsewhere.
        env.setdefault("HICACHE_LOOPBACK_SHIM", os.path.join(REPO, "build", "loopback",
                                                             "bind_loopback.so"))  # fmt: skip
        cmd = [
            *(sys.executable, "-m", "tests.sglang_check.run_pin", "--site", site),
            *("--mode", mode, "--out", out),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, cwd=outside, env=env
        )
        try:
            with open(out, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, json.JSONDecodeError):
            result = {"mode": mode, "fatal": f"no result (exit {proc.returncode})"}
    if proc.returncode:
        result.setdefault("fatal", f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    fork = result.get("fork_import")
    if fork is not None and project_dir:
        fork["expected_project_dir"] = os.path.abspath(project_dir)
        fork["ok"] = fork["ok"] and fork["project_file"].startswith(os.path.abspath(project_dir))
    return result


def verdict(r: dict[str, Any]) -> list[str]:
    """Every reason this run fails (empty: passed)."""
    bad = []
    for key in ("fatal", "gate_fatal"):
        if key in r:
            bad.append(r[key])
    fork = r.get("fork_import")
    if fork is not None and not fork["ok"]:
        bad.append(f"fork import: {fork}")
    rt = r.get("roundtrip", {})
    for key in ("idempotent", "uninstall_restores_exactly", "reinstall_same_bindings"):
        if rt and not rt.get(key):
            bad.append(f"roundtrip: {key} is false")
    for t in r.get("transfers", []):
        if not t["ok"]:
            bad.append(f"{t['case']}: {t['error']}")
    gate = r.get("gate")
    if gate and not gate["ok"]:
        bad.append(f"gate: {len(gate['unexplained'])} unexplained differences")
    for s in r.get("storage", []):
        if not s["ok"]:
            bad.append(f"L3 {s['case']}: {s.get('error', s)}")
    for t in r.get("tree_backend", []):
        if not t["ok"]:
            bad.append(f"tree backend {t['case']}: {t.get('error')}")
    for p in r.get("pd", []):
        if not p["ok"]:
            bad.append(f"PD {p['case']}: {p.get('error', p)}")
    return bad


def tree_backend_word(r: dict[str, Any]) -> str:
    """The tree-backend column: rows passed, differential sequences / operations, scheduler
    sequences, L3 rows, SGLang unit tests run / not applicable."""
    rows = r.get("tree_backend")
    if not rows:
        return "-"
    diff = [t for t in rows if t["case"].startswith("differential/")]
    sched = [t for t in rows if t["case"].startswith("scheduler/")]
    l3 = [t for t in rows if t["case"].startswith("storage")]
    units = r.get("sglang_unit_tests", {})
    seqs = sum(t.get("sequences", 0) for t in diff)
    ops = sum(t.get("operations", 0) for t in diff)
    return (
        f"{sum(t['ok'] for t in rows)}/{len(rows)} rows; diff {seqs} seq / {ops} ops; "
        f"{len(sched)} scheduler seq; {len(l3)} L3 rows; "
        f"SGLang unit tests run: {units.get('run', 0)}"
    )


def _pd_word(rows: list[dict[str, Any]]) -> str:
    """``ok/run (requests, bytes compared, fault cases passed/run)`` of the PD rows."""
    if not rows:
        return "-"
    run = [p for p in rows if "skipped" not in p]
    if not run:
        return "skipped"
    faults = sum(p.get("fault_cases_passed", 0) for p in run)
    return (
        f"{sum(p['ok'] for p in run)}/{len(run)} "
        f"({sum(p.get('requests', 0) for p in run)} req, "
        f"{sum(p.get('bytes_compared', 0) for p in run)} B, "
        f"faults {faults}/{sum(p.get('fault_cases', 0) for p in run)})"
    )


def _roundtrip_word(rt: dict[str, Any]) -> str:
    if not rt:
        return "-"
    return "exact" if all(v is True for v in rt.values() if isinstance(v, bool)) else "FAILED"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| pin | mode | fork import | install | transfer cases ok | kernel launches (variants) "
        "| unwarmed launches | tables verified by warm-up | round trip | L3 cases ok "
        "| PD rows ok (requests, bytes, faults) | gate rows "
        "| gate differences (class: count) | tree backend | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pin, modes in results.items():
        for mode, r in modes.items():
            inst = r.get("install", {})
            how = (
                ("registered" if inst.get("registered_sgl_kernel") else "rebound")
                + (" + JIT route-around" if inst.get("route_around_jit") else "")
                if inst
                else "-"
            )
            ts = r.get("transfers", [])
            rt = r.get("roundtrip", {})
            gate = r.get("gate")
            diffs = ", ".join(f"{k}: {v}" for k, v in (gate or {}).get("differences", {}).items())
            variants = sum(t.get("variants", 0) for t in ts)
            l3 = r.get("storage", [])
            l3_word = f"{sum(s['ok'] for s in l3)}/{len(l3)}" if l3 else "-"
            fork = r.get("fork_import")
            fork_word = "-" if fork is None else ("HF kernels kept" if fork["ok"] else "FAILED")
            copies = (
                f"{sum(t['ok'] for t in ts)}/{len(ts)} "
                f"| {sum(t.get('launches', 0) for t in ts)} ({variants}) "
                f"| {sum(t['unwarmed_launches'] for t in ts)} "
                f"| {sum(len(t.get('verified_tables', [])) for t in ts)}"
                if ts
                else "- | - | - | -"
            )
            lines.append(
                f"| {pin} | {mode} | {fork_word} | {how} | {copies} "
                f"| {_roundtrip_word(rt)} | {l3_word} | {_pd_word(r.get('pd', []))} "
                f"| {gate['rows'] if gate else '-'} | {diffs or ('none' if gate else '-')} "
                f"| {tree_backend_word(r)} | {'PASS' if not verdict(r) else 'FAIL'} |"
            )  # fmt: skip
    return "\n".join(lines)


def stub_lines(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    seen: dict[str, dict[str, Any]] = {}
    for modes in results.values():
        for r in modes.values():
            for s in r.get("stubs", []):
                entry = seen.setdefault(s["module"], {**s, "placeholders": set()})
                entry["placeholders"] |= set(s.get("placeholders", []))
    out = []
    for name, s in sorted(seen.items()):
        names = ", ".join(sorted(s["placeholders"])) or "none"
        out.append(f"- {name} ({s['kind']}): {s['reason']}" + (
            f" [placeholder names imported: {names}]" if s["kind"] == "stub" else ""))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-sglang-check")
    parser.add_argument("--pins", nargs="+", default=["0.5.17", "0.5.23"])
    parser.add_argument("--out", default="results")
    parser.add_argument(
        "--modes", nargs="+", default=None, help="only these modes (default: all of a pin)"
    )
    args = parser.parse_args(argv)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for pin in args.pins:
        results[pin] = {}
        extra = (
            *(REAL_STACK_MODES if pin in REAL_STACK_PINS else ()),
            *(("pd-interop",) if pin in PD_INTEROP_PINS else ()),
        )
        for mode in (*MODES, *extra):
            if args.modes and mode not in args.modes:
                continue
            print(f"[sglang-check] sglang=={pin} ({mode}) ...", flush=True)
            results[pin][mode] = run_one(args.venv, pin, mode)
    wheel = os.path.join(args.venv, "project-wheel")
    # the last pin again, over the non-editable install
    if os.path.isdir(wheel) and (not args.modes or "cpu" in args.modes):
        pin = args.pins[-1]
        print(f"[sglang-check] sglang=={pin} (cpu, project installed non-editable) ...", flush=True)
        results[pin]["cpu, non-editable"] = run_one(args.venv, pin, "cpu", project_dir=wheel)
    print()
    print(table(results))
    for pin, modes in results.items():
        names = [t["case"] for t in next(iter(modes.values())).get("transfers", [])]
        if names:
            print(f"\nTransfer cases, sglang=={pin} (each mode): " + ", ".join(names))
    for pin, modes in results.items():
        real = modes.get("real-stack")
        if real and real.get("transfers"):
            own = ", ".join(real.get("real_modules", []))
            print(f"\nReal stack, sglang=={pin} (SGLang's own {own}): device pool -> "
                  "build_kv_host_pool / HostPoolGroup -> L2TransferEngine:")  # fmt: skip
            for t in real["transfers"]:
                what = (
                    f"ok, {t.get('project_op_calls', 0)} project op calls, {t['launches']} "
                    "kernel launches, byte-exact both ways"
                    if t["ok"]
                    else f"FAILED: {t['error']}"
                )
                print(f"  {t['case']}: {what}")
    for pin, modes in results.items():
        tb = modes.get("tree-backend")
        if tb and tb.get("tree_backend"):
            print(
                f"\nThe project's tree as SGLang's radix-cache backend, sglang=={pin} "
                "(create_tree_cache, scheduler helpers, L3, UnifiedRadixCache differential):"
            )
            for t in tb["tree_backend"]:
                extra = ""
                if "reads_failed" in t:
                    extra = (f", {t['reads_failed']} L3 reads failed: {t['full L3 hits']} full, "
                             f"{t['partial L3 hits']} partial hits, "
                             f"{t['L3 misses (recomputed)']} misses recomputed; "
                             f"{t['l3_tokens_loaded']} tokens from L3, {t['kv_bytes_compared']} "
                             "KV bytes compared")  # fmt: skip
                elif "l3_tokens_loaded" in t:
                    extra = (f", {t['l3_tokens_stored']} tokens stored to L3, "
                             f"{t['l3_tokens_loaded']} loaded back from it, "
                             f"{t['aborted_prefetches']} aborted prefetches, "
                             f"{t['kv_bytes_compared']} KV bytes compared, no lock, slot or host "
                             "slot left")  # fmt: skip
                elif "sequences" in t:
                    extra = (f", {t['sequences']} sequences, {t['operations']} operations, "
                             f"{t['observations']} observations equal, {t['loads_back']} loads "
                             f"back, {t['kv_bytes_compared']} KV bytes compared")  # fmt: skip
                elif "kv_bytes_compared" in t:
                    extra = (f", {t['loads_back']} loads back, {t['kv_bytes_compared']} KV bytes "
                             "compared, no lock or slot left")  # fmt: skip
                what = f"ok{extra}" if t["ok"] else f"FAILED: {t.get('error')}"
                print(f"  {t['case']}: {what}")
            units = tb.get("sglang_unit_tests")
            if units:
                print(f"  SGLang's own radix-cache unit tests: {units}")
    for pin, modes in results.items():
        for mode, r in modes.items():
            rows = [s for s in r.get("storage", []) if s["case"].startswith("mooncake-real/")]
            if rows:
                print(f"\nL3 on a real mooncake_master, sglang=={pin} ({mode}), this project's "
                      "MooncakeStore <-> SGLang's, per TP rank:")  # fmt: skip
            for s in rows:
                what = (
                    f"skipped: {s['skipped']}" if "skipped" in s
                    else f"ok on {s['master']}, byte-exact both ways, objects per page "
                    f"{s['object_suffixes']}" if s["ok"]
                    else f"FAILED: {s.get('error')}"
                )  # fmt: skip
                print(f"  {s['case']}: {what}")
    for pin, modes in results.items():
        rows = modes.get("pd-interop", {}).get("pd", [])
        if rows:
            print(f"\nPD over SGLang's Mooncake wire, sglang=={pin} (SGLang's own connector in "
                  "child processes, real transfer engine over TCP on 127.0.0.1):")  # fmt: skip
            for p in rows:
                what = (
                    f"skipped: {p['skipped']}" if "skipped" in p
                    else "ok, " + (f"{p['requests']} requests byte-exact, {p['bytes_compared']} "
                                   "bytes compared, " if p.get("requests") else "")
                    + f"fault cases {p.get('fault_cases_passed', 0)}/{p.get('fault_cases', 0)}"
                    if p["ok"]
                    else f"FAILED: {p.get('error')}"
                )  # fmt: skip
                print(f"  {p['case']}: {what}")
                for name, detail in p.get("details", {}).items():
                    print(f"    {name}: {detail}")
    print("\nStubbed imports (everything else is SGLang's installed code):")
    print("\n".join(stub_lines(results)))
    failures = {
        f"{pin}/{mode}": verdict(r) for pin, modes in results.items() for mode, r in modes.items()
    }
    for pin, modes in results.items():
        gate = modes.get("cpu", {}).get("gate")
        if gate:
            print(f"\nGate {pin} ({gate['gate']}), {gate['rows']} rows; examples per class:")
            for cls, ex in gate["examples"].items():
                print(f"  {cls}: {ex}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sglang_check.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"results": results, "failures": failures}, f, indent=1, default=str)
    print(f"\nwrote {path}")
    bad = {k: v for k, v in failures.items() if v}
    for k, v in bad.items():
        print(f"FAIL {k}:\n  " + "\n  ".join(v[:20]))
    print("sglang-check:", "FAILED" if bad else "passed for " + ", ".join(args.pins))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
