"""Liveness and long-running hygiene of the optimistic prefill executor: no stall on a full
decode pool, no circular wait between parked requests and decode preallocation, bounded records
over many requests, rid reuse, and the decisions about SGLang's hooks (rejected count, the
force-not-ready hook without attempts, the metadata buffer cap).

Virtual clock, tiny model, CPU. Every story checks integrity after every step.
"""

from __future__ import annotations

import pytest

from hicache_prefill.prefill.disagg.protocol import KVPoll
from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.request.state import Outcome, Stage
from hicache_prefill.server_args import ServerArgs
from tests.prefill.executor_helpers import NOW, assert_drained, executor_args, prompt
from tests.support.harness import assert_decode_kv_matches, make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def args_(**kw) -> ServerArgs:
    """Chunks of 64 and no optimistic attempts unless a story sets them."""
    return executor_args(**{"chunked_prefill_size": 64, "optimistic_prefill_attempts": 0, **kw})


# ------------------------------------------------------------------------ stall on a full decode
@pytest.mark.parametrize("keep_received", [True, False], ids=["decode-keeps-a", "decode-frees-a"])
def test_two_requests_on_a_full_decode_pool_never_spin(keep_received):
    """2 requests of 40 tokens, attempts 0, decode pool of 64, bootstrap delay 0.1 s. The second
    peer's delay passes while the first request's 40 decode slots are taken, so it cannot
    preallocate. It used to report 0.1 s as its next event forever: ``run_until_idle`` slept and
    stepped in place until ``max_steps``. Now it waits (virtually) for something that can
    change: the first request's transfer frees decode memory (decode-frees-a: both succeed), or,
    while decode keeps it (decode-keeps-a), the second peer's bootstrap timeout at 300 s."""
    ex = make_executor(
        args_(),
        peer_config=PeerConfig(
            bootstrap_delay=DelayDistribution("fixed", 0.1), transfer_latency_s=0.001
        ),
        decode_pool_size=64,
        keep_received=keep_received,
    )
    ex.submit("a", prompt(40, seed=1))
    ex.submit("b", prompt(40, seed=2))
    ex.run_until_idle(max_steps=200, check=True)
    a, b = ex.result("a"), ex.result("b")
    assert a.outcome == Outcome.SUCCESS
    if keep_received:
        assert b.outcome == Outcome.ABORTED and "timed out after 300.0s" in b.error
        assert ex.clock.now() == pytest.approx(300.0)
        assert ex.stats.bootstrap_timeouts == 1 and ex.stats.bootstrap_failures == 1
        assert_decode_kv_matches(ex, "a")
    else:
        assert b.outcome == Outcome.SUCCESS and ex.clock.now() < 1.0
    assert_drained(ex)


def test_run_until_idle_raises_at_once_when_nothing_can_change():
    """A request whose peer can never preallocate (its prompt exceeds the decode pool) and never
    times out: nothing lies ahead, so ``run_until_idle`` reports the stall instead of stepping
    in place."""
    ex = make_executor(
        args_(),
        peer_config=PeerConfig(bootstrap_delay=NOW, bootstrap_timeout_s=float("inf")),
        decode_pool_size=8,
    )
    ex.submit("a", prompt(12))
    with pytest.raises(RuntimeError, match="stalled at t=0.000000.*bootstrap=\\['a'\\]"):
        ex.run_until_idle(max_steps=1_000_000)
    assert ex.stats.forward_passes == 0


# ------------------------------------------------------------------------ circular wait
def circular_wait_executor(attempts: int, **kw) -> OptimisticPrefillExecutor:
    """Prefill pool = decode pool = 128 tokens, page 4, prompts of 40 tokens (40 slots each)."""
    return make_executor(
        args_(max_total_tokens=128, chunked_prefill_size=256,
              optimistic_prefill_attempts=attempts, **kw),
        peer_config=PeerConfig(transfer_latency_s=0.001),
        decode_pool_size=128,
        keep_received=False,
    )  # fmt: skip


def run_circular_wait_story(ex: OptimisticPrefillExecutor) -> None:
    """Three requests whose peers are slow (ready at 0.5 s) arrive first; with optimism they
    compute and park holding 120 prefill slots. Three with ready peers then preallocate 120
    decode slots and wait for prefill memory; at 0.5 s the slow peers cannot preallocate."""
    slow = [ex.decode.create_peer(f"slow{i}", 40) for i in range(3)]
    for p in slow:
        p.ready_at = 0.5
    for i, p in enumerate(slow):
        ex.submit(p.rid, prompt(40, seed=10 + i), peer=p)
    ex.step()
    ex.check_integrity()
    for i in range(3):
        ex.submit(f"fast{i}", prompt(40, seed=20 + i))
    ex.run_until_idle(max_steps=10_000, check=True)


