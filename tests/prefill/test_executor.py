"""Optimistic prefill executor: one short story per path of docs/DESIGN.md section 7.

Every story runs the real tiny model on a virtual clock, steps the executor by hand, and calls
``check_integrity`` after every step (no leaked slots or locks, queues consistent). Peers never
finish their bootstrap on their own (delay 1e9 s) unless a story says so; the story drives them
with ``set_ready`` / ``fail``. Sends take 1 s of virtual time to ack.
"""

from __future__ import annotations

import logging

import pytest

from hicache_prefill.prefill.disagg.protocol import KVPoll
from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.request.state import Outcome, Stage
from tests.prefill.executor_helpers import BASE_ARGS, NEVER, executor_args, finish, prompt, step
from tests.support.harness import assert_decode_kv_matches, make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PS = BASE_ARGS["page_size"]  # 4
CHUNK = BASE_ARGS["chunked_prefill_size"]  # 16


def make(
    delay=NEVER, latency: float = 1.0, streams: str | None = None, **kw
) -> OptimisticPrefillExecutor:
    peer = PeerConfig(
        bootstrap_delay=delay,
        transfer_latency_s=latency,
        force_not_ready_prob=kw.pop("force_not_ready_prob", 0.0),
        transfer_failure_prob=kw.pop("transfer_failure_prob", 0.0),
        decode_prefix_len=kw.pop("decode_prefix_len", 0),
    )
    return make_executor(executor_args(**kw), peer_config=peer, streams=streams)


def sends_of(ex: OptimisticPrefillExecutor, rid: str) -> list[tuple[int, int, int, bool]]:
    return [(s.attempt, s.start, s.end, s.last) for s in ex.decode.send_log if s.rid == rid]


# ---------------------------------------------------------------------------------- success paths
def test_ready_before_admission_is_not_optimistic():
    ex = make(delay=DelayDistribution("fixed", 0.0))
    ex.submit("a", prompt(40))
    step(ex)
    a = ex.requests["a"]
    assert a.stage == Stage.RUNNING and not a.pending_bootstrap
    assert a.attempt_log == [(1, False)]
    assert sends_of(ex, "a") == []  # the first chunk is sent at its boundary (next step)
    step(ex)
    assert sends_of(ex, "a") == [(1, 0, 16, False)]
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.attempts == 0 and r.passes == 1
    assert sends_of(ex, "a") == [(1, 0, 16, False), (1, 16, 32, False), (1, 32, 40, True)]
    assert ex.stats.optimistic_admissions == 0 and r.ttft == pytest.approx(1.0)
    assert_decode_kv_matches(ex, "a")


def test_ready_mid_prefill_finalizes_at_the_boundary_and_sends_what_was_computed():
    ex = make()
    ex.submit("a", prompt(40))
    step(ex)
    a = ex.requests["a"]
    assert a.pending_bootstrap and a.computed_len == 16 and ex.stats.optimistic_admissions == 1
    step(ex)  # still bootstrapping, nobody ready waiting: keep computing, send nothing
    assert a.computed_len == 32 and sends_of(ex, "a") == []
    a.peer.set_ready()
    step(ex)  # boundary: finalize, send [0, 32), compute the last 8 and send them
    assert not a.pending_bootstrap
    assert sends_of(ex, "a") == [(1, 0, 32, False), (1, 32, 40, True)]
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.attempts == 1 and r.yields == 0 and not r.parked
    assert_decode_kv_matches(ex, "a")


def test_park_then_send():
    ex = make()
    ex.submit("a", prompt(10))
    step(ex)
    a = ex.requests["a"]
    assert a.stage == Stage.INFLIGHT and a.parked and ex.stats.parks == 1
    step(ex, 3)
    assert sends_of(ex, "a") == [] and a.peer.finalized_attempt is None  # no metadata either
    a.peer.set_ready()
    step(ex)
    assert sends_of(ex, "a") == [(1, 0, 10, True)] and a.peer.poll() == KVPoll.Transferring
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.parked and r.attempts == 1
    assert_decode_kv_matches(ex, "a")


