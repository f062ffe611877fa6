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

Everything here runs on the scheduler thread and never blocks, except device eviction under
``write_back`` (it waits for its own backups before freeing the slots they read).
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING

import torch

from hicache.radix_cache import RadixCache, TreeNode

if TYPE_CHECKING:
    from hicache.controller import HiCacheController
    from hicache.stats import CacheStats

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiRadixCache(RadixCache):
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
        super().__init__(controller.device_allocator, page_size)

    def reset(self) -> None:
        super().reset()
        self.ongoing_write_through: dict[int, TreeNode] = {}  # node id -> node being backed up
        self.ongoing_load_back: dict[int, TreeNode] = {}  # node id -> last node being loaded
        self._load_ancestors: dict[int, TreeNode] = {}  # node id -> device ancestor of the chain
        self._pending_write_slots: dict[int, torch.Tensor] = {}  # node id -> host slots written

    # ------------------------------------------------------------------ insert hooks

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        """Recomputed KV of a host-only node becomes its device copy; the host copy stays."""
        node.value = value
        self._add_device_tokens(node, len(value))

    def _on_insert_touch(self, node: TreeNode, chunked: bool) -> None:
        if not chunked:
            node.hit_count += 1
        elif self.upstream_chunked_insert:
            return
        self._maybe_backup(node, chunked)

    def _on_insert_create(self, node: TreeNode, chunked: bool) -> None:
        self._on_insert_touch(node, chunked)

    def _maybe_backup(self, node: TreeNode, chunked: bool) -> None:
        if self.write_policy == "write_back" or node.backuped:
            return
        if node.hit_count >= self.write_through_threshold or (
            chunked and self.write_policy == "write_through"
        ):
            self.write_backup(node)

    # Slot ownership of a backup: the node keeps its device slots (read by the copy) and gets
    # host slots from the controller at once (written by the copy). Until the write ack the host
    # copy is not readable: under write_through* the node is locked (cannot be evicted, so it is
    # never a host-only hit); under write_back evict() waits for the copy before freeing.
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Start the D2H backup of ``node``; returns tokens backed up (0 when the host is full
        even after host eviction). Never blocks."""
        host_indices = self.controller.write(node.value, node_id=node.id)
        if host_indices is None:
            self.evict_host(len(node.value))
            host_indices = self.controller.write(node.value, node_id=node.id)
        if host_indices is None:
            logger.debug("backup of %r skipped: host pool full", node)
            return 0
        node.host_value = host_indices
        self.ongoing_write_through[node.id] = node
        self._pending_write_slots[node.id] = host_indices
        if not write_back:
            self.inc_lock_ref(node)
        if self.stats is not None:
            self.stats.record_backup(len(host_indices))
        return len(host_indices)

    # ------------------------------------------------------------------ acks

    def writing_check(self) -> None:
        """Complete finished backups (non-blocking): their host copies become readable and
        write-through locks are released."""
        for node_id in self.controller.writing_check():
            self._ack_write(node_id)

    def _ack_write(self, node_id: int) -> None:
        node = self.ongoing_write_through.pop(node_id, None)
        self._pending_write_slots.pop(node_id, None)
        if node is not None and self.write_locks:
            self.dec_lock_ref(node)

    def loading_check(self) -> None:
        """Complete finished loads (non-blocking): release the locks they held."""
        for node_id in self.controller.loading_check():
            node = self.ongoing_load_back.pop(node_id, None)
            self._load_ancestors.pop(node_id, None)
            if node is not None:
                self.dec_lock_ref(node)

    def check_hicache_events(self) -> None:
        """Poll both ack queues without blocking."""
        self.writing_check()
        self.loading_check()

    # ------------------------------------------------------------------ device eviction

    # Slot ownership during evict: an unlocked device leaf either keeps its KV on the host
    # (backed up: device slots go back to the allocator, host slots stay with the node) or loses
    # it (deleted: device slots, and host slots of any host-only descendants, go back). Under
    # write_back a leaf that is not backed up first gets host slots and a D2H copy; its device
    # slots are freed only after that copy's ack, so no slot is free while a copy reads it.
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens (LRU unlocked leaves), or all evictable.
        Returns the device tokens freed. Blocks only under write_back, on its own backups."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        freed = 0
        while freed < num_tokens:
            round_freed, waited = self._evict_round(num_tokens - freed)
            freed += round_freed
            # Another round only helps after write-back copies: a parent skipped because its
            # children were still being copied (or the host was full) may be evictable now.
            if round_freed == 0 or not waited:
                break
        return freed

    def _evict_round(self, num_tokens: int) -> tuple[int, bool]:
        """One LRU pass over the current device leaves; returns (tokens freed, whether it waited
        for write-back copies)."""
        heap = [(x.last_access_time, x.id, x) for x in self._device_leaves()]
        heapq.heapify(heap)
        freed = 0
        write_back_nodes: list[TreeNode] = []
        waiting: set[int] = set()
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if x.lock_ref > 0 or x.evicted or x.id in waiting:
                continue
            parent = x.parent
            if x.backuped:
                freed += self._evict_backuped(x)
            elif self.write_policy == "write_back" and self.write_backup(x, write_back=True):
                freed += len(x.value)
                write_back_nodes.append(x)
                waiting.add(x.id)
            elif self._droppable(x):
                freed += self._evict_regular(x)
            else:
                continue
            if (
                parent is not self.root_node
                and parent.lock_ref == 0
                and all(c.evicted or c.id in waiting for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if write_back_nodes:
            self.controller.wait_write([x.id for x in write_back_nodes])
            for x in write_back_nodes:
                self._ack_write(x.id)
                self._evict_backuped(x)
        return freed, bool(write_back_nodes)

    def _droppable(self, node: TreeNode) -> bool:
        """A device leaf may be deleted with its host-only subtree unless a host copy below it is
        protected or a child is still device-resident (a write-back copy in this evict)."""
        return node.host_ref == 0 and all(c.evicted for c in node.children.values())

    def _evict_backuped(self, node: TreeNode) -> int:
        n = len(node.value)
        self.controller.evict_device(node.value)
        self.evictable_size_ -= n
        node.value = None
        if self.stats is not None:
            self.stats.record_evict_device(n)
        return n

    def _evict_regular(self, node: TreeNode) -> int:
        """Delete a device leaf that has no host copy (KV lost), with its host-only subtree."""
        n = len(node.value)
        self.controller.evict_device(node.value)
        self.evictable_size_ -= n
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            self.controller.evict_host(x.host_value)
            if self.stats is not None:
                self.stats.record_evict_host(len(x.host_value))
        if node.host_value is not None:  # not reached: backed-up leaves are never deleted
            self.controller.evict_host(node.host_value)
        self._delete_leaf(node)
        if self.stats is not None:
            self.stats.record_evict_device(n)
        return n

    # ------------------------------------------------------------------ host eviction

    def _host_leaves(self) -> list[TreeNode]:
        out = []
        stack = [self.root_node]
        while stack:
            x = stack.pop()
            if x.children:
                stack.extend(x.children.values())
            elif x is not self.root_node and x.evicted and x.host_ref == 0:
                out.append(x)
        return out

    # Slot ownership during evict_host: only host-only leaves lose their host slots (and their
    # node); the host copy of a device-resident node is a mirror and is never freed alone.
    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from host-only, unprotected leaves in LRU
        order, or as many as there are. Returns the host tokens freed. Never blocks."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        heap = [(x.last_access_time, x.id, x) for x in self._host_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if not x.evicted or x.children or x.host_ref > 0 or x.parent is None:
                continue
            n = len(x.host_value)
            self.controller.evict_host(x.host_value)
            freed += n
            parent = x.parent
            self._delete_leaf(x)
            if self.stats is not None:
                self.stats.record_evict_host(n)
            if parent is not self.root_node and parent.evicted and not parent.children:
                if parent.host_ref == 0:
                    heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    # ------------------------------------------------------------------ host protection

    def _protect_host(self, node: TreeNode) -> None:
        x = node
        while x is not self.root_node:
            x.host_ref += 1
            x = x.parent

    def _release_host(self, node: TreeNode) -> None:
        x = node
        while x is not self.root_node:
            x.host_ref -= 1
            x = x.parent

    # ------------------------------------------------------------------ load back

    # Slot ownership during load back: the host-only chain [ancestor, last] keeps its host slots
    # (read by the H2D copy) and gets fresh device slots at once (written by the copy). The chain
    # is device-resident from here on and locked until the load ack, so neither tier's slots are
    # freed while the copy runs; readers wait through layer_wait(layer). The device ancestor is
    # locked, and the chain's host copies protected, while eviction makes room.
    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int
    ) -> tuple[torch.Tensor, TreeNode]:
        """Queue the H2D load of the host-only chain ending at ``last_host_node``.

        Returns ``(device_indices, last_node)``: int64 slots of the loaded tokens (in key order)
        and the node now ending the device prefix, which the caller locks. Returns empty slots
        and the last device-resident ancestor when the hit is below ``load_back_threshold`` or
        the device cannot make room (the caller recomputes). ``host_hit_length`` is the value from
        ``match_prefix``; the tree's current chain is authoritative. The copy starts at
        ``ready_to_load_host_cache()``. Never blocks (except write_back eviction for room).
        """
        self._check_attached(last_host_node, "last_host_node")
        if host_hit_length < 0:
            raise ValueError(f"host_hit_length must be >= 0, got {host_hit_length}")
        chain: list[TreeNode] = []
        ancestor = last_host_node
        while ancestor.evicted:
            chain.append(ancestor)
            ancestor = ancestor.parent
        chain.reverse()
        if not chain:
            return self._empty(), last_host_node
        total = sum(len(x.host_value) for x in chain)
        if total != host_hit_length:
            logger.debug(
                "init_load_back: host_hit_length %d, chain holds %d", host_hit_length, total
            )
        if total < self.load_back_threshold:
            return self._empty(), ancestor

        host_indices = torch.cat([x.host_value for x in chain])
        self.inc_lock_ref(ancestor)
        self._protect_host(last_host_node)
        try:
            device_indices = self.controller.load(host_indices, node_id=last_host_node.id)
            if device_indices is None:
                self.evict(total)
                device_indices = self.controller.load(host_indices, node_id=last_host_node.id)
        finally:
            self._release_host(last_host_node)
            self.dec_lock_ref(ancestor)
        if device_indices is None:
            logger.debug("init_load_back: no device room for %d tokens; recompute", total)
            return self._empty(), ancestor

        offset = 0
        for x in chain:
            x.value = device_indices[offset : offset + len(x.host_value)]
            offset += len(x.host_value)
            self._add_device_tokens(x, len(x.value))
        self.ongoing_load_back[last_host_node.id] = last_host_node
        self._load_ancestors[last_host_node.id] = ancestor
        self.inc_lock_ref(last_host_node)
        if self.stats is not None:
            self.stats.record_load(total)
        return device_indices, last_host_node

    def ready_to_load_host_cache(self) -> int:
        """Launch the queued loads (one H2D per layer); returns the controller's producer id."""
        return self.controller.start_loading()

    def layer_wait(self, layer_id: int) -> None:
        """Before layer ``layer_id``'s attention: wait for that layer's load (a stream wait on
        CUDA, a host block on CPU; no wait when nothing is loading)."""
        self.controller.layer_done_counter.wait_until(layer_id)

    # ------------------------------------------------------------------ integrity hooks

    def pending_write_host_slots(self) -> torch.Tensor:
        """Host slots of backups not yet acked (int64, CPU)."""
        if not self._pending_write_slots:
            return torch.empty((0,), dtype=torch.int64)
        return torch.cat([s.cpu() for s in self._pending_write_slots.values()])

    def loading_nodes(self) -> list[TreeNode]:
        """Nodes whose device slots an H2D load is still writing (not readable before
        ``layer_wait``; not final before the load ack)."""
        out = []
        for node_id, last in self.ongoing_load_back.items():
            ancestor = self._load_ancestors[node_id]
            x = last
            while x is not ancestor and x is not self.root_node:
                out.append(x)
                x = x.parent
        return out

    def device_in_flight(self) -> int:
        """Device slots held by the controller outside the tree (e.g. deferred frees)."""
        return int(getattr(self.controller, "device_in_flight", lambda: 0)())

    def host_in_flight(self) -> int:
        """Host slots held by the controller outside the tree."""
        return int(getattr(self.controller, "host_in_flight", lambda: 0)())
