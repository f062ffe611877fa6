"""Optimistic prefill: TTFT with 0, 1 and 2 optimistic attempts on one trace, L2 under write_back.

The upstream measurement, scaled to the machine: long inputs of which ``--cached-fraction`` (80%)
is a shared prefix already in the cache, a steady Poisson arrival rate, and decode peers whose
bootstrap takes a delay drawn around the measured prefill time of one request (``--delay-scale``
times it, uniform on [0.5, 1.5] of that). Without optimism a request waits for its peer, then
computes; with it, it computes while the peer bootstraps (yield / park / retry as needed). Runs
again with injected bootstrap failures.

    python -m bench.bench_optimistic [--quick] [--out results]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_multiturn import CPU_MODEL, GPU_MODEL
from bench.e2e import (
    Driver,
    audit,
    bench_main,
    config_summary,
    cpu_note,
    free_memory,
    new_executor,
    on_cuda,
    plot_ttft,
    print_config_table,
    release_executor,
    shared_model,
    sum_integrity,
    time_left,
    write_result,
)
from bench.workload import cached_prompts, poisson_arrivals
from prefill.bootstrap import DelayDistribution, PeerConfig
from prefill.request import Outcome
from server_args import ServerArgs

ATTEMPTS = (0, 1, 2)

SIZES = {
    "quick": (
        dict(num_requests=24, input_len=1024, num_prefixes=4, utilization=0.25),
        dict(num_requests=24, input_len=8192, num_prefixes=4, utilization=0.25),
    ),
    "full": (
        dict(num_requests=64, input_len=2048, num_prefixes=4, utilization=0.25),
        dict(num_requests=64, input_len=32768, num_prefixes=4, utilization=0.25),
    ),
}


TABLE = [
    ("TTFT mean ms", "ttft_mean_s", 1e3, ".1f"),
    ("p50 ms", "ttft_p50_s", 1e3, ".1f"),
    ("p90 ms", "ttft_p90_s", 1e3, ".1f"),
    ("ok", "successes", 1, ".0f"),
    ("yields", "yields", 1, ".0f"),
    ("parks", "parks", 1, ".0f"),
    ("aborts", "aborts", 1, ".0f"),
    ("vs 0", "ttft_mean_speedup_vs_0", 1, ".2f"),
]


def server_args_for(attempts: int, opts: argparse.Namespace, failure_prob: float) -> ServerArgs:
    model = GPU_MODEL if on_cuda() else CPU_MODEL
    page = opts.page_size
    device_tokens = ((opts.device_pool_inputs * opts.input_len + page - 1) // page) * page
    return ServerArgs(
        **model,
        page_size=page,
        max_total_tokens=device_tokens,
        chunked_prefill_size=opts.chunked_prefill_size,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
        hicache_ratio=opts.hicache_ratio,
        hicache_mem_layout="page_first",
        hicache_io_backend="kernel",
        disaggregation_mode="prefill",
        optimistic_prefill_attempts=attempts,
        disaggregation_bootstrap_failure_prob=failure_prob,
        random_seed=opts.seed,
    )


def _warm(ex: Any, prefixes: list[list[int]]) -> None:
    """Put the shared prefixes in the cache (not measured)."""
    for i, p in enumerate(prefixes):
        ex.submit(f"warm-{i}", p)
    ex.run_until_idle()
    for i in range(len(prefixes)):
        ex.decode.release(f"warm-{i}")


def calibrate_prefill_s(opts: argparse.Namespace, prompts: list[list[int]], model: Any) -> float:
    """Median prefill latency of a request whose prefix is cached, peers ready at once, one at a
    time: the bootstrap delay is set around it."""
    args = server_args_for(0, opts, 0.0)
    ex = new_executor(
        args, PeerConfig(seed=opts.seed), decode_pool_tokens=opts.input_len * 8, model=model
    )
    _warm(ex, _prefixes_of(prompts, opts))
    times = []
    for i, p in enumerate(prompts[: opts.num_prefixes + 3]):
        ex.submit(f"cal-{i}", p)
        ex.run_until_idle()
        times.append(ex.result(f"cal-{i}").prefill_latency)
        ex.decode.release(f"cal-{i}")
    release_executor(ex)
    times.sort()
    return times[len(times) // 2]


def _prefixes_of(prompts: list[list[int]], opts: argparse.Namespace) -> list[list[int]]:
    n = int(opts.input_len * opts.cached_fraction)
    return [prompts[i][:n] for i in range(opts.num_prefixes)]


def run_config(
    attempts: int,
    failure_prob: float,
    opts: argparse.Namespace,
    prompts: list[list[int]],
    arrivals: list[float],
    delay: DelayDistribution,
    model: Any = None,
) -> dict[str, Any]:
    args = server_args_for(attempts, opts, failure_prob)
    peer = PeerConfig(
        bootstrap_delay=delay,
        bootstrap_failure_prob=failure_prob,
        seed=opts.seed,
    )
    decode_tokens = opts.input_len * (len(prompts) + opts.num_prefixes + 2)
    ex = new_executor(args, peer, decode_pool_tokens=decode_tokens, model=model)
    _warm(ex, _prefixes_of(prompts, opts))
    driver = Driver(ex, max_parallel=len(prompts))
    queue = collections.deque(range(len(prompts)))
    t0 = ex.clock.now()

    def next_due() -> float | None:
        return t0 + arrivals[queue[0]] if queue else None

    def pop_request() -> tuple[str, list[int]]:
        i = queue.popleft()
        return f"req-{i}", prompts[i]

    run = driver.drive(next_due, pop_request, on_result=lambda r: None, done=lambda: not queue)
    out = config_summary(run)
    stats = ex.stats
    out.update(
        yields=stats.yields, parks=stats.parks, aborts=stats.aborts, retries=stats.retries,
        optimistic_admissions=stats.optimistic_admissions,
        bootstrap_failures=stats.bootstrap_failures,
        attempts_used_max=max((r.attempts for r in run.results), default=0),
        failed_requests=sum(1 for r in run.results if r.outcome == Outcome.ABORTED),
    )  # fmt: skip
    out["integrity"] = audit(run)
    out["kv_max_rel_err"] = run.kv_max_rel_err
    if out["attempts_used_max"] > attempts:
        out["integrity"]["attempt_budget_exceeded"] = 1
    out["server_args"] = args.to_dict()
    release_executor(ex)
    return out


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    """Attempts 0 / 1 / 2 without and with injected bootstrap failures; returns the summary."""
    opts = parse_args(argv or [], quick)
    vocab = (GPU_MODEL if on_cuda() else CPU_MODEL).get("vocab_size", 32000)
    prompts = cached_prompts(
        opts.num_requests, opts.input_len, opts.cached_fraction, opts.num_prefixes, vocab, opts.seed
    )
    note = cpu_note()
    if note:
        print(f"[optimistic] {note}")
    model = shared_model(server_args_for(0, opts, 0.0))
    prefill_s = calibrate_prefill_s(opts, prompts, model)
    free_memory()
    mean_delay = opts.delay_scale * prefill_s
    delay = DelayDistribution("uniform", 0.5 * mean_delay, 1.5 * mean_delay)
    rate = opts.utilization / prefill_s
    arrivals = poisson_arrivals(len(prompts), rate, opts.seed)
    print(
        f"[optimistic] prefill of one {opts.input_len}-token request ({opts.cached_fraction:.0%} "
        f"cached): {prefill_s * 1e3:.1f} ms; bootstrap delay uniform "
        f"[{delay.a * 1e3:.1f}, {delay.b * 1e3:.1f}] ms; arrivals {rate:.1f}/s "
        f"(utilization {opts.utilization:g})"
    )
    runs = [("", 0.0, arrivals), ("_with_failures", opts.failure_prob, arrivals)]
    for u in opts.utilization_sweep:
        runs.append((f"_util_{u:g}", 0.0, poisson_arrivals(len(prompts), u / prefill_s, opts.seed)))
    results: dict[str, Any] = {}
    skipped: list[str] = []
    slowest = 0.0
    for suffix, failure_prob, times in runs:
        for attempts in ATTEMPTS:
            key = f"attempts_{attempts}{suffix}"
            if time_left() < 1.5 * slowest + 5:
                print(f"[optimistic] {key}: skipped, {time_left():.0f} s left", flush=True)
                skipped.append(key)
                continue
            print(f"[optimistic] {key} ...", flush=True)
            t0 = time.perf_counter()
            results[key] = run_config(attempts, failure_prob, opts, prompts, times, delay, model)
            slowest = max(slowest, time.perf_counter() - t0)
            free_memory()
            # Written after every configuration, so a run cut short still leaves its results.
            write_result(out_dir, "optimistic", {"workload": vars(opts), "note": note,
                                                 "partial": True, "configs": results})  # fmt: skip
    del model
    free_memory()
    for suffix, _, _ in runs:
        base = results.get(f"attempts_0{suffix}", {}).get("ttft_mean_s")
        for a in ATTEMPTS:
            res = results.get(f"attempts_{a}{suffix}")
            if res is None:
                continue
            mean = res["ttft_mean_s"]
            res["ttft_mean_speedup_vs_0"] = base / mean if base and mean else None
    print_config_table(results, TABLE, width=13)
    summary: dict[str, Any] = {k: _headline(v) for k, v in results.items()}
    summary.update(
        calibrated_prefill_s=prefill_s,
        bootstrap_delay={"kind": delay.kind, "low_s": delay.a, "high_s": delay.b},
        arrival_rate_per_s=rate,
        utilization=opts.utilization,
        integrity=sum_integrity(results),
        note=note,
        skipped_for_time=skipped,
    )
    doc = {"workload": vars(opts), "note": note, "summary": summary, "configs": results}
    path = write_result(out_dir, "optimistic", doc)
    labels = [
        n.replace("_with_failures", "\n+failures").replace("_util", "\nutil") for n in results
    ]
    plot_ttft(
        results, out_dir / "optimistic_ttft.png", "Optimistic prefill TTFT by attempts", labels
    )
    print(f"[optimistic] wrote {path}")
    return summary


def _headline(res: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "yields", "parks", "aborts", "retries",
        "optimistic_admissions", "bootstrap_failures", "successes", "ttft_mean_speedup_vs_0",
    )  # fmt: skip
    return {k: res.get(k) for k in keys}


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    cpu, gpu = SIZES["quick" if quick else "full"]
    size = gpu if on_cuda() else cpu
    p = argparse.ArgumentParser(prog="python -m bench.bench_optimistic", description=__doc__)
    p.add_argument("--num-requests", type=int, default=size["num_requests"])
    p.add_argument("--input-len", type=int, default=size["input_len"])
    p.add_argument("--cached-fraction", type=float, default=0.8)
    p.add_argument("--num-prefixes", type=int, default=size["num_prefixes"])
    p.add_argument(
        "--utilization",
        type=float,
        default=size["utilization"],
        help="Arrival rate as a fraction of one-at-a-time prefill capacity.",
    )
    p.add_argument(
        "--delay-scale",
        type=float,
        default=1.0,
        help="Mean bootstrap delay / calibrated prefill time.",
    )
    p.add_argument(
        "--failure-prob",
        type=float,
        default=0.1,
        help="Bootstrap failure probability of the second pass.",
    )
    p.add_argument(
        "--device-pool-inputs", type=int, default=6, help="Device pool size in input lengths."
    )
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=128 if not on_cuda() else 1024,
        help="Small enough that the uncached part takes two chunks (chunk boundaries "
        "are where an optimistic request may yield).",
    )
    p.add_argument(
        "--utilization-sweep",
        type=float,
        nargs="*",
        default=[0.5],
        help="Extra arrival rates (fractions of capacity) run without failures.",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(bench_main("optimistic", run))
