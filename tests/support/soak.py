"""A soak driver of the optimistic prefill executor on a virtual clock, shared by the soak tests
and ``bench/soak.py``: a seeded stream of requests sharing prefixes (multi-turn-style
follow-ups, so the radix tree hits), decode peers killed at random moments, results popped as
they come, sampled decode-side KV compared with a full recompute, and per-result protocol checks
(nothing sent for an attempt that was not finalized, attempts within the budget).

``soak_executor(args, seed)`` builds the executor a soak runs (its decode peers' failures and
delays, the virtual cost of a forward). ``run_soak(ex, cfg)`` drives ``ex`` until every request
has its outcome and returns a ``SoakReport``. It holds nothing per finished request, so it runs
any number of requests in bounded memory; ``on_progress`` is called every ``progress_every``
results (the benchmark samples RSS and step cost there).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.request.state import Outcome, RequestResult
from tests.support.harness import (
    build_cache,
    decode_kv_and_reference,
    kv_max_rel_error,
    make_executor,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakConfig:
    """What a soak submits and checks.

    ``requests``: how many; ``arrival_mean_s``: mean exponential gap between arrivals (virtual
    seconds); ``kill_prob``: per step, the chance that a random request in flight has its peer
    failed from outside; ``verify_every``: compare the decode-side KV of every n-th success with
    a full recompute (0: never); ``check_every_step``: ``check_integrity`` after every step;
    ``vocab``, ``max_prompt``: prompt token range and length cap; ``max_steps``: safety stop.
    """

    requests: int
    seed: int = 0
    arrival_mean_s: float = 0.004
    kill_prob: float = 0.03
    verify_every: int = 1
    check_every_step: bool = True
    vocab: int = 512
    max_prompt: int = 120
    kv_tolerance: float = 1e-4
    max_steps: int = 10_000_000


@dataclass
class SoakReport:
    """What a soak saw. Problems are counted, not raised, so a benchmark reports them; the tests
    assert they are 0."""

    submitted: int = 0
    successes: int = 0
    aborted: int = 0
    timed_out: int = 0
    verified: int = 0
    kv_mismatches: int = 0
    kv_max_rel_err: float = 0.0
    protocol_errors: list[str] = field(default_factory=list)
    max_attempts_used: int = 0
    steps: int = 0
    killed: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0


def soak_executor(
    args: Any,
    seed: int,
    *,
    bootstrap_failure_prob: float = 0.08,
    transfer_failure_prob: float = 0.04,
    force_not_ready_prob: float = 0.15,
    decode_pool_size: int = 4096,
    copy_delay_seed: int | None = None,
) -> OptimisticPrefillExecutor:
    """An executor over ``args`` (``tests.support.harness.make_executor``, virtual clock) for
    :func:`run_soak`. Decode peers (seeded by ``seed``) get ready after 0-30 ms (uniform), fail
    their bootstrap or a transfer with the given probabilities, report a first attempt not ready
    with ``force_not_ready_prob``, and ack a send after 2 ms plus its bytes at 20 MB/s; the
    decode side holds ``decode_pool_size`` tokens. A forward costs 20 us a token plus 200 us of
    virtual time. With ``copy_delay_seed``, every side-stream copy of the cache sleeps 0-1 ms
    first (seeded; CPU), so backups and loads race with the scheduler."""
    peers = PeerConfig(
        bootstrap_delay=DelayDistribution("uniform", 0.0, 0.03),
        bootstrap_failure_prob=bootstrap_failure_prob,
        transfer_failure_prob=transfer_failure_prob,
        force_not_ready_prob=force_not_ready_prob,
        transfer_latency_s=0.002,
        transfer_bandwidth=2e7,
        seed=seed,
    )
    delay: float | Callable[[], float] = 0.0
    if copy_delay_seed is not None:
        delay_rng = random.Random(copy_delay_seed)
        delay = lambda: delay_rng.random() * 1e-3  # noqa: E731
    return make_executor(
        args,
        peer_config=peers,
        cost_model=lambda n, p: 2e-5 * n + 2e-4,
        decode_pool_size=decode_pool_size,
        cache=build_cache(args, copy_delay=delay),
    )


def workload(cfg: SoakConfig) -> Iterator[tuple[float, str, list[int]]]:
    """``(arrival, rid, tokens)``: 8 shared system prompts and multi-turn-style extensions of
    recent prompts (the last 64 are remembered, so memory stays bounded)."""
    rng = random.Random(cfg.seed)
    systems = [
        [rng.randrange(cfg.vocab) for _ in range(rng.choice([8, 16, 24, 40]))] for _ in range(8)
    ]
    recent: list[list[int]] = []
    t = 0.0
    for i in range(cfg.requests):
        t += rng.expovariate(1 / cfg.arrival_mean_s)
        if recent and rng.random() < 0.35:
            base = rng.choice(recent)  # a follow-up turn: the whole earlier prompt is a prefix
        else:
            base = rng.choice(systems)
        tokens = base + [rng.randrange(cfg.vocab) for _ in range(rng.randint(1, 40))]
        tokens = tokens[: cfg.max_prompt]
        recent.append(tokens)
        if len(recent) > 64:
            recent.pop(0)
        yield t, f"req-{i}", tokens


def run_soak(
    ex: OptimisticPrefillExecutor,
    cfg: SoakConfig,
    on_progress: Callable[[SoakReport], None] | None = None,
    progress_every: int = 1000,
) -> SoakReport:
    """Drive ``ex`` (virtual clock, decode side keeping received KV) through ``cfg``'s
    workload until idle. Raises ``RuntimeError`` if it cannot finish within ``max_steps``."""
    rep = SoakReport()
    rng = random.Random(cfg.seed + 1)
    arrivals = workload(cfg)
    nxt = next(arrivals, None)
    attempts_cap = max(ex.max_attempts, 1 if ex.decode.force_not_ready_prob > 0 else 0)
    start = time.perf_counter()
    next_progress = progress_every
    due_now = 0
    for _ in range(cfg.max_steps):
        now = ex.clock.now()
        while nxt is not None and nxt[0] <= now:
            ex.submit(nxt[1], nxt[2])
            rep.submitted += 1
            nxt = next(arrivals, None)
        if ex.requests and rng.random() < cfg.kill_prob:
            victim = rng.choice(list(ex.requests.values()))
            victim.peer.fail("decode instance died (soak)")
            rep.killed += 1
        progressed = ex.step()
        rep.steps += 1
        if cfg.check_every_step:
            ex.check_integrity()
        for result in ex.pop_results():
            _account(ex, cfg, rep, result, attempts_cap)
        done = rep.successes + rep.aborted
        if on_progress is not None and done >= next_progress:
            rep.virtual_s, rep.wall_s = ex.clock.now(), time.perf_counter() - start
            on_progress(rep)
            next_progress += progress_every
        if nxt is None and ex.is_idle():
            break
        if progressed:
            due_now = 0
        else:
            due_now = ex.wait_for_next_event(due_now, also=nxt[0] if nxt is not None else None)
    else:
        raise RuntimeError(f"soak not finished after {cfg.max_steps} steps: {ex.describe()}")
    rep.virtual_s, rep.wall_s = ex.clock.now(), time.perf_counter() - start
    return rep


def _account(
    ex: OptimisticPrefillExecutor,
    cfg: SoakConfig,
    rep: SoakReport,
    r: RequestResult,
    attempts_cap: int,
) -> None:
    """Protocol checks of one result, then the sampled KV check; frees the decode-side KV."""
    peer = ex.decode.peers.get(r.rid) if r.outcome == Outcome.SUCCESS else None
    rep.max_attempts_used = max(rep.max_attempts_used, r.attempts)
    if r.attempts > attempts_cap:
        rep.protocol_errors.append(f"{r.rid}: {r.attempts} attempts > {attempts_cap}")
    if r.outcome != Outcome.SUCCESS:
        rep.aborted += 1
        rep.timed_out += int(r.error is not None and "timed out" in r.error)
        return
    rep.successes += 1
    if peer is None:
        rep.protocol_errors.append(f"{r.rid}: success without a kept decode peer")
        return
    sent = {t.attempt for t in peer.transfers}
    if peer.finalized_attempt != r.passes or sent != {r.passes}:
        rep.protocol_errors.append(
            f"{r.rid}: sends of attempts {sorted(sent)}, finalized {peer.finalized_attempt}, "
            f"last attempt {r.passes}"
        )
    if cfg.verify_every and rep.successes % cfg.verify_every == 0:
        err = kv_max_rel_error(decode_kv_and_reference(ex, r.rid))
        rep.verified += 1
        rep.kv_max_rel_err = max(rep.kv_max_rel_err, err)
        rep.kv_mismatches += int(err > cfg.kv_tolerance)
    ex.decode.release(r.rid)
