"""Optimistic prefill under L2 write_through (SGLang 0.5.23 semantics): a pending attempt keeps
its KV request-owned, nothing of it reaches the tree (so nothing reaches L2) before finalize, and
the executor refuses at build any optimism the gate would not keep for the policy the cache's
tree declares.

Stories on a virtual clock with the tiny model (page 4, chunk 16, integrity after every step),
then a soak of randomized traffic under write_through + 2 attempts.
"""

from __future__ import annotations

import pytest

from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs
from tests.prefill import executor_helpers
from tests.prefill.executor_helpers import (
    NEVER,
    NOW,
    WRITE_THROUGH,
    assert_drained,
    executor_args,
    prompt,
    step,
)
from tests.support.harness import assert_decode_kv_matches, build_cache, make_executor
from tests.support.soak import SoakConfig, run_soak, soak_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def wt_args(**kw) -> ServerArgs:
    """``executor_args`` with L2 under write_through and optimistic prefill allowed there."""
    return executor_args(**{**WRITE_THROUGH, **kw})


def make(
    args: ServerArgs | None = None, delay=NEVER, streams: str | None = None, **peer
) -> OptimisticPrefillExecutor:
    cfg = PeerConfig(bootstrap_delay=delay, transfer_latency_s=0.01, **peer)
    return make_executor(args or wt_args(), peer_config=cfg, streams=streams)


def finish(ex: OptimisticPrefillExecutor) -> None:
    """``executor_helpers.finish``, then the L2 cache closed."""
    executor_helpers.finish(ex)
    ex.cache.close()


def backed_up(ex: OptimisticPrefillExecutor) -> int:
    return ex.cache.stats.backed_up_tokens


# ------------------------------------------------------------------------ request-owned pending KV
def test_chunk_boundaries_of_a_pending_attempt_insert_nothing_then_finalize_publishes_once(
    stream_mode,
):
    ex = make(streams=stream_mode)
    assert ex.unpublished_pending and ex.max_attempts == 2
    ex.submit("a", prompt(40))
    step(ex, 3)  # chunks [0, 16), [16, 32), [32, 40): two boundaries, all pending
    a = ex.requests["a"]
    assert a.parked and a.pending_bootstrap and a.computed_len == 40
    assert ex.tree.total_size() == 0 and backed_up(ex) == 0  # nothing in the tree, nothing on L2
    assert a.tree_len == 0 and a.owned_slots() == 40
    a.peer.set_ready()
    step(ex)  # finalize: insert the 40 tokens once (write_through backs them up), then send
    assert not a.pending_bootstrap and a.tree_len == 40 and backed_up(ex) == 40
    assert [(s.attempt, s.start, s.end) for s in ex.decode.send_log] == [(1, 0, 40)]
    finish(ex)
    assert ex.result("a").outcome == Outcome.SUCCESS
    assert_decode_kv_matches(ex, "a")


