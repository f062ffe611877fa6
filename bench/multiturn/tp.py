"""``python -m bench.multiturn --tp N``: the same multi-turn trace and table, served by N
tensor-parallel ranks (``--tp-size N``), each with its own shard of the KV heads, cache, controller
and decode side, agreeing every cache and scheduling decision on a gloo group.

Launch: on a CPU machine ``python -m bench.multiturn --tp 2`` spawns the ranks itself
(``prefill.tp.launch.run_ranks``: gloo for the model's all_reduce and for the cache group); on
GPUs start one process per GPU with torchrun, which this module detects (``WORLD_SIZE``):

    torchrun --nproc-per-node 2 -m bench.multiturn --tp 2

(model collectives on NCCL, the cache group on gloo, as SGLang). Rank 0 drives the trace (it
alone submits, as SGLang's rank 0 receives the requests) and prints; the other ranks follow its
steps (``OptimisticPrefillExecutor.follow``). Every rank runs the calibration (its forward
passes are collective) and uses rank 0's, so the virtual clock charges the same time everywhere.

Reported like the single-rank run: TTFT and hits from rank 0's results (identical on every rank),
bytes moved and the integrity counters summed over the ranks, and each rank's own numbers under
``per_rank``. The audit runs on every rank: each rank's decode-side KV of the sampled requests
against the tensor-parallel model's recompute of its heads. Results: ``multiturn_tp{N}.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
from pathlib import Path
from typing import Any

from bench.clock.calibrate import describe, forward_curve
from bench.e2e.audit import audit, config_summary
from bench.e2e.budget import TimeBudget
from bench.e2e.calibrated import obtain_calibration
from bench.e2e.driver import TraceRun
from bench.e2e.report import (
    aggregate_seeds,
    print_config_table,
    print_spread,
    sum_integrity,
    write_result,
)
from bench.e2e.setup import cpu_note, free_memory, new_executor, release_executor
from bench.e2e.strict_audit import ForwardLog
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
from hicache.tp.group import TPGroup, new_cache_group
from prefill.disagg.sim_config import PeerConfig
from prefill.model.factory import build_model

SUMMED = ("d2h_bytes", "h2d_bytes", "backed_up_tokens", "loaded_tokens",
          "evicted_device_tokens")  # fmt: skip


def run_tp(opts: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Run the trace on ``opts.tp`` ranks (spawned here, or this process under torchrun);
    returns rank 0's summary."""
    if "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        import torch
        import torch.distributed as dist

        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != opts.tp:
            raise ValueError(f"--tp {opts.tp} under torchrun with {world} processes")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(minutes=30))  # fmt: skip
        try:
            summary = rank_main(rank, world, opts, str(out_dir))
            return summary if rank == 0 else {"integrity": {}}
        finally:
            dist.destroy_process_group()
    from prefill.tp.launch import run_ranks

    return run_ranks(rank_main, opts.tp, opts, str(out_dir), timeout_s=6 * 3600)[0]


def server_args_tp(name: str, device_tokens: int, opts: argparse.Namespace, tp: int) -> Any:
    return dataclasses.replace(server_args_for(name, device_tokens, opts), tp_size=tp)


