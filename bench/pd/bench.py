"""``python -m bench.pd [--full] [--out DIR]``: PD disaggregation over Mooncake on loopback,
wall clock (see ``bench.pd.engine_rate`` and ``bench.pd.ttft``).

Needs Mooncake's engine (installed by ``make bench``) and the loopback shim: this process hosts
the prefill side's engines, so it re-executes itself under the shim first (``python -m bench.pd``)
or, from the suite (``run``), runs in a child process started under it. Without Mooncake it
prints one line and reports the section as skipped.

Writes ``bench_pd.json``: the tables' rows, the fitted ``transfer_model`` (latency per item,
bandwidth) for the virtual clock's transfer model, the machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import Column, print_table, write_json
from bench.pd.transfer_model import virtual_clock_fields
from hicache.mooncake import loopback
from hicache.mooncake.availability import module_reason

logger = logging.getLogger(__name__)

RATE_COLUMNS = [Column("item_bytes", "item B", 9), Column("items", "items", 7),
                Column("calls", "calls", 6), Column("us_per_item", "us/item", 9, ".1f"),
                Column("gbps", "GB/s", 8, ".3f"), Column("best_gbps", "best", 8, ".3f"),
                Column("memcpy_gbps", "memcpy", 8, ".2f"),
                Column("scattered_memcpy_gbps", "scat.cp", 8, ".2f"),
                Column("vs_memcpy", "x memcpy", 9, ".3f")]  # fmt: skip
TTFT_COLUMNS = [Column("config", "config", 26), Column("succeeded", "ok", 5),
                Column("ttft_mean_ms", "mean ms", 9, ".1f"),
                Column("ttft_mean_min_ms", "min", 7, ".1f"),
                Column("ttft_mean_max_ms", "max", 7, ".1f"),
                Column("ttft_p50_ms", "p50 ms", 9, ".1f"),
                Column("ttft_p90_ms", "p90 ms", 9, ".1f"),
                Column("ttft_speedup_vs_0", "x vs 0", 8, ".2f")]  # fmt: skip


def measure(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Everything, in this process (which must have the shim loaded)."""
    import torch

    from bench.pd import engine_rate, ttft
    from prefill.testing.harness import single_torch_thread
    from prefill.testing.mooncake_decode import start_workers

    print("[bench_pd] transfer engine on loopback: GB/s per item size (wall clock) ...", flush=True)
    rate = engine_rate.measure(quick)
    print_table(rate["rows"], RATE_COLUMNS)
    m = rate["transfer_model"]
    print(f"[bench_pd] fitted cost: {_us(m['latency_per_item_s'])} us per item, "
          f"{_gb(m['bandwidth_Bps'])} GB/s")  # fmt: skip
    workers = start_workers(2, pool_tokens=32768, max_running_requests=64, check_free_pages=False,
                            env={"GLOG_minloglevel": "2"})  # fmt: skip
    try:
        with single_torch_thread():
            print("[bench_pd] optimistic prefill, TTFT (wall clock) ...", flush=True)
            opt = ttft.optimistic_rows(quick, workers)
            print_table(opt["rows"], TTFT_COLUMNS)
            print("[bench_pd] multi-turn, TTFT (wall clock) ...", flush=True)
            multi = ttft.multiturn_rows(quick, workers)
            print_table(multi["rows"], TTFT_COLUMNS)
    finally:
        for w in workers:
            w.stop()
    integrity: dict[str, int] = {}
    for row in opt["rows"] + multi["rows"]:
        for k, v in row["integrity"].items():
            if isinstance(v, int) and k != "kv_checked_requests":
                integrity[k] = integrity.get(k, 0) + v
    payload = {"quick": quick, "engine_rate": rate, "optimistic": opt, "multiturn": multi,
               "transfer_model": rate["transfer_model"], "integrity": integrity,
               "virtual_clock_transfer": virtual_clock_fields(rate["transfer_model"],
                                                              opt["rows"][0]),
               "torch_threads": torch.get_num_threads(),
               "command": "python -m bench.pd" + ("" if quick else " --full")}  # fmt: skip
    path = write_json("bench_pd", payload, out_dir)
    print(f"[bench_pd] wrote {path}")
    return payload


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.3f}"


def summary_of(payload: dict[str, Any]) -> dict[str, Any]:
    """The summary section of ``results/summary.json``."""
    rows = {(r["workers"], r["attempts"]): r for r in payload["optimistic"]["rows"]}
    return {
        "transfer_model": payload["transfer_model"],
        "virtual_clock_transfer": payload["virtual_clock_transfer"],
        "gbps_by_item_bytes": {r["item_bytes"]: r["gbps"] for r in payload["engine_rate"]["rows"]},
        "optimistic_ttft_mean_ms": {f"{k}w_{a}att": r["ttft_mean_ms"]
                                    for (k, a), r in rows.items()},
        "multiturn_ttft_mean_ms": {f"{r['workers']}w": r["ttft_mean_ms"]
                                   for r in payload["multiturn"]["rows"]},
        "integrity": payload["integrity"],
    }  # fmt: skip


def run(quick: bool = True, out_dir: Path = Path("results")) -> dict[str, Any]:
    """The suite's entry (``python -m bench``): in a child process under the loopback shim
    unless this one has it. Without Mooncake: ``{"skipped": reason}``."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # before Mooncake's glog starts (import)
    reason = module_reason("engine")
    if reason is not None:
        print(f"[bench_pd] skipped: Mooncake is not usable here ({reason})")
        return {"skipped": reason}
    if loopback.shim_loaded():
        return summary_of(measure(quick, out_dir))
    try:
        env = loopback.preload_env()
    except loopback.ShimUnavailable as e:
        print(f"[bench_pd] skipped: {e}")
        return {"skipped": str(e)}
    cmd = [sys.executable, "-m", "bench.pd", "--out", str(out_dir)] + ([] if quick else ["--full"])
    subprocess.run(cmd, env=env, check=True)
    return summary_of(json.loads((out_dir / "bench_pd.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="Full sizes (default: quick).")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "2")  # before Mooncake's glog starts (import)
    reason = module_reason("engine")
    if reason is not None:
        print(f"[bench_pd] skipped: Mooncake is not usable here ({reason})")
        return 0
    loopback.reexec_under_shim()  # returns only when the shim is loaded (or cannot be)
    loopback.forget_preload()
    if not loopback.shim_loaded():
        print("[bench_pd] skipped: the loopback shim could not be loaded")
        return 0
    measure(not args.full, args.out)
    return 0
