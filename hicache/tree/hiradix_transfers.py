"""The two-phase copies of a ``HiRadixCache`` and the in-flight state between their phases.

A D2H backup starts at ``write_backup`` and completes at its write ack (``writing_check``); an
H2D load back starts at ``init_load_back`` (launched by ``ready_to_load_host_cache``) and
completes at its load ack (``loading_check``). Between the two phases the node is held: locked
(write-through backups, every load) and listed in ``ongoing_write_through`` /
``ongoing_load_back``; a host copy not yet acked is not readable. This file owns that state, the
acks that clear it and the views of it that ``check_integrity`` reads. *When* a backup starts is
the write policy's decision, in ``hiradix_cache.py``; the controller moves the bytes.

A copy that fails (``hicache.transfer.errors``; what the tree does is in ``failed_copies``): a
backup whose launch fails is skipped as when the host is full, and one that fails while it runs
leaves its node device-only at its ack, as if never backed up; a load back that fails at its
launch (``ready_to_load_host_cache``), at a layer's wait (``layer_wait``) or at its ack raises
``LoadBackError``, and ``cancel_load_back()`` makes its nodes host-only again once the caller
released its locks on them (the caller recomputes).

``HiRadixTransfers`` is the base of ``HiRadixCache`` and is not built on its own: it uses the
subclass's attributes (declared below) and its ``evict`` / ``evict_host``.

Tensor parallelism (the controller's ``group``): every rank holds an identical tree over its
own shard of the KV heads. The tree changes only through calls every rank makes in the same
order with the same arguments, and every input that is rank-local is agreed first:

==========================  ===============================================================
decision                    agreed input (collective on the cache group)
==========================  ===============================================================
acks applied each tick      ``agree_min_many([finished writes, finished loads])``: every rank
                            enters it every tick (0 for an empty queue, no early return) and
                            pops exactly that many of each (``check_hicache_events``)
backup started / skipped    host room, reserved on every rank then ``agree_all``
                            (``controller.write``); a refusal is one on every rank, so every
                            rank runs the same ``evict_host`` and the same retry
load back started / not     device room, ``agree_all`` of the reservation (a group-agreed
                            capacity snapshot, ``controller.load``); without room every rank
                            runs the same ``evict`` and the same retry, else all recompute
device / host eviction      none needed: identical trees and arguments pop the same LRU
                            leaves; under write_back each backup's result is agreed (above)
                            and ``wait_write`` waits for the same backups on every rank
device slots for requests   ``KVCache.alloc_device``: ``agree_all`` of room, ``agree_max`` of
                            the tokens to evict
==========================  ===============================================================

Node ids are a per-process counter (they only break LRU ties between nodes of one tree, whose
relative order is the same on every rank); cross-rank checks compare ``tp_digest.tree_state``,
which names nodes by their path, not their id.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hicache.transfer.controller import ack_error
from hicache.transfer.errors import BackupError, LoadBackError
from hicache.tree.failed_copies import check_revertable, drop_failed_backup, revert_loads
from hicache.tree.lru_queues import HOST, LRUQueue, is_host_candidate
from hicache.tree.node import TreeNode
from hicache.tree.radix_cache import RadixCache

if TYPE_CHECKING:
    from hicache.cache_stats import CacheStats
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.tp.group import TPGroup
    from hicache.transfer.controller import HiCacheController

logger = logging.getLogger(__name__)


class HiRadixTransfers(RadixCache):
    """Backups, load backs and their acks for ``HiRadixCache`` (see the module docstring)."""

    # Set by HiRadixCache.__init__.
    controller: HiCacheController
    host_allocator: TokenToKVPoolAllocator
    write_locks: bool
    load_back_threshold: int
    stats: CacheStats | None

    def reset(self) -> None:
        super().reset()
        self._host_queue = LRUQueue(HOST, is_host_candidate)  # host-only leaves, LRU first
        self.ongoing_write_through: dict[int, TreeNode] = {}  # node id -> node being backed up
        self.ongoing_load_back: dict[int, TreeNode] = {}  # node id -> last node being loaded
        self._load_ancestors: dict[int, TreeNode] = {}  # node id -> device ancestor of the chain
        self._unacked_write_slots: dict[int, torch.Tensor] = {}  # node id -> host slots written
        self._failed_loads: set[int] = set()  # loads whose ack reported a failure, not undone

    def _queues(self) -> tuple[LRUQueue, ...]:
        return (self._device_queue, self._host_queue)

    # ------------------------------------------------------------------ backup (D2H)

    # Slot ownership of a backup: the node keeps its device slots (read by the copy) and gets
    # host slots from the controller at once (written by the copy). Until the write ack the host
    # copy is not readable: under write_through* the node is locked (cannot be evicted, so it is
    # never a host-only hit); under write_back evict() waits for the copy before freeing.
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Start the D2H backup of ``node``; returns tokens backed up (0 when the host is full
        even after host eviction). Never blocks.

        A backup whose launch fails (``BackupError``: the controller freed what it allocated) is
        skipped as when the host is full: 0, logged, counted in ``stats.d2h_failed_copies``; the
        node stays device-only, evictable and backed up later as if never backed up, so an
        ``insert`` that starts it still completes. Under tensor parallelism the error is raised
        instead (the other ranks launched theirs: skipping here alone would split the trees).
        """
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
        return len(host_indices)

    # ------------------------------------------------------------------ acks

    @property
    def group(self) -> TPGroup:
        """The cache group the controller agrees on (``SingleRankGroup`` for one rank)."""
        return self.controller.group

    def writing_check(self, n: int | None = None) -> None:
        """Complete the first ``n`` backups (``None``: the finished ones; non-blocking): their
        host copies become readable and write-through locks are released."""
        for node_id in self.controller.writing_check(n):
            self._ack_write(node_id)

    def _ack_write(self, node_id: int) -> bool:
        """Apply one popped backup ack; ``False`` when its copy failed while it ran: the node
        is then device-only again, its host slots freed (``failed_copies``)."""
        node = self.ongoing_write_through.pop(node_id, None)
        slots = self._unacked_write_slots.pop(node_id, None)
        failure = self.controller.take_failure(node_id)
        if node is not None and failure is not None and slots is not None:
            logger.warning("backup of %r failed; the node stays device-only: %s", node, failure)
            drop_failed_backup(self, node, slots)
        if node is not None and self.write_locks:
            self.dec_lock_ref(node)
        return failure is None

    def loading_check(self, n: int | None = None) -> None:
        """Complete the first ``n`` loads (``None``: the finished ones; non-blocking): release
        the locks they held. A load whose ack reports a failure (it failed while it ran) is
        undone at once when no caller locks its nodes (they are host-only again, as before
        ``init_load_back``); otherwise it stays held and ``LoadBackError`` is raised after every
        other ack was applied: the caller releases its locks on those nodes, then calls
        ``cancel_load_back()``. (A caller that waits per layer, ``layer_wait``, is told
        earlier.)"""
        failed = self._apply_load_acks(self.controller.loading_check(n))
        if not failed:
            return
        self._failed_loads.update(failed)
        try:
            check_revertable(self, self._failed_loads)
        except ValueError as exc:
            raise LoadBackError(
                "load_to_device_per_layer",
                f"the loads of node ids {sorted(self._failed_loads)} failed while they ran; "
                f"release the locks on their nodes, then cancel_load_back() ({exc})",
                sorted(self._failed_loads),
            ) from exc
        revert_loads(self, self._failed_loads)
        self._failed_loads.clear()

    def _apply_load_acks(self, node_ids: list[int]) -> list[int]:
        """Release the locks of the popped loads that succeeded; returns the node ids of those
        whose copy failed (still held, for ``revert_loads``)."""
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
        """Undo every load back that did not complete, after a ``LoadBackError`` and once the
        caller released each lock it took on the nodes ``init_load_back`` returned since: the
        queued loads (their launch failed, or they were never started) and the launched ones
        whose copy failed. Their nodes are host-only again, as before ``init_load_back``, and
        their device slots are freed; a caller recomputes that KV. Loads that succeeded are
        acked as usual. Returns the tokens undone.

        Blocks until every launched load finished (an error path). Raises ``ValueError``,
        changing nothing, while a caller still locks one of those nodes. Single rank only
        (``RuntimeError`` otherwise): which copy failed is rank-local, so under tensor
        parallelism a failed copy is fatal (the failing rank raises, the others stop at their
        next collective)."""
        c = self.controller
        if self.group.size > 1:
            raise RuntimeError("cancel_load_back: a failed copy is not agreed across TP ranks")
        c.wait_loads()
        failed = [nid for ack in c.ack_load_queue if ack_error(ack) for nid in ack.node_ids]
        queued = [op.node_id for op in c.load_queue]
        todo = {*queued, *failed, *self._failed_loads}
        check_revertable(self, [nid for nid in todo if nid in self.ongoing_load_back])
        self._failed_loads.update(self._apply_load_acks(c.loading_check(len(c.ack_load_queue))))
        self._failed_loads.update(c.cancel_loads())
        undone = revert_loads(self, self._failed_loads)
        self._failed_loads.clear()
        return undone

    def check_hicache_events(self) -> None:
        """Poll both ack queues without blocking: the leading finished backups and loads,
        as many of each as every rank of the group has finished (one collective per call when
        ``tp_size > 1``, entered whatever the queues hold)."""
        c = self.controller
        writes, loads = self.group.agree_min_many(
            [c.count_finished_writes(), c.count_finished_loads()], tag="hicache_acks"
        )
        self.writing_check(writes)
        self.loading_check(loads)

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
            if x.host_ref == 0:
                self._host_queue.push_if_candidate(x)
            x = x.parent

    # ------------------------------------------------------------------ load back (H2D)

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
            if self.stats is not None:
                self.stats.record_load_back_no_room(total)
            return self._empty(), ancestor

        offset = 0
        for x in chain:  # top down; the host queue drops them lazily (no longer host-only)
            x.value = device_indices[offset : offset + len(x.host_value)]
            offset += len(x.host_value)
            x.parent.device_children += 1
            self._add_device_tokens(x, len(x.value))
        self._own(device_indices)
        self.ongoing_load_back[last_host_node.id] = last_host_node
        self._load_ancestors[last_host_node.id] = ancestor
        self.inc_lock_ref(last_host_node)
        if self.stats is not None:
            self.stats.record_load(total)
        return device_indices, last_host_node

    def ready_to_load_host_cache(self) -> int:
        """Launch the queued loads (one H2D per layer); returns the controller's producer id.
        Raises ``LoadBackError`` when the launch fails; the tree and the controller are then as
        before the call (the loads still queued): the caller releases the locks it took on the
        nodes ``init_load_back`` returned and calls ``cancel_load_back()``."""
        return self.controller.start_loading()

    def layer_wait(self, layer_id: int) -> None:
        """Before layer ``layer_id``'s attention: wait for that layer's load (a stream wait on
        CUDA, a host block on CPU; no wait when nothing is loading). Raises ``LoadBackError``
        when that layer's copy failed while it ran (thread CPU streams): its KV must not be
        read; the caller releases its locks on the loaded nodes and calls
        ``cancel_load_back()``."""
        self.controller.layer_done_counter.wait_until(layer_id)

    # ------------------------------------------------------------------ integrity hooks

    def unacked_write_host_slots(self) -> torch.Tensor:
        """Host slots of backups not yet acked (int64, CPU)."""
        if not self._unacked_write_slots:
            return torch.empty((0,), dtype=torch.int64)
        return torch.cat([s.cpu() for s in self._unacked_write_slots.values()])

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
