"""The multi-turn trace of ``bench_cache_ops`` and the drivers that play it on a radix tree.

Trace (deterministic per seed): 4 shared system prompts; each step either continues one of the
active conversations (80%) or starts a new one under a random system prompt; the step's key is
the conversation so far plus a new user turn and the model's reply. A conversation past
``max_conv_tokens`` is retired. Every segment is a multiple of 16 tokens, so keys are whole pages
at page 1 and 16 and every tree sees the same keys. Each step also carries a pure-miss key
(token ids no conversation uses).

A step on a tree (``play_step``), each op timed alone with ``perf_counter_ns``:
``match`` (match plus the device indices of the hit, as the scheduler needs them), ``lock`` the
matched node, allocate the rest (not timed), ``insert``, free the duplicates (not timed),
``unlock``, then ``miss`` (the pure-miss match). ``evict`` is timed by the caller's schedule.

``ProjectDriver`` plays it on this project's ``RadixCache`` with keys as ``array('q')``, the key
type SGLang 0.5.23 carries token ids in (its tokenizer manager converts ``input_ids`` to one) and
the one SGLang's trees get here, built outside the timed region as theirs are;
``ProjectListDriver`` plays the same steps with keys as lists of fresh ints (what this project's
executor passes), so the table shows the price of converting a list key too. The project drivers
also time the allocator's ``free`` inside every eviction (``free_ns``), so an eviction's cost
splits into the tree's share and the allocator's. ``bench/cache_ops/sglang_trees.py`` has the
drivers for SGLang's trees (same interface).
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.tree.radix_cache import RadixCache

SEGMENT = 16  # every segment is a multiple of this many tokens
VOCAB = 50_000
MISS_TOKEN = VOCAB + 1  # never in a conversation


@dataclass(frozen=True)
class Step:
    key: list[int]
    miss_key: list[int]


class MultiTurnTrace:
    """Keys of a multi-turn chat workload sized for a tree of ``capacity`` tokens."""

    def __init__(
        self,
        capacity: int,
        seed: int = 0,
        system_tokens: int = 256,
        user_tokens: tuple[int, int] = (32, 256),
        reply_tokens: tuple[int, int] = (64, 512),
        p_continue: float = 0.8,
        max_conv_tokens: int = 8192,
    ) -> None:
        self.rng = random.Random(seed)
        self.systems = [self._tokens(system_tokens) for _ in range(4)]
        self.user_tokens = user_tokens
        self.reply_tokens = reply_tokens
        self.p_continue = p_continue
        self.max_conv_tokens = max_conv_tokens
        # About 1/4 of the tree's tokens belong to conversations still going on.
        self.max_active = max(4, capacity // (4 * 2048))
        self.active: list[list[int]] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def _segment(self, lo_hi: tuple[int, int]) -> list[int]:
        lo, hi = lo_hi
        return self._tokens(self.rng.randrange(lo // SEGMENT, hi // SEGMENT + 1) * SEGMENT)

    def __iter__(self) -> Iterator[Step]:
        rng = self.rng
        while True:
            turn = self._segment(self.user_tokens) + self._segment(self.reply_tokens)
            if self.active and rng.random() < self.p_continue:
                i = rng.randrange(len(self.active))
                key = self.active[i] + turn
                if len(key) > self.max_conv_tokens:
                    self.active.pop(i)
                else:
                    self.active[i] = key
            else:
                key = rng.choice(self.systems) + turn
                if len(self.active) < self.max_active:
                    self.active.append(key)
                else:
                    self.active[rng.randrange(len(self.active))] = key
            miss = [MISS_TOKEN] + self._tokens(511)
            yield Step(key, miss)


class ProjectDriver:
    """This project's device-only ``RadixCache`` with its own allocator; keys as ``array('q')``.

    ``free_ns``: nanoseconds spent in the allocator's ``free`` so far (the tree's evictions and
    the caller's frees of duplicates), read around an eviction by ``timed_evict``."""

    name = "project"

    def __init__(self, pool_tokens: int, page_size: int) -> None:
        self.allocator = TokenToKVPoolAllocator(pool_tokens, page_size, "cpu")
        self.tree = RadixCache(self.allocator, page_size)
        self.free_ns = 0
        free = self.allocator.free
        clock = time.perf_counter_ns

        def timed_free(slots: torch.Tensor) -> None:
            t0 = clock()
            free(slots)
            self.free_ns += clock() - t0

        self.allocator.free = timed_free  # the tree frees through this instance attribute

    def prepare(self, key: list[int]) -> Any:
        # A fresh buffer per request, as SGLang's trees get theirs (RadixKey(array("q", ...))).
        return array("q", key)

    def match(self, key: Any) -> tuple[int, torch.Tensor, Any]:
        m = self.tree.match_prefix(key)
        return len(m.device_indices), m.device_indices, m.last_device_node

    def miss(self, key: Any) -> int:
        return len(self.tree.match_prefix(key).device_indices)

    def lock(self, node: Any) -> Any:
        self.tree.inc_lock_ref(node)
        return node

    def unlock(self, node: Any, token: Any) -> None:
        self.tree.dec_lock_ref(token)

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    frees_duplicates = False  # the caller frees value[matched:returned] (none here)

    def insert(self, key: Any, slots: torch.Tensor, matched: int) -> int:
        return self.tree.insert(key, slots)

    def evict(self, n: int) -> int:
        return self.tree.evict(n)

    def size(self) -> int:
        return self.tree.total_size()

    def available(self) -> int:
        return self.allocator.available_size()

    def check(self) -> None:
        self.tree.check_integrity()


