"""The executor over an L3 tier: a second executor finds the first one's pages (KV equal to a full
recompute), the three prefetch stop policies on the executor's (virtual) clock, the retry's
lookup seeded by a yield, and optimistic prefill with L3: ``speculative_l3_pages`` stays 0 in
SGLang 0.5.23's allowed configuration (``buffer_only`` + ``write_through``), while the refused
one (L3 + ``write_back``, the gate bypassed) stores KV of an aborted attempt."""

from __future__ import annotations

import json

import pytest

import hicache_prefill.prefill.executor as executor_module
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs
from tests.hicache.storage.io.io_helpers import DYNAMIC, TestStorage
from tests.prefill.executor_helpers import NEVER, NOW, executor_args, prompt, step
from tests.support.harness import assert_decode_kv_matches, make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P = prompt(64, seed=7)


def l3_args(store: str, **kw) -> ServerArgs:
    """L3 over the ``test_memory`` store ``store``. ``wait_complete`` unless told: on a virtual
    clock storage IO takes no time, so a ``timeout`` wait ends whenever the clock jumps to its
    deadline (nothing else due), before or after the real IO thread finished."""
    extra = {"store": store, "prefetch_threshold": 8, **DYNAMIC, **kw.pop("extra", {})}
    base = dict(
        enable_hierarchical_cache=True, hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra), load_back_threshold=4,
        hicache_storage_prefetch_policy="wait_complete",
    )  # fmt: skip
    return executor_args(**{**base, **kw})


def make(args: ServerArgs, delay=NOW, **peer):
    cfg = PeerConfig(bootstrap_delay=delay, transfer_latency_s=0.01, **peer)
    ex = make_executor(args, peer_config=cfg)
    return ex, TestStorage.last


def warm(store: str, tokens: list[int] = P, **kw) -> None:
    """A first executor computes ``tokens`` and stores their pages."""
    ex, _ = make(l3_args(store, **kw))
    ex.submit("w", tokens)
    ex.run_until_idle(check=True)
    ex.drain_cache_events()
    assert ex.cache.storage.stats.backup_tokens == len(tokens) // 4 * 4
    ex.cache.close()


@pytest.mark.parametrize("mode", ["cache", "buffer_only"])
def test_a_second_executor_finds_the_first_ones_pages(mode):
    warm(f"warm-{mode}", hicache_host_memory_mode=mode)
    ex, _ = make(l3_args(f"warm-{mode}", hicache_host_memory_mode=mode))
    ex.submit("b", P + prompt(6, seed=8))
    ex.run_until_idle(check=True)
    r = ex.result("b")
    assert r.outcome == Outcome.SUCCESS
    assert (r.cached_device_tokens, r.cached_host_tokens, r.cached_storage_tokens) == (0, 64, 64)
    assert ex.cache.stats.storage_hit_tokens == 64
    assert_decode_kv_matches(ex, "b")
    ex.drain_cache_events()
    ex.check_integrity()
    ex.cache.close()


def test_best_effort_never_waits():
    warm("be")
    ex, store = make(l3_args("be", hicache_storage_prefetch_policy="best_effort"))
    store.gate.clear()  # the lookup cannot answer
    ex.submit("b", P + [1])
    ex.run_until_idle(check=True)
    r = ex.result("b")
    assert r.outcome == Outcome.SUCCESS and r.cached_storage_tokens == 0
    assert ex.cache.storage.stats.prefetch_terminated == 1
    store.gate.set()
    ex.drain_cache_events()
    ex.check_integrity()
    ex.cache.close()


def test_wait_complete_admits_only_after_the_prefetch_completed():
    warm("wc")
    ex, store = make(l3_args("wc", hicache_storage_prefetch_policy="wait_complete"))
    store.gate.clear()
    ex.submit("b", P + [1])
    step(ex, 20)
    assert ex.stats.forward_passes == 0 and ex.requests["b"].slots is None
    store.gate.set()
    ex.run_until_idle(check=True)
    assert ex.result("b").cached_storage_tokens == 64
    ex.drain_cache_events()
    ex.cache.close()


