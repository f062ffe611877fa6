"""``HiCacheStorageController``: the L3 tier of one rank as the tree and the executor see it
(SGLang 0.5.23's storage part of ``HiCacheController``): IO threads, prefetches and backups over
one backend; ``build_storage_controller`` builds it from ``ServerArgs``.

Every change to the tree or the host pool happens on the scheduler thread. The threads' results
are rank-local; ``check_events`` agrees them on the cache group (counts, hits and progress by MIN),
so every rank applies the same results in the same order.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from hicache_prefill.hicache.storage.backend_factory import StorageBackendFactory
from hicache_prefill.hicache.storage.base import HiCacheStorage
from hicache_prefill.hicache.storage.config import storage_config_for_pool
from hicache_prefill.hicache.storage.extra_config import StorageSettings, split_extra_config
from hicache_prefill.hicache.storage.io.prefetch import PrefetchBook, StorageTree
from hicache_prefill.hicache.storage.io.workers import (
    CacheRequestHandle,
    StorageOperation,
    StorageStats,
    StorageWorkers,
    uses_zero_copy,
)
from hicache_prefill.hicache.tp.group import TPGroup

logger = logging.getLogger(__name__)

BELIEFS_CAPACITY = 512 * 1024

WriteObserver = Callable[[list[str]], None]  # told of the keys each backup stored


class StoredBeliefs:
    """``buffer_only``: a bounded LRU set of the keys this rank started to store, so a node
    inserted again is not staged twice; dropped when a query agreed the page is absent."""

    def __init__(self, capacity: int = BELIEFS_CAPACITY) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, keys: list[str]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def contains_all(self, keys: list[str] | None) -> bool:
        return bool(keys) and all(k in self._keys for k in keys)

    def discard(self, keys: list[str]) -> None:
        for k in keys:
            self._keys.pop(k, None)

    def clear(self) -> None:
        """Forget every key (the backend was cleared)."""
        self._keys.clear()


class HiCacheStorageController:
    """``tree.attach_storage(self)`` after building it."""

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
            backend,
            tree.controller.host_pool,
            zero_copy=zero_copy,
            is_storage_writer=is_storage_writer,
        )
        self.backups: dict[int, StorageOperation] = {}
        self.beliefs = StoredBeliefs()
        self.observers: list[WriteObserver] = []
        self.prefetches = PrefetchBook(
            tree,
            self.workers,
            settings,
            self.stats,
            write_staged_tokens=self._write_staged_tokens,
            absent=self.beliefs.discard,
        )
        self._closed = False

    @property
    def buffer_only(self) -> bool:
        return self.settings.buffer_only

    def backup_node(self, node: Any, host_indices: torch.Tensor, keys: list[str]) -> None:
        """Cache mode: ``node``'s host copy is protected until the storage ack."""
        op = StorageOperation(
            host_indices.clone(), list(keys), prefix_keys=self._prefix_keys(node), node=node
        )
        self.tree.protect_host(node)
        self._submit_backup(op)

    def backup_staged(self, node: Any, host_indices: torch.Tensor, keys: list[str]) -> None:
        """``buffer_only``: the staging is freed at the storage ack."""
        op = StorageOperation(
            host_indices, list(keys), prefix_keys=self._prefix_keys(node), staging=True
        )
        self._submit_backup(op)

    def believed_stored(self, keys: list[str] | None) -> bool:
        return self.beliefs.contains_all(keys)

    def note_staging(self, keys: list[str]) -> None:
        self.beliefs.add(keys)

    def check_events(self) -> None:
        """Apply the threads' results that every rank has, in queue order."""
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
            self._on_backup_ack(w.backup_ack_queue.get_nowait())

    def host_slots_held(self) -> int:
        return sum(t.numel() for t in self._held_slots())

    def ops_in_flight(self) -> int:
        return self.prefetches.in_flight() + len(self.backups)

    def prefetch(
        self,
        handle: CacheRequestHandle,
        anchor: Any,
        new_tokens: list[int],
        storage_start: int,
    ) -> bool:
        """``new_tokens``: those after ``anchor``, the deepest matched node, which ends at token
        ``storage_start``."""
        last_hash = anchor.hash_value[-1] if anchor.hash_value else None
        prefix = None
        if self.settings.pass_prefix_keys:
            prefix = self._prefix_keys(anchor) + list(anchor.hash_value or [])
        return self.prefetches.prefetch(
            handle, anchor, new_tokens, last_hash, storage_start, prefix_keys=prefix
        )

    def check_prefetch_progress(self, handle: CacheRequestHandle, now: float) -> bool:
        return self.prefetches.check_progress(handle, now)

    def take_loaded(self, handle: CacheRequestHandle) -> int:
        return self.prefetches.take_loaded(handle)

    def take_loaded_span(self, handle: CacheRequestHandle) -> tuple[int, int | None]:
        return self.prefetches.take_loaded_span(handle)

    def has_prefetch(self, handle: CacheRequestHandle) -> bool:
        p = self.prefetches
        return handle in p.ongoing or handle in p.staged

    def release(self, handle: CacheRequestHandle) -> None:
        self.prefetches.release(handle)

    def next_deadline(self) -> float | None:
        return self.prefetches.next_deadline()

    def attach_staged(self, handle: CacheRequestHandle, token_ids: list[int]) -> int:
        """``buffer_only``, at admission: the attempt's fetched pages enter the tree as a
        host-only node after their prefix; the tokens attached (0: the staging is freed)."""
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
            m.last_host_node,
            token_ids[start : start + n],
            staged.host_indices,
            staged.hash_value,
        )
        self.prefetches.free_slots(staged.host_indices[:present])
        self.stats.prefetch_inserted_tokens += n - present
        return n - present

    def add_write_observer(self, observer: WriteObserver) -> None:
        self.observers.append(observer)

    def _submit_backup(self, op: StorageOperation) -> None:
        self.backups[op.id] = op
        self.stats.backup_ops += 1
        self.workers.backup_queue.put(op)

    def _prefix_keys(self, node: Any) -> list[str] | None:
        if not self.settings.pass_prefix_keys:
            return None
        chain = []
        x = node.parent
        while x is not None and x.hash_value:
            chain.append(x.hash_value)
            x = x.parent
        return [k for part in reversed(chain) for k in part]

    def _on_backup_ack(self, op: StorageOperation) -> None:
        self.backups.pop(op.id, None)
        if op.node is not None:
            self.tree.release_host(op.node)
        if op.staging:
            self.tree.controller.evict_host(op.host_indices)
        if not self.workers.is_storage_writer:
            self.stats.backup_skipped_ops += 1
            return
        if op.failed:
            self.stats.backup_failed_ops += 1
            logger.warning(
                "storage backup failed after %d of %d tokens (%s)",
                op.completed_tokens,
                op.host_indices.numel(),
                op.error,
            )
        self.stats.backup_tokens += op.completed_tokens
        written = op.hash_value[: op.completed_tokens // self.page_size]
        if written:
            for observer in self.observers:
                observer(written)

    def _staged_backup_slots(self) -> int:
        return sum(op.host_indices.numel() for op in self.backups.values() if op.staging)

    def _held_slots(self) -> list[torch.Tensor]:
        staging = [op.host_indices for op in self.backups.values() if op.staging]
        return self.prefetches.held_slot_tensors() + staging

    def _write_staged_tokens(self) -> int:
        return self._staged_backup_slots() + self.tree.staged_write_tokens()

    def check_integrity(self) -> None:
        """``AssertionError`` unless every host slot the tier holds is allocated and held once."""
        held = self._held_slots()
        if not held:
            return
        slots = torch.cat([h.cpu() for h in held])
        if slots.unique().numel() != slots.numel():
            raise AssertionError("storage: a host slot is held twice")
        if not self.tree.host_allocator.is_allocated(slots):
            raise AssertionError("storage: a host slot it holds is free")

    def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.workers.close()
        finally:
            self.backend.close()


def build_storage_controller(
    args: Any, tree: StorageTree, host_pool: Any, group: TPGroup
) -> HiCacheStorageController:
    """A backend that cannot be built on some rank fails every rank with one ``ValueError``,
    before any thread starts."""
    name = args.hicache_storage_backend
    backend, error = None, None
    try:
        settings, backend_extra = split_extra_config(
            args.storage_extra_config(),
            page_size=args.page_size,
            prefetch_policy=args.hicache_storage_prefetch_policy,
            host_memory_mode=args.hicache_host_memory_mode,
        )
        config = storage_config_for_pool(
            host_pool,
            args.storage_model_name(),
            tp_rank=group.rank,
            tp_size=group.size,
            extra_config=backend_extra,
        )
        backend = StorageBackendFactory.create_backend(name, config, host_pool)
        backend.register_mem_pool_host(host_pool)
    except ValueError as e:
        error = e
    if not group.agree_all(error is None, tag="storage_backend_built"):
        if backend is not None:
            backend.close()
        raise ValueError(
            f"--hicache-storage-backend={name}: "
            f"{error if error is not None else 'another rank could not build its backend'}"
        ) from error
    assert backend is not None
    controller = HiCacheStorageController(
        tree,
        backend,
        settings,
        zero_copy=uses_zero_copy(name, backend_extra),
        is_storage_writer=config.is_storage_writer,
        backend_name=name,
    )
    try:
        tree.attach_storage(controller)
    except ValueError:
        controller.close()
        raise
    logger.info(
        "L3 storage %s (%s, prefetch %s, threshold %d tokens) for model %s",
        name,
        settings.host_memory_mode,
        settings.prefetch_policy,
        settings.prefetch_threshold,
        config.model_name,
    )
    return controller