class ProjectListDriver(ProjectDriver):
    """``ProjectDriver`` with keys as lists of ints (the tree converts them at each call)."""

    name = "project_list"

    def prepare(self, key: list[int]) -> Any:
        # A fresh list of fresh int objects, as a scheduler gets token ids from a tokenizer: the
        # trace builds each turn's key from the previous one, and sharing those int objects with
        # the keys stored in the tree would make the conversion read warm objects only.
        return array("q", key).tolist()


OPS = ("match", "miss", "insert", "lock", "unlock")


def play_step(driver: Any, step: Step, samples: dict[str, list[float]] | None) -> tuple[int, int]:
    """One request of the trace on ``driver``; appends each op's microseconds to ``samples``
    (when given). Returns ``(matched tokens, new tokens)``."""
    key = driver.prepare(step.key)
    miss_key = driver.prepare(step.miss_key)
    clock = time.perf_counter_ns
    t0 = clock()
    matched, indices, node = driver.match(key)
    t1 = clock()
    token = driver.lock(node)
    t2 = clock()
    need = len(step.key) - matched
    slots = driver.alloc(need)
    if slots is None:
        driver.evict(need - driver.available())
        slots = driver.alloc(need)
    full = torch.cat([indices, slots])
    t3 = clock()
    present = driver.insert(key, full, matched)
    t4 = clock()
    if present > matched and not driver.frees_duplicates:
        driver.free(full[matched:present])
    t5 = clock()
    driver.unlock(node, token)
    t6 = clock()
    driver.miss(miss_key)
    t7 = clock()
    if samples is not None:
        samples["match"].append((t1 - t0) / 1e3)
        samples["lock"].append((t2 - t1) / 1e3)
        samples["insert"].append((t4 - t3) / 1e3)
        samples["unlock"].append((t6 - t5) / 1e3)
        samples["miss"].append((t7 - t6) / 1e3)
    return matched, need


def timed_evict(driver: Any, n: int) -> tuple[float, int, float | None]:
    """``driver.evict(n)``: (microseconds, tokens freed, microseconds of it in the allocator's
    ``free``, or ``None`` for a driver that does not time its allocator)."""
    before = getattr(driver, "free_ns", None)
    t0 = time.perf_counter_ns()
    freed = driver.evict(n)
    us = (time.perf_counter_ns() - t0) / 1e3
    if before is None:
        return us, freed, None
    return us, freed, (driver.free_ns - before) / 1e3