def test_timeout_waits_its_budget_on_the_executors_clock():
    warm("to")
    ex, store = make(l3_args("to", hicache_storage_prefetch_policy="timeout",
                             extra={"prefetch_timeout_base": 2.0,
                                    "prefetch_timeout_per_ki_token": 16.0}))  # fmt: skip
    budget = 2.0 + (64 // 4) * (4 / 1024 * 16.0)  # SGLang's formula: 3.0 s for 64 tokens
    assert ex.cache.storage.settings.timeout_s(64, 4) == pytest.approx(budget)
    store.gate.clear()
    ex.submit("b", P + [1])
    step(ex)  # the first blocked poll starts the timer
    t0 = ex.clock.now()
    ex.clock.advance(budget - 0.01)
    step(ex, 3)
    assert ex.stats.forward_passes == 0  # still waiting
    ex.clock.advance(0.02)
    step(ex)
    assert ex.stats.forward_passes == 1 and ex.clock.now() - t0 > budget
    ex.run_until_idle(check=True)
    assert ex.result("b").cached_storage_tokens == 0  # nothing had landed
    store.gate.set()
    ex.drain_cache_events()
    ex.cache.close()


def test_timeout_with_nothing_else_to_do_jumps_the_virtual_clock_to_the_deadline():
    warm("to2")
    ex, store = make(l3_args("to2", hicache_storage_prefetch_policy="timeout"))
    store.gate.clear()
    ex.submit("b", P + [1])
    t0 = ex.clock.now()
    ex.run_until_idle(check=True)
    assert ex.clock.now() - t0 >= 1.0 + 16 * (4 / 1024 * 0.25)  # the default budget
    store.gate.set()
    ex.drain_cache_events()
    ex.cache.close()


def test_a_yield_seeds_the_retrys_lookup_with_the_prefix_it_had_matched():
    warm("seed", tokens=P[:32])
    args = l3_args("seed", hicache_host_memory_mode="buffer_only",
                   optimistic_prefill_write_through=True, max_running_requests=1)  # fmt: skip
    assert args.optimistic_prefill_attempts == 2
    ex, _ = make(args, delay=NEVER)
    ex.submit("a", P)
    a = ex.requests["a"]
    while a.computed_len == 0:  # a's prefetch lands, a is admitted with its 32-token hit
        step(ex)
    assert a.cached_storage == 32 and a.tree_len == 32 and a.computed_len == 48
    ex.submit("b", prompt(8, seed=9))
    ex.requests["b"].peer.set_ready()
    step(ex)  # a yields to b (the one running slot): its lookup is seeded with its 32 tokens
    assert ex.stats.yields == 1 and a.slots is None
    assert a.storage_epoch == 1 and a.storage_prefetch_last_match_len == 32
    ex.tree.evict(10_000)  # a's prefix leaves the device while it waits (buffer_only: no L2)
    while a.slots is None:  # the shrunk match re-issues one lookup; the retry waits for it
        step(ex)
        ex.clock.advance(0.005)  # b's transfer completes, freeing the slot
    assert a.storage_prefetch_retries == 1 and a.cached_storage == 32
    assert ex.cache.storage.stats.prefetch_issued == 2
    a.peer.set_ready()
    ex.run_until_idle(check=True)
    assert ex.result("a").outcome == Outcome.SUCCESS
    assert_decode_kv_matches(ex, "a")
    ex.drain_cache_events()
    ex.check_integrity()
    ex.cache.close()


def test_optimistic_prefill_with_l3_buffer_only_write_through_stores_nothing_speculative():
    args = l3_args("opt", hicache_host_memory_mode="buffer_only",
                   hicache_write_policy="write_back",  # resolved to write_through
                   optimistic_prefill_write_through=True,
                   disaggregation_force_not_ready_prob=0.5)  # fmt: skip
    assert args.hicache_write_policy == "write_through" and args.optimistic_prefill_attempts == 2
    delay = DelayDistribution("uniform", 0.0, 0.05)
    ex, _ = make(args, delay=delay, bootstrap_failure_prob=0.3, force_not_ready_prob=0.5)
    base = prompt(40, seed=3)
    for i in range(12):
        ex.submit(f"r{i}", base[: 16 + 2 * i] + prompt(4 + i % 5, seed=100 + i))
        step(ex, 2)
    ex.run_until_idle(check=True)
    ex.drain_cache_events()
    ex.check_integrity()
    s, st = ex.stats, ex.cache.storage.stats
    assert s.yields > 0 and s.bootstrap_failures > 0 and st.backup_tokens > 0
    assert s.speculative_l3_pages == 0 and s.speculative_l2_pages == 0
    for r in ex.pop_results():
        if r.outcome == Outcome.SUCCESS:
            assert_decode_kv_matches(ex, r.rid)
    ex.cache.close()


def test_the_refused_interleaving_l3_write_back_stores_kv_of_an_aborted_attempt(monkeypatch):
    """The gate bypassed under L3 + write_back: publish at a chunk boundary, yield, device
    eviction (write_back backs up to L2, then L3), bootstrap failure: the aborted attempt's KV is
    in the shared store, and ``check_integrity`` says so."""
    args = l3_args(
        "refused",
        hicache_write_policy="write_back",
        optimistic_prefill_write_through=True,
        extra={"prefetch_threshold": 4096},  # no lookups: only the write path here
        max_running_requests=1,
    )  # the retry waits while b runs
    assert args.optimistic_prefill_attempts == 0  # the gate refuses it
    args.optimistic_prefill_attempts = 2
    with pytest.raises(ValueError, match="optimistic-prefill-attempts"):
        make(args, delay=NEVER)  # and so does the executor, built on its own
    monkeypatch.setattr(executor_module, "check_gate", lambda *a: None)
    ex, store = make(args, delay=NEVER)
    r_tokens = prompt(40, seed=11)
    ex.submit("r", r_tokens)
    step(ex)  # r computes [0, 16) optimistically
    ex.submit("b", prompt(8, seed=12))
    ex.requests["b"].peer.set_ready()
    step(ex)  # boundary: r publishes [0, 16) (write_back), then yields to b
    assert ex.stats.yields == 1
    r = ex.requests["r"]
    assert r.slots is None and ex.tree.evictable_size() >= 16  # its published chunk, unlocked
    ex.tree.evict(10_000)  # device pressure: write_back backs up, the L2 ack feeds L3
    ex.drain_cache_events()  # the storage write lands
    r.peer.fail()  # r's bootstrap fails: it never finalized
    ex.run_until_idle()
    ex.drain_cache_events()
    assert ex.result("r").outcome == Outcome.ABORTED
    keys = page_hashes(r_tokens[:16], 4)
    assert all(any(name.startswith(k) for name in store.pages) for k in keys)
    assert ex.stats.speculative_l3_pages >= len(keys)
    with pytest.raises(AssertionError, match="speculative_l3_pages"):
        ex.check_integrity()
    ex.cache.close()


def test_storage_flags_refuse_bad_input_at_startup(tmp_path):
    with pytest.raises(ValueError, match="--hicache-storage-backend=nosuch"):
        make(l3_args("x", hicache_storage_backend="nosuch"))
    with pytest.raises(ValueError, match="'prefetch_threshold'"):
        make(l3_args("x", extra={"prefetch_threshold": "many"}))
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    args = executor_args(
        enable_hierarchical_cache=True, hicache_storage_backend="file",
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": str(blocked)}),
    )  # fmt: skip
    with pytest.raises(ValueError, match="file_storage_path"):
        make(args)
    dyn = executor_args(enable_hierarchical_cache=True, hicache_storage_backend="dynamic",
                        hicache_storage_backend_extra_config='{"backend_name": "x"}')  # fmt: skip
    with pytest.raises(ValueError, match="module_path"):
        make(dyn)


@pytest.mark.parametrize("evicted", [False, True], ids=["kept", "evicted_while_waiting"])
def test_prefetched_pages_evicted_before_admission_count_as_unused(evicted):
    """Cache mode, as SGLang 0.5.23: the completion ack puts the fetched pages into the tree as
    an unprotected host-only node while the request still waits (here: for its bootstrap);
    host pressure may evict it before the admission, which then recomputes. The admission
    counts what it did not find (``prefetch_unused_tokens``)."""
    store = f"unused-{evicted}"
    warm(store)
    ex, _ = make(l3_args(store), delay=NEVER)
    ex.submit("b", P + [1])
    stats = ex.cache.storage.stats
    for _ in range(200):
        if stats.prefetch_inserted_tokens:
            break
        step(ex)
        ex.clock.advance(0.001)
    assert stats.prefetch_inserted_tokens == 64 and ex.requests["b"].slots is None
    assert ex.tree.match_prefix(P).host_hit_length == 64
    if evicted:  # other prefetches' host slots or write-through backups would do this
        assert ex.tree.evict_host(64) == 64
    ex.requests["b"].peer.set_ready()
    ex.run_until_idle(check=True)
    r = ex.result("b")
    assert r.outcome == Outcome.SUCCESS
    assert r.cached_storage_tokens == (0 if evicted else 64)
    assert stats.prefetch_unused_tokens == (64 if evicted else 0)
    assert ex.cache.stats.storage_hit_tokens == r.cached_storage_tokens
    assert_decode_kv_matches(ex, "b")
    ex.drain_cache_events()
    ex.check_integrity()
    ex.cache.close()
