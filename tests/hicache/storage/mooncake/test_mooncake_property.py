"""Property: random sequences of puts, reads and existence queries by two ``MooncakeStore``s (a
writer and a reader, each its own host pool) over one fake Mooncake, with injected return codes
per object (put and get), objects damaged or lost from outside (another geometry under the
name, an owner that exited) and the master going down and coming back, never read back wrong
KV and never raise.

Keys are content hashes, so key ``k`` always names the writer's page ``k``. After every step:

- a page the reader reports read (``batch_get_v1`` True) holds exactly the writer's page ``k``;
  a slot the call was not given keeps its bytes (a failed page's own slots may hold partial
  bytes: the prefetch that asked owns and frees them);
- a page counts as stored only when all its objects are in the store;
- with nothing injected, ``batch_exists`` is the model's prefix of whole pages;
- the counters add up: every page a healthy read asked for is read or failed, and every failed
  object is counted under its return code (or ``wrong_size``).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_prefill.hicache.storage.config import storage_config_for_pool
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore
from tests.hicache.storage.helpers import fill_random, host_pool, same_slots, slot_bytes
from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster

N_KEYS, PAGE = 4, 2
KEYS = [page_hashes([k, k + 100], PAGE)[0] for k in range(N_KEYS)]
MASTER = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp",
          "global_segment_size": 0}  # fmt: skip
PUT_CODES = (-200, -600, -800, -900)
GET_CODES = (-704, -800, -707, -600)

keys_range = st.tuples(st.integers(0, N_KEYS - 1), st.integers(1, N_KEYS))
op = st.one_of(
    st.tuples(st.just("set"), keys_range),
    st.tuples(st.just("get"), keys_range),
    st.tuples(st.just("exists"), keys_range),
    st.tuples(st.just("put_code"), st.tuples(st.integers(0, 2 * N_KEYS - 1),
                                             st.sampled_from(PUT_CODES))),
    st.tuples(st.just("get_code"), st.tuples(st.integers(0, 2 * N_KEYS - 1),
                                             st.sampled_from(GET_CODES))),
    st.tuples(st.just("damage"), st.tuples(st.integers(0, 2 * N_KEYS - 1),
                                           st.sampled_from(["bigger", "smaller", "lost"]))),
    st.tuples(st.just("heal"), st.just(0)),
    st.tuples(st.just("master"), st.booleans()),
)  # fmt: skip


def content(k: int) -> torch.Tensor:
    """The writer's slots of page ``k`` (one page per key)."""
    return torch.arange(k * PAGE, (k + 1) * PAGE)


def make(cluster: FakeCluster, pool) -> MooncakeStore:
    cfg = storage_config_for_pool(pool, "org/m", extra_config=MASTER)
    store = MooncakeStore(cfg, pool)
    store.register_mem_pool_host(pool)
    return store


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(op, min_size=1, max_size=30),
    kind=st.sampled_from(["mha", "mla"]),
    layout=st.sampled_from(["page_first", "page_first_direct"]),
    seed=st.integers(0, 2**16),
)
def test_reads_are_exact_or_reported_failed_and_counted(ops, kind, layout, seed) -> None:
    cluster = FakeCluster()
    saved, MooncakeStore.store_factory = MooncakeStore.store_factory, cluster.factory
    try:
        _run(cluster, ops, kind, layout, seed)
    finally:
        MooncakeStore.store_factory = saved


def _run(cluster: FakeCluster, ops: list, kind: str, layout: str, seed: int) -> None:
    src = host_pool(kind, layout, page=PAGE, size=N_KEYS * PAGE)
    dst = host_pool(kind, layout, page=PAGE, size=N_KEYS * PAGE)
    fill_random(src, seed)
    fill_random(dst, seed + 1)
    writer, reader = make(cluster, src), make(cluster, dst)
    per_page = writer.names.per_page
    names = writer.names.objects(KEYS)  # the reader's names are the same (one model, rank 0)
    assert names == reader.names.objects(KEYS)
    injected = False  # any code, damage or outage so far (then existence is not predictable)
    asked_healthy = 0
    for name, arg in ops:
        if name == "set":
            lo, n = arg
            ks = list(range(lo, min(N_KEYS, lo + n)))
            slots = torch.cat([content(k) for k in ks])
            got = writer.batch_set_v1([KEYS[k] for k in ks], slots)
            for k, ok in zip(ks, got, strict=True):
                objs = names[k * per_page : (k + 1) * per_page]
                assert ok == all(o in cluster.objects for o in objs) or cluster.master_down
        elif name == "get":
            lo, n = arg
            ks = list(range(lo, min(N_KEYS, lo + n)))
            at = torch.arange(len(ks) * PAGE) + N_KEYS * PAGE  # the reader's spare half
            others = [s for s in range(dst.size) if s not in set(at.tolist())]
            before = slot_bytes(dst, others)
            got = reader.batch_get_v1([KEYS[k] for k in ks], at)
            if not cluster.master_down:
                asked_healthy += len(ks)
            for i, (k, ok) in enumerate(zip(ks, got, strict=True)):
                if ok:
                    assert same_slots(src, content(k), dst, at[i * PAGE : (i + 1) * PAGE])
            for x, y in zip(before, slot_bytes(dst, others), strict=True):
                assert torch.equal(x, y)  # slots it was not given: untouched
        elif name == "exists":
            lo, n = arg
            ks = list(range(lo, min(N_KEYS, lo + n)))
            found = reader.batch_exists([KEYS[k] for k in ks])
            whole = [all(o in cluster.objects for o in names[k * per_page : (k + 1) * per_page])
                     for k in ks]  # fmt: skip
            expect = next((i for i, w in enumerate(whole) if not w), len(whole))
            assert found == (0 if cluster.master_down else expect)
        elif name == "put_code":
            i, code = arg
            cluster.put_codes[names[i % len(names)]] = code
            injected = True
        elif name == "get_code":
            i, code = arg
            cluster.get_codes[names[i % len(names)]] = code
            injected = True
        elif name == "damage":
            i, how = arg
            obj = names[i % len(names)]
            if obj in cluster.objects:
                if how == "lost":  # its owner exited
                    del cluster.objects[obj]
                elif how == "bigger":
                    cluster.objects[obj] += b"\0" * 8
                else:
                    cluster.objects[obj] = cluster.objects[obj][:-8]
                injected = True
        elif name == "heal":
            cluster.put_codes.clear()
            cluster.get_codes.clear()
        else:
            cluster.master_down = not arg
            injected = True
    s = reader.get_stats()
    assert s.pages_read + s.pages_read_failed == asked_healthy
    failed_objects = sum(s.errors.values()) + s.wrong_size
    assert (failed_objects == 0) == (s.pages_read_failed == 0)
    if not injected:  # the only failures: pages never stored
        assert set(s.errors) <= {"-704 OBJECT_NOT_FOUND"} and s.wrong_size == 0
    w = writer.get_stats()  # every put is counted: written, or failed under its code
    assert w.objects_written == len(cluster.put_names) - sum(w.errors.values())
    writer.close()
    reader.close()