def test_circular_wait_without_optimism_finishes_at_half_a_second():
    ex = circular_wait_executor(attempts=0)
    run_circular_wait_story(ex)
    results = ex.pop_results()
    assert [r.outcome for r in results] == [Outcome.SUCCESS] * 6
    assert ex.clock.now() == pytest.approx(0.501, abs=2e-3)
    assert_drained(ex)


def test_circular_wait_with_optimism_ends_by_the_bootstrap_timeout():
    """With 2 attempts it used to never finish. The parked requests' peers time out at 300 s
    (SGLang's default), which frees their prefill slots; the fast ones then finish."""
    ex = circular_wait_executor(attempts=2)
    run_circular_wait_story(ex)
    results = {r.rid: r for r in ex.pop_results()}
    assert len(results) == 6
    for i in range(3):
        assert results[f"fast{i}"].outcome == Outcome.SUCCESS
        slow = results[f"slow{i}"]
        assert slow.outcome == Outcome.ABORTED and "timed out" in slow.error and slow.parked
    assert ex.stats.bootstrap_timeouts == 3
    assert_drained(ex)


def test_circular_wait_with_optimism_is_broken_by_yielding_a_parked_request():
    """SGLang's rule: when every running slot is held (``max_running_requests``) and requests
    wait, a parked request whose peer is still bootstrapping yields. With 3 running slots the
    parked requests yield to the fast ones and everything succeeds at about 0.5 s."""
    ex = circular_wait_executor(attempts=2, max_running_requests=3)
    run_circular_wait_story(ex)
    results = {r.rid: r for r in ex.pop_results()}
    assert [results[r].outcome for r in sorted(results)] == [Outcome.SUCCESS] * 6
    assert ex.stats.parked_yields >= 3 and ex.stats.bootstrap_timeouts == 0
    assert ex.clock.now() < 1.0
    assert_drained(ex)


# ------------------------------------------------------------------------ bounded records
def test_records_are_freed_after_the_outcome_and_a_rid_can_come_back():
    ex = make_executor(
        args_(optimistic_prefill_attempts=2),
        peer_config=PeerConfig(bootstrap_delay=DelayDistribution("uniform", 0.0, 0.01),
                               transfer_latency_s=0.001, bootstrap_failure_prob=0.2, seed=3),
        decode_pool_size=512, keep_received=False, send_log_size=16,
    )  # fmt: skip
    for rnd in range(5):
        for i in range(40):
            ex.submit(f"r{i}", prompt(24, seed=100 * rnd + i))  # the same rids every round
        with pytest.raises(ValueError, match="already in flight"):
            ex.submit("r0", prompt(8))
        ex.run_until_idle(max_steps=100_000, check=True)
        with pytest.raises(ValueError, match="not popped yet"):
            ex.submit("r0", prompt(8))
        assert ex.result("r0") is not None
        results = ex.pop_results()
        assert sorted(r.rid for r in results) == sorted(f"r{i}" for i in range(40))
        assert ex.result("r0") is None and ex.results == {}
        # Nothing per finished request is kept: requests, peers, live peers, their sends.
        assert ex.requests == {} and ex.decode.peers == {} and ex.decode._live == {}
        assert len(ex.decode.send_log) <= 16 and ex.decode.next_event_time() is None
    s = ex.stats
    assert s.submitted == 200 and s.successes + s.aborts == 200 and s.bootstrap_failures > 0
    assert s.ttft_count == s.successes and len(s.ttft_samples) == s.successes
    assert s.to_dict()["ttft_mean"] == pytest.approx(s.ttft_sum / s.ttft_count)
    assert_drained(ex)


