"""Radix tree across two tiers with SGLang's write policies (SGLang ``HiRadixCache``).

A node's KV can live on the device (``value``), on the host (``host_value``), or both. The
controller moves bytes (D2H backups on its write stream, H2D loads on its load stream) and acks
them by node id; this file decides what to move and when, and keeps the tree consistent with the
acks:

============================  ==========================================================
policy                        D2H backup happens
============================  ==========================================================
``write_through``             at the first insert that creates or touches the node
``write_through_selective``   when the node's insert count reaches 2
``write_back``                never on insert; when device eviction picks the node
============================  ==========================================================

Evicting a device leaf: backed up -> free its device slots, keep it host-only; not backed up ->
delete it under ``write_through*`` (KV lost), back it up and wait for the copy under
``write_back``. Host eviction takes host-only, unlocked, ``host_ref == 0`` leaves only.

Chunked inserts (unfinished, chunk-prefilled requests): SGLang skips them in the hit count and
therefore never backs up a long chunk-prefilled prompt under write-through. By default this
cache keeps them out of the hit count (no self-inflation) but still backs up the pages they cover
under ``write_through``; ``upstream_chunked_insert=True`` reproduces SGLang.

Under write_back with a full host pool, eviction keeps LRU order across both tiers: when a
backup finds no host room even after host eviction, the backups this eviction already launched
are finished first (their older nodes become host-only and host-evictable), so the most recently
used leaves keep a host copy and the oldest lose theirs.

This file owns the policies: when an insert starts a backup and what device and host eviction
do with each leaf (the LRU order itself is ``eviction.py``'s queues, kept by the tree; one
device eviction's state, its host-bound write-backs, is ``device_eviction.py``'s).
Starting a backup or a load back, the in-flight state until its ack and the acks live in
``hiradix_transfers.py``, the base class.

Everything here runs on the scheduler thread and never blocks, except device eviction under
``write_back`` (it waits for its own backups before freeing the slots they read).

**L3 storage** (``attach_storage``; ``storage_hooks`` has the pieces): every node gets its pages'
keys at insert; a host copy, once its D2H ack is in, is stored by the storage tier
(``write_through`` after the insert's backup, ``write_through_selective`` after the second hit,
``write_back`` at device eviction), its host pages protected (``host_ref``) until the storage
ack; pages fetched from storage come back as host-only nodes (``insert_host``) that the ordinary
load back brings to the device. With ``buffer_only`` the host pool only stages: a backup's host
slots leave the node at once (no host copy in the tree) and are freed at the storage ack; a
fetched node loses its host copy when its load back is queued (freed at the H2D ack).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache.tree.device_eviction import DeviceEviction
from hicache.tree.hiradix_transfers import HiRadixTransfers
from hicache.tree.node import TreeNode
from hicache.tree.storage_hooks import (
    StorageHooks,
    assign_hashes,
    check_storage_tree,
    host_chain_tokens,
    insert_host,
)
from kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache.cache_stats import CacheStats
    from hicache.transfer.controller import HiCacheController

__all__ = ["WRITE_POLICIES", "HiRadixCache"]

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiRadixCache(HiRadixTransfers):
    """Device + host prefix cache.

    Args:
        controller: the ``HiCacheController`` that owns both allocators and the copy streams.
        page_size: tokens per page (same for both tiers).
        write_policy: one of ``WRITE_POLICIES``.
        load_back_threshold: host hits shorter than this many tokens are recomputed.
        upstream_chunked_insert: reproduce SGLang's chunked-insert behaviour (see module doc).
        stats: optional stats object fed with backups, loads and evictions (prefix hits are
            recorded by the admitting executor, not by ``match_prefix``).
    """

    def __init__(
        self,
        controller: HiCacheController,
        page_size: int,
        write_policy: str = "write_through",
        load_back_threshold: int = 10,
        upstream_chunked_insert: bool = False,
        stats: CacheStats | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be >= 0, got {load_back_threshold}")
        self.controller = controller
        self.host_allocator = controller.host_allocator
        self.write_policy = write_policy
        self.write_through_threshold = 1 if write_policy == "write_through" else 2
        # Write-through backups hold a lock until their ack; write-back ones are waited for.
        self.write_locks = write_policy != "write_back"
        self.load_back_threshold = load_back_threshold
        self.upstream_chunked_insert = upstream_chunked_insert
        self.stats = stats
        self.storage: StorageHooks | None = None
        # node id -> (host slots, page keys) of a D2H backup whose pages go to storage at its ack
        self._storage_writes: dict[int, tuple[torch.Tensor, list[str]]] = {}
        super().__init__(controller.device_allocator, page_size)

    def attach_storage(self, storage: StorageHooks) -> None:
        """Give the tree its L3 tier (before the first insert: nodes get keys from then on).
        ``buffer_only`` storage needs ``write_through`` (``ServerArgs`` resolves it)."""
        if self.all_nodes():
            raise ValueError("attach_storage: the tree already holds nodes without page keys")
        if storage.buffer_only and self.write_policy != "write_through":
            raise ValueError(
                "--hicache-host-memory-mode=buffer_only needs --hicache-write-policy="
                f"write_through, got {self.write_policy}"
            )
        self.storage = storage

    @property
    def backs_up_on_insert(self) -> bool:
        """``write_through`` and ``write_through_selective`` back up from ``insert`` (the first
        or second insert touching a node); ``write_back`` only when eviction picks a node."""
        return self.write_policy != "write_back"

    # ------------------------------------------------------------------ insert hooks

    def insert(
        self,
        key: Sequence[int] | torch.Tensor,
        value: torch.Tensor | None = None,
        chunked: bool = False,
    ) -> int:
        """``RadixCache.insert``; the slots are checked against the device pool first (the
        backups an insert starts read them), so a bad slot raises ``ValueError`` before the
        tree changes rather than from a backup halfway through the walk."""
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.dtype == torch.int64:
            alloc = self.controller.device_allocator
            slot_indices("value", value, n_slots=alloc.page_table_size * self.page_size)
        return super().insert(key, value, chunked)

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        """Recomputed KV of a host-only node becomes its device copy; the host copy stays."""
        node.value = value
        node.parent.device_children += 1
        self._add_device_tokens(node, len(value))
        self._device_queue.push_if_candidate(node)

    def _inc_hit_count(self, node: TreeNode, chunked: bool) -> None:
        """Count the hit, then back ``node`` up when the write policy says so. Chunked inserts
        are not counted; with ``upstream_chunked_insert`` they do not back up either. With
        storage, a node created by this insert gets its page keys first."""
        if self.storage is not None and node.hash_value is None:
            assign_hashes(node, self.page_size)
        super()._inc_hit_count(node, chunked)
        if chunked and self.upstream_chunked_insert:
            return
        self._maybe_backup(node, chunked)

    def _maybe_backup(self, node: TreeNode, chunked: bool) -> None:
        if self.write_policy == "write_back" or node.backuped:
            return
        if self._buffer_only and (
            node.id in self._storage_writes or self.storage.believed_stored(node.hash_value)
        ):
            return  # buffer_only: already stored, or its staging is on the way
        if node.hit_count >= self.write_through_threshold or (
            chunked and self.write_policy == "write_through"
        ):
            self.write_backup(node)

    # ------------------------------------------------------------------ L3 storage

    @property
    def _buffer_only(self) -> bool:
        return self.storage is not None and self.storage.buffer_only

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """The D2H backup (``HiRadixTransfers.write_backup``). With storage the pages and keys
        it copies are remembered for the storage write at its ack (a split meanwhile does not
        lose a fragment); with ``buffer_only`` the host slots are staging: they leave the node
        at once (the tree keeps no host copy) and are freed at the storage ack."""
        n = super().write_backup(node, write_back)
        if n and self.storage is not None:
            self._storage_writes[node.id] = (node.host_value, list(node.hash_value))
            if self.storage.buffer_only:
                node.host_value = None
                self.storage.note_staging(node.hash_value)
        return n

    def _ack_write(self, node_id: int) -> bool:
        """A D2H ack: the base's bookkeeping, then the node's pages go to storage (cache mode:
        its host copy, protected until the storage ack; buffer_only: its staging). A backup
        whose copy failed sends nothing to storage (its host slots are already freed)."""
        node = self.ongoing_write_through.get(node_id)
        written = self._storage_writes.pop(node_id, None)
        ok = super()._ack_write(node_id)
        if written is None or node is None or not ok:
            return ok
        host_indices, keys = written
        if self.storage.buffer_only:
            self.storage.backup_staged(node, host_indices, keys)
        elif node.parent is not None and node.host_value is not None:
            self.storage.backup_node(node, host_indices, keys)
        return ok

    def check_hicache_events(self) -> None:
        """L2 acks (which may start storage backups), then the storage tier's tick."""
        super().check_hicache_events()
        if self.storage is not None:
            self.storage.check_events()

    def insert_host(
        self, anchor: TreeNode, key: list[int], host_indices: torch.Tensor, hashes: list[str]
    ) -> int:
        """Pages fetched from storage as a host-only node after ``anchor`` (``storage_hooks``);
        returns the tokens of ``key`` already in the tree (the caller frees their slots)."""
        return insert_host(self, anchor, key, host_indices, hashes)

    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int
    ) -> tuple[torch.Tensor, TreeNode]:
        """The load back (``HiRadixTransfers.init_load_back``). With ``buffer_only`` storage a
        host-only node is a fetched page's staging: once its load is queued the node keeps only
        its device copy and the staging is freed at the H2D ack (the controller defers it); a
        staging that does not load (below the threshold, no device room) is dropped."""
        device_indices, last = super().init_load_back(last_host_node, host_hit_length)
        if self._buffer_only:
            self._release_staging(last_host_node, loaded=device_indices.numel() > 0)
        return device_indices, last

    def _release_staging(self, last_host_node: TreeNode, loaded: bool) -> None:
        if not loaded:  # the staging did not load: the host-only nodes go (LRU host leaves)
            self.evict_host(host_chain_tokens(last_host_node))
            return
        frees = []
        x = last_host_node
        while x is not self.root_node and x.host_value is not None:
            frees.append(x.host_value)
            x.host_value = None
            x = x.parent
        if frees:
            self.controller.evict_host(torch.cat(frees))  # held until the H2D ack

    def check_integrity(self, request_owned: int = 0) -> None:
        """The tree's checks (``integrity.check_tree``), and with storage its page keys
        (``storage_hooks.check_storage_tree``)."""
        super().check_integrity(request_owned)
        if self.storage is not None:
            check_storage_tree(self, self.all_nodes(), self.storage.buffer_only)

    def host_in_flight(self) -> int:
        """Host slots outside the tree: the controller's deferred frees, buffer_only staging
        not acked yet, and what the storage tier holds (prefetches, staging after the ack)."""
        held = super().host_in_flight()
        if self.storage is not None:
            held += self.storage.host_slots_held()
            if self.storage.buffer_only:
                held += sum(h.numel() for h, _ in self._storage_writes.values())
        return held

    # ------------------------------------------------------------------ device eviction

    # Slot ownership during evict: an unlocked device leaf either keeps its KV on the host
    # (backed up: device slots go back to the allocator, host slots stay with the node) or loses
    # it (deleted: device slots, and host slots of any host-only descendants, go back). Under
    # write_back a leaf that is not backed up first gets host slots and a D2H copy; its device
    # slots are freed only after that copy's ack, so no slot is free while a copy reads it.
    # Device slots are given back in one call at the end.
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens (LRU unlocked leaves), or all evictable.
        Returns the device tokens freed. O(k log n) for k leaves; blocks only under write_back,
        on the backups it launched."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        run = DeviceEviction(self)
        try:
            while run.freed < num_tokens:
                x = run.next_leaf()
                if x is None:
                    if not run.host_bound:
                        break
                    run.finish_host_bound()  # parents of the backed-up leaves may be leaves now
                    continue
                run.evict_one(x)
            run.finish_host_bound()
        finally:
            run.give_back()
        return run.freed

    def _droppable(self, node: TreeNode) -> bool:
        """A device leaf may be deleted with its host-only subtree unless a host copy below it is
        protected or a child is still device-resident (a write-back copy in this evict)."""
        return node.host_ref == 0 and node.device_children == 0

    def _evict_backuped(self, node: TreeNode, frees: list[torch.Tensor]) -> int:
        """Drop the device copy of a backed-up node (its slots go to ``frees``)."""
        n = len(node.value)
        frees.append(node.value)
        self.evictable_size_ -= n
        node.value = None
        parent = node.parent
        parent.device_children -= 1
        if parent is not self.root_node:
            self._device_queue.push_if_candidate(parent)
        self._host_queue.push_if_candidate(node)
        if self.stats is not None:
            self.stats.record_evict_device(n)
        return n

    def _evict_regular(self, node: TreeNode, frees: list[torch.Tensor]) -> int:
        """Delete a device leaf that has no host copy (KV lost), with its host-only subtree
        (whose host slots go back at once)."""
        n = len(node.value)
        frees.append(node.value)
        self.evictable_size_ -= n
        host_frees: list[torch.Tensor] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            host_frees.append(x.host_value)
            x.parent = None  # deleted with the subtree
            if x.queued:
                self._note_stale()
        if node.host_value is not None:  # not reached: backed-up leaves are never deleted
            host_frees.append(node.host_value)
        self._free_host(host_frees)
        parent = node.parent
        self._delete_leaf(node)
        parent.device_children -= 1
        if parent is not self.root_node:
            self._device_queue.push_if_candidate(parent)
        if self.stats is not None:
            self.stats.record_evict_device(n)
        return n

    # ------------------------------------------------------------------ host eviction

    # Slot ownership during evict_host: only host-only leaves lose their host slots (and their
    # node); the host copy of a device-resident node is a mirror and is never freed alone.
    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from host-only, unprotected leaves in LRU
        order, or as many as there are. Returns the host tokens freed. O(k log n) for k leaves;
        never blocks."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        queue = self._host_queue
        root = self.root_node
        freed = 0
        frees: list[torch.Tensor] = []
        while freed < num_tokens:
            x = queue.pop()
            if x is None:
                break
            parent = x.parent
            frees.append(x.host_value)
            freed += len(x.host_value)
            self._delete_leaf(x)
            if parent is not root:
                queue.push_if_candidate(parent)
        self._free_host(frees)
        return freed

    def _free_host(self, slots: list[torch.Tensor]) -> None:
        """Give host slots of deleted nodes back to the controller, in one call."""
        if not slots:
            return
        host = slots[0] if len(slots) == 1 else torch.cat(slots)
        self.controller.evict_host(host)
        if self.stats is not None:
            self.stats.record_evict_host(host.numel())
