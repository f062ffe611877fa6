"""Property test: long sequences of cache operations over every tier (device, host, L3) with the
fault injector in front of the storage (random delays, random failures of every call), pages
damaged in the store, restarts that find the previous cache's pages, and every write policy and
host memory mode. After every operation the cache's integrity holds; every prefix read, whether
it was on the device, loaded back from the host or fetched from storage, holds exactly its
tokens' KV; at the end nothing is held (no host page, lock or operation leaked) and the cache
kept serving."""

from __future__ import annotations

import os
import random
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_prefill.hicache.storage.fault_injector import ENV_DELAY, ENV_FAILURE
from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle
from tests.hicache.storage.io.io_helpers import STORES, build, drain
from tests.support.kv_content import check_device, write_device

PAGE, PATTERNS, MAX_PAGES = 4, 4, 6
CONFIGS = [("write_through", "cache"), ("write_through_selective", "cache"),
           ("write_back", "cache"), ("write_through", "buffer_only")]  # fmt: skip
POLICIES = ("best_effort", "wait_complete", "timeout")


def _tokens(pages: list[int]) -> list[int]:
    return [1000 * p + i for p in pages for i in range(PAGE)]


class Story:
    def __init__(self, seed: int, config: int, policy: str) -> None:
        self.rng = random.Random(seed)
        self.policy, self.mode = CONFIGS[config]
        self.store = f"faults-{seed}-{config}"
        STORES.pop(self.store, None)
        self.prefetch_policy = policy
        self.served = 0
        self.now = 0.0
        self.n = 0
        self.open()

    def open(self) -> None:
        self.kv, self.backend = build(
            self.store, policy=self.policy, mode=self.mode, tokens=48, threshold=PAGE,
            hicache_storage_prefetch_policy=self.prefetch_policy,
            extra={"prefetch_timeout_base": 0.01},
        )  # fmt: skip

    def request(self) -> None:
        kv, tree = self.kv, self.kv.tree
        pages = [self.rng.randrange(PATTERNS) for _ in range(self.rng.randint(1, MAX_PAGES))]
        key = _tokens(pages)
        m = tree.match_prefix(key)
        matched = m.device_indices.numel() + m.host_hit_length
        self.n += 1
        handle = CacheRequestHandle(f"q{self.n}", 0)
        if kv.storage.prefetch(handle, m.last_host_node, key[matched:], matched):
            while not kv.storage.check_prefetch_progress(handle, self.now):
                tree.check_hicache_events()
                self.now += 0.002
                time.sleep(0.0005)
            if kv.storage.buffer_only:
                kv.storage.attach_staged(handle, key)
            kv.storage.release(handle)
            m = tree.match_prefix(key)
        prefix, last = m.device_indices, m.last_device_node
        if m.host_hit_length:
            import torch

            dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
            tree.ready_to_load_host_cache()
            prefix = torch.cat([prefix, dev])
        tree.inc_lock_ref(last)
        for layer in range(kv.device_pool.layer_num):
            tree.layer_wait(layer)
        check_device(kv.device_pool, prefix, key[: len(prefix)], range(len(prefix)))
        new = kv.alloc_device(len(key) - len(prefix))
        if new is not None:
            import torch

            write_device(kv.device_pool, new, key[len(prefix) :], range(len(prefix), len(key)))
            assert tree.insert(key, torch.cat([prefix, new])) == len(prefix)
            self.served += 1
        tree.dec_lock_ref(last)

    def step(self, op: str) -> None:
        tree = self.kv.tree
        tree.check_hicache_events()
        if op == "request":
            self.request()
        elif op == "evict":
            tree.evict(self.rng.randint(1, 12) * PAGE)
        elif op == "evict_host":
            tree.evict_host(self.rng.randint(1, 12) * PAGE)
        elif op == "damage" and self.backend.pages:
            name = self.rng.choice(sorted(self.backend.pages))
            self.backend.pages[name] = self.backend.pages[name][: -self.rng.randint(1, 8)]
        elif op == "restart":
            drain(self.kv)
            self.kv.close()
            self.open()
        elif op == "drain":
            drain(self.kv)
        self.kv.check_integrity()

    def finish(self) -> None:
        drain(self.kv)
        kv = self.kv
        kv.check_integrity()
        assert all(x.lock_ref == 0 and x.host_ref == 0 for x in kv.tree.all_nodes())
        assert kv.storage.host_slots_held() == 0 and not kv.storage.prefetches.ongoing
        kv.close()


OPS = st.lists(
    st.sampled_from(["request"] * 5 + ["evict", "evict", "evict_host", "damage", "restart",
                                       "drain"]),
    min_size=30, max_size=60,
)  # fmt: skip


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), config=st.integers(0, len(CONFIGS) - 1),
       policy=st.sampled_from(POLICIES), ops=OPS)  # fmt: skip
def test_faults_never_give_wrong_kv_nor_leak(seed, config, policy, ops):
    saved = {k: os.environ.get(k) for k in (ENV_DELAY, ENV_FAILURE)}
    os.environ[ENV_DELAY] = "0.001"
    os.environ[ENV_FAILURE] = "0.15"
    try:
        story = Story(seed, config, policy)
        assert type(story.kv.storage.backend).__name__ == "HiCacheStorageFailureInjector"
        for op in ops:
            story.step(op)
        story.finish()
        assert story.served > 0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
