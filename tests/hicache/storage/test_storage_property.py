"""Property: random set / get / exists / clear sequences over ``HiCacheFile`` behind seeded
injected failures, with files damaged from outside and a small byte budget, never read back
wrong KV and never raise.

A page key always names one content (keys are content hashes), so the model is a fixed
universe of pages. After every step:

- a page read back (``batch_get_v1`` into a pool, or ``get`` into a buffer) is byte-exact, or the
  call reports a miss and the destination page is untouched;
- without injected failures and without a budget, a key is found exactly when it was stored,
  not damaged and not cleared since;
- every other page of the reading pool keeps its bytes.
"""

from __future__ import annotations

import os
import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_prefill.hicache.storage.config import storage_config_for_pool
from hicache_prefill.hicache.storage.fault_injector import HiCacheStorageFailureInjector
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from tests.hicache.storage.helpers import fill_random, host_pool, same_slots, slot_bytes

N_KEYS, PAGE = 5, 2
KEYS = [page_hashes([k, k + 100], PAGE)[0] for k in range(N_KEYS)]

op = st.one_of(
    st.tuples(st.just("set_v1"), st.integers(0, N_KEYS - 1)),
    st.tuples(st.just("set"), st.integers(0, N_KEYS - 1)),
    st.tuples(st.just("get_v1"), st.integers(0, N_KEYS - 1)),
    st.tuples(st.just("get"), st.integers(0, N_KEYS - 1)),
    st.tuples(st.just("exists"), st.integers(0, N_KEYS - 1)),
    st.tuples(st.just("batch_exists"), st.integers(1, N_KEYS)),
    st.tuples(st.just("damage"), st.integers(0, N_KEYS - 1)),
    st.tuples(st.just("clear"), st.just(0)),
)


def content_slots(k: int) -> torch.Tensor:
    """Where page ``k``'s content sits in the source pool (one page per key)."""
    return torch.arange(k * PAGE, (k + 1) * PAGE)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    layout=st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
    kind=st.sampled_from(["mha", "mla"]),
    failure=st.sampled_from([0.0, 0.3]),
    budget_pages=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_pages_read_back_exact_or_missing(ops, layout, kind, failure, budget_pages, seed) -> None:
    src = host_pool(kind, layout, page=PAGE, size=8)  # 16 slots: one page per key, and spare
    dst = host_pool(kind, layout, page=PAGE, size=8)
    fill_random(src, seed)
    fill_random(dst, seed + 1)
    with tempfile.TemporaryDirectory() as d:
        extra = {"file_storage_path": d, "max_size": budget_pages * src.page_nbytes}
        writer = HiCacheFile(storage_config_for_pool(src, "m", extra_config=extra))
        reader = HiCacheFile(
            storage_config_for_pool(dst, "m", extra_config={"file_storage_path": d})
        )
        w = HiCacheStorageFailureInjector(writer, 0.0, failure, seed=seed)
        r = HiCacheStorageFailureInjector(reader, 0.0, failure, seed=seed + 7)
        w.register_mem_pool_host(src)
        r.register_mem_pool_host(dst)
        exact = failure == 0 and budget_pages == 0
        stored: set[int] = set()
        for name, k in ops:
            before = slot_bytes(dst, range(dst.size))
            touched: range | None = None
            if name == "set_v1":
                if w.batch_set_v1([KEYS[k]], content_slots(k)) == [True]:
                    stored.add(k)
            elif name == "set":
                if w.set(KEYS[k], src.get_data_page(k * PAGE)):
                    stored.add(k)
            elif name == "get_v1":
                at = (N_KEYS + k % 3) * PAGE  # a spare page of the reader
                hit = r.batch_get_v1([KEYS[k]], torch.arange(at, at + PAGE)) == [True]
                if hit:
                    touched = range(at, at + PAGE)
                    assert same_slots(src, content_slots(k), dst, touched), "wrong KV read back"
                assert not exact or hit == (k in stored)
            elif name == "get":
                page = r.get(KEYS[k], dst.get_dummy_flat_data_page())
                if page is not None:
                    assert torch.equal(_raw(page), _raw(src.get_data_page(k * PAGE)))
                assert not exact or (page is not None) == (k in stored)
            elif name == "exists":
                assert not exact or r.exists(KEYS[k]) == (k in stored)
            elif name == "batch_exists":
                n = r.batch_exists(KEYS[:k])
                assert 0 <= n <= k
                if exact:
                    want = next((i for i in range(k) if i not in stored), k)
                    assert n == want
            elif name == "damage":
                path = writer.path_of(KEYS[k])
                if os.path.exists(path):
                    with open(path, "r+b") as f:
                        f.truncate(os.path.getsize(path) // 2)
                stored.discard(k)
            else:
                assert w.clear()
                stored.clear()
            after = slot_bytes(dst, range(dst.size))
            for slot in range(dst.size):
                if touched is None or slot not in touched:
                    assert all(
                        torch.equal(a[slot], b[slot]) for a, b in zip(before, after, strict=True)
                    )
        assert not any(n.endswith(".tmp") for n in os.listdir(d))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)
