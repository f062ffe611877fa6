"""Random sequences of cache operations against the real controller with delayed CPU streams.

A hypothesis state machine plays requests (match, optional load back, compute the missing pages,
insert, release), standalone locks and unlocks, device and host evictions, and ack polls, in any
order. After every step: ``check_integrity`` of the tree, allocators and controller, and every
readable device slot and acked host copy is compared bit for bit with the KV its tokens must
have (``tests/support/kv_content.py``). Requests also read their whole prefix after ``layer_wait``
and check it, so a load back or a device hit that serves wrong KV is caught where it is used.

Configurations cover every pair of (layout + io backend, page size, MHA/MLA, write policy), plus
SGLang's chunked-insert behaviour once and a host pool smaller than the device pool (failed
backups, host eviction to make room, write-back drops) per policy; Triton kernels run
interpreted, so geometry is tiny and examples are few (about a minute on two cores).
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
from hicache_prefill.server_args import ServerArgs
from tests.support.kv_content import check_device, check_tree_content, write_device


class Config(NamedTuple):
    layout: str
    io: str
    page_size: int
    use_mla: bool
    policy: str
    upstream: bool = False  # SGLang's chunked-insert behaviour
    host_ratio: float = 2.0  # < 1: host pressure (failed backups, host eviction on backup)
    threshold_pages: int = 0  # load_back_threshold in pages (0: load any host hit)


CONFIGS = [
    Config("layer_first", "kernel", 1, False, "write_through"),
    Config("layer_first", "kernel", 16, True, "write_back"),
    Config("page_first", "kernel", 16, False, "write_back"),
    Config("page_first", "kernel", 1, True, "write_through_selective"),
    Config("layer_first", "direct", 16, False, "write_through_selective"),
    Config("layer_first", "direct", 1, True, "write_back"),
    Config("page_first_direct", "direct", 16, True, "write_through"),
    Config("page_first_direct", "direct", 1, False, "write_through_selective"),
    Config("layer_first", "direct", 16, False, "write_through", upstream=True),
    # a host pool smaller than the device pool, and short host hits recomputed
    Config("layer_first", "direct", 1, False, "write_through", host_ratio=0.5, threshold_pages=2),
    Config("page_first", "kernel", 16, True, "write_back", host_ratio=0.5, threshold_pages=2),
    Config("page_first_direct", "direct", 16, False, "write_through_selective", host_ratio=0.75),
]
DEVICE_PAGES = 8  # device pool; the host pool is twice as large
MAX_KEY_PAGES = 4
PAGE_PATTERNS = 3  # a small alphabet of pages, so keys share prefixes and nodes split


def _key(pages: list[int], page_size: int) -> list[int]:
    return [1000 * p + i for p in pages for i in range(page_size)]


def _machine(config: Config) -> type[RuleBasedStateMachine]:
    layout, io, page_size, use_mla, policy, upstream, host_ratio, threshold_pages = config
    pages_st = st.lists(st.integers(0, PAGE_PATTERNS - 1), min_size=1, max_size=MAX_KEY_PAGES)

    class CacheMachine(RuleBasedStateMachine):
        @initialize()
        def build(self) -> None:
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
                load_back_threshold=max(1, threshold_pages * page_size),
                hicache_upstream_chunked_insert=upstream,
                **geometry,
            )
            assert (args.hicache_mem_layout, args.hicache_io_backend) == (layout, io)
            self.kv = build_kv_cache(args, copy_delay=lambda: random.random() * 0.002)
            self.tree = self.kv.tree
            self.held: list = []

        # ------------------------------------------------------------------ requests
        @rule(pages=pages_st, chunked=st.booleans(), load=st.sampled_from([True, True, False]))
        def request(self, pages: list[int], chunked: bool, load: bool) -> None:
            """Match, maybe load back, read the prefix, compute the rest, insert, release."""
            tree, kv = self.tree, self.kv
            key = _key(pages, page_size)
            m = tree.match_prefix(key)
            prefix, last = m.device_indices, m.last_device_node
            if load and m.host_hit_length:
                dev, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
                tree.ready_to_load_host_cache()
                prefix = torch.cat([prefix, dev])
            tree.inc_lock_ref(last)
            for layer in range(kv.device_pool.layer_num):
                tree.layer_wait(layer)
            if len(prefix):  # (kv_content's checks reject empty slot lists)
                check_device(kv.device_pool, prefix, key[: len(prefix)], range(len(prefix)))
            need = len(key) - len(prefix)
            new = kv.allocator.alloc(need)
            if new is None:
                tree.evict(need)
                new = kv.allocator.alloc(need)
            if new is None:  # no room even after eviction: the request waits (not an error)
                tree.dec_lock_ref(last)
                return
            kv.check_integrity(request_owned=need)
            write_device(kv.device_pool, new, key[len(prefix) :], range(len(prefix), len(key)))
            present = tree.insert(key, torch.cat([prefix, new]), chunked=chunked)
            assert present == len(prefix), (present, len(prefix))
            tree.dec_lock_ref(last)

        @rule(pages=pages_st, evict_pages=st.integers(1, DEVICE_PAGES))
        def evict_then_reuse(self, pages: list[int], evict_pages: int) -> None:
            """Device pressure, then a request that reuses the prefix (host hit -> load back)."""
            self.drain()
            self.tree.evict(evict_pages * page_size)
            self.request(pages, chunked=False, load=True)

        @rule(pages=pages_st)
        def match(self, pages: list[int]) -> None:
            m = self.tree.match_prefix(_key(pages, page_size))
            assert len(m.device_indices) % page_size == 0 and m.host_hit_length % page_size == 0

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
            before = self.kv.host_pool.available_size() + self.tree.host_in_flight()
            freed = self.tree.evict_host(pages * page_size)
            assert self.kv.host_pool.available_size() + self.tree.host_in_flight() == (
                before + freed
            )

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
            if hasattr(self, "kv"):
                self.kv.check_integrity()
                check_tree_content(self.kv)
                # the tree never frees a slot a copy still uses (no deferred free was needed)
                assert self.tree.device_in_flight() == 0 and self.tree.host_in_flight() == 0

        def teardown(self) -> None:
            if not hasattr(self, "kv"):
                return
            try:
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
                self.kv.close()

    CacheMachine.__name__ = f"CacheMachine_{layout}_{io}_p{page_size}_{policy}"
    return CacheMachine


def _id(c: Config) -> str:
    name = f"{c.layout}-{c.io}-p{c.page_size}-{'mla' if c.use_mla else 'mha'}-{c.policy}"
    if c.upstream:
        name += "-upstream"
    if c.host_ratio < 1:
        name += f"-host{c.host_ratio}"
    return name


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_random_operation_sequences(config: Config) -> None:
    run_state_machine_as_test(
        _machine(config),
        settings=settings(
            max_examples=20,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