def rank_main(rank: int, world: int, opts: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    """One rank's whole run: every configuration under every seed, in the same order on every
    rank. Rank 0 prints, writes the result and returns the summary (the others an empty one)."""
    if opts.host_time == "measured":
        raise ValueError("--host-time measured at --tp > 1: each rank measures its own host "
                         "time, so the ranks' clocks would differ; use model or off")  # fmt: skip
    group = new_cache_group()
    say = print if rank == 0 else (lambda *a, **k: None)
    working_set, device_tokens = pool_sizes(opts)
    note = cpu_note()
    say(f"[multiturn tp{world}] {world} ranks, working set {working_set} tokens, device pool "
        f"{device_tokens} tokens per rank (its KV heads), host pool = {opts.hicache_ratio}x "
        f"device; clock: {opts.clock}; seeds {opts.seeds}", flush=True)  # fmt: skip
    cal_args = server_args_tp("write_back", device_tokens, opts, world)
    model = build_model(cal_args)
    longest = longest_prompt(opts)
    # Forward passes are collective (every rank times the same grid); copies are this rank's
    # shard, timed on a single-rank cache of its geometry. Rank 0's calibration is everyone's.
    # No host calibration trace here: host time is charged only from a replayed calibration
    # that holds host costs (--calibration).
    local = dataclasses.replace(cal_args, tp_size=1, head_num=cal_args.kv_heads_per_rank())
    if opts.calibration is not None and rank != 0:
        cal = None
    else:
        cal = obtain_calibration(f"multiturn_tp{world}", opts, local, model,
                                 opts.chunked_prefill_size, longest,
                                 Path(out_dir) if rank == 0 else None)  # fmt: skip
    cal = group.broadcast_object(cal if rank == 0 else None, src=0, tag="calibration")
    say(f"[multiturn tp{world}] calibration (rank 0): {describe(cal)}", flush=True)
    rate = request_rate(opts, cal)
    per_seed: dict[int, dict[str, Any]] = {}
    budget = TimeBudget(agree=lambda ok: group.agree_all(ok, tag="time_left"))
    for seed in opts.seeds:
        results = per_seed.setdefault(seed, {})
        for name in opts.configs:
            if not budget.allows(f"{name}/seed{seed}"):
                say(f"[multiturn tp{world}] {name} seed {seed}: skipped for time")
                continue
            with budget.timed():
                results[name] = run_config_tp(name, seed, device_tokens, rate, opts, model,
                                              cal, group)  # fmt: skip
            free_memory()
            if rank == 0:
                add_ratios(results)
    del model
    free_memory()
    if rank != 0:
        return {"integrity": {}}
    configs = aggregate_seeds(per_seed, HEADLINE_KEYS, RATIO)
    summary = {
        **configs, "mode": opts.clock, "seeds": opts.seeds, "tp_size": world,
        "request_rate_per_s": rate, "working_set_tokens": working_set,
        "device_pool_tokens_per_rank": device_tokens, "calibration": cal.as_dict(),
        "forward_curve": forward_curve(cal.forward), "calibration_source": cal.source,
        "integrity": sum_integrity(configs), "note": note,
        "skipped_for_time": budget.skipped,
    }  # fmt: skip
    print(f"\n[multiturn tp{world}] mean over seeds {opts.seeds} ({opts.clock} clock), "
          f"{world} ranks; bytes and integrity summed over the ranks")  # fmt: skip
    print_config_table(configs, TABLE)
    print_spread(configs, RATIO, "mean TTFT vs device-only")
    doc = {"workload": vars(opts), "note": note, "summary": summary, "per_seed": per_seed}
    path = write_result(Path(out_dir), f"multiturn_tp{world}", doc)
    print(f"[multiturn tp{world}] wrote {path}")
    return summary


def run_config_tp(
    name: str, seed: int, device_tokens: int, rate: float, opts: argparse.Namespace, model: Any,
    cal: Any, group: TPGroup,
) -> dict[str, Any]:  # fmt: skip
    """One configuration under one seed: rank 0 drives the trace (``drive_trace``, as
    ``run_config``), the others follow; then the audit on every rank, and per-rank numbers
    gathered."""
    args = server_args_tp(name, device_tokens, opts, group.size)
    conversations = conversations_for(opts, args.vocab_size, seed)
    decode_tokens = decode_tokens_for(conversations, opts)
    virtual = opts.clock == "virtual"
    ex, cost = new_executor(args, PeerConfig(seed=seed), decode_tokens, model, cal, group,
                            virtual=virtual, host_mode=opts.host_time)  # fmt: skip
    log = ForwardLog(ex)  # every rank: the strict audit replays on every rank
    if group.rank == 0:
        run = drive_trace(ex, cost, conversations, rate, seed, name, opts, forward_log=log)
        ex.stop_followers()
    else:
        ex.follow(after_step=None if cost is None else cost.settle)
        run = TraceRun(label="", executor=ex, cost=cost, forward_log=log)
    run.sampled = group.broadcast_object(run.sampled, src=0, tag="sampled")
    integrity = audit(run)  # collective: every rank checks its own shard
    mine = {"integrity": integrity, "cache": ex.cache.stats.as_dict(),
            "kv_max_rel_err": run.kv_max_rel_err}  # fmt: skip
    ranks = group.all_gather_object(mine, tag="per_rank")
    out: dict[str, Any] = {}
    if group.rank == 0:
        out = config_summary(run)
        for key in SUMMED:
            out[key] = sum(r["cache"][key] for r in ranks)
        out["integrity"] = sum_integrity({i: r for i, r in enumerate(ranks)})
        out["integrity"]["kv_checked_requests"] = integrity["kv_checked_requests"]
        errs = [r["kv_max_rel_err"] for r in ranks if r["kv_max_rel_err"] is not None]
        out["kv_max_rel_err"] = max(errs) if errs else None
        out["per_rank"] = ranks
        out["seed"] = seed
        out["server_args"] = args.to_dict()
    release_executor(ex)
    return out
