"""Long-run soak of the optimistic prefill executor on a virtual clock: does memory stay flat and
does a step cost the same after 100k requests as after 10k?

One executor (tiny model, L2 write_through with optimistic prefill and 2 attempts by default)
serves a seeded stream of requests sharing prefixes, with bootstrap and transfer failures and
peers killed at random moments (``prefill.testing.soak``). Results are popped as they come; the
decode KV of every 1000th success is checked against a full recompute. Every ``--window`` finished
requests the run records the process RSS (``/proc/self/status`` VmRSS, after ``gc.collect()``),
the mean cost of a step in that window (process CPU time, ``time.process_time``, which other
processes on a shared machine disturb less than wall time; wall time is recorded too), the cost
of one ``decode.next_event_time()`` call, and the executor's live record counts.

The reference is the same run's first window after ``--warmup`` requests: the report gives RSS
growth and step-cost ratio of every later window against it (targets: RSS growth under 5%,
step cost flat). The virtual clock only orders events.

``python -m bench.soak [--requests 100000] [--window 5000] [--warmup 10000]
[--config write_through|write_back|device]`` writes ``results/bench_soak.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "0")  # CPU copies: the torch reference of the ops

from bench.common import write_json  # noqa: E402
from prefill.testing.harness import single_torch_thread  # noqa: E402
from prefill.testing.soak import SoakConfig, SoakReport, run_soak, soak_executor  # noqa: E402
from server_args import ServerArgs  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "write_through": dict(
        enable_hierarchical_cache=True,
        hicache_write_policy="write_through",
        optimistic_prefill_write_through=True,
    ),
    "write_back": dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
    "device": dict(enable_hierarchical_cache=False),
}


def rss_mb() -> float:
    """Resident set size of this process in MB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def build(config: str, seed: int) -> Any:
    args = ServerArgs(
        page_size=4, max_total_tokens=2048, chunked_prefill_size=64, device="cpu",
        dtype="float32", disaggregation_mode="prefill", optimistic_prefill_attempts=2,
        hicache_io_backend="direct", hicache_mem_layout="page_first_direct", random_seed=seed,
        **CONFIGS[config],
    )  # fmt: skip
    return soak_executor(
        args, seed, bootstrap_failure_prob=0.02, transfer_failure_prob=0.01,
        force_not_ready_prob=0.0, decode_pool_size=8192,
    )  # fmt: skip


