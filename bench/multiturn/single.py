"""The multi-turn benchmark on one rank: the calibration (measured, with its host calibration
trace, or replayed), every configuration under every seed, one executor per (configuration,
seed), audited, aggregated and written to ``multiturn.json``; then the sweeps
(``bench.multiturn.sweep``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.clock.calibrate import Calibration, describe, forward_curve
from bench.clock.host_cost import HostCosts
from bench.clock.host_meter import HostMeter, fit_meters
from bench.clock.trace_copies import CopyRecorder
from bench.common import time_left
from bench.e2e.audit import audit, config_summary
from bench.e2e.budget import TimeBudget
from bench.e2e.calibrated import obtain_calibration, without_host
from bench.e2e.report import (
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
    new_executor,
    release_executor,
    shared_model,
)
from bench.multiturn.sweep import run_sweeps
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

HOST_TRACE_CLIENTS = {"cpu": 8, "cuda": 3}
"""Clients of each configuration's host calibration trace: the benchmark's conversations (every
round), fewer of them, the device pool sized for them at the same working-set ratio."""


def run_config(
    name: str, seed: int, device_tokens: int, rate: float, opts: argparse.Namespace, model: Any,
    cal: Calibration | None, virtual: bool | None = None, host_mode: str | None = None,
    max_requests: int | None = None, meters: dict[str, list[HostMeter]] | None = None,
    quiet: bool = False, acks_at_step_end: bool = False, host: SharedHostPool | None = None,
    copies: CopyRecorder | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One configuration under one seed (``virtual``: default whether ``cal`` is given;
    ``host_mode``: default ``--host-time``; the host costs are this configuration's profile).
    ``meters``: receives the run's host meter under ``name``, which then records its samples
    (the host calibration trace). ``acks_at_step_end``: see ``new_executor``. ``host``: the
    benchmark's shared host pool, for configurations of its pool size (the sweeps and the host
    trace size theirs otherwise and build their own)."""
    args = server_args_for(name, device_tokens, opts)
    conversations = conversations_for(opts, args.vocab_size, seed)
    decode_tokens = decode_tokens_for(conversations, opts)
    ex, cost = new_executor(args, PeerConfig(seed=seed), decode_tokens, model, cal,
                            virtual=virtual, host_mode=host_mode or opts.host_time,
                            record_host=meters is not None,
                            acks_at_step_end=acks_at_step_end, host_profile=name,
                            host=host, copies=copies)  # fmt: skip
    if meters is not None and cost is not None and cost.meter is not None:
        meters.setdefault(name, []).append(cost.meter)
    run = drive_trace(ex, cost, conversations, rate, seed, name, opts, max_requests,
                      quiet=quiet)  # fmt: skip
    integrity = audit(run)  # first: it pops the acks still ahead on the clock (copy stats)
    out = config_summary(run)
    out["integrity"] = integrity
    out["kv_max_rel_err"] = run.kv_max_rel_err
    out["seed"] = seed
    out["server_args"] = args.to_dict()
    release_executor(ex, host)
    return out


def host_trace(opts: argparse.Namespace, model: Any) -> Any:  # Callable[[Calibration], HostCosts]
    """The host calibration trace: ``HOST_TRACE_CLIENTS`` conversations of the first seed (all
    their rounds: first prompts, hits, load backs and evictions alike) under every
    configuration, on the virtual clock with host time measured (and charged as measured),
    then (a configuration with an L2 cache) on wall time with the real copies recorded; the
    fit of every call's samples, per configuration, and of the copies
    (``bench.clock.trace_copies``)."""
    small = argparse.Namespace(**{**vars(opts), "num_clients": HOST_TRACE_CLIENTS[device_kind()]})
    _, device_tokens = pool_sizes(small)

    def trace(cal: Calibration) -> HostCosts:
        meters: dict[str, list[HostMeter]] = {}
        copies = CopyRecorder()
        bare = without_host(cal)
        rate = request_rate(small, bare)
        for name in small.configs:
            run_config(name, small.seeds[0], device_tokens, rate, small, model, bare, True,
                       "measured", None, meters, quiet=True)  # fmt: skip
            free_memory()
            if server_args_for(name, device_tokens, small).enable_hierarchical_cache:
                run_config(name, small.seeds[0], device_tokens, rate, small, model, bare, False,
                           quiet=True, copies=copies)  # fmt: skip
                free_memory()
        info = {"benchmark": "multiturn", "configs": list(small.configs),
                "clients": small.num_clients, "rounds": small.num_rounds,
                "device_pool_tokens": device_tokens, "seed": small.seeds[0]}  # fmt: skip
        return fit_meters(meters, info, cal.timer, cal.num_layers, copies)

    return trace


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
    # Host costs are calibrated for the virtual clock only (a wall-clock run measures them).
    wanted = opts.clock == "virtual" and opts.host_time == "model"
    trace = host_trace(opts, model) if wanted else None
    host = SharedHostPool()  # one pinned host pool: the calibration and every L2 configuration
    cal = obtain_calibration("multiturn", opts, cal_args, model, opts.chunked_prefill_size,
                             longest, out_dir, trace, build_cache=host.build)  # fmt: skip
    print(f"[multiturn] calibration: {describe(cal)}", flush=True)
    rate = request_rate(opts, cal)
    print(f"[multiturn] arrivals {rate:.2f}/s (load {opts.load:g} of device-only capacity)")
    virtual = opts.clock == "virtual"
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
                results[name] = run_config(name, seed, device_tokens, rate, opts, model, cal,
                                           virtual, host=host)  # fmt: skip
            free_memory()
            add_ratios(results)
            # Written after every configuration, so a run cut short still leaves its results.
            write_result(out_dir, "multiturn", {"workload": vars(opts), "note": note,
                                                "partial": True, "per_seed": per_seed})  # fmt: skip
    host.release()
    configs = aggregate_seeds(per_seed, HEADLINE_KEYS, RATIO)
    print(f"\n[multiturn] mean over seeds {opts.seeds} ({opts.clock} clock)")
    print_config_table(configs, TABLE)
    print_spread(configs, RATIO, "mean TTFT vs device-only")
    sweeps = None
    if opts.sweeps and virtual:
        sweeps = run_sweeps(opts, model, cal, out_dir, run_config)
    del model
    free_memory()
    summary = {
        **configs,
        "mode": opts.clock,
        "seeds": opts.seeds,
        "request_rate_per_s": rate,
        "load": opts.load,
        "working_set_tokens": working_set,
        "device_pool_tokens": device_tokens,
        "working_set_over_device_pool": ratio,
        "calibration_source": cal.source,
        "forward_curve": forward_curve(cal.forward),
        "h2d_gb_per_s": cal.h2d.bytes_per_s / 1e9,
        "calibration": cal.as_dict(),
        "integrity": add_counters(sum_integrity(configs),
                                  {} if sweeps is None else sweeps["integrity"]),
        "checks": sum_checks(configs),
        "sweeps": sweeps,
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
