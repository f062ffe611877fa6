"""TTFT over the real transport, wall clock: the executor here, one or two decode worker processes
that Mooncake writes the KV into. Cached-prefix prompts arrive (Poisson) at half the measured
prefill rate; a worker preallocates a request only after a drawn delay of 0.5 to 1.5 prefill
times (a busy decode), which optimistic prefill (attempts 2) can use and the baseline (0) waits
out. TTFT: arrival to the transfer's ``Success``. The configurations take turns over ``repeats``;
every run ends with ``audit`` (``INTEGRITY``).
"""

from __future__ import annotations

import itertools
import random
import statistics
from typing import Any

import numpy as np

from prefill.clock import WallClock
from prefill.disagg.backends import make_decode_backend
from prefill.executor import OptimisticPrefillExecutor as Executor
from prefill.model.factory import build_model
from prefill.request.state import Outcome
from prefill.scheduler.metadata_buffers import DEFAULT_MAX_RUNNING_REQUESTS, metadata_buffer_count
from prefill.testing.harness import build_cache, decode_kv_and_reference, kv_max_rel_error
from prefill.testing.mooncake_decode import DecodeWorker, MooncakeDecode, wait_for
from server_args import ServerArgs, prepare_server_args

PROMPT, CACHED, PREFIXES, VOCAB = 256, 204, 4, 1024
FLAGS = (
    "--device cpu --dtype float32 --num-layers 4 --num-attention-heads 8 --head-num 4 "
    f"--head-dim 32 --hidden-size 256 --intermediate-size 768 --vocab-size {VOCAB} --page-size 16 "
    "--max-total-tokens 8192 --chunked-prefill-size 64 --disaggregation-mode prefill "
    "--disaggregation-transfer-backend mooncake --disaggregation-bootstrap-port 0"
).split()
CONFIGS = [(1, 0), (1, 2), (2, 0), (2, 2)]  # (decode workers, optimistic attempts)
INTEGRITY = ("integrity_errors", "kv_mismatches", "decode_leaked_slots", "decode_late_writes")
KV_REL_TOL = 1e-3  # float32 KV against a recompute: reduction order only; wrong KV is ~1


def server_args(attempts: int) -> ServerArgs:
    """The prefill server: a small float32 model on the CPU, Mooncake transport on loopback."""
    return prepare_server_args([*FLAGS, "--optimistic-prefill-attempts", str(attempts)])


class BusyDecode(MooncakeDecode):
    """The decode workers, each preallocating request ``rid`` ``delays[rid]`` seconds late."""

    def __init__(self, backend: Any, workers: list[DecodeWorker], delays: dict[str, float]) -> None:
        super().__init__(backend, workers, owned=[])  # the workers outlive the executor
        self.delay_s = lambda rid: delays.get(rid, 0.0)


def executor(args: ServerArgs, model: Any, workers: list, delays: dict[str, float]) -> Executor:
    """A wall-clock executor over ``args`` whose decode side is ``BusyDecode(workers, delays)``."""
    cache, clock = build_cache(args), WallClock()
    rows = metadata_buffer_count(DEFAULT_MAX_RUNNING_REQUESTS)
    backend = make_decode_backend(args, cache.device_pool, clock, rows, 0, keep_received=True)
    decode = BusyDecode(backend, workers, delays)
    return Executor(args, cache=cache, model=model, clock=clock, decode=decode)


def one_by_one(ex: Executor, prompts: list[list[int]], tag: str) -> list[Any]:
    """Each prompt alone until its result (returned); its decode KV released."""
    out = []
    for i, p in enumerate(prompts):
        ex.submit(f"{tag}-{i}", p)
        ex.run_until_idle()
        out += ex.pop_results()
        ex.release_received(f"{tag}-{i}")
    return out


def drive(ex: Executor, prompts: list[list[int]], arrivals: list[float]) -> dict[str, Any]:
    """``req-i`` submitted ``arrivals[i]`` seconds from now; steps until every result is in,
    then ``audit``."""
    t0, sent, due_now, results, ttfts, kept = ex.clock.now(), 0, 0, 0, [], []
    while results < len(prompts):
        while sent < len(prompts) and t0 + arrivals[sent] <= ex.clock.now():
            ex.submit(f"req-{sent}", prompts[sent])
            sent += 1
        progressed = ex.step()
        for r in ex.pop_results():
            results += 1
            if r.outcome == Outcome.SUCCESS:
                ttfts.append((r.finish_time - t0 - arrivals[int(r.rid[4:])]) * 1e3)
                if len(ttfts) % 4 == 1:
                    kept.append(r.rid)  # its decode KV is checked by the audit
                else:
                    ex.release_received(r.rid)
        nxt = t0 + arrivals[sent] if sent < len(prompts) else None
        due_now = 0 if progressed else ex.wait_for_next_event(due_now, also=nxt, local=True)
    items = sum(s["items"] for s in ex.decode.backend.transport.stats()["sessions"].values())
    return {
        "ttfts_ms": ttfts,
        "requests": results,
        "items_per_send": items / max(ex.stats.sends, 1),
        "integrity": audit(ex, kept),
    }


