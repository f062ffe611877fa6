"""``PrefetchBook``: the scheduler-thread side of prefetches from storage (SGLang 0.5.23's
``prefetch_from_storage``, ``check_prefetch_progress``, ``_handle_prefetch_result``).

Nothing of a released attempt reaches the next one (a late ack only frees). From the hit on, the
host slots are the operation's; at the result ``[:completed]`` go to the tree (cache mode) or the
staging (``buffer_only``), the rest stay held until the completion ack, then are freed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hicache_prefill.hicache.storage.extra_config import StorageSettings
from hicache_prefill.hicache.storage.io.workers import (
    CacheRequestHandle,
    PrefetchAck,
    PrefetchOperation,
    StorageStats,
    StorageWorkers,
)
from hicache_prefill.hicache.tp.agreed import agreed_alloc
from hicache_prefill.hicache.tp.group import TPGroup

logger = logging.getLogger(__name__)

CACHE_PREFETCH_CAPACITY_FRACTION = 0.5  # of the host pool, reserved by prefetches
BUFFER_PREFETCH_CAPACITY_FRACTION = 0.9  # SGLang HICACHE_LOAD_POOL_USAGE_FRACTION


class StorageTree(Protocol):
    """What the storage tier needs of its ``HiRadixCache``."""

    page_size: int
    root_node: Any
    host_allocator: Any  # the host pool's TokenToKVPoolAllocator
    controller: Any  # HiCacheController: evict_host (deferred frees)
    group: TPGroup
    load_back_threshold: int

    def protect_host(self, node: Any) -> None: ...

    def release_host(self, node: Any) -> None: ...

    def staged_write_tokens(self) -> int: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def insert_host(
        self, anchor: Any, key: list[int], host_indices: torch.Tensor, hashes: list[str]
    ) -> int: ...

    def match_prefix(self, key: list[int]) -> Any: ...


@dataclass
class _Ongoing:
    op: PrefetchOperation
    anchor: Any  # cache mode: the protected node the pages hang from; None for buffer_only
    reserved: int  # cache mode: tokens counted in ``occupied_tokens``


@dataclass(frozen=True)
class StagedPrefetch:
    """``buffer_only``: ``num_tokens`` fetched tokens from token ``storage_start`` of the
    request, parked in host slots ``host_indices`` for their attempt."""

    host_indices: torch.Tensor
    hash_value: list[str]
    storage_start: int
    num_tokens: int


class PrefetchBook:
    """Prefetches in flight, by attempt. ``absent`` is told of keys a query agreed are not
    stored."""

    def __init__(
        self,
        tree: StorageTree,
        workers: StorageWorkers,
        settings: StorageSettings,
        stats: StorageStats,
        write_staged_tokens: Callable[[], int],
        absent: Callable[[list[str]], None],
    ) -> None:
        self.tree = tree
        self.workers = workers
        self.settings = settings
        self.stats = stats
        self.page_size = workers.page_size
        self.write_staged_tokens = write_staged_tokens
        self.absent = absent
        self.ongoing: dict[CacheRequestHandle, _Ongoing] = {}
        self.orphans: dict[int, tuple[PrefetchOperation, int]] = {}  # op id -> (op, held from)
        self.staged: dict[CacheRequestHandle, StagedPrefetch] = {}
        self.loaded: dict[CacheRequestHandle, int] = {}
        self.loaded_start: dict[CacheRequestHandle, int] = {}  # first inserted token's position
        self.occupied_tokens = 0
        size = tree.host_allocator.size
        fraction = (
            BUFFER_PREFETCH_CAPACITY_FRACTION
            if settings.buffer_only
            else CACHE_PREFETCH_CAPACITY_FRACTION
        )
        self.capacity_limit = int(size * fraction)

    def rate_limited(self) -> bool:
        if self.settings.buffer_only:
            alloc = self.tree.host_allocator
            used = alloc.size - alloc.available_size() - self.write_staged_tokens()
            return max(0, used) >= self.capacity_limit
        return self.occupied_tokens >= self.capacity_limit

    def prefetch(
        self,
        handle: CacheRequestHandle,
        anchor: Any,
        new_tokens: list[int],
        last_hash: str | None,
        storage_start: int,
        prefix_keys: list[str] | None = None,
    ) -> bool:
        """``False`` when declined or when the attempt already has one."""
        if handle in self.ongoing or handle in self.staged:
            return False
        key = new_tokens[: len(new_tokens) // self.page_size * self.page_size]
        if len(key) < self.settings.prefetch_threshold:
            if key:
                self.stats.prefetch_too_short += 1
            return False
        if self.rate_limited():
            self.stats.prefetch_rate_limited += 1
            return False
        op = PrefetchOperation(
            handle, list(key), last_hash, prefix_keys=prefix_keys, storage_start=storage_start
        )
        if self.settings.buffer_only:
            self.ongoing[handle] = _Ongoing(op, None, 0)
        else:
            self.tree.protect_host(anchor)
            self.occupied_tokens += len(key)
            self.ongoing[handle] = _Ongoing(op, anchor, len(key))
        self.stats.prefetch_issued += 1
        self.workers.query_queue.put(op)
        return True

    def on_hit(self, op: PrefetchOperation, pages: int) -> None:
        entry = self.ongoing.get(op.handle)
        if entry is None or entry.op is not op:
            self.stats.prefetch_revoked += 1  # released before its hit was known
            return
        if self.settings.buffer_only and pages < len(op.all_hash_values):
            self.absent(op.all_hash_values[pages:])
        tokens = pages * self.page_size
        if op.is_terminated() or tokens < self.settings.prefetch_threshold:
            self._revoke(op.handle)
            return
        slots = self._alloc(tokens)
        if slots is None:
            self._revoke(op.handle)
            return
        op.hash_value = op.all_hash_values[: slots.numel() // self.page_size]
        op.host_indices = slots
        self.stats.prefetch_hit_tokens += slots.numel()
        self.workers.io_queue.put(op)

    def _alloc(self, tokens: int) -> torch.Tensor | None:
        """Host slots for a hit, agreed on every rank (cache mode may evict, then go partial)."""
        tree, ps = self.tree, self.page_size
        group, alloc = tree.group, tree.host_allocator
        slots = agreed_alloc(group, alloc, tokens, pool="host", tag="storage_prefetch_room")
        if slots is not None or self.settings.buffer_only:
            return slots
        need = group.agree_max(tokens - alloc.available_size(), tag="storage_prefetch_evict")
        tree.evict_host(max(need, 0))
        slots = agreed_alloc(group, alloc, tokens, pool="host", tag="storage_prefetch_room2")
        if slots is not None:
            return slots
        free = group.agree_min(alloc.available_size() // ps * ps, tag="storage_prefetch_free")
        if free < self.settings.prefetch_threshold:
            return None
        return agreed_alloc(group, alloc, free, pool="host", tag="storage_prefetch_partial")

    def _revoke(self, handle: CacheRequestHandle) -> None:
        entry = self.ongoing.pop(handle)
        self._release_anchor(entry)
        self.stats.prefetch_revoked += 1

    def _release_anchor(self, entry: _Ongoing) -> None:
        if entry.anchor is not None:
            self.tree.release_host(entry.anchor)
            self.occupied_tokens -= entry.reserved

    def on_ack(self, ack: PrefetchAck, completed_tokens: int) -> None:
        op = ack.operation
        if not ack.completed_req:
            op.completed_tokens = completed_tokens
            return
        op.done = True
        orphan = self.orphans.pop(op.id, None)
        if orphan is not None:
            self.free_slots(op.host_indices[orphan[1] :])
            return
        entry = self.ongoing.get(op.handle)
        if entry is not None and entry.op is op:
            self._apply_result(op)

    def check_progress(self, handle: CacheRequestHandle, now: float) -> bool:
        """Whether the attempt may be admitted now. Collective under ``timeout``."""
        entry = self.ongoing.get(handle)
        if entry is None:
            return True
        op = entry.op
        if not op.is_terminated():
            if not self._can_terminate(op, now):
                if op.wait_started is None:
                    op.wait_started = now
                return False
        op.mark_terminate()
        self.stats.prefetch_terminated += 1
        if op.host_indices is None:
            self._revoke(handle)
        else:
            self._apply_result(op)
        return True

    def _can_terminate(self, op: PrefetchOperation, now: float) -> bool:
        policy = self.settings.prefetch_policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        expired = False
        if op.wait_started is not None:
            landed = (
                op.host_indices is not None
                and op.completed_tokens >= len(op.hash_value) * self.page_size
            )
            budget = self.settings.timeout_s(op.requested_tokens, self.page_size)
            expired = not landed and now - op.wait_started >= budget  # a virtual clock lands on it
        return self.tree.group.agree_any(expired, tag="storage_prefetch_timeout")

    def next_deadline(self) -> float | None:
        if self.settings.prefetch_policy != "timeout":
            return None
        times = [
            e.op.wait_started + self.settings.timeout_s(e.op.requested_tokens, self.page_size)
            for e in self.ongoing.values()
            if e.op.wait_started is not None
        ]
        return min(times) if times else None

    def take_loaded(self, handle: CacheRequestHandle) -> int:
        return self.take_loaded_span(handle)[0]

    def take_loaded_span(self, handle: CacheRequestHandle) -> tuple[int, int | None]:
        """(tokens the attempt's prefetch inserted, the position of the first; ``None`` when
        none)."""
        return self.loaded.pop(handle, 0), self.loaded_start.pop(handle, None)

    def take_staged(self, handle: CacheRequestHandle) -> StagedPrefetch | None:
        """The caller frees or attaches them."""
        return self.staged.pop(handle, None)

    def _apply_result(self, op: PrefetchOperation) -> None:
        entry = self.ongoing.pop(op.handle)
        done, ps = op.completed_tokens, self.page_size
        slots = op.host_indices
        assert slots is not None
        self.stats.prefetch_fetched_tokens += done
        if self.settings.buffer_only:
            if done:
                self.staged[op.handle] = StagedPrefetch(
                    slots[:done], op.hash_value[: done // ps], op.storage_start, done
                )
        else:
            inserted = 0
            if done:
                present = self.tree.insert_host(
                    entry.anchor, op.token_ids[:done], slots[:done], op.hash_value[: done // ps]
                )
                self.free_slots(slots[:present])
                inserted = done - present
                self.stats.prefetch_inserted_tokens += inserted
                if inserted:
                    self.loaded_start[op.handle] = op.storage_start + present
            self._release_anchor(entry)
            self.loaded[op.handle] = inserted
        if op.done:
            self.free_slots(slots[done:])
        else:
            self.orphans[op.id] = (op, done)
        logger.debug("prefetch %s: %d of %d tokens", op.handle, done, op.requested_tokens)

    def release(self, handle: CacheRequestHandle) -> None:
        entry = self.ongoing.pop(handle, None)
        if entry is not None:
            op = entry.op
            op.mark_terminate()
            self._release_anchor(entry)
            self.stats.prefetch_released += 1
            if op.host_indices is not None:
                if op.done:
                    self.free_slots(op.host_indices)
                else:
                    self.orphans[op.id] = (op, 0)
        staged = self.staged.pop(handle, None)
        if staged is not None:
            self.drop_staged(staged)
        self.loaded.pop(handle, None)
        self.loaded_start.pop(handle, None)

    def drop_staged(self, staged: StagedPrefetch) -> None:
        self.stats.prefetch_dropped_tokens += staged.num_tokens
        self.free_slots(staged.host_indices)

    def free_slots(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.tree.controller.evict_host(slots)

    def in_flight(self) -> int:
        """Operations the IO threads still hold (not completed)."""
        return sum(1 for e in self.ongoing.values() if not e.op.done) + len(self.orphans)

    def held_slot_tensors(self) -> list[torch.Tensor]:
        out = [e.op.host_indices for e in self.ongoing.values() if e.op.host_indices is not None]
        out += [op.host_indices[start:] for op, start in self.orphans.values()]
        out += [s.host_indices for s in self.staged.values()]
        return out