def test_finalize_at_a_chunk_boundary_publishes_the_computed_pages_before_the_first_send(
    stream_mode,
):
    ex = make(streams=stream_mode)
    ex.submit("a", prompt(40))
    step(ex, 2)  # [0, 16) computed, boundary (pending: no insert), [16, 32) computed
    a = ex.requests["a"]
    assert ex.tree.total_size() == 0 and a.computed_len == 32
    a.peer.set_ready()
    step(ex)  # boundary: finalize, insert [0, 32), send it; compute [32, 40), insert, send
    assert [(s.start, s.end, s.last) for s in ex.decode.send_log] == [
        (0, 32, False), (32, 40, True),
    ]  # fmt: skip
    assert a.tree_len == 40 and backed_up(ex) == 40 and ex.stats.speculative_l2_pages == 0
    finish(ex)
    assert_decode_kv_matches(ex, "a")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_yield_publishes_only_under_write_back_and_the_retry_recomputes_the_rest(
    policy, stream_mode
):
    ex = make(wt_args(hicache_write_policy=policy), streams=stream_mode)
    ex.submit("a", prompt(40, seed=1))
    step(ex)  # a computes [0, 16) optimistically
    ex.submit("b", prompt(8, seed=2), peer=None)
    ex.requests["b"].peer.set_ready()
    step(ex)  # boundary: b is bootstrapped and waiting, so a yields; b runs, then a's retry
    wt = policy == "write_through"
    a = ex.requests["a"]
    assert ex.stats.yields == 1 and a.attempt_log == [(1, True), (2, True)]
    assert ex.stats.unpublished_dropped_tokens == (16 if wt else 0)
    # The retry's prefix: nothing under write_through (dropped unpublished), 16 under write_back.
    assert a.cached_device == (0 if wt else 16)
    assert ex.stats.yield_recomputed_tokens == (16 if wt else 0)
    a.peer.set_ready()
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.yields == 1
    assert r.cached_device_tokens == (0 if wt else 16)
    assert r.total_computed_tokens == (56 if wt else 40)
    assert_decode_kv_matches(ex, "a")


def test_abort_of_a_pending_attempt_frees_its_kv_unpublished():
    ex = make()
    ex.submit("a", prompt(30))
    step(ex, 2)
    a = ex.requests["a"]
    assert a.parked and a.owned_slots() == 32
    free = ex.allocator.available_size()
    a.peer.fail()
    step(ex)
    assert ex.result("a").outcome == Outcome.ABORTED
    assert ex.allocator.available_size() == free + 32 and ex.tree.total_size() == 0
    assert backed_up(ex) == 0 and ex.stats.unpublished_dropped_tokens == 30
    finish(ex)


def test_force_hook_without_attempts_under_the_earlier_gate_publishes_nothing_speculative():
    """Flag off: the gate resolves the attempts to 0 under write_through, but SGLang's force hook
    still runs a first pass as if the peer were not ready. That pass keeps its KV unpublished
    (the tree would back it up), yields, and the finalized pass publishes."""
    args = wt_args(optimistic_prefill_write_through=False)
    assert args.optimistic_prefill_attempts == 0
    ex = make(args, delay=NOW, force_not_ready_prob=1.0)
    ex.submit("a", prompt(20))
    step(ex, 2)  # two chunks, then the forced yield at the end of the first pass
    assert ex.stats.forced_not_ready == 1 and ex.stats.yields == 1
    assert backed_up(ex) == 0 and ex.tree.total_size() == 0
    finish(ex)
    r = ex.result("a")
    assert r.outcome == Outcome.SUCCESS and r.passes == 2 and backed_up(ex) == 20
    assert_decode_kv_matches(ex, "a")


# ------------------------------------------------------------------------ the gate asks the cache
def test_args_changed_after_resolution_are_refused_at_build():
    """The earlier gate resolved the attempts to 0 under write_through; setting them back to 2
    afterwards used to run optimism anyway (and back a speculative chunk up to L2)."""
    args = wt_args(optimistic_prefill_write_through=False)
    assert args.optimistic_prefill_attempts == 0
    args.optimistic_prefill_attempts = 2
    with pytest.raises(ValueError) as err:
        make(args)
    for flag in (
        "--optimistic-prefill-attempts=2",
        "--hicache-write-policy=write_through",
        "--optimistic-prefill-write-through=False",
    ):
        assert flag in str(err.value)


def test_selective_write_through_is_refused_even_with_the_flag():
    args = wt_args(hicache_write_policy="write_through_selective")
    assert args.optimistic_prefill_attempts == 0  # the gate's own resolution
    args.optimistic_prefill_attempts = 1
    with pytest.raises(ValueError, match="--hicache-write-policy=write_through_selective"):
        make(args)


