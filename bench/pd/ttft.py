"""Wall-clock TTFT over the real transport (``bench.pd``'s second and third tables): the executor
in this process, one then two decode worker processes, KV written into their memory by
Mooncake on loopback, every handshake (bootstrap route, REGISTER, META, STATUS) real.

- **optimistic**: long prompts, 80% of them a shared cached prefix (``bench.e2e.workload``),
  Poisson arrivals; each decode worker preallocates a request only after a delay drawn from
  ``[0.5, 1.5] x`` the measured prefill time (a busy decode instance: the delay is injected on
  the decode side, the same draws in every configuration); ``--optimistic-prefill-attempts`` 0
  against 2, with 1 and 2 workers.
- **multiturn**: a few clients, each round's prompt the whole history, the next round sent when
  the previous one's KV arrived; no injected delay; 1 and 2 workers.

TTFT is from the request's send time to the prefill side's transfer ``Success`` (the last
chunk's KV and metadata row written into decode memory). Each configuration runs ``repeats``
times, interleaved with the others (the machine is shared: a burst of load falls on different
configurations); a row gives the median of the runs' mean TTFT, their min..max, and p50 / p90
over every request. Every run ends with the end-to-end
audit (``bench.e2e.audit``: leaked slots and locks, sampled decode KV against a recompute, sends
of attempts never finalized) and the workers' own counters (pages held, late writes).
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any

from bench.e2e.audit import audit, latency_stats
from bench.e2e.driver import Driver
from bench.e2e.setup import model_args, shared_model
from bench.e2e.workload import cached_prompts, make_conversations, poisson_arrivals
from prefill.disagg.sim_config import PeerConfig
from prefill.request.state import Outcome
from prefill.testing.harness import make_executor
from prefill.testing.mooncake_decode import DecodeWorker, MooncakeDecode
from server_args import ServerArgs

logger = logging.getLogger(__name__)

PAGE, CHUNK = 16, 64


def server_args(attempts: int, device_tokens: int) -> ServerArgs:
    return ServerArgs(
        **model_args(), page_size=PAGE, max_total_tokens=device_tokens,
        chunked_prefill_size=CHUNK, disaggregation_mode="prefill",
        optimistic_prefill_attempts=attempts, disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=0, device="cpu", random_seed=0,
    )  # fmt: skip


def _executor(args: ServerArgs, model: Any, workers: list[DecodeWorker]) -> Any:
    return make_executor(args, peer_config=PeerConfig(), model=model, keep_received=True,
                         send_log_size=None, decode_workers=workers)  # fmt: skip


def _finish(run: Any, ex: Any, workers: list[DecodeWorker], label: str) -> dict[str, Any]:
    """Audit and numbers of one configuration; closes its prefill side."""
    decode: MooncakeDecode = ex.decode
    ttfts = [run.ttft[r.rid] for r in run.results if r.outcome == Outcome.SUCCESS]
    sessions = decode.backend.transport.stats()["sessions"]
    ok = sum(1 for r in run.results if r.outcome == Outcome.SUCCESS)
    out: dict[str, Any] = {"config": label, "requests": len(run.results), "succeeded": ok,
                           "ttfts_ms": [t * 1e3 for t in ttfts]}  # fmt: skip
    out["transfer"] = {
        "calls": sum(s["calls"] for s in sessions.values()),
        "items": sum(s["items"] for s in sessions.values()),
        "bytes": sum(s["bytes"] for s in sessions.values()),
    }
    out["transfer"]["items_per_request"] = out["transfer"]["items"] / max(ok, 1)
    out["integrity"] = audit(run)
    try:
        decode.close()
    finally:
        held = late = 0
        for w in workers:
            deadline = time.monotonic() + 30
            while True:
                s = w.call("stats")[0]
                if s["held"] == 0 and s["free_tokens"] == s["pool_tokens"]:
                    break
                if time.monotonic() > deadline:
                    held += s["pool_tokens"] - s["free_tokens"]
                    break
                time.sleep(0.05)
            late += s["late_writes"]
        out["integrity"]["decode_leaked_slots"] = held
        out["integrity"]["decode_late_writes"] = late
    out["stats"] = {k: getattr(ex.stats, k) for k in ("yields", "parks", "aborts",
                                                       "optimistic_admissions", "finalized",
                                                       "sends")}  # fmt: skip
    out["transfer"]["items_per_send"] = out["transfer"]["items"] / max(ex.stats.sends, 1)
    return out


def _warm(ex: Any, prefixes: list[list[int]]) -> None:
    for i, p in enumerate(prefixes):
        ex.submit(f"warm-{i}", p)
    ex.run_until_idle()
    ex.pop_results()
    for i in range(len(prefixes)):
        ex.decode.release(f"warm-{i}")


def prefill_time_s(model: Any, workers: list[DecodeWorker], prefixes: list[list[int]],
                   prompts: list[list[int]]) -> float:  # fmt: skip
    """Median prefill latency (submit to the end of the forward) of a cached-prefix request
    whose decode is ready at once, one at a time: sets the injected delays and arrivals."""
    ex = _executor(server_args(0, 8192), model, workers[:1])
    try:
        _warm(ex, prefixes)
        times = []
        for i, p in enumerate(prompts):
            ex.submit(f"cal-{i}", p)
            ex.run_until_idle()
            (res,) = ex.pop_results()
            times.append(res.prefill_latency)
            ex.decode.release(f"cal-{i}")
    finally:
        ex.decode.close()
    return sorted(times)[len(times) // 2]


def _drive_arrivals(ex: Any, prompts: list[list[int]], arrivals: list[float]) -> Any:
    """Send ``prompts[i]`` at ``arrivals[i]`` (seconds from now), at most 8 in flight."""
    queue = list(range(len(prompts)))
    t0 = ex.clock.now()
    return Driver(ex, max_parallel=8, kv_sample_every=4).drive(
        next_due=lambda: t0 + arrivals[queue[0]] if queue else None,
        pop_request=lambda: (f"req-{queue[0]}", prompts[queue.pop(0)]),
        on_result=lambda r: None, done=lambda: not queue,
    )  # fmt: skip


def _drive_rounds(ex: Any, convs: list[Any]) -> Any:
    """Every client's rounds, the next one sent once the previous one finished, at most 4
    requests in flight."""
    ready = list(range(len(convs)))  # clients whose next round may be sent
    sent: dict[str, tuple[int, list[int]]] = {}
    t0 = ex.clock.now()

    def pop() -> tuple[str, list[int]]:
        c = ready.pop(0)
        prompt = convs[c].next_prompt()
        rid = f"c{c}-r{convs[c].round}"
        sent[rid] = (c, prompt)
        return rid, prompt

    def on_result(res: Any) -> None:
        c, prompt = sent.pop(res.rid)
        convs[c].complete_round(prompt)
        if not convs[c].done:
            ready.append(c)

    return Driver(ex, max_parallel=4, kv_sample_every=4).drive(
        next_due=lambda: t0 if ready else None, pop_request=pop, on_result=on_result,
        done=lambda: all(c.done for c in convs) and not ready,
    )  # fmt: skip


def aggregate(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its repeats: the median of the runs' mean TTFT (with min..max),
    p50 / p90 over every request of every repeat, counters and integrity summed."""
    means = sorted(statistics.fmean(r["ttfts_ms"]) for r in runs if r["ttfts_ms"])
    pooled = latency_stats([t for r in runs for t in r["ttfts_ms"]])
    integrity: dict[str, int] = {}
    for r in runs:
        for k, v in r["integrity"].items():
            integrity[k] = integrity.get(k, 0) + int(v)
    return {
        "config": label, "repeats": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "succeeded": sum(r["succeeded"] for r in runs),
        "ttft_mean_ms": statistics.median(means) if means else None,
        "ttft_mean_min_ms": means[0] if means else None,
        "ttft_mean_max_ms": means[-1] if means else None,
        "ttft_p50_ms": pooled["p50"], "ttft_p90_ms": pooled["p90"],
        "transfer_items_per_request": statistics.fmean(r["transfer"]["items_per_request"]
                                                       for r in runs),
        "transfer_bytes_per_run": runs[0]["transfer"]["bytes"],
        "transfer_items_per_send": statistics.fmean(r["transfer"]["items_per_send"] for r in runs),
        "sent_bytes_per_send": runs[0]["transfer"]["bytes"] / max(runs[0]["stats"]["sends"], 1),
        "stats": runs[-1]["stats"], "integrity": integrity,
    }  # fmt: skip


