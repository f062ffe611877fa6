"""The multi-turn trace of ``bench.cache_ops`` and the project's driver that plays it on a tree.

Deterministic per seed: 4 shared system prompts; a step continues a chat (80%) or starts one with
a user turn and a reply (multiples of 16 tokens), plus a pure-miss key. ``play_step`` times each op
alone; allocation, frees of duplicates and building the ``array('q')`` keys are untimed.
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Iterator
from typing import Any

import torch

from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.tree.radix_cache import RadixCache

SEGMENT, VOCAB = 16, 50_000
OPS = ("match", "miss", "insert", "lock", "unlock")
Step = tuple[list[int], list[int]]  # a request's key, a pure-miss key


class MultiTurnTrace:
    """Keys of a multi-turn chat workload sized for a tree of ``capacity`` tokens."""

    def __init__(self, capacity: int, seed: int = 0, max_conv_tokens: int = 8192) -> None:
        self.rng = random.Random(seed)
        self.systems = [self._tokens(256) for _ in range(4)]
        self.max_conv_tokens = max_conv_tokens
        self.max_active = max(4, capacity // (4 * 2048))  # ~1/4 of the tree in live chats
        self.active: list[list[int]] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def _segment(self, lo: int, hi: int) -> list[int]:
        return self._tokens(self.rng.randrange(lo // SEGMENT, hi // SEGMENT + 1) * SEGMENT)

    def __iter__(self) -> Iterator[Step]:
        rng, active = self.rng, self.active
        while True:
            turn = self._segment(32, 256) + self._segment(64, 512)
            if active and rng.random() < 0.8:
                i = rng.randrange(len(active))
                key = active[i] + turn
                if len(key) > self.max_conv_tokens:  # retired
                    active.pop(i)
                else:
                    active[i] = key
            else:
                key = rng.choice(self.systems) + turn
                if len(active) < self.max_active:
                    active.append(key)
                else:
                    active[rng.randrange(len(active))] = key
            yield key, [VOCAB + 1] + self._tokens(511)


class ProjectDriver:
    """This project's device-only ``RadixCache`` over its own allocator."""

    name = "project"
    frees_duplicates = False  # the caller frees value[matched:returned]

    def __init__(self, pool_tokens: int, page_size: int) -> None:
        self.allocator = TokenToKVPoolAllocator(pool_tokens, page_size, "cpu")
        self.tree = RadixCache(self.allocator, page_size)

    def prepare(self, key: Any) -> array:
        return array("q", key)  # a fresh buffer per request, as SGLang's RadixKey gets

    def match(self, key: array) -> tuple[int, torch.Tensor, Any]:
        m = self.tree.match_prefix(key)
        return len(m.device_indices), m.device_indices, m.last_device_node

    def lock(self, node: Any) -> Any:
        self.tree.inc_lock_ref(node)
        return node

    def unlock(self, node: Any, token: Any) -> None:
        self.tree.dec_lock_ref(token)

    def insert(self, key: array, slots: torch.Tensor, matched: int) -> int:
        return self.tree.insert(key, slots)

    def evict(self, n: int) -> int:
        return self.tree.evict(n)


def alloc(driver: Any, n: int) -> torch.Tensor:
    """``n`` slots from the driver's allocator, evicting the shortfall first when short."""
    slots = driver.allocator.alloc(n)
    if slots is None:
        driver.evict(n - driver.allocator.available_size())
        slots = driver.allocator.alloc(n)
    return slots


def play_step(driver: Any, step: Step, samples: dict[str, list[float]] | None) -> tuple[int, int]:
    """One step on ``driver``, each op's microseconds appended to ``samples`` (when given);
    returns ``(matched tokens, new tokens)``."""
    key, miss_key = driver.prepare(step[0]), driver.prepare(step[1])
    clock = time.perf_counter_ns
    t0 = clock()
    matched, indices, node = driver.match(key)
    t1 = clock()
    token = driver.lock(node)
    t2 = clock()
    need = len(step[0]) - matched
    full = torch.cat([indices, alloc(driver, need)])
    t3 = clock()
    present = driver.insert(key, full, matched)
    t4 = clock()
    if present > matched and not driver.frees_duplicates:
        driver.allocator.free(full[matched:present])
    t5 = clock()
    driver.unlock(node, token)
    t6 = clock()
    driver.match(miss_key)
    t7 = clock()
    if samples is not None:
        for op, ns in zip(OPS, (t1 - t0, t7 - t6, t4 - t3, t2 - t1, t6 - t5), strict=True):
            samples[op].append(ns / 1e3)
    return matched, need