def test_yield_to_a_bootstrapped_request_then_hit_on_retry():
    ex = make()
    ex.submit("a", prompt(40, seed=1))
    step(ex)  # a: optimistic, first chunk computed
    ex.submit("b", prompt(16, seed=2))
    ex.requests["b"].peer.set_ready()
    step(ex)  # b admitted bootstrapped -> a yields at its boundary; b takes the whole budget
    a, b = ex.requests["a"], ex.requests["b"]
    assert ex.stats.yields == 1 and ex.stats.retries == 1
    assert a.stage == Stage.WAITING and a.attempt == 2 and a.optimistic_attempts == 2
    assert ex.waiting_queue[0] is a and a.slots is None
    assert b.stage == Stage.INFLIGHT and sends_of(ex, "b") == [(1, 0, 16, True)]
    step(ex)  # a retries: its 16 computed tokens are a device hit
    assert a.cached_device == 16 and a.computed_len == 32
    a.peer.set_ready()
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.attempts == 2 and r.passes == 2 and r.yields == 1
    assert r.cached_device_tokens == 16 and r.total_computed_tokens == 16 + 24
    assert {s[0] for s in sends_of(ex, "a")} == {2}  # nothing sent for attempt 1
    assert_decode_kv_matches(ex, "a")
    assert_decode_kv_matches(ex, "b")


def test_no_yield_when_only_optimistic_requests_wait():
    ex = make()
    ex.submit("a", prompt(40, seed=1))
    step(ex)
    ex.submit("b", prompt(12, seed=2))  # b is optimistic too: a keeps its turn
    step(ex)
    assert ex.stats.yields == 0 and ex.requests["a"].computed_len == 32


def test_attempts_used_up_fall_back_to_the_bootstrap_queue():
    ex = make(optimistic_prefill_attempts=1)
    ex.submit("a", prompt(40, seed=1))
    step(ex)
    ex.submit("b", prompt(8, seed=2))
    ex.requests["b"].peer.set_ready()
    step(ex)
    a = ex.requests["a"]
    assert a.stage == Stage.BOOTSTRAP and ex.stats.fallbacks == 1 and ex.stats.retries == 0
    step(ex, 3)
    assert a.stage == Stage.BOOTSTRAP and a.optimistic_attempts == 1  # waits for its peer
    a.peer.set_ready()
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.attempts == 1 and r.passes == 2
    assert r.cached_device_tokens == 16
    assert ex.stats.optimistic_admissions == 1
    assert_decode_kv_matches(ex, "a")


def test_force_not_ready_yields_once_at_the_end_of_the_first_attempt():
    ex = make(delay=DelayDistribution("fixed", 0.0), force_not_ready_prob=1.0)
    ex.submit("a", prompt(20))
    step(ex, 2)
    a = ex.requests["a"]
    assert a.attempt_log[0] == (1, True) and ex.stats.forced_not_ready == 1
    assert ex.stats.yields == 1 and not a.was_parked
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.passes == 2 and r.cached_device_tokens == 16
    assert {s[0] for s in sends_of(ex, "a")} == {2}
    assert_decode_kv_matches(ex, "a")


def test_decode_prefix_len_skips_what_decode_already_has():
    ex = make(delay=DelayDistribution("fixed", 0.0), decode_prefix_len=8)
    ex.submit("a", prompt(30))
    finish(ex)
    assert sends_of(ex, "a")[0][1] == 8
    assert ex.result("a").decode_prefix_len == 8
    assert_decode_kv_matches(ex, "a")


def test_l2_write_back_evicted_prefix_is_loaded_back(stream_mode):
    """A's KV is evicted to the host (write_back backs it up on eviction); C shares A's prompt
    and gets it back as a host hit, loaded layer by layer under the forward."""
    ex = make(
        delay=DelayDistribution("fixed", 0.0),
        max_total_tokens=64,
        streams=stream_mode,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
        load_back_threshold=4,
    )
    a = prompt(40, seed=1)
    ex.submit("a", a)
    finish(ex)
    ex.submit("b", prompt(44, seed=2))  # needs the room: A's pages go to the host
    finish(ex)
    ex.submit("c", a + prompt(6, seed=3))
    finish(ex)
    r = ex.result("c")
    assert r.outcome == Outcome.SUCCESS and r.cached_host_tokens > 0
    assert r.cached_device_tokens + r.cached_host_tokens == 40
    assert ex.cache.stats.loaded_tokens > 0
    for rid in "abc":
        assert_decode_kv_matches(ex, rid)


# ---------------------------------------------------------------------------------- hit stats
def _assert_cache_hits_match_results(ex: OptimisticPrefillExecutor) -> None:
    """One ``record_match`` per admitted attempt; with no yields, the results' cached tokens."""
    s = ex.cache.stats
    results = list(ex.results.values())
    assert s.matched_attempts == sum(r.passes for r in results) == ex.stats.admissions
    assert s.device_hit_tokens == sum(r.cached_device_tokens for r in results)
    assert s.host_hit_tokens == sum(r.cached_host_tokens for r in results)


