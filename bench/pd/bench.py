"""``python -m bench.pd [--quick] [--out DIR]``: PD disaggregation over Mooncake's TCP transport on
loopback, measured on this CPU (wall clock): the write cost per item size (``bench.pd.rate``) and
TTFT with decode worker processes (``bench.pd.ttft``). Writes ``bench_pd.json``, whose
``kv_transfer_measured`` is the write cost as a ``bench.profile.CopyPath`` (latency per item).

The prefill side's engines live in the measuring process, which must preload the loopback shim:
``main`` and ``run`` start it as a child under the shim. Mooncake logs at ``MC_LOG_LEVEL=ERROR``
(unless set otherwise); the one line every engine logs at start-up at that level (``NOISE``) is
dropped from the child's stderr and counted. Without Mooncake or the shim: the section is skipped
with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import Column, print_table, write_json
from hicache.mooncake import loopback
from hicache.mooncake.availability import module_reason

MEASURED_ON = "a CPU: Mooncake over TCP loopback, wall clock"
NOISE = ("Local segment descriptor not found", "Logging before InitGoogleLogging")
RATE_COLUMNS = [
    Column("item_bytes", "item B", 8),
    Column("us_per_item", "us/item", 9, ".1f"),
    Column("gbps", "GB/s", 8, ".3f"),
    Column("best_gbps", "best GB/s", 10, ".3f"),
    Column("memcpy_gbps", "copy GB/s", 10, ".2f"),
]
TTFT_COLUMNS = [
    Column("config", "config", 24),
    Column("succeeded", "ok", 5),
    Column("ttft_mean_ms", "mean ms", 9, ".1f"),
    Column("ttft_mean_min_ms", "min", 7, ".1f"),
    Column("ttft_mean_max_ms", "max", 7, ".1f"),
    Column("ttft_p90_ms", "p90 ms", 8, ".1f"),
    Column("ttft_speedup_vs_0", "x vs 0", 8, ".2f"),
]


def measure(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Both tables, in this process (the shim loaded); writes the JSON."""
    from bench.pd import rate, ttft
    from prefill.testing.harness import single_torch_thread
    from prefill.testing.mooncake_decode import start_workers

    print(
        f"[pd] measured on {MEASURED_ON}; write cost per item size, median of repeats", flush=True
    )
    cost = rate.measure(quick)
    print_table(cost["rows"], RATE_COLUMNS)
    if (path := cost["kv_transfer_measured"]) is not None:
        print(
            f"[pd] least squares: {path['latency_s'] * 1e6:.1f} us per item, {path['gbps']:.3f}"
            f" GB/s (largest residual {path['max_rel_residual']:.0%})"
        )
    print("[pd] TTFT (ms), optimistic prefill attempts 0 and 2, busy decode workers", flush=True)
    workers = start_workers(2, pool_tokens=32768, max_running_requests=64, check_free_pages=False)
    try:
        with single_torch_thread():
            latency = ttft.measure(quick, workers)
    finally:
        for w in workers:
            w.stop()
    print_table(latency["rows"], TTFT_COLUMNS)
    integrity = {k: sum(r["integrity"][k] for r in latency["rows"]) for k in ttft.INTEGRITY}
    payload = {
        "quick": quick,
        "measured_on": MEASURED_ON,
        "kv_transfer_measured": path,
        "rate": cost,
        "ttft": latency,
        "integrity": integrity,
    }
    print(f"[pd] integrity: {integrity}\n[pd] wrote {write_json('bench_pd', payload, out_dir)}")
    return payload


def child(quick: bool, out_dir: Path) -> int:
    """``python -m bench.pd`` under the shim, ``NOISE`` dropped from its stderr (docstring)."""
    cmd = [sys.executable, "-m", "bench.pd", "--out", str(out_dir)] + (["--quick"] if quick else [])
    proc = subprocess.Popen(cmd, env=loopback.preload_env(), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    hidden = 0
    for line in proc.stderr:
        if any(n in line for n in NOISE):
            hidden += 1
        else:
            sys.stderr.write(line)
    print(f"[pd] {hidden} lines of Mooncake start-up logging ({NOISE[0]!r}) not shown")
    return proc.wait()


def skip_reason() -> str | None:
    """Why Mooncake's engine or the shim is not usable here, or ``None``."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before any engine; children inherit it
    reason = module_reason("engine")
    if reason is None:
        try:
            loopback.build_shim()
        except loopback.ShimUnavailable as e:
            reason = str(e)
    return reason


def run(quick: bool = True, out_dir: Path = Path("results")) -> dict[str, Any]:
    """The suite's entry: the summary section, or ``{"skipped": reason}``."""
    if (reason := skip_reason()) is not None:
        print(f"[pd] skipped: {reason}")
        return {"skipped": reason}
    path = out_dir / "bench_pd.json"
    if loopback.shim_loaded():
        payload = measure(quick, out_dir)
    else:
        path.unlink(missing_ok=True)
        rc = child(quick, out_dir)
        if not path.exists():
            raise RuntimeError(f"python -m bench.pd exited {rc} without writing {path}")
        payload = json.loads(path.read_text())
    return {
        "measured_on": payload["measured_on"],
        "kv_transfer_measured": payload["kv_transfer_measured"],
        "gbps_by_item_bytes": {r["item_bytes"]: r["gbps"] for r in payload["rate"]["rows"]},
        "ttft_mean_ms": {r["config"]: r["ttft_mean_ms"] for r in payload["ttft"]["rows"]},
        "integrity": payload["integrity"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pd",
        description="PD disaggregation over Mooncake on TCP loopback, measured on this CPU: the "
        "write cost per item size and TTFT with decode worker processes.",
    )
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (under a minute).")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    args = parser.parse_args(argv)
    if (reason := skip_reason()) is not None:
        print(f"[pd] skipped: {reason}")
        return 0
    if not loopback.shim_loaded():
        return child(args.quick, args.out)
    return 1 if any(measure(args.quick, args.out)["integrity"].values()) else 0
