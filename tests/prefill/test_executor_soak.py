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

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hicache_prefill.prefill.disagg.protocol import KVPoll
from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.model.paged import ModelConfig, PagedTransformer
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs
from tests.prefill.executor_helpers import WRITE_THROUGH, assert_drained, executor_args
from tests.support.harness import assert_decode_kv_matches, make_executor
from tests.support.soak import SoakConfig, SoakReport, run_soak, soak_executor, workload

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATTEMPTS = 2


def soak_args(hierarchical: bool, max_total_tokens: int = 256, **kw) -> ServerArgs:
    """Chunks of 32, L2 (``hierarchical``) under write_back at twice the device pool."""
    base = dict(
        max_total_tokens=max_total_tokens, chunked_prefill_size=32,
        optimistic_prefill_attempts=ATTEMPTS, enable_hierarchical_cache=hierarchical,
        hicache_write_policy="write_back", hicache_ratio=2.0, load_back_threshold=8,
        random_seed=0,
    )  # fmt: skip
    return executor_args(**{**base, **kw})


def check_final(ex: OptimisticPrefillExecutor, rep: SoakReport | None = None) -> None:
    """Drained (``assert_drained``), every device slot free or in the tree, and (with a report)
    every result passed the soak's protocol and KV checks."""
    assert_drained(ex)
    tree_tokens = ex.tree.evictable_size() + ex.tree.protected_size()
    assert ex.allocator.available_size() + tree_tokens == ex.allocator.size
    if rep is not None:
        assert rep.protocol_errors == []
        assert rep.kv_mismatches == 0 and rep.verified > 0
        assert rep.successes + rep.aborted == rep.submitted == ex.stats.submitted
        assert rep.max_attempts_used <= ATTEMPTS


@pytest.mark.parametrize("hierarchical", [False, True], ids=["device-only", "L2-write-back"])
def test_soak(hierarchical):
    args = soak_args(hierarchical)
    ex = soak_executor(args, seed=11, copy_delay_seed=6 if hierarchical else None)
    rep = run_soak(ex, SoakConfig(requests=300, seed=7))
    check_final(ex, rep)
    s = ex.stats
    assert rep.successes > 100 and rep.killed > 0
    assert s.optimistic_admissions > 30 and s.parks > 0 and s.yields > 0 and s.retries > 0
    assert s.bootstrap_failures > 0 and s.transfer_failures > 0 and s.forced_not_ready > 0
    assert s.cached_device_tokens > 0
    assert s.unpublished_dropped_tokens == 0  # write_back / device-only publish at yield
    if hierarchical:
        assert s.cached_host_tokens > 0, "no load-back happened; the pool is not small enough"


def test_soak_wall_clock_smoke():
    """The same machinery on real time (what benchmarks use), briefly."""
    from hicache_prefill.prefill.clock import WallClock

    args = soak_args(True)
    ex = make_executor(
        args,
        clock=WallClock(),
        decode_pool_size=2048,
        peer_config=PeerConfig(bootstrap_delay=DelayDistribution("uniform", 0, 0.005), seed=1),
    )
    for _t, rid, toks in workload(SoakConfig(requests=20, seed=3)):
        ex.submit(rid, toks)
    ex.run_until_idle(check=True)
    results = ex.pop_results()
    assert len(results) == 20 and all(r.outcome == Outcome.SUCCESS for r in results)
    for r in results:
        assert_decode_kv_matches(ex, r.rid)
        ex.decode.release(r.rid)
    check_final(ex)


# ------------------------------------------------------------------------------------- property
_MODEL = PagedTransformer(ModelConfig.from_server_args(soak_args(False)))

_submit = st.tuples(st.just("submit"), st.integers(0, 7), st.integers(0, 5), st.integers(1, 50))
_step = st.tuples(st.just("step"), st.integers(1, 3))
ops = st.lists(
    st.one_of(
        _submit,
        _step,
        _submit,  # listed twice: traffic and steps make up most of a sequence
        _step,
        st.tuples(st.just("ready"), st.integers(0, 30)),
        st.tuples(st.just("fail"), st.integers(0, 30)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("advance"), st.sampled_from([0.0005, 0.002, 0.01, 400.0])),
    ),
    min_size=8,
    max_size=40,
)

POLICIES = {
    "device-only": dict(enable_hierarchical_cache=False),
    "write_back": dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
    "write_through": WRITE_THROUGH,
}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=ops,
    policy=st.sampled_from(sorted(POLICIES)),
    attempts=st.integers(0, 2),
    max_running=st.sampled_from([None, 1, 2]),
    forced=st.sampled_from([0.0, 0.5]),
)
def test_random_operation_sequences_keep_invariants(ops, policy, attempts, max_running, forced):
    """Random submit / step / ready / fail / pop / advance sequences (rids reused once their
    result is popped; long advances time bootstraps out) keep every invariant after every
    operation, under each publishing mode, and drain to a clean state."""
    args = soak_args(
        False, max_total_tokens=128, optimistic_prefill_attempts=attempts,
        max_running_requests=max_running, **POLICIES[policy],
    )  # fmt: skip
    ex = make_executor(
        args,
        model=_MODEL,
        cost_model=lambda n, p: 1e-4,
        decode_pool_size=96,  # small: preallocation sometimes waits for decode memory
        peer_config=PeerConfig(
            bootstrap_delay=DelayDistribution("fixed", 1e9),
            transfer_latency_s=0.002,
            decode_prefix_len=4,
            force_not_ready_prob=forced,
        ),
    )
    assert ex.unpublished_pending == (policy == "write_through")
    prefixes = [[(7 * k + j) % 512 for j in range(24)] for k in range(6)]
    n = 0

    def pop() -> None:
        for r in ex.pop_results():
            if r.outcome == Outcome.SUCCESS:
                assert_decode_kv_matches(ex, r.rid)
                ex.decode.release(r.rid)

    for op in ops:
        rids = list(ex.requests)
        if op[0] == "submit":
            rid = f"r{op[1]}"
            if rid not in ex.requests and rid not in ex.results:
                ex.submit(rid, prefixes[op[2]] + [(n * 13 + j) % 512 for j in range(op[3])])
                n += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                ex.step()
                ex.check_integrity()
        elif op[0] in ("ready", "fail") and rids:
            peer = ex.requests[rids[op[1] % len(rids)]].peer
            peer.set_ready() if op[0] == "ready" else peer.fail()
        elif op[0] == "pop":
            pop()
        elif op[0] == "advance":
            ex.clock.advance(op[1])
        ex.check_integrity()
    for req in ex.requests.values():  # let every surviving peer finish its bootstrap
        if req.peer.poll() == KVPoll.Bootstrapping:
            req.peer.set_ready()
    ex.run_until_idle(max_steps=20_000, check=True)
    pop()
    check_final(ex)
    ex.cache.close()
    s = ex.stats  # which paths this example reached (--hypothesis-show-statistics)
    for name in ("yields", "parked_yields", "bootstrap_timeouts", "unpublished_dropped_tokens",
                 "forced_not_ready", "metadata_buffer_waits", "transfer_failures"):  # fmt: skip
        if getattr(s, name):
            event(name)