@pytest.mark.parametrize("hierarchical", [False, True], ids=["device_only", "hicache"])
def test_chunk_re_matches_do_not_count_as_prefix_hits(hierarchical, stream_mode):
    """A 40-token prompt prefilled in 16-token chunks re-matches its prefix after every chunk
    insert (16, 32, 40 tokens); none of that is a hit. Only B's admission hits A's prompt
    (its first 39 tokens, page-aligned: 36). Device-only caches count hits too."""
    kw = dict(enable_hierarchical_cache=True, hicache_write_policy="write_back")
    kw = kw if hierarchical else {}
    ex = make(delay=DelayDistribution("fixed", 0.0), streams=stream_mode, **kw)
    assert ex.cache.hierarchical == hierarchical
    a = prompt(40)
    ex.submit("a", a)
    finish(ex)
    assert ex.stats.chunks == 3
    s = ex.cache.stats
    assert (s.matched_attempts, s.device_hit_tokens, s.host_hit_tokens) == (1, 0, 0)
    ex.submit("b", a)
    finish(ex)
    assert (s.matched_attempts, s.device_hit_tokens, s.host_hit_tokens) == (2, 36, 0)
    _assert_cache_hits_match_results(ex)


def test_host_hits_count_what_admission_loads_back(stream_mode):
    """As the L2 load-back story: C's host hit is recorded once, as the tokens loaded."""
    ex = make(
        delay=DelayDistribution("fixed", 0.0),
        max_total_tokens=64,
        streams=stream_mode,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
        load_back_threshold=4,
    )
    a = prompt(40, seed=1)
    ex.submit("a", a)
    finish(ex)
    ex.submit("b", prompt(44, seed=2))
    finish(ex)
    ex.submit("c", a + prompt(6, seed=3))
    finish(ex)
    assert ex.result("c").cached_host_tokens > 0
    assert ex.cache.stats.host_hit_tokens == ex.result("c").cached_host_tokens
    _assert_cache_hits_match_results(ex)


def test_host_hit_below_load_back_threshold_is_recomputed_not_counted(stream_mode):
    ex = make(
        delay=DelayDistribution("fixed", 0.0),
        max_total_tokens=64,
        streams=stream_mode,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
        load_back_threshold=1000,
    )
    a = prompt(40, seed=1)
    ex.submit("a", a)
    finish(ex)
    ex.submit("b", prompt(44, seed=2))
    finish(ex)
    assert ex.tree.match_prefix(a).host_hit_length > 0  # on the host, but below the threshold
    ex.submit("c", a + prompt(6, seed=3))
    finish(ex)
    assert ex.result("c").cached_host_tokens == 0
    assert ex.cache.stats.host_hit_tokens == 0 and ex.cache.stats.loaded_tokens == 0
    _assert_cache_hits_match_results(ex)
    assert_decode_kv_matches(ex, "c")