def run_config(config: str, requests: int, window: int, warmup: int, seed: int) -> dict[str, Any]:
    ex = build(config, seed)
    windows: list[dict[str, Any]] = []
    # Each window's costs count from the end of the previous sample (gc, probes, print excluded).
    last = {"steps": 0, "wall": time.perf_counter(), "cpu": time.process_time()}

    def sample(rep: SoakReport) -> None:
        cpu, wall = time.process_time() - last["cpu"], time.perf_counter() - last["wall"]
        steps = rep.steps - last["steps"]
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(100):
            ex.decode.next_event_time()
        net_us = (time.perf_counter() - t0) / 100 * 1e6
        row = {
            "finished": rep.successes + rep.aborted,
            "rss_mb": rss_mb(),
            "step_us": cpu / steps * 1e6 if steps else None,
            "step_wall_us": wall / steps * 1e6 if steps else None,
            "next_event_time_us": net_us,
            "requests_in_flight": len(ex.requests),
            "decode_peers": len(ex.decode.peers),
            "live_peers": len(ex.decode._live),
            "send_log": len(ex.decode.send_log),
            "ttft_reservoir": len(ex.stats.ttft_samples),
            "tree_nodes": sum(1 for _ in ex.tree.all_nodes()),
        }
        windows.append(row)
        last.update(steps=rep.steps, wall=time.perf_counter(), cpu=time.process_time())
        print(
            f"  {config:13s} {row['finished']:>7d} done  RSS {row['rss_mb']:7.1f} MB  "
            f"step {row['step_us']:6.0f} us CPU ({row['step_wall_us']:6.0f} wall)  "
            f"next_event_time {net_us:5.1f} us  nodes {row['tree_nodes']:4d}  "
            f"in flight {row['requests_in_flight']:3d}  peers {row['decode_peers']:3d}",
            flush=True,
        )

    cfg = SoakConfig(
        requests=requests, seed=seed, kill_prob=0.01, verify_every=1000, check_every_step=False
    )
    with single_torch_thread():
        rep = run_soak(ex, cfg, on_progress=sample, progress_every=window)
    ex.drain_cache_events()
    ex.check_integrity()
    ex.cache.close()
    base = next((w for w in windows if w["finished"] >= warmup), windows[-1])
    after = [w for w in windows if w["finished"] > base["finished"]] or [base]
    step_ratios = [w["step_us"] / base["step_us"] for w in after]
    return {
        "config": config,
        "requests": requests,
        "successes": rep.successes,
        "aborted": rep.aborted,
        "verified_kv": rep.verified,
        "kv_mismatches": rep.kv_mismatches,
        "protocol_errors": len(rep.protocol_errors),
        "speculative_l2_pages": ex.stats.speculative_l2_pages,
        "steps": rep.steps,
        "wall_s": rep.wall_s,
        "virtual_s": rep.virtual_s,
        "warmup_requests": base["finished"],
        "rss_base_mb": base["rss_mb"],
        "rss_max_after_warmup_mb": max(w["rss_mb"] for w in after),
        "rss_growth_pct": (max(w["rss_mb"] for w in after) / base["rss_mb"] - 1) * 100,
        "step_us_base": base["step_us"],
        "step_us_last": after[-1]["step_us"],
        "step_cost_ratio_max": max(step_ratios),
        "step_cost_ratio_median": statistics.median(step_ratios),
        "next_event_time_us_base": base["next_event_time_us"],
        "next_event_time_us_last": after[-1]["next_event_time_us"],
        "windows": windows,
    }


def run(quick: bool, out_dir: Path, config: str = "write_through") -> dict[str, Any]:
    """``bench`` suite entry: 20k requests (quick) or 100k."""
    requests, window, warmup = (20_000, 2_000, 4_000) if quick else (100_000, 5_000, 10_000)
    res = run_config(config, requests, window, warmup, seed=0)
    report(res)
    write_json("bench_soak", res, out_dir)
    return {k: v for k, v in res.items() if k != "windows"}


def report(res: dict[str, Any]) -> None:
    print(
        f"\n{res['config']}: {res['requests']} requests ({res['successes']} ok, "
        f"{res['aborted']} aborted) in {res['wall_s']:.0f} s wall, {res['steps']} steps\n"
        f"  RSS after {res['warmup_requests']} requests: {res['rss_base_mb']:.1f} MB; max later "
        f"{res['rss_max_after_warmup_mb']:.1f} MB (growth {res['rss_growth_pct']:+.2f}%, "
        f"target < 5%)\n"
        f"  step cost (CPU): {res['step_us_base']:.0f} us at warm-up, "
        f"{res['step_us_last']:.0f} us at the end (ratio to warm-up: max "
        f"{res['step_cost_ratio_max']:.2f}, median {res['step_cost_ratio_median']:.2f})\n"
        f"  next_event_time: {res['next_event_time_us_base']:.1f} us -> "
        f"{res['next_event_time_us_last']:.1f} us\n"
        f"  integrity: {res['kv_mismatches']} KV mismatches of {res['verified_kv']} checked, "
        f"{res['protocol_errors']} protocol errors, {res['speculative_l2_pages']} speculative "
        "L2 pages"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--window", type=int, default=5_000)
    p.add_argument("--warmup", type=int, default=10_000)
    p.add_argument("--config", choices=sorted(CONFIGS), default="write_through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    res = run_config(a.config, a.requests, a.window, a.warmup, a.seed)
    report(res)
    write_json("bench_soak", res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
