"""Optimistic prefill: TTFT with 0, 1 and 2 optimistic attempts on one trace per seed, L2 under
write_back (and under write_through where ``ServerArgs`` has ``optimistic_prefill_write_through``).

The upstream measurement, scaled to the machine: long inputs of which ``--cached-fraction`` (80%)
is a shared prefix already in the cache, a steady Poisson arrival rate, and decode peers whose
bootstrap takes a delay drawn around the prefill time of one request (``--delay-scale`` times
it, uniform on [0.5, 1.5] of that), that time being measured on the benchmark's own clock.
Without optimism a request waits for its peer, then computes; with it, it computes while the
peer bootstraps (yield / park / retry as needed). Runs again with injected bootstrap failures
(``_with_failures``), with peers that report not-ready to a request's first attempt
(``_forced_retry``, upstream's force-retry hook: every such request runs one optimistic
attempt whatever the limit, as upstream's hook does, and yields at its end) and, at full
size, at higher load (``_util_*``). Under write_back a yield publishes the computed pages and
the retry hits them; under write_through a yield releases them and the retry recomputes them
(``recomputed_tokens_per_yield``, counted position by position). The write_through rows run the
base and forced-retry traces, the same traces (seed by seed) as the write_back rows.

Headline: mean TTFT with 0 attempts / mean TTFT with N attempts, per seed, reported as mean and
spread over ``--seeds``; on the virtual clock (the default on a CPU) it depends only on the
seeds and the calibration, measured at the start and written to ``calibration.json``, or
replayed with ``--calibration FILE`` (``bench.e2e.driver``, ``bench.clock.calibrate``). Beside
it, the zero-load ceiling ``E[B+P]/E[max(B,P)]`` that the delay distribution and the prefill
time alone set (``bench.optimistic.sweep.ceiling``); with ``--sweeps`` (the default on a CPU)
the ratio is also measured against the delay scale and the utilization.

    python -m bench.optimistic [--quick] [--out results] [--clock wall] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.clock.calibrate import Calibration, describe, forward_curve
from bench.clock.host_cost import HostCosts
from bench.clock.host_meter import HostMeter, fit_meters
from bench.clock.trace_copies import CopyRecorder
from bench.common import time_left
from bench.e2e.budget import TimeBudget
from bench.e2e.calibrated import obtain_calibration, without_host
from bench.e2e.report import (
    add_common_args,
    add_counters,
    aggregate_seeds,
    plot_ttft,
    print_config_table,
    print_spread,
    sum_checks,
    sum_integrity,
    write_result,
)
from bench.e2e.setup import (
    SharedHostPool,
    cpu_note,
    device_kind,
    free_memory,
    on_cuda,
    shared_model,
)
from bench.e2e.workload import poisson_arrivals
from bench.optimistic.run import (
    POLICIES,
    Trace,
    available_policies,
    calibrate_prefill_s,
    make_trace,
    run_config,
)
from bench.optimistic.sweep import ceiling, delay_for, run_sweeps

ATTEMPTS = (2, 0, 1)
"""Run order within a variant: the headline pair (2 vs 0 attempts) first, so a run cut short by
its deadline (``bench/gpu_check.sh``) loses ``attempts_1``, not the headline. The CPU quick size
runs only the pair (``--attempts``): on its trace ``attempts_1`` equals ``attempts_2`` in every
seed outside the forced-retry rows, and a third of the suite's time went to it."""
RATIO = "ttft_mean_speedup_vs_0"
SECTIONS = {"write_back": "optimistic", "write_through": "optimistic_write_through"}

SIZES = {
    "quick": (
        dict(num_requests=120, input_len=256, num_prefixes=4, utilization=0.25, chunk=32,
             seeds=(0, 1, 2), kv_sample_every=20, sweep=[], attempts=ATTEMPTS[:2]),
        dict(num_requests=24, input_len=8192, num_prefixes=4, utilization=0.25, chunk=1024,
             seeds=(0,), kv_sample_every=4, sweep=[]),
    ),
    "full": (
        dict(num_requests=400, input_len=1024, num_prefixes=4, utilization=0.25, chunk=128,
             seeds=(0, 1, 2, 3, 4), kv_sample_every=8, sweep=[0.5]),
        dict(num_requests=64, input_len=32768, num_prefixes=4, utilization=0.25, chunk=4096,
             seeds=(0, 1, 2), kv_sample_every=4, sweep=[0.5]),
    ),
}  # fmt: skip