# ---------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("attempts", [0, 2])
def test_fail_while_in_the_bootstrap_queue(attempts):
    ex = make(optimistic_prefill_attempts=attempts)
    ex.submit("busy", prompt(40, seed=3))  # keeps the scheduler busy when optimistic
    ex.submit("a", prompt(12))
    if attempts == 0:
        step(ex)
        assert ex.requests["a"].stage == Stage.BOOTSTRAP
    ex.requests["a"].peer.fail()
    step(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.ABORTED and "failed" in r.error and r.ttft is None
    assert sends_of(ex, "a") == [] and ex.stats.bootstrap_failures == 1
    ex.requests["busy"].peer.fail()
    finish(ex)


def test_fail_while_waiting():
    ex = make()
    ex.submit("a", prompt(40, seed=1))
    ex.submit("b", prompt(12, seed=2))
    step(ex)  # a runs, b waits (budget used)
    b = ex.requests["b"]
    assert b.stage == Stage.WAITING
    b.peer.fail()
    step(ex)
    assert ex.result("b").outcome == Outcome.ABORTED and b.stage == Stage.DONE
    ex.requests["a"].peer.set_ready()
    finish(ex)
    assert ex.result("a").outcome == Outcome.SUCCESS


def test_fail_mid_chunk_keeps_computed_pages_cached_and_releases_the_rest():
    ex = make()
    ex.submit("a", prompt(40))
    step(ex, 2)
    a = ex.requests["a"]
    a.peer.fail()
    free_before = ex.allocator.available_size()
    step(ex)
    assert ex.result("a").outcome == Outcome.ABORTED and ex.chunked_req is None
    assert sends_of(ex, "a") == [] and a.slots is None and a.last_node is None
    # The 32 computed tokens stay in the tree, unlocked (evictable); nothing else is held.
    assert ex.tree.evictable_size() == 32 and ex.tree.protected_size() == 0
    assert ex.allocator.available_size() == free_before
    finish(ex)


def test_fail_while_parked():
    ex = make()
    ex.submit("a", prompt(10))
    step(ex)
    assert ex.requests["a"].parked
    ex.requests["a"].peer.fail()
    step(ex)
    assert ex.result("a").outcome == Outcome.ABORTED and sends_of(ex, "a") == []
    finish(ex)


def test_fail_while_transferring_frees_at_once_and_the_send_is_never_read():
    """As SGLang: a transfer failure releases the request's KV at once. The failed peer never
    reads the send still in flight, so the freed slots may be reused right away."""
    ex = make(delay=DelayDistribution("fixed", 0.0), max_total_tokens=16)
    ex.submit("a", prompt(10))
    step(ex)
    a = ex.requests["a"]
    assert sends_of(ex, "a") == [(1, 0, 10, True)]
    assert a.owned_slots() == 4  # the partial last page is request-owned and read by the send
    tail = set(a.slots[8:].tolist())
    a.peer.fail()
    step(ex)
    assert ex.result("a").outcome == Outcome.ABORTED and ex.stats.transfer_failures == 1
    assert a.stage == Stage.DONE and a.slots is None and "a" not in ex.requests
    assert ex.tree.protected_size() == 0 and ex.request_owned_slots() == 0
    ex.submit("b", prompt(12, seed=9))
    step(ex)
    assert tail <= set(ex.requests["b"].slots.tolist())  # reused before the send's ack time
    finish(ex)
    assert ex.clock.now() >= 1.0 and a.peer.received_end == 0  # a's send never landed
    assert_decode_kv_matches(ex, "b")


def test_fail_mid_prefill_after_finalize_with_a_chunk_in_flight():
    ex = make(delay=DelayDistribution("fixed", 0.0))
    ex.submit("a", prompt(40))
    step(ex, 2)  # chunk 1 sent at the boundary, chunk 2 computed
    a = ex.requests["a"]
    assert sends_of(ex, "a") == [(1, 0, 16, False)] and a.peer.inflight_reads() == 1
    a.peer.fail()
    step(ex)
    assert ex.result("a").outcome == Outcome.ABORTED and ex.chunked_req is None
    assert a.stage == Stage.DONE and a.last_node is None  # released at once
    assert sends_of(ex, "a") == [(1, 0, 16, False)]  # nothing more after the failure
    assert a.peer.inflight_reads() == 0 and a.peer.received_end == 0
    finish(ex)


def test_injected_transfer_failure_aborts():
    ex = make(delay=DelayDistribution("fixed", 0.0), transfer_failure_prob=1.0)
    ex.submit("a", prompt(10))
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.ABORTED and "transfer" in r.error


# ---------------------------------------------------------------------------------- the gate
def test_gate_resolved_to_zero_under_write_through_runs_without_optimism(caplog, stream_mode):
    args = executor_args(enable_hierarchical_cache=True, hicache_write_policy="write_through")
    assert args.optimistic_prefill_attempts == 0
    with caplog.at_level(logging.WARNING, logger="hicache_prefill.prefill.scheduler.admission"):
        peer = PeerConfig(bootstrap_delay=NEVER)
        ex = make_executor(args, peer_config=peer, streams=stream_mode)
    gate_logs = [r for r in caplog.records if "optimistic prefill disabled" in r.message]
    assert len(gate_logs) == 1 and "write-back" in gate_logs[0].message
    ex.submit("a", prompt(20))
    step(ex, 3)
    assert ex.stats.forward_passes == 0 and ex.requests["a"].stage == Stage.BOOTSTRAP
    ex.requests["a"].peer.set_ready()
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.attempts == 0 and ex.stats.optimistic_admissions == 0
    assert_decode_kv_matches(ex, "a")


def test_write_back_keeps_optimism_on():
    args = executor_args(enable_hierarchical_cache=True, hicache_write_policy="write_back")
    assert args.optimistic_prefill_attempts == 2


# ---------------------------------------------------------------------------------- API
def test_submit_rejects_bad_input_and_changes_nothing():
    ex = make()
    ex.submit("a", prompt(4))
    with pytest.raises(ValueError, match="rid"):
        ex.submit("a", prompt(4))
    with pytest.raises(ValueError, match="token_ids"):
        ex.submit("b", [])
    with pytest.raises(ValueError, match="token_ids"):
        ex.submit("b", [1, 2, 100_000])
    with pytest.raises(ValueError, match="token_ids"):
        ex.submit("b", prompt(300))
    assert list(ex.requests) == ["a"] and ex.stats.submitted == 1
    assert "b" not in ex.decode.peers
