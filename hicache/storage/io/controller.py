"""``HiCacheStorageController``: the L3 tier as the tree and the executor see it (SGLang 0.5.23's
storage part of ``HiCacheController`` and of its radix cache), over one backend.

It owns the IO threads (``workers``), the prefetches (``prefetch.PrefetchBook``) and the backups
(``backup.BackupBook``), and implements the tree's ``StorageHooks``. Every change it makes to the
tree or the host pool happens on the scheduler thread, in ``check_events`` (once per tick, from
``HiRadixCache.check_hicache_events``) or in a call the scheduler makes (``prefetch``,
``check_prefetch_progress``, ``release``, ``attach_staged``).

Tensor parallelism: each rank has its own backend, threads and host pool (its shard of the KV
heads; MLA pages are written by rank 0 only). The threads' results are rank-local; the tick
agrees them on the cache group, so every rank applies the same results in the same order:

| what | agreed |
|---|---|
| hits, prefetch acks, backup acks to apply | ``agree_min_many`` of the queue lengths, every tick |
| each hit | MIN of the ranks' hit pages (``agree_min_many`` over the hits applied) |
| each prefetch ack | MIN of the ranks' progress (``agree_min_many`` over the acks applied) |
| host slots for a hit | ``agreed_alloc`` (room on every rank, else host eviction everywhere) |
| a ``timeout`` expiry | ``agree_any`` |

Operations are submitted in the same order on every rank (the trees are identical), and each
produces the same number of results on every rank whatever its storage did, so the i-th result
of a queue is the same operation on every rank.

Slot accounting (``check_integrity`` and the tree's host ledger): host slots held outside the
tree are ``host_slots_held()`` (prefetch slots and ``buffer_only`` staging after the D2H ack).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from hicache.storage.base import HiCacheStorage
from hicache.storage.io.backup import BackupBook, WriteObserver
from hicache.storage.io.operations import CacheRequestHandle
from hicache.storage.io.prefetch import PrefetchBook, StagedPrefetch
from hicache.storage.io.settings import StorageSettings
from hicache.storage.io.stats import StorageStats
from hicache.storage.io.workers import StorageWorkers

logger = logging.getLogger(__name__)


class StorageTree(Protocol):
    """What the storage tier needs of its ``HiRadixCache`` (it imports nothing of the tree)."""

    page_size: int
    root_node: Any
    host_allocator: Any  # the host pool's TokenToKVPoolAllocator
    controller: Any  # HiCacheController: evict_host (deferred frees)
    group: Any  # TPGroup
    load_back_threshold: int

    def protect_host(self, node: Any) -> None: ...

    def release_host(self, node: Any) -> None: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def insert_host(
        self, anchor: Any, key: list[int], host_indices: torch.Tensor, hashes: list[str]
    ) -> int: ...

    def match_prefix(self, key: list[int]) -> Any: ...


class HiCacheStorageController:
    """The storage tier of one rank (module docstring).

    Args:
        tree: the ``HiRadixCache`` (``StorageTree``); call ``tree.attach_storage(self)`` after.
        backend: the ``HiCacheStorage`` (host pool registered).
        settings: ``StorageSettings``.
        zero_copy: use the backend's v1 calls (``workers.uses_zero_copy``).
        is_storage_writer: ``False`` on MLA ranks other than 0.
        backend_name: for logs and stats.
    """

    def __init__(
        self,
        tree: StorageTree,
        backend: HiCacheStorage,
        settings: StorageSettings,
        *,
        zero_copy: bool = False,
        is_storage_writer: bool = True,
        backend_name: str = "",
    ) -> None:
        self.tree = tree
        self.backend = backend
        self.backend_name = backend_name
        self.settings = settings
        self.page_size = tree.page_size
        self.stats = StorageStats()
        self.workers = StorageWorkers(
            backend, tree.controller.host_pool, zero_copy=zero_copy,
            is_storage_writer=is_storage_writer,
        )  # fmt: skip
        self.backups = BackupBook(tree, self.workers, self.stats, settings.pass_prefix_keys)
        self.prefetches = PrefetchBook(
            tree, self.workers, settings, self.stats,
            write_staged_tokens=self._write_staged_tokens, absent=self.backups.beliefs.discard,
        )  # fmt: skip
        self._closed = False

    # ------------------------------------------------------------------ StorageHooks
    @property
    def buffer_only(self) -> bool:
        return self.settings.buffer_only

    def backup_node(self, node: Any, host_indices: torch.Tensor, keys: list[str]) -> None:
        self.backups.backup_node(node, host_indices, keys)

    def backup_staged(self, node: Any, host_indices: torch.Tensor, keys: list[str]) -> None:
        self.backups.backup_staged(node, host_indices, keys)

    def believed_stored(self, keys: list[str] | None) -> bool:
        return self.backups.beliefs.contains_all(keys)

    def note_staging(self, keys: list[str]) -> None:
        self.backups.beliefs.add(keys)

    def check_events(self) -> None:
        """Apply the threads' results that every rank has, in queue order (module docstring).
        Never blocks (except for the group's collectives)."""
        w, group = self.workers, self.tree.group
        n_hits, n_acks, n_backups = group.agree_min_many(
            [w.hit_queue.qsize(), w.ack_queue.qsize(), w.backup_ack_queue.qsize()],
            tag="storage_events",
        )
        if n_hits:
            hits = [w.hit_queue.get_nowait() for _ in range(n_hits)]
            pages = group.agree_min_many([op.local_hit_pages for op in hits], tag="storage_hits")
            for op, n in zip(hits, pages, strict=True):
                self.prefetches.on_hit(op, n)
        if n_acks:
            acks = [w.ack_queue.get_nowait() for _ in range(n_acks)]
            done = group.agree_min_many(
                [0 if a.completed_req else int(a.completed_tokens) for a in acks],
                tag="storage_prefetch_acks",
            )
            for ack, n in zip(acks, done, strict=True):
                self.prefetches.on_ack(ack, n)
        for _ in range(n_backups):
            self.backups.on_ack(w.backup_ack_queue.get_nowait())

    def host_slots_held(self) -> int:
        return self.prefetches.held_slots() + self.backups.held_slots()

    def ops_in_flight(self) -> int:
        return self.prefetches.in_flight() + len(self.backups.ongoing)

    # ------------------------------------------------------------------ scheduler API
    def prefetch(
        self,
        handle: CacheRequestHandle,
        anchor: Any,
        new_tokens: list[int],
        storage_start: int,
    ) -> bool:
        """Start a prefetch of ``new_tokens`` (the tokens after ``anchor``, the deepest matched
        node, which ends at token ``storage_start``) for the attempt ``handle``."""
        last_hash = anchor.hash_value[-1] if anchor.hash_value else None
        prefix = None
        if self.settings.pass_prefix_keys:
            prefix = self.backups._prefix_keys(anchor) + list(anchor.hash_value or [])
        return self.prefetches.prefetch(
            handle, anchor, new_tokens, last_hash, storage_start, prefix_keys=prefix
        )

    def check_prefetch_progress(self, handle: CacheRequestHandle, now: float) -> bool:
        return self.prefetches.check_progress(handle, now)

    def take_loaded(self, handle: CacheRequestHandle) -> int:
        return self.prefetches.take_loaded(handle)

    def has_prefetch(self, handle: CacheRequestHandle) -> bool:
        p = self.prefetches
        return handle in p.ongoing or handle in p.staged

    def release(self, handle: CacheRequestHandle) -> None:
        self.prefetches.release(handle)

    def next_deadline(self) -> float | None:
        return self.prefetches.next_deadline()

    def attach_staged(self, handle: CacheRequestHandle, token_ids: list[int]) -> int:
        """``buffer_only``, at the attempt's admission: its fetched pages enter the tree as a
        host-only node after the prefix they continue, for the load back that follows (which
        frees the staging at its H2D ack). Returns the tokens attached (0: nothing staged, or
        the prefix they continue is no longer in the tree, or they are below the load-back
        threshold: the staging is freed)."""
        staged = self.prefetches.take_staged(handle)
        if staged is None:
            return 0
        start, n = staged.storage_start, staged.num_tokens
        m = self.tree.match_prefix(token_ids[:start])
        matched = m.device_indices.numel() + m.host_hit_length
        if matched != start or n < self.tree.load_back_threshold:
            self.prefetches.drop_staged(staged)
            return 0
        present = self.tree.insert_host(
            m.last_host_node, token_ids[start : start + n], staged.host_indices,
            staged.hash_value,
        )  # fmt: skip
        self.prefetches._free(staged.host_indices[:present])
        self.stats.prefetch_inserted_tokens += n - present
        return n - present

    def add_write_observer(self, observer: WriteObserver) -> None:
        """``observer(keys)`` is told, at each applied backup ack, of the keys it stored."""
        self.backups.observers.append(observer)

    def _write_staged_tokens(self) -> int:
        staged = getattr(self.tree, "_storage_writes", {})
        return self.backups.held_slots() + sum(h.numel() for h, _ in staged.values())

    # ------------------------------------------------------------------ lifecycle
    def check_integrity(self) -> None:
        """``AssertionError`` unless every host slot the tier holds is allocated and held once."""
        held = self.prefetches.held_slot_tensors() + [
            op.host_indices for op in self.backups.ongoing.values() if op.staging
        ]
        if not held:
            return
        slots = torch.cat([h.cpu() for h in held])
        if slots.unique().numel() != slots.numel():
            raise AssertionError("storage: a host slot is held twice")
        if not self.tree.host_allocator.is_allocated(slots):
            raise AssertionError("storage: a host slot it holds is free")

    def close(self) -> None:
        """Stop the IO threads (after the work they hold) and close the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.workers.close()
        finally:
            self.backend.close()


__all__ = ["HiCacheStorageController", "StagedPrefetch", "StorageTree"]
