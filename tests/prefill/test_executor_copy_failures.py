"""The executor when a cache copy fails, in both CPU stream modes.

A host load that fails during admission (at its launch on inline streams, under the forward at
a layer's wait on thread streams) sends its requests back to recompute their host hit: they
finish with the right KV on the decode side, nothing leaks, and the cache keeps serving hits.
Failed backups under write-through only cost host copies. ``check_integrity`` runs after every
step (``finish``).
"""

from __future__ import annotations

import logging

import pytest

from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.request.state import Outcome
from tests.prefill.executor_helpers import executor_args, finish, prompt
from tests.support.faults import CopyFaults
from tests.support.harness import assert_decode_kv_matches, make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NOW = DelayDistribution("fixed", 0.0)


def make(stream_mode: str, **kw):
    args = executor_args(max_total_tokens=64, enable_hierarchical_cache=True, **kw)
    return make_executor(args, peer_config=PeerConfig(bootstrap_delay=NOW), streams=stream_mode)


def test_a_failed_load_back_during_admission_is_recomputed(stream_mode, caplog) -> None:
    ex = make(stream_mode, hicache_write_policy="write_back", load_back_threshold=4)
    a = prompt(40, seed=1)
    ex.submit("a", a)
    finish(ex)
    ex.submit("b", prompt(44, seed=2))  # A's pages go to the host
    finish(ex)
    assert ex.tree.match_prefix(a).host_hit_length > 0
    with (
        CopyFaults().fail_calls("load_to_device_per_layer", [0]) as faults,
        caplog.at_level(logging.WARNING, logger="hicache_prefill.prefill.scheduler"),
    ):
        ex.submit("c", a + prompt(6, seed=3))
        finish(ex)
        assert faults.failures == ["load_to_device_per_layer"]
    # inline: the launch failed in the batch's admission; thread: the forward's layer wait
    where = "not launched" if stream_mode == "inline" else "under the forward"
    assert [r for r in caplog.records if where in r.getMessage()]
    r = ex.result("c")
    assert r.outcome == Outcome.SUCCESS and r.cached_host_tokens == 0  # recomputed
    assert ex.stats.load_back_failures == 1 and ex.cache.stats.h2d_failed_copies == 1
    assert ex.cache.stats.loaded_tokens == 0 and ex.cache.stats.host_hit_tokens == 0
    assert_decode_kv_matches(ex, "c")
    ex.submit("d", prompt(44, seed=4))  # pushes the prefix to the host again
    finish(ex)
    ex.submit("e", a + prompt(6, seed=5))
    finish(ex)  # a load back works again
    assert ex.result("e").cached_host_tokens > 0
    for rid in "abde":
        assert_decode_kv_matches(ex, rid)


def test_failed_backups_under_write_through_cost_only_host_copies(stream_mode) -> None:
    ex = make(stream_mode, hicache_write_policy="write_through", load_back_threshold=4)
    a = prompt(24, seed=1)
    with CopyFaults().fail_calls("backup_from_device_all_layer", range(0, 100, 2)):
        for i, p in enumerate([a, prompt(30, seed=2), a + prompt(8, seed=3), prompt(36, seed=4)]):
            ex.submit(f"r{i}", p)
            finish(ex)
    assert ex.cache.stats.d2h_failed_copies > 0
    ex.submit("again", a + prompt(4, seed=5))
    finish(ex)
    assert all(r.outcome == Outcome.SUCCESS for r in ex.results.values())
    for rid in ex.results:
        assert_decode_kv_matches(ex, rid)
