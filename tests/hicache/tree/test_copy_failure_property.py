"""Random sequences of cache operations with copies that fail, in both CPU stream modes.

The state machine of ``test_hicache_property`` (requests that match, load back, read their
prefix after ``layer_wait``, compute the rest and insert; locks, evictions of both tiers, ack
polls) runs with a seeded share of every copy call failing (``tests/support/faults.py``: the
host pool's copies, the kernel and direct ops under them, the index move) and, on thread
streams, random copy delays. A request whose load back fails releases its lock, has the tree
undo the load (``cancel_load_back``) and recomputes. After every step: ``check_integrity`` and
every readable device slot and acked host copy bit for bit (a failed copy must never leave
readable garbage), and no slot held for a copy in flight. At the end everything is evicted and
both pools are whole again.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from hicache_prefill.hicache.builder import build_kv_cache
from hicache_prefill.hicache.transfer.errors import LoadBackError
from hicache_prefill.server_args import ServerArgs
from tests.support.faults import CopyFaults
from tests.support.kv_content import check_device, check_tree_content, write_device


class Config(NamedTuple):
    layout: str
    io: str
    page_size: int
    use_mla: bool
    policy: str
    host_ratio: float = 2.0


CONFIGS = [
    Config("layer_first", "direct", 2, False, "write_through"),
    Config("page_first_direct", "direct", 2, True, "write_back", host_ratio=0.75),
    Config("page_first", "kernel", 1, False, "write_through"),
]
DEVICE_PAGES = 8
MAX_KEY_PAGES = 3
PAGE_PATTERNS = 3
FAIL_RATE = 0.12  # per wrapped call; a copy passes two or three of them


def _key(pages: list[int], page_size: int) -> list[int]:
    return [1000 * p + i for p in pages for i in range(page_size)]


def _machine(config: Config, mode: str) -> type[RuleBasedStateMachine]:
    layout, io, page_size, use_mla, policy, host_ratio = config
    pages_st = st.lists(st.integers(0, PAGE_PATTERNS - 1), min_size=1, max_size=MAX_KEY_PAGES)

    class FailingCacheMachine(RuleBasedStateMachine):
        @initialize(seed=st.integers(0, 2**16))
        def build(self, seed: int) -> None:
            geometry = (
                dict(use_mla=True, kv_lora_rank=4, qk_rope_head_dim=2)
                if use_mla
                else dict(head_num=1)
            )
            args = ServerArgs(
                device="cpu",
                num_layers=2,
                head_dim=4,
                max_total_tokens=DEVICE_PAGES * page_size,
                page_size=page_size,
                enable_hierarchical_cache=True,
                hicache_ratio=host_ratio,
                hicache_write_policy=policy,
                hicache_mem_layout=layout,
                hicache_io_backend=io,
                load_back_threshold=1,
                **geometry,
            )
            rng = random.Random(seed)
            delay = (lambda: rng.random() * 0.001) if mode == "thread" else 0.0
            self.kv = build_kv_cache(args, copy_delay=delay, streams=mode)
            self.tree = self.kv.tree
            self.held: list = []
            self.load_failures = 0
            self.faults = CopyFaults().fail_rate(FAIL_RATE, seed).install()

        # ------------------------------------------------------------------ requests
        @rule(pages=pages_st, load=st.sampled_from([True, True, False]))
        def request(self, pages: list[int], load: bool) -> None:
            """Match, maybe load back (recompute when it fails), read, compute, insert."""
            tree, kv = self.tree, self.kv
            key = _key(pages, page_size)
            m = tree.match_prefix(key)
            prefix, last = m.device_indices, m.last_device_node
            if load and m.host_hit_length:
                dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
                prefix = torch.cat([prefix, dev])
            tree.inc_lock_ref(last)
            try:
                tree.ready_to_load_host_cache()
                for layer in range(kv.device_pool.layer_num):
                    tree.layer_wait(layer)
            except LoadBackError:
                self.load_failures += 1
                tree.dec_lock_ref(last)
                tree.cancel_load_back()
                kv.check_integrity()
                m = tree.match_prefix(key)  # recompute the host hit
                prefix, last = m.device_indices, m.last_device_node
                tree.inc_lock_ref(last)
            if len(prefix):
                check_device(kv.device_pool, prefix, key[: len(prefix)], range(len(prefix)))
            need = len(key) - len(prefix)
            new = kv.allocator.alloc(need)
            if new is None:
                tree.evict(need)
                new = kv.allocator.alloc(need)
            if new is None:
                tree.dec_lock_ref(last)
                return
            write_device(kv.device_pool, new, key[len(prefix) :], range(len(prefix), len(key)))
            present = tree.insert(key, torch.cat([prefix, new]))
            assert present == len(prefix), (present, len(prefix))
            tree.dec_lock_ref(last)

        @rule(pages=pages_st, evict_pages=st.integers(1, DEVICE_PAGES))
        def evict_then_reuse(self, pages: list[int], evict_pages: int) -> None:
            self.drain()
            self.tree.evict(evict_pages * page_size)
            self.request(pages, load=True)

        @rule(pages=pages_st)
        def lock(self, pages: list[int]) -> None:
            node = self.tree.match_prefix(_key(pages, page_size)).last_device_node
            if node is not self.tree.root_node:
                self.tree.inc_lock_ref(node)
                self.held.append(node)

        @rule(i=st.integers(0, 100))
        def unlock(self, i: int) -> None:
            # No precondition: what is held depends on copy timing, and Hypothesis needs the
            # same rules enabled when it replays a sequence.
            if not self.held:
                return
            self.tree.dec_lock_ref(self.held.pop(i % len(self.held)))

        @rule(pages=st.integers(1, DEVICE_PAGES))
        def evict(self, pages: int) -> None:
            self.tree.evict(pages * page_size)

        @rule(pages=st.integers(1, 2 * DEVICE_PAGES))
        def evict_host(self, pages: int) -> None:
            self.tree.evict_host(pages * page_size)

        @rule()
        def poll(self) -> None:
            self.tree.check_hicache_events()

        @rule()
        def drain(self) -> None:
            self.kv.controller.write_stream.synchronize()
            self.kv.controller.load_stream.synchronize()
            self.tree.check_hicache_events()

        # ------------------------------------------------------------------ checks
        @invariant()
        def consistent(self) -> None:
            if not hasattr(self, "kv"):
                return
            self.kv.check_integrity()
            check_tree_content(self.kv)
            assert self.tree.device_in_flight() == 0 and self.tree.host_in_flight() == 0
            s = self.kv.stats
            assert s.d2h_failed_copies + s.h2d_failed_copies <= len(self.faults.failures)
            assert s.h2d_failed_copies >= self.load_failures

        def teardown(self) -> None:
            if not hasattr(self, "kv"):
                return
            try:
                self.faults.off()
                for node in self.held:
                    self.tree.dec_lock_ref(node)
                self.drain()
                self.tree.evict(10**9)
                self.tree.evict_host(10**9)
                self.drain()
                self.kv.check_integrity()
                assert not self.tree.root_node.children, "unlocked nodes survived eviction"
                assert self.kv.allocator.available_size() == self.kv.allocator.size
                assert self.kv.host_pool.available_size() == self.kv.host_pool.size
            finally:
                self.faults.restore()
                self.kv.close()

    FailingCacheMachine.__name__ = f"FailingCacheMachine_{layout}_{io}_{policy}_{mode}"
    return FailingCacheMachine


def _id(c: Config) -> str:
    return f"{c.layout}-{c.io}-p{c.page_size}-{'mla' if c.use_mla else 'mha'}-{c.policy}"


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_random_operations_with_failing_copies(config: Config, stream_mode: str) -> None:
    run_state_machine_as_test(
        _machine(config, stream_mode),
        settings=settings(
            max_examples=8,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
