"""``python -m bench.soak``: a long run of the optimistic prefill executor (virtual clock, simulated
decode peers failing and killed at random: ``tests.support.soak``), measured on this CPU: per
``window`` of finished requests the RSS, the CPU time of a step and the live record counts,
against the first window after ``warmup`` (targets: RSS growth under 5%, step cost flat).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

from bench.common import Column, table_header, table_row, write_json
from hicache_prefill.server_args import prepare_server_args
from tests.support.harness import single_torch_thread
from tests.support.soak import SoakConfig, SoakReport, run_soak, soak_executor

FLAGS = (
    "--page-size 4 --max-total-tokens 2048 --chunked-prefill-size 64 --device cpu --dtype float32 "
    "--disaggregation-mode prefill --optimistic-prefill-attempts 2 --hicache-io-backend direct "
    "--hicache-mem-layout page_first_direct"
).split()
CONFIGS = {
    "write_through": "--enable-hierarchical-cache --optimistic-prefill-write-through",
    "write_back": "--enable-hierarchical-cache --hicache-write-policy write_back",
    "device": "",
}
CONFIG = "write_through"  # the default
COLUMNS = [
    Column("finished", "done", 8),
    Column("rss_mb", "RSS MB", 9, ".1f"),
    Column("step_us", "step us CPU", 12, ".0f"),
    Column("tree_nodes", "nodes", 7),
    Column("in_flight", "in flight", 10),
    Column("decode_peers", "peers", 7),
]
SIZES = {True: (20_000, 2_000, 4_000), False: (100_000, 5_000, 10_000)}  # requests, window, warmup


def run(
    quick: bool = True, out_dir: Path = Path("bench-out"), sizes: tuple = (), config: str = CONFIG
) -> dict[str, Any]:
    """A soak of ``CONFIGS[config]`` at ``sizes`` (requests, window, warmup) or ``SIZES[quick]``:
    prints each window and the report, writes ``bench_soak.json``, returns it without windows."""
    requests, window, warmup = sizes or SIZES[quick]
    args = prepare_server_args([*FLAGS, "--random-seed", "0", *CONFIGS[config].split()])
    faults = dict(bootstrap_failure_prob=0.02, transfer_failure_prob=0.01, force_not_ready_prob=0.0)
    ex = soak_executor(args, 0, decode_pool_size=8192, **faults)
    windows: list[dict[str, Any]] = []
    last = [0, time.process_time()]  # steps and CPU time at the end of the last window

    def sample(rep: SoakReport) -> None:
        step_us = (time.process_time() - last[1]) / max(rep.steps - last[0], 1) * 1e6
        gc.collect()
        with open("/proc/self/status") as f:  # the resident set size, in MB
            rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
        row = {"finished": rep.successes + rep.aborted, "rss_mb": rss, "step_us": step_us}
        row |= {"in_flight": len(ex.requests), "decode_peers": len(ex.decode.peers)}
        row["tree_nodes"] = sum(1 for _ in ex.tree.all_nodes())
        print(table_row(row, COLUMNS), flush=True)
        windows.append(row)
        last[:] = [rep.steps, time.process_time()]

    cfg = SoakConfig(requests, 0, kill_prob=0.01, verify_every=1000, check_every_step=False)
    print(table_header(COLUMNS))
    with single_torch_thread():
        rep = run_soak(ex, cfg, on_progress=sample, progress_every=window)
    ex.drain_cache_events()
    ex.check_integrity()
    ex.cache.close()
    base = next((w for w in windows if w["finished"] >= warmup), windows[-1])
    after = [w for w in windows if w["finished"] > base["finished"]] or [base]
    integrity = {"kv_mismatches": rep.kv_mismatches, "protocol_errors": len(rep.protocol_errors)}
    integrity["speculative_l2_pages"] = ex.stats.speculative_l2_pages
    res = {"config": config, "requests": requests, "successes": rep.successes}
    res |= {"aborted": rep.aborted, "wall_s": rep.wall_s, "warmup_requests": base["finished"]}
    res["rss_base_mb"] = base["rss_mb"]
    res["rss_growth_pct"] = (max(w["rss_mb"] for w in after) / base["rss_mb"] - 1) * 100
    res |= {"step_us_base": base["step_us"], "step_us_last": after[-1]["step_us"]}
    res["step_cost_ratio_max"] = max(w["step_us"] for w in after) / base["step_us"]
    res |= {"verified_kv": rep.verified, "integrity": integrity}
    print(
        f"[soak] {config}: {requests} requests ({rep.successes} ok, {rep.aborted} aborted) in "
        f"{rep.wall_s:.0f} s, measured on a CPU; after {res['warmup_requests']} requests: RSS "
        f"{res['rss_base_mb']:.1f} MB, growth {res['rss_growth_pct']:+.2f}% (target < 5%); step "
        f"{res['step_us_base']:.0f} us CPU, last {res['step_us_last']:.0f} us, worst window "
        f"x{res['step_cost_ratio_max']:.2f}; integrity {integrity} ({rep.verified} KV checked)"
    )
    print(f"[soak] wrote {write_json('bench_soak', {**res, 'windows': windows}, out_dir)}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--quick", action="store_true", help="20k requests (default: 100k).")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    p.add_argument("--config", choices=sorted(CONFIGS), default=CONFIG)
    a = p.parse_args(argv)
    return 1 if any(run(a.quick, a.out, config=a.config)["integrity"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
