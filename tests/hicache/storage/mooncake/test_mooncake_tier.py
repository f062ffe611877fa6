"""The L3 tier over ``MooncakeStore`` in this process, with the fake Mooncake (``fake_mooncake``):
two executors share pages (KV equal to a recompute), every Mooncake call comes from a storage IO
thread (never the scheduler's), a master that goes down costs storage, not service, and a full
store or a failed read (-800, -704, an object of another size) is counted, recomputed and leaves
no host page behind, in ``cache`` and ``buffer_only`` host memory."""

from __future__ import annotations

import json

import pytest
import torch

from hicache_prefill.hicache.storage.mooncake.page_footers import PageFooters
from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore
from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.request.state import Outcome
from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster
from tests.prefill.executor_helpers import NOW, executor_args, prompt
from tests.support.harness import assert_decode_kv_matches, make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE_BYTES = 2 * 4 * 2 * 16 * 4 * 4  # K and V x 4 layers x 2 heads x 16 x fp32 x 4 tokens


@pytest.fixture
def cluster(monkeypatch) -> FakeCluster:
    c = FakeCluster()
    monkeypatch.setattr(MooncakeStore, "store_factory", c.factory)
    return c


def make(mode: str = "cache", **kw):
    extra = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp",
             "global_segment_size": 0, "prefetch_threshold": 8}  # fmt: skip
    args = executor_args(
        enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
        hicache_storage_backend_extra_config=json.dumps(extra), load_back_threshold=4,
        hicache_storage_prefetch_policy="wait_complete", hicache_host_memory_mode=mode,
        optimistic_prefill_attempts=0, **kw,
    )  # fmt: skip
    return make_executor(args, peer_config=PeerConfig(bootstrap_delay=NOW,
                                                      transfer_latency_s=0.01))  # fmt: skip


def serve(ex, requests: dict[str, list[int]]) -> dict:
    for rid, tokens in requests.items():
        ex.submit(rid, tokens)
    ex.run_until_idle(check=True)
    ex.drain_cache_events()
    ex.check_integrity()
    out = {r.rid: r for r in ex.pop_results()}
    for rid, r in out.items():
        assert r.outcome == Outcome.SUCCESS, r
        assert_decode_kv_matches(ex, rid)
        ex.decode.release(rid)
    return out


def backend(ex) -> MooncakeStore:
    return ex.cache.storage.backend


def host_free(ex) -> bool:
    """Every host slot free once the tree let go of everything (no page leaked)."""
    ex.tree.evict(ex.allocator.size)
    ex.drain_cache_events()
    alloc = ex.tree.host_allocator
    ex.tree.evict_host(alloc.size)
    ex.drain_cache_events()
    ex.check_integrity()
    return alloc.available_size() == alloc.size


@pytest.mark.parametrize("mode", ["cache", "buffer_only"])
def test_two_executors_share_pages_and_only_storage_threads_call_mooncake(cluster, mode):
    p = prompt(64, seed=1)
    a = make(mode)
    serve(a, {"a": p})
    assert backend(a).get_stats().pages_stored == 16
    b = make(mode)
    r = serve(b, {"b": p + prompt(6, seed=2)})["b"]
    assert (r.cached_host_tokens, r.cached_storage_tokens, r.computed_tokens) == (64, 64, 6)
    threads = {t for _, t in cluster.data_calls()}
    assert threads and all(t.startswith("hicache-storage-") for t in threads), threads
    a.cache.close()
    b.cache.close()
    assert all(c.closed for c in cluster.clients)


