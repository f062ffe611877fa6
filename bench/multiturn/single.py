"""The multi-turn benchmark on one rank: every configuration under every seed, one executor
per (configuration, seed), audited, aggregated and written to ``multiturn.json``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.clock.calibrate import Calibration, calibrate_run, describe
from bench.common import time_left
from bench.e2e.audit import audit, config_summary
from bench.e2e.budget import TimeBudget
from bench.e2e.report import (
    aggregate_seeds,
    plot_ttft,
    print_config_table,
    print_spread,
    sum_integrity,
    write_result,
)
from bench.e2e.setup import (
    SharedHostPool,
    cpu_note,
    free_memory,
    new_executor,
    release_executor,
    shared_model,
)
from bench.multiturn.trace import (
    HEADLINE_KEYS,
    RATIO,
    TABLE,
    add_ratios,
    conversations_for,
    decode_tokens_for,
    drive_trace,
    longest_prompt,
    pool_sizes,
    request_rate,
    server_args_for,
)
from prefill.disagg.sim_config import PeerConfig


def run_config(
    name: str, seed: int, device_tokens: int, rate: float, opts: argparse.Namespace, model: Any,
    cal: Calibration | None, host: SharedHostPool | None = None,
) -> dict[str, Any]:  # fmt: skip
    args = server_args_for(name, device_tokens, opts)
    conversations = conversations_for(opts, args.vocab_size, seed)
    decode_tokens = decode_tokens_for(conversations, opts)
    ex, cost = new_executor(args, PeerConfig(seed=seed), decode_tokens, model, cal, host=host)
    run = drive_trace(ex, cost, conversations, rate, seed, name, opts)
    out = config_summary(run)
    out["integrity"] = audit(run)
    out["kv_max_rel_err"] = run.kv_max_rel_err
    out["seed"] = seed
    out["server_args"] = args.to_dict()
    release_executor(ex, host)
    return out


def run_single(opts: argparse.Namespace, out_dir: Path) -> dict:
    """Every configuration under every seed on one rank; returns the summary keyed by
    configuration."""
    working_set, device_tokens = pool_sizes(opts)
    ratio = working_set / device_tokens
    note = cpu_note()
    print(
        f"[multiturn] working set {working_set} tokens, device pool {device_tokens} tokens "
        f"(working set / device pool = {ratio:.2f}); host pool = {opts.hicache_ratio}x device; "
        f"clock: {opts.clock}; seeds {opts.seeds}"
    )
    if note:
        print(f"[multiturn] {note}")
    cal_args = server_args_for("write_back", device_tokens, opts)
    model = shared_model(cal_args)
    longest = longest_prompt(opts)
    host = SharedHostPool()  # one pinned host pool: the calibration and every L2 configuration
    cal = calibrate_run(cal_args, model, opts.chunked_prefill_size, longest,
                        build_cache=host.build)  # fmt: skip
    print(f"[multiturn] calibration: {describe(cal)}", flush=True)
    rate = request_rate(opts, cal)
    print(f"[multiturn] arrivals {rate:.2f}/s (load {opts.load:g} of device-only capacity)")
    per_seed: dict[int, dict[str, Any]] = {}
    budget = TimeBudget()
    for seed in opts.seeds:
        results = per_seed.setdefault(seed, {})
        for name in opts.configs:
            if not budget.allows(f"{name}/seed{seed}"):
                print(f"[multiturn] {name} seed {seed}: skipped, {time_left():.0f} s left")
                continue
            print(f"[multiturn] {name} seed {seed}: running", flush=True)
            with budget.timed():
                results[name] = run_config(name, seed, device_tokens, rate, opts, model,
                                           cal if opts.clock == "virtual" else None,
                                           host)  # fmt: skip
            free_memory()
            add_ratios(results)
            # Written after every configuration, so a run cut short still leaves its results.
            write_result(out_dir, "multiturn", {"workload": vars(opts), "note": note,
                                                "partial": True, "per_seed": per_seed})  # fmt: skip
    host.release()
    del model
    free_memory()
    configs = aggregate_seeds(per_seed, HEADLINE_KEYS, RATIO)
    print(f"\n[multiturn] mean over seeds {opts.seeds} ({opts.clock} clock)")
    print_config_table(configs, TABLE)
    print_spread(configs, RATIO, "mean TTFT vs device-only")
    summary = {
        **configs,
        "mode": opts.clock,
        "seeds": opts.seeds,
        "request_rate_per_s": rate,
        "working_set_tokens": working_set,
        "device_pool_tokens": device_tokens,
        "working_set_over_device_pool": ratio,
        "calibration": cal.as_dict(),
        "integrity": sum_integrity(configs),
        "note": note,
        "skipped_for_time": budget.skipped,
        "host_pool_allocations": host.allocations,
    }
    doc = {"workload": vars(opts), "note": note, "summary": summary, "per_seed": per_seed}
    path = write_result(out_dir, "multiturn", doc)
    first = per_seed[opts.seeds[0]]
    plot_ttft(first, out_dir / "multiturn_ttft.png",
              f"Multi-turn prefill TTFT per cache configuration (seed {opts.seeds[0]})",
              list(first))  # fmt: skip
    print(f"[multiturn] wrote {path}")
    return summary