TABLE = [
    ("TTFT mean ms", "ttft_mean_s", 1e3, ".1f"),
    ("p50 ms", "ttft_p50_s", 1e3, ".1f"),
    ("p90 ms", "ttft_p90_s", 1e3, ".1f"),
    ("ok", "successes", 1, ".0f"),
    ("yields", "yields", 1, ".1f"),
    ("parks", "parks", 1, ".1f"),
    ("aborts", "aborts", 1, ".1f"),
    ("recomp/yield", "recomputed_tokens_per_yield", 1, ".1f"),
    ("vs 0", RATIO, 1, ".3f"),
]

HEADLINE_KEYS = (
    "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "yields", "parks", "aborts", "retries",
    "optimistic_admissions", "bootstrap_failures", "successes", "prefill_tokens_computed",
    "recomputed_tokens", "recomputed_tokens_per_yield", RATIO,
)  # fmt: skip


HOST_TRACE_REQUESTS = {"cpu": 40, "cuda": 12}
"""Requests of each configuration's host calibration trace (the first ones of the first seed)."""


def host_trace(
    opts: argparse.Namespace, model: Any, policies: list[str], host: SharedHostPool | None = None
) -> Any:
    """The host calibration trace: the first ``HOST_TRACE_REQUESTS`` requests of the first
    seed with 0 and 2 attempts (and 2 with forced retries) under every policy, on the virtual
    clock with host time measured (and charged as measured), and with 2 attempts on wall time
    with the real copies recorded; the fit of every call's samples, and of the copies
    (``bench.clock.trace_copies``). ``host``: the benchmark's shared host pool (same pool size
    as its configurations)."""

    host_requests = HOST_TRACE_REQUESTS[device_kind()]

    def trace(cal: Calibration) -> HostCosts:
        bare = without_host(cal)
        prefill_s = calibrate_prefill_s(opts, model, bare, True, "off", host=host)
        delay = delay_for(opts.delay_scale, prefill_s)
        arrivals = poisson_arrivals(host_requests, opts.utilization / prefill_s, opts.seeds[0])
        meters: dict[str, list[HostMeter]] = {}
        copies = CopyRecorder()
        for policy in policies:
            for attempts, forced in ((0, 0.0), (2, 0.0), (2, opts.forced_retry_prob)):
                t = make_trace(opts, opts.seeds[0], arrivals, delay, 0.0, forced)
                run_config(t, attempts, policy, model, bare, True, "measured", meters,
                           host=host)  # fmt: skip
                free_memory()
                if attempts == 2 and not forced:  # the copies' wall-clock samples: one run
                    run_config(t, attempts, policy, model, bare, False, host=host, copies=copies)
                    free_memory()
        info = {"benchmark": "optimistic", "policies": policies, "attempts": [0, 2],
                "requests_each": host_requests, "seed": opts.seeds[0]}  # fmt: skip
        return fit_meters(meters, info, cal.timer, cal.num_layers, copies)

    return trace


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    """Attempts 0 / 1 / 2 without and with injected bootstrap failures and at a higher load,
    under every seed, then the sweeps; returns the write_back summary (with the write_through
    one, where the flag exists, under ``extra_sections``)."""
    opts = parse_args(argv or [], quick)
    note = cpu_note()
    if note:
        print(f"[optimistic] {note}")
    policies = [p for p in available_policies() if p in opts.policies]
    args0 = Trace.server_args(opts, 0, 0.0, "write_back")
    model = shared_model(args0)
    virtual = opts.clock == "virtual"
    host = SharedHostPool()  # one pinned host pool: calibrations and every configuration
    trace = (host_trace(opts, model, policies, host)
             if virtual and opts.host_time == "model" else None)  # fmt: skip
    cal = obtain_calibration("optimistic", opts, args0, model, opts.chunk, opts.input_len,
                             out_dir, trace, build_cache=host.build)  # fmt: skip
    print(f"[optimistic] calibration: {describe(cal)}", flush=True)
    prefill_s = calibrate_prefill_s(opts, model, cal, virtual=virtual, host=host)
    free_memory()
    delay = delay_for(opts.delay_scale, prefill_s)
    rate = opts.utilization / prefill_s
    head_ceiling = ceiling(delay, prefill_s)
    print(
        f"[optimistic] prefill of one {opts.input_len}-token request ({opts.cached_fraction:.0%} "
        f"cached): {prefill_s * 1e3:.2f} ms ({opts.clock} clock); bootstrap delay uniform "
        f"[{delay.a * 1e3:.1f}, {delay.b * 1e3:.1f}] ms; arrivals {rate:.1f}/s "
        f"(utilization {opts.utilization:g}); zero-load ceiling E[B+P]/E[max(B,P)] = "
        f"{head_ceiling:.3f}; seeds {opts.seeds}; policies {policies}"
    )
    # (suffix, bootstrap failure prob, utilization, forced-retry prob, policies)
    variants = [
        ("", 0.0, opts.utilization, 0.0, policies),
        ("_with_failures", opts.failure_prob, opts.utilization, 0.0, ["write_back"]),
        ("_forced_retry", 0.0, opts.utilization, opts.forced_retry_prob, policies),
    ] + [(f"_util_{u:g}", 0.0, u, 0.0, ["write_back"]) for u in opts.utilization_sweep]
    per_seed: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in policies}
    budget = TimeBudget()
    traces: dict[tuple[int, str], Trace] = {}
    for seed, (suffix, failure_prob, util, forced, _), policy, attempts in run_order(
        opts.seeds, variants, opts.attempts
    ):
        if (seed, suffix) not in traces:
            arrivals = poisson_arrivals(opts.num_requests, util / prefill_s, seed)
            traces[seed, suffix] = make_trace(opts, seed, arrivals, delay, failure_prob, forced)
        trace = traces[seed, suffix]
        results = per_seed[policy].setdefault(seed, {})
        key = f"attempts_{attempts}{suffix}"
        if not budget.allows(f"{policy}/{key}/seed{seed}"):
            print(f"[optimistic] {policy} {key} seed {seed}: skipped, "
                  f"{time_left():.0f} s left")  # fmt: skip
            continue
        print(f"    {policy} {key} seed {seed}: running", flush=True)  # names a step cut short
        t0 = time.perf_counter()
        with budget.timed():
            results[key] = res = run_config(trace, attempts, policy, model, cal, virtual,
                                            host=host)  # fmt: skip
        print(f"    {policy} {key} seed {seed}: {res['successes']} ok, TTFT mean "
              f"{res['ttft_mean_s'] * 1e3:.2f} ms, {res['yields']} yields "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
        free_memory()
        _ratios(results)
        # Written after every configuration: a run cut short leaves its results.
        write_result(out_dir, "optimistic", {"workload": vars(opts), "note": note,
                                             "partial": True, "per_seed": per_seed})  # fmt: skip
    host.release()
    sweeps = None
    if opts.sweeps and virtual:
        sweeps = run_sweeps(opts, model, cal, prefill_s, out_dir, make_trace, run_config)
    del model
    free_memory()
    common = dict(
        mode=opts.clock, seeds=opts.seeds, calibrated_prefill_s=prefill_s,
        bootstrap_delay={"kind": delay.kind, "low_s": delay.a, "high_s": delay.b},
        delay_scale=opts.delay_scale, ceiling_zero_load=head_ceiling,
        arrival_rate_per_s=rate, utilization=opts.utilization, note=note,
        calibration_source=cal.source, forward_curve=forward_curve(cal.forward),
        host_pool_allocations=host.allocations,
    )  # fmt: skip
    sections: dict[str, dict[str, Any]] = {}
    for policy in policies:
        configs = aggregate_seeds(per_seed[policy], HEADLINE_KEYS, RATIO)
        print(f"\n[optimistic] L2 {policy}: mean over seeds {opts.seeds} ({opts.clock} clock)")
        print_config_table(configs, TABLE, width=13)
        print_spread(configs, RATIO, "mean TTFT vs 0 attempts")
        sections[SECTIONS[policy]] = {
            **configs, **common, "write_policy": policy, "integrity": sum_integrity(configs),
            "checks": sum_checks(configs),
            "skipped_for_time": [s for s in budget.skipped if s.startswith(policy + "/")],
        }  # fmt: skip
    summary = sections.get("optimistic", {})
    summary["calibration"] = cal.as_dict()
    summary["sweeps"] = sweeps
    if sweeps is not None:
        summary["integrity"] = add_counters(summary["integrity"], sweeps["integrity"])
    doc = {"workload": vars(opts), "note": note, "summary": sections, "per_seed": per_seed}
    path = write_result(out_dir, "optimistic", doc)
    first = {f"{p[:2]}:{k}": v for p in policies for k, v in per_seed[p][opts.seeds[0]].items()}
    labels = [n.replace("_with_failures", "\n+failures").replace("_forced_retry", "\n+forced")
              .replace("_util", "\nutil") for n in first]  # fmt: skip
    plot_ttft(first, out_dir / "optimistic_ttft.png",
              f"Optimistic prefill TTFT by attempts (seed {opts.seeds[0]}; wr: write_back, "
              "wt: write_through)", labels)  # fmt: skip
    print(f"[optimistic] wrote {path}")
    extra = {k: v for k, v in sections.items() if k != "optimistic"}
    if extra:
        summary["extra_sections"] = extra
    return summary


def run_order(
    seeds: list[int], variants: list[tuple], attempts: tuple[int, ...] = ATTEMPTS
) -> list[tuple]:
    """``(seed, variant, policy, attempts)`` in the order they run: per seed, the first
    (headline) variant's ``attempts_2`` and ``attempts_0`` under every policy, then its
    ``attempts_1``, then each other variant in ``ATTEMPTS`` order under its policies; only the
    attempt counts in ``attempts``."""
    ordered = [a for a in ATTEMPTS if a in attempts]
    head = [a for a in ordered if a in ATTEMPTS[:2]]
    tail = [a for a in ordered if a not in ATTEMPTS[:2]]
    order = []
    for seed in seeds:
        base, *rest = variants
        for group in (head, tail):
            order += [(seed, base, policy, a) for policy in base[4] for a in group]
        for variant in rest:
            order += [(seed, variant, policy, a) for policy in variant[4] for a in ordered]
    return order


def _ratios(results: dict[str, Any]) -> None:
    for key, res in results.items():
        base_key = "attempts_0" + key[len("attempts_0") :]
        base = results.get(base_key, {}).get("ttft_mean_s")
        mean = res.get("ttft_mean_s")
        res[RATIO] = base / mean if base and mean else None


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    cpu, gpu = SIZES["quick" if quick else "full"]
    size = gpu if on_cuda() else cpu
    p = argparse.ArgumentParser(prog="python -m bench.optimistic", description=__doc__)
    p.add_argument("--num-requests", type=int, default=size["num_requests"])
    p.add_argument("--input-len", type=int, default=size["input_len"])
    p.add_argument("--cached-fraction", type=float, default=0.8)
    p.add_argument("--num-prefixes", type=int, default=size["num_prefixes"])
    p.add_argument("--utilization", type=float, default=size["utilization"],
                   help="Arrival rate as a fraction of one-at-a-time prefill capacity.")
    p.add_argument("--delay-scale", type=float, default=1.0,
                   help="Mean bootstrap delay / calibrated prefill time.")
    p.add_argument("--failure-prob", type=float, default=0.1,
                   help="Bootstrap failure probability of the _with_failures rows.")
    p.add_argument("--forced-retry-prob", type=float, default=0.5,
                   help="Probability that a peer reports not-ready to a request's first attempt "
                   "(upstream's force-retry test hook) in the _forced_retry rows: every such "
                   "request yields once, so recomputation per yield shows.")
    p.add_argument("--device-pool-inputs", type=int, default=6,
                   help="Device pool size in input lengths.")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", dest="chunk", type=int, default=size["chunk"],
                   help="Small enough that the uncached part takes two chunks (chunk boundaries "
                   "are where an optimistic request may yield).")
    p.add_argument("--attempts", type=int, nargs="+", default=list(size.get("attempts", ATTEMPTS)),
                   choices=list(ATTEMPTS),
                   help="Attempt counts to run (0 and 2 are the headline pair; the CPU quick "
                   "size runs only those).")
    p.add_argument("--utilization-sweep", type=float, nargs="*", default=size["sweep"],
                   help="Extra arrival rates (fractions of capacity) run without failures.")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
                   help="L2 write policies to run (write_through needs the executor's "
                   "optimistic_prefill_write_through flag; skipped without it).")
    add_common_args(p, size["seeds"], size["kv_sample_every"])
    opts = p.parse_args(argv)
    if 0 not in opts.attempts:
        raise ValueError(f"--attempts {opts.attempts}: must include 0 (every ratio's baseline)")
    return opts