def _interleaved(configs: list[Any], repeats: int, run_one: Any) -> list[list[dict[str, Any]]]:
    """``run_one(config)`` ``repeats`` times per configuration, the order rotated every round
    (a burst of load on the shared machine then falls on different configurations)."""
    out: list[list[dict[str, Any]]] = [[] for _ in configs]
    for r in range(repeats):
        order = list(range(len(configs)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            out[i].append(run_one(configs[i]))
    return out


def optimistic_rows(quick: bool, workers: list[DecodeWorker]) -> dict[str, Any]:
    """Attempts 0 and 2, with 1 and 2 workers (module docstring)."""
    n, repeats = (40, 3) if quick else (160, 5)
    vocab = model_args()["vocab_size"]
    prompts = cached_prompts(n + 5, 256, 0.8, 4, vocab, seed=1)
    prefixes = [p[: int(256 * 0.8)] for p in prompts[:4]]
    model = shared_model(server_args(0, 8192))
    prefill_s = prefill_time_s(model, workers, prefixes, prompts[n:])
    rng = random.Random(2)
    delays = [rng.uniform(0.5 * prefill_s, 1.5 * prefill_s) for _ in range(n)]
    arrivals = poisson_arrivals(n, 0.5 / prefill_s, seed=3)

    def run_one(cfg: tuple[int, int]) -> dict[str, Any]:
        k, attempts = cfg
        ex = _executor(server_args(attempts, 8192), model, workers[:k])
        decode: MooncakeDecode = ex.decode
        _warm(ex, prefixes)
        decode.delay_s = lambda rid: delays[int(rid[4:])] if rid.startswith("req-") else 0.0
        run = _drive_arrivals(ex, prompts[:n], arrivals)
        return _finish(run, ex, workers[:k], f"{k} worker(s), attempts {attempts}")

    configs = [(1, 0), (1, 2), (2, 0), (2, 2)]
    runs = _interleaved(configs, repeats, run_one)
    rows = [aggregate(f"{k} worker(s), attempts {a}", rs) | {"workers": k, "attempts": a}
            for (k, a), rs in zip(configs, runs, strict=True)]  # fmt: skip
    by = {(r["workers"], r["attempts"]): r for r in rows}
    for k in (1, 2):
        base, opt = by[(k, 0)]["ttft_mean_ms"], by[(k, 2)]["ttft_mean_ms"]
        by[(k, 2)]["ttft_speedup_vs_0"] = base / opt if base and opt else None
    return {"rows": rows, "prefill_ms": prefill_s * 1e3,
            "decode_delay_ms": [0.5 * prefill_s * 1e3, 1.5 * prefill_s * 1e3],
            "arrival_rate_per_s": 0.5 / prefill_s, "requests": n, "repeats": repeats}  # fmt: skip


def multiturn_rows(quick: bool, workers: list[DecodeWorker]) -> dict[str, Any]:
    """1 and 2 workers, no injected delay (module docstring)."""
    clients, rounds, repeats = (6, 3, 3) if quick else (16, 5, 5)
    vocab = model_args()["vocab_size"]
    model = shared_model(server_args(0, 16384))

    def run_one(k: int) -> dict[str, Any]:
        convs = make_conversations(clients, rounds, 192, 48, vocab, seed=4)
        ex = _executor(server_args(0, 16384), model, workers[:k])
        return _finish(_drive_rounds(ex, convs), ex, workers[:k], f"{k} worker(s)")

    runs = _interleaved([1, 2], repeats, run_one)
    rows = [aggregate(f"{k} worker(s)", rs) | {"workers": k}
            for k, rs in zip([1, 2], runs, strict=True)]  # fmt: skip
    return {"rows": rows, "clients": clients, "rounds": rounds, "repeats": repeats}