def test_a_down_master_costs_storage_not_service_and_service_resumes(cluster):
    ex = make(hicache_ratio=4.0)
    r1 = [prompt(32, seed=10 + i) for i in range(2)]
    serve(ex, {f"x{i}": q for i, q in enumerate(r1)})
    stored = backend(ex).get_stats().pages_stored
    cluster.master_down = True
    calls = len(cluster.data_calls())
    res = serve(ex, {**{f"y{i}": q + [5] for i, q in enumerate(r1)},
                     "z": prompt(24, seed=20)})  # fmt: skip
    assert all(res[f"y{i}"].cached_device_tokens == 32 for i in range(2))  # L1 serves
    assert len(cluster.data_calls()) == calls  # Mooncake untouched while down
    st, bs = ex.cache.storage.stats, backend(ex).get_stats()
    assert st.backup_failed_ops > 0 and bs.skipped_unhealthy > 0 and bs.pages_stored == stored
    cluster.master_down = False
    serve(ex, {"u": prompt(28, seed=30)})
    assert backend(ex).get_stats().pages_stored == stored + 7
    assert host_free(ex)
    ex.cache.close()


@pytest.mark.parametrize("mode", ["cache", "buffer_only"])
def test_a_full_store_is_counted_and_leaves_no_host_page_behind(cluster, mode):
    cluster.capacity_bytes = 5 * (PAGE_BYTES + 2 * PageFooters.size)  # K and V carry a footer
    ex = make(mode)
    p = prompt(40, seed=40)  # 10 pages, 5 fit
    serve(ex, {"a": p})
    st, bs = ex.cache.storage.stats, backend(ex).get_stats()
    assert st.backup_failed_ops > 0 and bs.pages_stored == 5
    assert bs.errors.get("-200 NO_AVAILABLE_HANDLE", 0) > 0
    assert host_free(ex)
    reader = make(mode)
    r = serve(reader, {"b": p + [1]})["b"]
    assert r.cached_storage_tokens == 20  # the stored prefix, the rest recomputed
    assert host_free(reader)
    ex.cache.close()
    reader.cache.close()


@pytest.mark.parametrize("mode, code", [("cache", -800), ("buffer_only", -704),
                                        ("cache", "smaller")])  # fmt: skip
def test_a_failed_read_is_recomputed_counted_and_leaves_no_host_page_behind(cluster, mode, code):
    p = prompt(40, seed=50)  # 10 pages
    writer = make(mode)
    serve(writer, {"a": p})
    v4 = [n for n in cluster.put_names if n.endswith("_v")][4]  # page 4's V object
    if code == "smaller":  # another geometry under the name: Mooncake returns its size
        cluster.objects[v4] = cluster.objects[v4][:-4]
    else:  # the owner died (-800), or left the store (-704), after B saw the page exist
        cluster.get_codes[v4] = code
    reader = make(mode)
    r = serve(reader, {"b": p + [1]})["b"]  # KV checked against the decode side's recompute
    assert (r.cached_storage_tokens, r.computed_tokens) == (16, 25)  # pages 0-3 read, 4 failed
    st, bs = reader.cache.storage.stats, backend(reader).get_stats()
    assert (st.prefetch_hit_tokens, st.prefetch_fetched_tokens) == (40, 16)  # agreed, then read
    assert bs.pages_read_failed >= 1
    assert (bs.wrong_size if code == "smaller" else sum(bs.errors.values())) >= 1
    assert host_free(reader)
    writer.cache.close()
    reader.cache.close()


@pytest.mark.parametrize("mode, damage", [("cache", "random"), ("buffer_only", "swapped")])
def test_a_damaged_or_swapped_page_is_recomputed_never_served(cluster, mode, damage):
    p = prompt(40, seed=60)  # 10 pages
    writer = make(mode)
    serve(writer, {"a": p})
    values = [n for n in cluster.put_names if n.endswith("_v")]
    size = len(cluster.objects[values[4]])
    if damage == "random":
        noise = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator())
        cluster.objects[values[4]] = noise.numpy().tobytes()
    else:  # page 5's V object under page 4's name: the right size, the wrong KV
        cluster.objects[values[4]] = cluster.objects[values[5]]
    reader = make(mode)
    r = serve(reader, {"b": p + [1]})["b"]  # KV checked against the decode side's recompute
    assert (r.cached_storage_tokens, r.computed_tokens) == (16, 25)  # pages 0-3 read, 4 failed
    bs = backend(reader).get_stats()
    assert bs.read_corrupt == 1 and bs.pages_read_failed >= 1 and bs.errors == {}
    assert host_free(reader)
    writer.cache.close()
    reader.cache.close()