def audit(ex: Executor, kept: list[str]) -> dict[str, int]:
    """``INTEGRITY`` of a run (module docstring); closes the prefill side."""
    out = dict.fromkeys(INTEGRITY, 0)
    ex.drain_cache_events()
    try:
        ex.check_integrity()
    except AssertionError:
        out["integrity_errors"] = 1
    for rid in kept:
        out["kv_mismatches"] += kv_max_rel_error(decode_kv_and_reference(ex, rid)) > KV_REL_TOL
        ex.release_received(rid)
    ex.decode.close()
    for w in ex.decode.workers:
        wait_for(lambda w=w: _freed(w.call("stats")[0]), 30)
        stats = w.call("stats")[0]
        out["decode_leaked_slots"] += stats["pool_tokens"] - stats["free_tokens"]
        out["decode_late_writes"] += stats["late_writes"]
    return out


def _freed(stats: dict[str, int]) -> bool:
    return stats["held"] == 0 and stats["free_tokens"] == stats["pool_tokens"]


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats: the median of their mean TTFT, its min..max, the p90 of
    every request; counts and ``INTEGRITY`` summed."""
    means = sorted(statistics.fmean(r["ttfts_ms"]) for r in runs if r["ttfts_ms"])
    pooled = [t for r in runs for t in r["ttfts_ms"]]
    return {
        "requests": sum(r["requests"] for r in runs),
        "succeeded": len(pooled),
        "ttft_mean_ms": statistics.median(means) if means else None,
        "ttft_mean_min_ms": min(means, default=None),
        "ttft_mean_max_ms": max(means, default=None),
        "ttft_p90_ms": float(np.percentile(pooled, 90)) if pooled else None,
        "items_per_send": statistics.fmean(r["items_per_send"] for r in runs),
        "integrity": {k: sum(r["integrity"][k] for r in runs) for k in INTEGRITY},
    }


def measure(quick: bool, workers: list[DecodeWorker]) -> dict[str, Any]:
    """The table's rows (module docstring)."""
    n, repeats = (40, 3) if quick else (160, 5)
    rng = random.Random(1)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(CACHED)] for _ in range(PREFIXES)]
    prompts = [
        prefixes[i % PREFIXES] + [rng.randrange(1, VOCAB) for _ in range(PROMPT - CACHED)]
        for i in range(n + 5)
    ]
    model = build_model(server_args(0))
    ex = executor(server_args(0), model, workers[:1], {})
    one_by_one(ex, prefixes, "warm")
    prefill_s = statistics.median(r.prefill_latency for r in one_by_one(ex, prompts[n:], "cal"))
    ex.decode.close()
    delays = {f"req-{i}": rng.uniform(0.5, 1.5) * prefill_s for i in range(n)}
    arrivals = list(itertools.accumulate(rng.expovariate(0.5 / prefill_s) for _ in range(n)))
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for r in range(repeats):
        for k, attempts in CONFIGS[r % 4 :] + CONFIGS[: r % 4]:
            ex = executor(server_args(attempts), model, workers[:k], delays)
            one_by_one(ex, prefixes, "warm")
            runs[(k, attempts)].append(drive(ex, prompts[:n], arrivals))
    rows = [
        {"config": f"{k} worker(s), attempts {a}", "workers": k, "attempts": a, **aggregate(rs)}
        for (k, a), rs in runs.items()
    ]
    for base, opt in zip(rows[0::2], rows[1::2], strict=True):
        if base["ttft_mean_ms"] and opt["ttft_mean_ms"]:
            opt["ttft_speedup_vs_0"] = base["ttft_mean_ms"] / opt["ttft_mean_ms"]
    info = {"prefill_ms": prefill_s * 1e3, "arrival_rate_per_s": 0.5 / prefill_s}
    return {"rows": rows, "requests": n, "repeats": repeats, **info}
