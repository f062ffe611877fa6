"""The L3 tier across two real tensor-parallel ranks (gloo): each rank stores and reads its own
shard, its storage answers on its own (rank 1 lacks pages, rank 0 has a damaged one), and every
decision is the group's: the hit is the MIN of the ranks' existence answers, the host pages are
allocated for that hit on both, the progress is the MIN of what each read, a ``timeout`` expiry
seen by one rank ends the wait on both, and the trees stay equal (``tree_state`` digests)."""

from __future__ import annotations

from typing import Any

from hicache_prefill.hicache.builder import build_kv_cache
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle
from hicache_prefill.hicache.tp.digest import tree_state
from hicache_prefill.hicache.tp.group import new_cache_group
from hicache_prefill.prefill.model.paged import ModelConfig
from hicache_prefill.prefill.model.tp import TPShard
from tests.hicache.storage.io.io_helpers import TestStorage, cache_args
from tests.support.kv_content import check_device, write_device
from tests.support.tp_harness import run_ranks

A = list(range(200, 232))  # 8 pages of 4


def _tick_until(kv: Any, cond: Any) -> None:
    """Tick (every rank enters the same agreements) until ``cond`` holds on every rank."""
    while not kv.group.agree_all(bool(cond()), tag="test_until"):
        kv.tree.check_hicache_events()


def _rank(rank: int, world: int) -> dict[str, Any]:
    group = new_cache_group()
    args = cache_args("tp", num_attention_heads=4, head_num=2, tp_size=world)
    head0 = TPShard.plan(ModelConfig.from_server_args(args), rank, world).kv_heads[0]
    kv = build_kv_cache(args, group=group)
    new = kv.alloc_device(len(A))
    write_device(kv.device_pool, new, A, range(len(A)), head0)
    kv.tree.insert(A, new)
    _tick_until(kv, lambda: not kv.tree.ongoing_write_through and not kv.storage.ops_in_flight())
    kv.close()

    kv = build_kv_cache(args, group=group)  # a second process of the same rank
    store = TestStorage.last
    keys = page_hashes(A, 4)
    if rank == 1:
        store.missing = set(keys[5:])  # rank 1 has pages 0..4 only
    else:
        victim = next(k for k in store.pages if k.startswith(keys[3]))
        store.pages[victim] = store.pages[victim][:-4]  # rank 0 reads pages 0..2 whole
    h = CacheRequestHandle("r", 0)
    assert kv.storage.prefetch(h, kv.tree.root_node, A, 0)
    ops = kv.storage.prefetches
    _tick_until(kv, lambda: ops.ongoing[h].op.host_indices is not None)
    hit = ops.ongoing[h].op.host_indices.numel()
    _tick_until(kv, lambda: h not in ops.ongoing)
    loaded = kv.storage.take_loaded(h)
    group.assert_same("tree", tree_state(kv.tree))
    m = kv.tree.match_prefix(A)
    dev, node = kv.tree.init_load_back(m.last_host_node, m.host_hit_length)
    kv.tree.inc_lock_ref(node)
    kv.tree.ready_to_load_host_cache()
    for layer in range(2):
        kv.tree.layer_wait(layer)
    check_device(kv.device_pool, dev, A[: dev.numel()], range(dev.numel()), head0)
    _tick_until(kv, lambda: not kv.tree.ongoing_load_back)
    kv.tree.dec_lock_ref(node)
    kv.check_integrity()

    # A timeout that only rank 1's clock has passed ends the wait on both ranks.
    store.gate.clear()
    h2 = CacheRequestHandle("s", 0)
    assert kv.storage.prefetch(h2, kv.tree.root_node, A[:16] + [9] * 16, 0)
    waits = [kv.storage.check_prefetch_progress(h2, 0.0)]  # first blocked poll starts the timer
    waits.append(kv.storage.check_prefetch_progress(h2, 100.0 if rank == 1 else 0.5))
    store.gate.set()
    _tick_until(kv, lambda: not kv.storage.ops_in_flight())
    group.assert_same("tree after timeout", tree_state(kv.tree))
    kv.check_integrity()
    kv.close()
    return {"hit": hit, "loaded": loaded, "dev": dev.numel(), "waits": waits}


def test_two_ranks_agree_on_hits_progress_and_timeouts():
    outs = run_ranks(_rank, 2)
    for out in outs:
        assert out["hit"] == 5 * 4  # the MIN of 8 and 5 pages, allocated on both ranks
        assert out["loaded"] == 3 * 4 and out["dev"] == 12  # the MIN of what each read
        assert out["waits"] == [False, True]  # rank 1's expiry is everyone's