def test_ttft_reservoir_is_bounded_and_aggregates_stay_exact():
    from hicache_prefill.prefill.executor_stats import TTFT_RESERVOIR_SIZE, ExecutorStats

    s = ExecutorStats()
    values = [i * 1e-3 for i in range(3 * TTFT_RESERVOIR_SIZE)]
    for v in values:
        s.record_ttft(v)
    assert len(s.ttft_samples) == TTFT_RESERVOIR_SIZE
    assert s.ttft_count == len(values) and s.ttft_min == 0.0 and s.ttft_max == values[-1]
    assert s.to_dict()["ttft_mean"] == pytest.approx(sum(values) / len(values))
    # A uniform sample: its median is near the true median (within 5% of the range).
    assert abs(s.to_dict()["ttft_p50"] - values[len(values) // 2]) < 0.05 * values[-1]


# ------------------------------------------------------------------------ SGLang hook decisions
def test_prompt_over_the_pool_is_rejected_and_counted():
    ex = make_executor(args_(), peer_config=PeerConfig(bootstrap_delay=NOW))
    with pytest.raises(ValueError, match="the device pool holds 256"):
        ex.submit("big", prompt(300))
    with pytest.raises(ValueError, match="token_ids must not be empty"):
        ex.submit("empty", [])
    assert ex.stats.rejected == 1 and ex.stats.submitted == 0 and not ex.requests
    assert "big" not in ex.decode.peers


def test_force_not_ready_hook_applies_without_optimistic_attempts():
    """SGLang's ``should_force_retry`` ignores ``optimistic_prefill_attempts``: a forced request
    runs its first pass as if its ready peer were not, yields at its end, then runs finalized."""
    ex = make_executor(
        args_(optimistic_prefill_attempts=0),
        peer_config=PeerConfig(bootstrap_delay=NOW, force_not_ready_prob=1.0,
                               transfer_latency_s=0.001),
    )  # fmt: skip
    ex.submit("a", prompt(20))
    ex.step()
    ex.check_integrity()
    a = ex.requests["a"]
    assert a.attempt_log[0] == (1, True) and ex.stats.forced_not_ready == 1
    assert ex.stats.yields == 1 and ex.stats.fallbacks == 1 and a.stage == Stage.BOOTSTRAP
    ex.run_until_idle(max_steps=100, check=True)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.passes == 2 and r.attempts == 1
    assert r.cached_device_tokens == 16  # the forced pass's pages were published (device only)
    assert_decode_kv_matches(ex, "a")
    assert_drained(ex)


def test_metadata_buffers_cap_optimistic_admissions():
    """SGLang's prefill side has ``2 * max_running_requests`` metadata buffers; every admission
    takes one until its outcome, so at most that many requests are admitted at once."""
    ex = make_executor(
        args_(optimistic_prefill_attempts=2, max_running_requests=2, chunked_prefill_size=8),
        peer_config=PeerConfig(bootstrap_delay=DelayDistribution("fixed", 1e9),
                               transfer_latency_s=0.001),
    )  # fmt: skip
    assert ex.metadata.size == 4
    for i in range(7):
        ex.submit(f"r{i}", prompt(12, seed=i))
    ex.step()
    ex.check_integrity()
    admitted = [r for r in ex.requests.values() if r.stage != Stage.BOOTSTRAP]
    assert len(admitted) == 4 and ex.metadata.available_size() == 0
    assert ex.stats.metadata_buffer_waits == 3
    assert [r.rid for r in ex.bootstrap_queue] == ["r4", "r5", "r6"]
    for p in [r.peer for r in ex.requests.values()]:
        p.set_ready()
    ex.run_until_idle(max_steps=1000, check=True)
    assert [r.outcome for r in ex.pop_results()] == [Outcome.SUCCESS] * 7
    assert_drained(ex)


def test_max_running_requests_bounds_requests_holding_kv():
    ex = make_executor(
        args_(optimistic_prefill_attempts=1, max_running_requests=2),
        peer_config=PeerConfig(bootstrap_delay=DelayDistribution("fixed", 1e9)),
    )
    for i in range(4):
        ex.submit(f"r{i}", prompt(8, seed=i))
    for _ in range(3):
        ex.step()
        ex.check_integrity()
        holding = [r for r in ex.requests.values() if r.slots is not None]
        assert len(holding) <= 2
    assert len(ex.inflight_queue) == 2 and all(r.parked for r in ex.inflight_queue)
    # Both running slots are held by parked requests and two wait: one parked request yields
    # (its attempt is used up, so it goes back to the bootstrap queue) and a waiter runs.
    assert ex.stats.parked_yields >= 1
    for r in list(ex.requests.values()):
        if r.peer.poll() == KVPoll.Bootstrapping:
            r.peer.set_ready()
    ex.run_until_idle(max_steps=1000, check=True)
    assert [r.outcome for r in ex.pop_results()] == [Outcome.SUCCESS] * 4
    assert_drained(ex)