def test_a_cache_built_from_other_flags_is_checked_by_what_its_tree_declares():
    write_back = wt_args(hicache_write_policy="write_back", optimistic_prefill_write_through=False)
    assert write_back.optimistic_prefill_attempts == 2
    cache = build_cache(wt_args(optimistic_prefill_write_through=False))  # a write_through tree
    assert cache.tree.backs_up_on_insert
    try:
        with pytest.raises(ValueError, match="backs up at insert: True"):
            make_executor(write_back, peer_config=PeerConfig(bootstrap_delay=NEVER), cache=cache)
    finally:
        cache.close()


@pytest.mark.parametrize(
    "kw, unpublished",
    [
        (dict(enable_hierarchical_cache=False), False),
        (dict(hicache_write_policy="write_back"), False),
        (dict(), True),
    ],
    ids=["device-only", "write_back", "write_through"],
)
def test_publishing_mode_follows_the_tree(kw, unpublished):
    ex = make(wt_args(**kw))
    assert ex.max_attempts == 2 and ex.unpublished_pending is unpublished
    ex.cache.close()


def test_speculative_l2_pages_counts_an_insert_of_a_pending_attempt():
    """What the count catches: inserting a pending attempt's pages into a write_through tree
    (what the earlier executor did) backs them up, and ``check_integrity`` fails."""
    ex = make()
    ex.submit("a", prompt(16))
    step(ex)
    a = ex.requests["a"]
    assert a.pending_bootstrap and ex.stats.speculative_l2_pages == 0
    ex.kv.cache_unfinished(a, chunked=False)  # bypass the executor's rule on purpose
    assert ex.stats.speculative_l2_pages == 4  # 16 tokens, page 4
    with pytest.raises(AssertionError, match="4 host pages written from attempts not final"):
        ex.check_integrity()
    ex.cache.close()


# ------------------------------------------------------------------------ soak
SOAK_CASES = [
    pytest.param(1, "kernel", "page_first", id="page1-kernel"),
    pytest.param(16, "direct", "page_first_direct", id="page16-direct"),
]


def wt_soak_executor(page: int, io: str, layout: str, seed: int) -> OptimisticPrefillExecutor:
    """Small pools (device 256 tokens, host 1.5x) so eviction, host eviction and load back
    happen; side-stream copies sleep 0-1 ms (seeded) so backups and loads race."""
    args = wt_args(
        page_size=page, max_total_tokens=256, chunked_prefill_size=32, hicache_ratio=1.5,
        hicache_io_backend=io, hicache_mem_layout=layout, load_back_threshold=page,
        random_seed=seed,
    )  # fmt: skip
    return soak_executor(args, seed=seed, copy_delay_seed=seed)


@pytest.mark.parametrize("page, io, layout", SOAK_CASES)
def test_soak_write_through_two_attempts(page, io, layout):
    """500 requests: random bootstrap delays, bootstrap and transfer failures, forced retries,
    peers killed at random moments. Ends with 0 speculative L2 pages (checked every step), no
    leaked slots, locks or metadata buffers, and sampled decode-side KV equal to a recompute."""
    ex = wt_soak_executor(page, io, layout, seed=page)
    rep = run_soak(ex, SoakConfig(requests=500, seed=page, verify_every=4, max_prompt=96))
    assert_drained(ex)
    assert rep.protocol_errors == [] and rep.kv_mismatches == 0 and rep.verified > 50
    assert rep.submitted == 500 and rep.successes > 250 and rep.max_attempts_used <= 2
    s, cs = ex.stats, ex.cache.stats
    assert s.optimistic_admissions > 50 and s.parks > 0 and s.yields > 0 and s.retries > 0
    assert s.unpublished_dropped_tokens > 0 and s.yield_recomputed_tokens > 0
    assert s.bootstrap_failures > 0 and s.transfer_failures > 0 and rep.killed > 0
    assert cs.backed_up_tokens > 0 and cs.evicted_device_tokens > 0
    assert cs.evicted_host_tokens > 0 and cs.loaded_tokens > 0 and s.cached_host_tokens > 0
    ex.cache.close()
