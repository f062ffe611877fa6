"""Radix tree across two tiers with SGLang's write policies (SGLang ``HiRadixCache``). A node
with a copy in flight is in ``ongoing_write_through`` / ``ongoing_load_back`` and held (locked, or
waited for by write_back eviction); a host copy is readable only after its ack. Under TP every
rank-local input is agreed on ``group`` first."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.transfer.controller import ack_error
from hicache_prefill.hicache.transfer.errors import BackupError, LoadBackError
from hicache_prefill.hicache.tree.keys import TOKEN_BYTES, key_bytes
from hicache_prefill.hicache.tree.lru_queues import HOST, LRUQueue, is_host_candidate
from hicache_prefill.hicache.tree.node import TreeNode, descend
from hicache_prefill.hicache.tree.radix_cache import RadixCache
from hicache_prefill.kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache_prefill.hicache.cache_stats import CacheStats
    from hicache_prefill.hicache.tp.group import TPGroup
    from hicache_prefill.hicache.transfer.controller import HiCacheController

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class StorageHooks(Protocol):
    """What the tree calls on its L3 tier (``hicache.storage.io.controller``): ``backup_node``
    stores an acked host copy (cache mode), ``backup_staged`` an acked ``buffer_only`` staging,
    which ``note_staging`` announced; ``host_slots_held`` counts prefetch and staging slots."""

    buffer_only: bool

    def backup_node(self, node: TreeNode, host_indices: torch.Tensor, keys: list[str]) -> None: ...
    def backup_staged(
        self, node: TreeNode, host_indices: torch.Tensor, keys: list[str]
    ) -> None: ...
    def believed_stored(self, keys: list[str]) -> bool: ...
    def note_staging(self, keys: list[str]) -> None: ...
    def check_events(self) -> None: ...
    def host_slots_held(self) -> int: ...


@dataclass
class _EvictionRun:
    """One device eviction. ``host_bound``: nodes moving to the host once their write-back
    ``backups`` are acked, children first; ``parents``: heap of parents whose every device child
    is host-bound; ``kept``: host-bound nodes whose backup failed (they stay on the device)."""

    freed: int = 0
    host_bound: dict[int, TreeNode] = field(default_factory=dict)  # by id, in order taken
    backups: list[int] = field(default_factory=list)
    host_bound_children: dict[int, int] = field(default_factory=dict)
    parents: list[tuple[int, int, TreeNode]] = field(default_factory=list)
    frees: list[torch.Tensor] = field(default_factory=list)
    kept: dict[int, TreeNode] = field(default_factory=dict)


class HiRadixCache(RadixCache):
    """Device + host prefix cache over the ``controller``'s allocators and copy streams. Host
    hits shorter than ``load_back_threshold`` tokens are recomputed; ``upstream_chunked_insert``
    reproduces SGLang's chunked inserts (never backed up)."""

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

    def reset(self) -> None:
        super().reset()
        self._host_queue = LRUQueue(HOST, is_host_candidate)  # host-only leaves, LRU first
        self.ongoing_write_through: dict[int, TreeNode] = {}  # node id -> node being backed up
        self.ongoing_load_back: dict[int, TreeNode] = {}  # node id -> last node being loaded
        self._load_ancestors: dict[int, TreeNode] = {}  # node id -> device ancestor of the chain
        self._unacked_write_slots: dict[int, torch.Tensor] = {}  # node id -> host slots written
        self._failed_loads: set[int] = set()  # loads whose ack reported a failure, not undone

    def eviction_queues(self) -> tuple[LRUQueue, ...]:
        return (self._device_queue, self._host_queue)

    @property
    def group(self) -> TPGroup:
        """The cache group the controller agrees on (``SingleRankGroup`` for one rank)."""
        return self.controller.group

    def attach_storage(self, storage: StorageHooks) -> None:
        """Give the tree its L3 tier, before the first insert."""
        if self.all_nodes():
            raise ValueError("attach_storage: the tree already holds nodes without page keys")
        if storage.buffer_only and self.write_policy != "write_through":
            raise ValueError(
                "--hicache-host-memory-mode=buffer_only needs --hicache-write-policy="
                f"write_through, got {self.write_policy}"
            )
        self.storage = storage

    @property
    def _buffer_only(self) -> bool:
        return self.storage is not None and self.storage.buffer_only

    @property
    def backs_up_on_insert(self) -> bool:
        """``write_through*`` back up from ``insert``; ``write_back`` only at eviction."""
        return self.write_policy != "write_back"

    def insert(
        self,
        key: Sequence[int] | torch.Tensor,
        value: torch.Tensor | None = None,
        chunked: bool = False,
        counted_from: int | None = None,
    ) -> int:
        """``RadixCache.insert``, with the slots first checked against the device pool's range."""
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.dtype == torch.int64:
            alloc = self.controller.device_allocator
            slot_indices("value", value, n_slots=alloc.page_table_size * self.page_size)
        return super().insert(key, value, chunked, counted_from)

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        """Recomputed KV of a host-only node becomes its device copy; the host copy stays."""
        node.value = value
        node.parent.device_children += 1
        self._add_device_tokens(node, len(value))
        self._device_queue.push_if_candidate(node)

    def _skip_hit_count(self, node: TreeNode) -> None:
        if self.storage is not None and node.hash_value is None:
            node.hash_value = self._chained_keys(node, node.tokens)

    def _inc_hit_count(self, node: TreeNode, chunked: bool) -> None:
        """Count the hit (after giving a new node its page keys), then back the node up when the
        policy says so (a chunked insert under ``upstream_chunked_insert``: never)."""
        if self.storage is not None and node.hash_value is None:
            node.hash_value = self._chained_keys(node, node.tokens)
        super()._inc_hit_count(node, chunked)
        if chunked and self.upstream_chunked_insert:
            return
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

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Start the D2H backup of ``node``; returns the tokens backed up: 0 when the host is full
        even after host eviction or the launch failed (``BackupError``: logged; raised under TP)."""
        try:
            host_indices = self.controller.write(node.value, node_id=node.id)
            if host_indices is None:
                self.evict_host(len(node.value))
                host_indices = self.controller.write(node.value, node_id=node.id)
        except BackupError as exc:
            if self.group.size > 1:
                raise
            logger.warning("backup of %r skipped: %s", node, exc)
            return 0
        if host_indices is None:
            logger.debug("backup of %r skipped: host pool full", node)
            return 0
        node.host_value = host_indices
        self.ongoing_write_through[node.id] = node
        self._unacked_write_slots[node.id] = host_indices
        if not write_back:
            self.inc_lock_ref(node)
        if self.stats is not None:
            self.stats.record_backup(len(host_indices))
        if self.storage is not None:
            self._storage_writes[node.id] = (host_indices, list(node.hash_value))
            if self.storage.buffer_only:
                node.host_value = None
                self.storage.note_staging(node.hash_value)
        return len(host_indices)

    def writing_check(self, n: int | None = None) -> None:
        """Complete the first ``n`` backups (``None``: the finished ones; non-blocking)."""
        for node_id in self.controller.writing_check(n):
            self._ack_write(node_id)

    def _ack_write(self, node_id: int) -> None:
        """Apply one popped backup ack: release its lock, then store its pages or drop it."""
        node = self.ongoing_write_through.pop(node_id, None)
        slots = self._unacked_write_slots.pop(node_id, None)
        written = self._storage_writes.pop(node_id, None)
        failure = self.controller.take_failure(node_id)
        if node is not None and failure is not None and slots is not None:
            logger.warning("backup of %r failed; the node stays device-only: %s", node, failure)
            self._drop_failed_backup(node, slots)
        if node is not None and self.write_locks:
            self.dec_lock_ref(node)
        if written is None or node is None or failure is not None:
            return
        host_indices, keys = written
        if self.storage.buffer_only:
            self.storage.backup_staged(node, host_indices, keys)
        elif node.parent is not None and node.host_value is not None:
            self.storage.backup_node(node, host_indices, keys)

    def _drop_failed_backup(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        """``node`` and the upper halves split off it lose their host copy; frees ``host_slots``."""
        x: TreeNode | None = node
        while x is not None and x is not self.root_node and x.host_value is not None:
            if not bool(torch.isin(x.host_value.cpu(), host_slots.cpu()).all()):
                break
            x.host_value = None
            x = x.parent
        self.controller.evict_host(host_slots)

    def check_hicache_events(self) -> None:
        """Apply the backups and loads every rank has finished (one collective), then L3's tick."""
        c = self.controller
        writes, loads = self.group.agree_min_many(
            [c.count_finished_writes(), c.count_finished_loads()], tag="hicache_acks"
        )
        self.writing_check(writes)
        self.loading_check(loads)
        if self.storage is not None:
            self.storage.check_events()

    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int
    ) -> tuple[torch.Tensor, TreeNode]:
        """Queue the H2D load of the host-only chain ending at ``last_host_node``; returns its
        device slots and the node now ending the device prefix (the caller locks it), or empty
        slots and the device ancestor when the hit is below the threshold or finds no room."""
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
            logger.debug("init_load_back: host_hit_length %d, chain %d", host_hit_length, total)
        if total < self.load_back_threshold:
            return self._no_load_back(last_host_node, ancestor)
        host_indices = torch.cat([x.host_value for x in chain])
        self.inc_lock_ref(ancestor)
        self.protect_host(last_host_node)
        try:
            device_indices = self.controller.load(host_indices, node_id=last_host_node.id)
            if device_indices is None:
                self.evict(total)
                device_indices = self.controller.load(host_indices, node_id=last_host_node.id)
        finally:
            self.release_host(last_host_node)
            self.dec_lock_ref(ancestor)
        if device_indices is None:
            logger.debug("init_load_back: no device room for %d tokens; recompute", total)
            if self.stats is not None:
                self.stats.record_load_back_no_room(total)
            return self._no_load_back(last_host_node, ancestor)
        offset = 0
        for x in chain:  # top down; the host queue drops them lazily (no longer host-only)
            x.value = device_indices[offset : offset + len(x.host_value)]
            offset += len(x.host_value)
            x.parent.device_children += 1
            self._add_device_tokens(x, len(x.value))
        self._set_owned(device_indices, True)
        self.ongoing_load_back[last_host_node.id] = last_host_node
        self._load_ancestors[last_host_node.id] = ancestor
        self.inc_lock_ref(last_host_node)
        if self.stats is not None:
            self.stats.record_load(total)
        if self._buffer_only:  # the staging is freed at the H2D ack (the controller defers it)
            frees = []
            x = last_host_node
            while x is not self.root_node and x.host_value is not None:
                frees.append(x.host_value)
                x.host_value = None
                x = x.parent
            if frees:
                self.controller.evict_host(torch.cat(frees))
        return device_indices, last_host_node

    def _no_load_back(
        self, last_host_node: TreeNode, ancestor: TreeNode
    ) -> tuple[torch.Tensor, TreeNode]:
        """No load: a ``buffer_only`` staging that does not load is dropped (LRU host leaves)."""
        if self._buffer_only:
            self.evict_host(self._host_chain_tokens(last_host_node))
        return self._empty(), ancestor

    def protect_host(self, node: TreeNode) -> None:
        """Keep the host copies from ``node`` up from host eviction (``host_ref``)."""
        x = node
        while x is not self.root_node:
            x.host_ref += 1
            x = x.parent

    def release_host(self, node: TreeNode) -> None:
        """Undo one ``protect_host(node)``."""
        x = node
        while x is not self.root_node:
            x.host_ref -= 1
            if x.host_ref == 0:
                self._host_queue.push_if_candidate(x)
            x = x.parent

    def ready_to_load_host_cache(self) -> int:
        """Launch the queued loads; ``LoadBackError`` on a failed launch (the loads stay queued)."""
        return self.controller.start_loading()

    def layer_wait(self, layer_id: int) -> None:
        """Wait for layer ``layer_id``'s load; ``LoadBackError`` when its copy failed."""
        self.controller.layer_done_counter.wait_until(layer_id)

    def loading_check(self, n: int | None = None) -> None:
        """Complete the first ``n`` loads (``None``: the finished ones). A failed load is undone at
        once when no caller locks its nodes, else ``LoadBackError`` after the other acks."""
        failed = self._apply_load_acks(self.controller.loading_check(n))
        if not failed:
            return
        self._failed_loads.update(failed)
        try:
            self._check_revertable(self._failed_loads)
        except ValueError as exc:
            raise LoadBackError(
                "load_to_device_per_layer",
                f"the loads of node ids {sorted(self._failed_loads)} failed while they ran; "
                f"release the locks on their nodes, then cancel_load_back() ({exc})",
                sorted(self._failed_loads),
            ) from exc
        self._revert_loads(self._failed_loads)
        self._failed_loads.clear()

    def _apply_load_acks(self, node_ids: list[int]) -> list[int]:
        """Release the locks of the popped loads that succeeded; returns the ids of failed ones."""
        failed = []
        for node_id in node_ids:
            failure = self.controller.take_failure(node_id)
            if failure is not None and node_id in self.ongoing_load_back:
                failed.append(node_id)
                continue
            node = self.ongoing_load_back.pop(node_id, None)
            self._load_ancestors.pop(node_id, None)
            if node is not None:
                self.dec_lock_ref(node)
        return failed

    def cancel_load_back(self) -> int:
        """Undo every load back that did not complete (queued, or failed while it ran) once the
        caller released its locks (``ValueError`` otherwise); returns the tokens. Single rank."""
        c = self.controller
        if self.group.size > 1:
            raise RuntimeError("cancel_load_back: a failed copy is not agreed across TP ranks")
        c.wait_loads()
        failed = [nid for ack in c.ack_load_queue if ack_error(ack) for nid in ack.node_ids]
        queued = [op.node_id for op in c.load_queue]
        todo = {*queued, *failed, *self._failed_loads}
        self._check_revertable([nid for nid in todo if nid in self.ongoing_load_back])
        self._failed_loads.update(self._apply_load_acks(c.loading_check(len(c.ack_load_queue))))
        self._failed_loads.update(c.cancel_loads())
        undone = self._revert_loads(self._failed_loads)
        self._failed_loads.clear()
        return undone

    def _load_chain(self, node_id: int) -> list[TreeNode]:
        """The nodes a load writes, deepest first: its last node up to its device ancestor."""
        ancestor = self._load_ancestors[node_id]
        out = []
        x = self.ongoing_load_back[node_id]
        while x is not ancestor and x is not self.root_node:
            out.append(x)
            x = x.parent
        return out

    def _own_locks(self) -> dict[int, int]:
        """The tree's own locks per node id: loads and write-through backups in flight."""
        holders = list(self.ongoing_load_back.values())
        if self.write_locks:
            holders += list(self.ongoing_write_through.values())
        counts: dict[int, int] = {}
        for h in holders:
            x: TreeNode | None = h
            while x is not None and x is not self.root_node:
                counts[x.id] = counts.get(x.id, 0) + 1
                x = x.parent
        return counts

    def _check_revertable(self, node_ids: Iterable[int]) -> None:
        """``ValueError`` naming the first node of these loads that cannot be host-only again: a
        caller locks it, or a device-resident child outside these loads sits below it."""
        chains = {nid: self._load_chain(nid) for nid in set(node_ids)}
        reverted = {x.id for chain in chains.values() for x in chain}
        own = self._own_locks()
        for nid, chain in chains.items():
            for x in chain:
                if x.lock_ref != own.get(x.id, 0):
                    raise ValueError(
                        f"the failed load of node {nid} cannot be undone: {x!r} holds "
                        f"{x.lock_ref - own.get(x.id, 0)} lock(s) of a caller; release the locks "
                        "taken on the nodes init_load_back returned first"
                    )
                for c in x.children.values():
                    if c.value is not None and c.id not in reverted:
                        raise ValueError(
                            f"the failed load of node {nid} cannot be undone: {c!r} below it is "
                            "device-resident (KV computed on the loaded prefix)"
                        )

    def _revert_loads(self, node_ids: Iterable[int]) -> int:
        """Make the nodes of these loads host-only again, deepest first; returns the tokens."""
        ids = [nid for nid in node_ids if nid in self.ongoing_load_back]
        frees: list[torch.Tensor] = []
        total = 0
        for nid in sorted(ids, key=lambda i: -self._depth(self.ongoing_load_back[i])):
            chain = self._load_chain(nid)
            ancestor = self._load_ancestors.pop(nid)
            self.dec_lock_ref(self.ongoing_load_back.pop(nid))
            for x in chain:  # deepest first: each is a device leaf when it is reverted
                n = len(x.value)
                frees.append(x.value)
                self._add_device_tokens(x, -n)
                x.value = None
                x.parent.device_children -= 1
                self._host_queue.push_if_candidate(x)
                total += n
            if ancestor is not self.root_node:
                self._device_queue.push_if_candidate(ancestor)
            logger.warning("load back of node %d undone: %d nodes host-only again", nid, len(chain))
        self._free_device(frees)
        if self.stats is not None and total:
            self.stats.record_load(-total)  # counted at init_load_back; never arrived
        return total

    def _depth(self, x: TreeNode) -> int:
        d = 0
        while x is not self.root_node and x.parent is not None:
            d += 1
            x = x.parent
        return d

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens (LRU unlocked leaves), or all evictable;
        returns the tokens freed. Blocks only under write_back, on the backups it launched."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        run = _EvictionRun()
        try:
            while run.freed < num_tokens:
                x = self._next_leaf(run)
                if x is None:
                    if not run.host_bound:
                        break
                    self._finish_host_bound(run)  # their parents may be leaves now
                    continue
                self._evict_leaf(run, x)
            self._finish_host_bound(run)
        finally:
            for x in run.kept.values():
                self._device_queue.push_if_candidate(x)
            self._free_device(run.frees)
        return run.freed

    def _next_leaf(self, run: _EvictionRun) -> TreeNode | None:
        """The run's least recently used device leaf: the tree's queue or ``run.parents``."""
        queue = self._device_queue
        x = queue.peek()
        while x is not None and (x.id in run.host_bound or x.id in run.kept):
            queue.pop()  # a host-bound node is no candidate until its backup is done
            x = queue.peek()
        parents = run.parents
        while parents and not self._parent_ready(run, parents[0][2]):
            heapq.heappop(parents)
        if parents and (x is None or (parents[0][0], parents[0][1]) < (x.last_access_time, x.id)):
            return heapq.heappop(parents)[2]
        return queue.pop() if x is not None else None

    def _parent_ready(self, run: _EvictionRun, x: TreeNode) -> bool:
        return (
            x.parent is not None
            and x.value is not None
            and x.lock_ref == 0
            and x.device_children == run.host_bound_children.get(x.id, 0)
            and x.id not in run.host_bound
            and x.id not in run.kept
        )

    def _evict_leaf(self, run: _EvictionRun, x: TreeNode) -> None:
        parent = x.parent
        if x.backuped:
            if x.device_children:  # its children are host-bound: it follows them to the host
                self._add_host_bound(run, x)
            else:
                run.freed += self._evict_device(x, run.frees)
                self._push_if_host_bound_parent(run, parent)
            return
        if self.write_policy == "write_back":
            ok = self.write_backup(x, write_back=True)
            if not ok and run.backups:
                # Host full of this run's own backups: finish them (older leaves become
                # host-only and host-evictable), then retry, so LRU order holds on the host.
                self._finish_host_bound(run)
                ok = x.parent is not None and self.write_backup(x, write_back=True)
            if ok:
                run.backups.append(x.id)
                self._add_host_bound(run, x)
                return
        if self._droppable(x):
            run.freed += self._evict_device(x, run.frees)
            self._push_if_host_bound_parent(run, parent)

    def _push_if_host_bound_parent(self, run: _EvictionRun, parent: TreeNode) -> None:
        """A device child of ``parent`` left now while others are host-bound: once those are all
        that is left, ``parent`` is the run's candidate in LRU order (as in ``_add_host_bound``)."""
        bound = run.host_bound_children.get(parent.id, 0)
        if bound and bound == parent.device_children and parent.lock_ref == 0:
            heapq.heappush(run.parents, (parent.last_access_time, parent.id, parent))

    def _add_host_bound(self, run: _EvictionRun, x: TreeNode) -> None:
        run.host_bound[x.id] = x
        run.freed += len(x.value)
        parent = x.parent
        if parent is self.root_node:
            return
        count = run.host_bound_children.get(parent.id, 0) + 1
        run.host_bound_children[parent.id] = count
        if count == parent.device_children and parent.lock_ref == 0:
            heapq.heappush(run.parents, (parent.last_access_time, parent.id, parent))

    def _finish_host_bound(self, run: _EvictionRun) -> None:
        """Wait for the run's backups, ack them, and move every host-bound node to the host; a
        node whose backup failed is deleted when it may be, else kept on the device."""
        if not run.host_bound:
            return
        if run.backups:
            self.controller.wait_write(run.backups)
            for node_id in run.backups:
                self._ack_write(node_id)
        for x in run.host_bound.values():  # children before parents
            if (x.backuped and x.device_children == 0) or self._droppable(x):
                self._evict_device(x, run.frees)
            else:
                run.freed -= len(x.value)
                run.kept[x.id] = x
        run.host_bound = {}
        run.backups = []
        run.host_bound_children.clear()

    def _droppable(self, node: TreeNode) -> bool:
        """An attached device leaf with no protected host copy below may be deleted."""
        return node.parent is not None and node.host_ref == 0 and node.device_children == 0

    def _evict_device(self, node: TreeNode, frees: list[torch.Tensor]) -> int:
        """Free a device leaf's copy (slots to ``frees``): a backed-up one stays host-only, any
        other is deleted with its host-only subtree (KV lost)."""
        n = len(node.value)
        frees.append(node.value)
        self.evictable_size_ -= n
        parent = node.parent
        if node.backuped:
            node.value = None
            self._host_queue.push_if_candidate(node)
        else:
            host_frees: list[torch.Tensor] = []
            stack = list(node.children.values())
            while stack:
                x = stack.pop()
                stack.extend(x.children.values())
                host_frees.append(x.host_value)
                x.parent = None  # deleted with the subtree
                if x.queued:
                    self._note_stale()
            self._free_host(host_frees)
            self._delete_leaf(node)
        self._drop_device_child(parent)
        if self.stats is not None:
            self.stats.record_evict_device(n)
        return n

    def _free_device(self, frees: list[torch.Tensor]) -> None:
        if frees:
            slots = frees[0] if len(frees) == 1 else torch.cat(frees)
            self.controller.evict_device(slots)
            self._set_owned(slots, False)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from host-only, unprotected LRU leaves."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        taken = self._pop_leaves(self._host_queue, num_tokens, device=False)
        self._free_host([x.host_value for x, _ in taken])
        return sum(len(x.host_value) for x, _ in taken)

    def _free_host(self, slots: list[torch.Tensor]) -> None:
        if not slots:
            return
        host = slots[0] if len(slots) == 1 else torch.cat(slots)
        self.controller.evict_host(host)
        if self.stats is not None:
            self.stats.record_evict_host(host.numel())

    def _chained_keys(self, node: TreeNode, tokens: bytes) -> list[str]:
        """Page keys of ``tokens`` (``node``'s) chained from its parent's last key (SGLang's
        ``compute_node_hash_values``)."""
        parent = node.parent
        prior = parent.hash_value[-1] if parent is not None and parent.hash_value else None
        return page_hashes(np.frombuffer(tokens, np.int64), self.page_size, prior)

    def insert_host(
        self, anchor: TreeNode, key: list[int], host_indices: torch.Tensor, hashes: list[str]
    ) -> int:
        """SGLang's ``insert_host``: pages fetched from storage (whole pages right after
        ``anchor``) enter as one host-only node taking a clone of ``host_indices[returned:]``;
        returns the tokens already in the tree. ``ValueError`` for mismatched lengths."""
        ps = self.page_size
        if len(key) % ps or len(key) != host_indices.numel() or len(hashes) != len(key) // ps:
            raise ValueError(
                f"insert_host: {len(key)} tokens, {host_indices.numel()} host slots and "
                f"{len(hashes)} keys do not describe the same whole pages of {ps}"
            )
        if anchor.parent is None and anchor.tokens:
            raise ValueError(f"insert_host: anchor {anchor!r} is not in the tree")
        kb = key_bytes(key)
        now = self._tick()
        pb = self.page_bytes
        node, off, end = anchor, 0, len(kb)
        while off < end:  # the walk of insert: stamp each node, split the last one
            child = node.children.get(kb[off : off + pb])
            if child is None:
                break
            node = descend(child, kb, off, end, now, pb)
            off += len(node.tokens)
        i = off // TOKEN_BYTES
        if off < end:
            new = TreeNode(kb[off:], node, None, now)
            new.host_value = host_indices[i:].clone()
            new.hash_value = list(hashes[i // ps :])
            node.children[kb[off : off + pb]] = new
            self._host_queue.push_if_candidate(new)
        return i

    def _host_chain_tokens(self, last_host_node: TreeNode) -> int:
        """Tokens of the host-only nodes ending at ``last_host_node``."""
        n, x = 0, last_host_node
        while x.parent is not None and x.value is None:
            n += x.num_tokens
            x = x.parent
        return n

    def check_integrity(self, request_owned: int = 0) -> None:
        """``RadixCache.check_integrity``; with storage, every node also carries one key per page
        chained from its parent's, and no ``buffer_only`` node keeps a host copy."""
        super().check_integrity(request_owned)
        if self.storage is None:
            return
        ps = self.page_size
        for x in self.all_nodes():
            if x.hash_value is None or len(x.hash_value) != x.num_tokens // ps:
                raise AssertionError(f"storage: {x!r} lacks one page key per page")
            if self._chained_keys(x, x.tokens[: ps * TOKEN_BYTES])[0] != x.hash_value[0]:
                raise AssertionError(f"storage: {x!r}'s first key does not continue its parent's")
            if self.storage.buffer_only and x.host_value is not None:
                raise AssertionError(f"storage: buffer_only, yet {x!r} keeps a host copy")

    def unacked_write_host_slots(self) -> torch.Tensor:
        """Host slots of backups not yet acked (int64, CPU)."""
        if not self._unacked_write_slots:
            return torch.empty((0,), dtype=torch.int64)
        return torch.cat([s.cpu() for s in self._unacked_write_slots.values()])

    def loading_nodes(self) -> list[TreeNode]:
        """Nodes whose device slots an H2D load is still writing."""
        return [x for node_id in self.ongoing_load_back for x in self._load_chain(node_id)]

    def device_in_flight(self) -> int:
        """Device slots held by the controller outside the tree (e.g. deferred frees)."""
        return self.controller.device_in_flight()

    def staged_write_tokens(self) -> int:
        """Host slots of ``buffer_only`` backups staged for storage and not yet handed over."""
        return sum(h.numel() for h, _ in self._storage_writes.values())

    def host_in_flight(self) -> int:
        """Host slots outside the tree: deferred frees, staging, what the storage tier holds."""
        held = self.controller.host_in_flight()
        if self.storage is not None:
            held += self.storage.host_slots_held()
            if self.storage.buffer_only:
                held += self.staged_write_tokens()
        return held
