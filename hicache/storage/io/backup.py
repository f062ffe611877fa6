"""``BackupBook``: the scheduler-thread side of backups to storage, and ``StoredBeliefs``.

A backup starts at the L2 ack of a node's D2H copy (``HiRadixCache._ack_write``): cache mode
protects the node's host pages (``host_ref`` from the node to the root, so host eviction skips
them) until the storage ack is applied; ``buffer_only`` hands over its staging slots, freed at
the storage ack. The backup thread stores them in batches of 128 pages and stops at the first
failed batch (``workers``). Acks are applied in submission order, as many as every rank has
(``controller``); a failure is counted, never raised, and leaves the tree as it was.

Slot ownership: cache mode, the host slots stay the node's throughout (a clone of the slots is
what the thread reads; protection keeps them allocated); ``buffer_only``, the staging is this
book's from the D2H ack to the storage ack, then freed (``held_slots`` counts it).

``StoredBeliefs`` (``buffer_only``, SGLang's existence beliefs): the keys this rank started to
store, an LRU of at most 512K entries, so a node inserted again is not staged twice. A belief
is added when the staging starts (whatever the write's fate, on every rank alike) and dropped
when a prefetch query agreed that the page is absent.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from hicache.storage.io.operations import StorageOperation
from hicache.storage.io.stats import StorageStats
from hicache.storage.io.workers import StorageWorkers

logger = logging.getLogger(__name__)

BELIEFS_CAPACITY = 512 * 1024

WriteObserver = Callable[[list[str]], None]
"""Told of the keys of each backup's pages that reached storage (scheduler thread)."""


class StoredBeliefs:
    """A bounded LRU set of page keys (module docstring)."""

    def __init__(self, capacity: int = BELIEFS_CAPACITY) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

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


class BackupBook:
    """Backups in flight (module docstring). ``tree``: the ``StorageTree`` (host protection and
    the L2 controller's frees)."""

    def __init__(
        self, tree: Any, workers: StorageWorkers, stats: StorageStats, pass_prefix_keys: bool
    ) -> None:
        self.tree = tree
        self.workers = workers
        self.stats = stats
        self.pass_prefix_keys = pass_prefix_keys
        self.ongoing: dict[int, StorageOperation] = {}
        self.beliefs = StoredBeliefs()
        self.observers: list[WriteObserver] = []

    def backup_node(self, node: Any, host_indices: torch.Tensor, keys: list[str]) -> None:
        """Cache mode: store ``node``'s acked host copy, protected until the storage ack."""
        op = StorageOperation(
            host_indices.clone(), list(keys), prefix_keys=self._prefix_keys(node), node=node
        )
        self.tree.protect_host(node)
        self._submit(op)

    def backup_staged(self, node: Any, host_indices: torch.Tensor, keys: list[str]) -> None:
        """``buffer_only``: store the acked staging, freed at the storage ack."""
        op = StorageOperation(
            host_indices, list(keys), prefix_keys=self._prefix_keys(node), staging=True
        )
        self._submit(op)

    def _submit(self, op: StorageOperation) -> None:
        self.ongoing[op.id] = op
        self.stats.backup_ops += 1
        self.workers.submit_backup(op)

    def _prefix_keys(self, node: Any) -> list[str] | None:
        """The keys of the pages before ``node`` (``hicache_storage_pass_prefix_keys``)."""
        if not self.pass_prefix_keys:
            return None
        chain = []
        x = node.parent
        while x is not None and x.hash_value:
            chain.append(x.hash_value)
            x = x.parent
        return [k for part in reversed(chain) for k in part]

    def on_ack(self, op: StorageOperation) -> None:
        """The backup thread finished ``op`` (agreed to be applied now)."""
        self.ongoing.pop(op.id, None)
        if op.node is not None:
            self.tree.release_host(op.node)
        if op.staging:
            self.tree.controller.evict_host(op.host_indices)
        if not self.workers.is_storage_writer:
            self.stats.backup_skipped_ops += 1
            return
        if op.failed:
            self.stats.backup_failed_ops += 1
            logger.warning("storage backup failed after %d of %d tokens (%s)",
                           op.completed_tokens, op.host_indices.numel(), op.error)  # fmt: skip
        self.stats.backup_tokens += op.completed_tokens
        written = op.hash_value[: op.completed_tokens // self.workers.page_size]
        if written:
            for observer in self.observers:
                observer(written)

    def held_slots(self) -> int:
        """Host slots this book holds outside the tree (``buffer_only`` staging)."""
        return sum(op.host_indices.numel() for op in self.ongoing.values() if op.staging)
