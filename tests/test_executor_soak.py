"""Soak and property tests of the optimistic prefill executor.

Soak: hundreds of requests sharing prefixes (so the radix tree hits), random arrival times,
bootstrap delays, bootstrap/transfer failures, forced not-ready first attempts and peers failed
from outside at random moments (queued, mid-chunk, parked, transferring), on a device pool small
enough to force eviction (and, with the L2 cache under write_back, backups and load-backs).
``check_integrity`` runs after every step. At the end: no leaked slots or locks, every
successful request's decode-side KV equals a full recompute, nothing was ever sent for an
attempt that was not finalized, and optimistic attempts never exceed the budget.

Property: a random sequence of submit / step / ready / fail / advance-time operations keeps the
invariants after every operation and drains to a clean state (hypothesis).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill.bootstrap import DelayDistribution, KVPoll, PeerConfig
from prefill.executor import OptimisticPrefillExecutor
from prefill.harness import (
    assert_decode_kv_matches,
    build_cache,
    make_executor,
    single_torch_thread,
)
from prefill.model import ModelConfig, PagedTransformer
from prefill.request import Outcome, Stage
from server_args import ServerArgs

ATTEMPTS = 2


@pytest.fixture(autouse=True)
def _one_torch_thread():
    with single_torch_thread():
        yield


def soak_args(hierarchical: bool, max_total_tokens: int = 256) -> ServerArgs:
    return ServerArgs(
        page_size=4,
        max_total_tokens=max_total_tokens,
        chunked_prefill_size=32,
        device="cpu",
        dtype="float32",
        disaggregation_mode="prefill",
        optimistic_prefill_attempts=ATTEMPTS,
        enable_hierarchical_cache=hierarchical,
        hicache_write_policy="write_back",
        hicache_ratio=2.0,
        load_back_threshold=8,
        random_seed=0,
    )


def workload(n: int, seed: int) -> list[tuple[float, str, list[int]]]:
    """``(arrival, rid, tokens)``: 8 shared system prompts, multi-turn-style extensions."""
    rng = random.Random(seed)
    systems = [[rng.randrange(512) for _ in range(rng.choice([8, 16, 24, 40]))] for _ in range(8)]
    history: list[list[int]] = []
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1 / 0.004)
        if history and rng.random() < 0.35:
            base = rng.choice(history)  # a follow-up turn: the whole earlier prompt is a prefix
        else:
            base = rng.choice(systems)
        tokens = (base + [rng.randrange(512) for _ in range(rng.randint(1, 40))])[:120]
        history.append(tokens)
        out.append((t, f"req-{i}", tokens))
    return out


def check_final(ex: OptimisticPrefillExecutor, verified: set[str]) -> None:
    ex.drain_cache_events()
    ex.check_integrity()
    assert ex.is_idle() and ex.request_owned_slots() == 0
    assert all(node.lock_ref == 0 for node in ex.tree.all_nodes()), "a lock leaked"
    tree_tokens = ex.tree.evictable_size() + ex.tree.protected_size()
    assert ex.allocator.available_size() + tree_tokens == ex.allocator.size
    assert len(ex.results) == len(ex.requests)
    for rid, req in ex.requests.items():
        r = ex.results[rid]
        assert req.stage == Stage.DONE
        assert r.attempts <= ATTEMPTS and r.attempts == req.optimistic_attempts
        if r.outcome == Outcome.SUCCESS:
            assert rid in verified
    # Nothing sent for an attempt that was not finalized; aborted-before-finalize sent nothing.
    for s in ex.decode.send_log:
        peer = ex.requests[s.rid].peer
        assert peer.finalized_attempt == s.attempt, (s, peer.finalized_attempt)
        assert s.attempt == ex.requests[s.rid].attempt  # only the last attempt ever sends
    for rid, req in ex.requests.items():
        if req.peer.finalized_attempt is None:
            assert not [s for s in ex.decode.send_log if s.rid == rid]
    assert ex.stats.optimistic_admissions == sum(r.attempts for r in ex.results.values())


def verify_new_successes(ex: OptimisticPrefillExecutor, verified: set[str]) -> None:
    for rid, r in ex.results.items():
        if r.outcome == Outcome.SUCCESS and rid not in verified:
            assert_decode_kv_matches(ex, rid)
            ex.decode.release(rid)
            verified.add(rid)


@pytest.mark.parametrize("hierarchical", [False, True], ids=["device-only", "L2-write-back"])
def test_soak(hierarchical):
    args = soak_args(hierarchical)
    peer_cfg = PeerConfig(
        bootstrap_delay=DelayDistribution("uniform", 0.0, 0.03),
        bootstrap_failure_prob=0.08,
        transfer_failure_prob=0.04,
        force_not_ready_prob=0.15,
        transfer_latency_s=0.002,
        transfer_bandwidth=2e7,
        seed=11,
    )
    rng = random.Random(5)
    delay_rng = random.Random(6)  # side-stream copies sleep 0-1 ms: backups and loads race
    delay = (lambda: delay_rng.random() * 1e-3) if hierarchical else 0.0
    ex = make_executor(
        args,
        peer_config=peer_cfg,
        cost_model=lambda n, p: 2e-5 * n + 2e-4,
        decode_pool_size=4096,
        cache=build_cache(args, copy_delay=delay),
    )
    arrivals = workload(300, seed=7)
    verified: set[str] = set()
    i = 0
    for _ in range(100_000):
        now = ex.clock.now()
        while i < len(arrivals) and arrivals[i][0] <= now:
            ex.submit(arrivals[i][1], arrivals[i][2])
            i += 1
        if rng.random() < 0.03:  # a decode peer dies at a random moment
            live = [r for r in ex.requests.values() if r.stage not in (Stage.DONE,)]
            if live:
                rng.choice(live).peer.fail("decode instance died (soak)")
        progressed = ex.step()
        ex.check_integrity()
        verify_new_successes(ex, verified)
        if i == len(arrivals) and ex.is_idle():
            break
        if not progressed:
            nxt = [
                t
                for t in (
                    ex.decode.next_event_time(),
                    arrivals[i][0] if i < len(arrivals) else None,
                )
                if t is not None
            ]
            ex.clock.wait_until(min(nxt) if nxt else now + 1e-3)
    check_final(ex, verified)
    s = ex.stats
    outcomes = [r.outcome for r in ex.results.values()]
    assert outcomes.count(Outcome.SUCCESS) > 100
    assert s.optimistic_admissions > 30 and s.parks > 0 and s.yields > 0 and s.retries > 0
    assert s.bootstrap_failures > 0 and s.transfer_failures > 0 and s.forced_not_ready > 0
    assert s.cached_device_tokens > 0
    if hierarchical:
        assert s.cached_host_tokens > 0, "no load-back happened; the pool is not small enough"


def test_soak_wall_clock_smoke():
    """The same machinery on real time (what benchmarks use), briefly."""
    from prefill.clock import WallClock

    args = soak_args(True)
    ex = make_executor(
        args,
        clock=WallClock(),
        decode_pool_size=2048,
        peer_config=PeerConfig(bootstrap_delay=DelayDistribution("uniform", 0, 0.005), seed=1),
    )
    for _t, rid, toks in workload(20, seed=3):
        ex.submit(rid, toks)
    ex.run_until_idle(check=True)
    verified: set[str] = set()
    verify_new_successes(ex, verified)
    check_final(ex, verified)
    assert len(verified) == 20


# ------------------------------------------------------------------------------------- property
_MODEL = PagedTransformer(ModelConfig.from_server_args(soak_args(False)))

ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 5), st.integers(1, 50)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("ready"), st.integers(0, 30)),
        st.tuples(st.just("fail"), st.integers(0, 30)),
        st.tuples(st.just("advance"), st.sampled_from([0.0005, 0.002, 0.01])),
    ),
    max_size=40,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=ops, hierarchical=st.booleans(), attempts=st.integers(0, 2))
def test_random_operation_sequences_keep_invariants(ops, hierarchical, attempts):
    args = soak_args(hierarchical, max_total_tokens=128)
    args.optimistic_prefill_attempts = attempts
    ex = make_executor(
        args,
        model=_MODEL,
        cost_model=lambda n, p: 1e-4,
        peer_config=PeerConfig(
            bootstrap_delay=DelayDistribution("fixed", 1e9),
            transfer_latency_s=0.002,
            decode_prefix_len=4,
        ),
    )
    prefixes = [[(7 * k + j) % 512 for j in range(24)] for k in range(6)]
    verified: set[str] = set()
    n = 0
    for op in ops:
        rids = list(ex.requests)
        if op[0] == "submit":
            ex.submit(f"r{n}", (prefixes[op[1]] + [(n * 13 + j) % 512 for j in range(op[2])]))
            n += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                ex.step()
                ex.check_integrity()
        elif op[0] in ("ready", "fail") and rids:
            peer = ex.requests[rids[op[1] % len(rids)]].peer
            peer.set_ready() if op[0] == "ready" else peer.fail()
        elif op[0] == "advance":
            ex.clock.advance(op[1])
        ex.check_integrity()
        verify_new_successes(ex, verified)
    for req in ex.requests.values():  # let every surviving peer finish its bootstrap
        if req.peer.poll() == KVPoll.Bootstrapping:
            req.peer.set_ready()
    ex.run_until_idle(max_steps=20_000, check=True)
    verify_new_successes(ex, verified)
    check_final(ex, verified)
