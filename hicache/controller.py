"""Moves KV between the device and host pools asynchronously (SGLang ``HiCacheController``).

Two side streams: ``write_stream`` (D2H backups) and ``load_stream`` (H2D loads). Everything runs
on the scheduler thread and never blocks, except ``wait_write`` / ``wait_all`` (documented) and,
on CPU streams, ``LayerDoneCounter.wait_until`` (a host wait is the only wait a CPU has).

Slot ownership while a copy runs (the invariant ``check_integrity`` verifies):

- ``write(d)``: device slots ``d`` are read, fresh host slots ``h`` written, from the call until
  the write ack is popped (``writing_check`` / ``wait_write``).
- ``load(h)``: fresh device slots ``d`` are written, host slots ``h`` read, from the call (queued)
  until the load ack is popped (``loading_check``).
- Neither tier's slots return to their allocator while a copy uses them: ``evict_device`` /
  ``evict_host`` of such slots DEFER the free until the copy's ack is popped; the controller
  holds them meanwhile (``device_in_flight()`` / ``host_in_flight()`` count them).
- A load whose host slots are still being written by a backup waits (on its stream) for that
  backup; a backup launched while loads are in flight waits for the latest load.

Acks are ``HiCacheAck(start_event, finish_event, node_ids, ...)``, completed in launch order.

Tensor parallelism: each rank has its own controller over its shard of the KV heads, and its
copies finish at their own pace. Two things here are rank-local and are agreed on the
controller's ``group`` (``hicache.tp_group``; ``SingleRankGroup`` at ``tp_size`` 1, where every
agreement is the identity):

- whether a pool has room: ``write`` reserves host space and ``load`` device space on every
  rank (a capacity check that holds until the commit: nothing else allocates in between on the
  one scheduler thread), agrees (``agree_all``), then commits everywhere (allocates, launches)
  or aborts everywhere (returns ``None``). A commit whose allocation fails after the group
  agreed there was room raises ``RuntimeError`` (the ranks' allocators diverged).
- how many acks finished: ``count_finished_writes`` / ``count_finished_loads`` count this
  rank's leading finished acks; the tree agrees the minimum over ranks and pops exactly that
  many with ``writing_check(n)`` / ``loading_check(n)`` (``hiradix_transfers``).

Everything else (which slots a free defers, which acks ``wait_write`` pops) follows from the
same calls in the same order on every rank, so both allocators stay identical across ranks.

Whether a freed slot is still in use is answered by per-page busy counts (``BusyPages``: raised
at launch or queueing, lowered when the ack is popped), so a free costs O(freed pages) whatever
the number of copies in flight.

This file owns the copy launches, the load queue and the ack queues. The slot accounting above
(``BusyPages``, ``InflightSlots``, the deferred frees) is in ``inflight_slots``; the per-layer
load events (``LayerDoneCounter``) are in ``layer_done_counter``. Both are re-exported here.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

import numpy as np
import torch

from hicache.allocator import TokenToKVPoolAllocator
from hicache.inflight_slots import (
    BusyPages,
    CopyUsage,
    DeferredFrees,
    InflightSlots,
    cat_cpu,
    check_indices,
)
from hicache.layer_done_counter import LayerDoneCounter, LayerLoadingEvent
from hicache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache.memory_pool_host_base import SUPPORTED_LAYOUT_IO
from hicache.memory_pool_host_mha import MHATokenToKVPoolHost
from hicache.memory_pool_host_mla import MLATokenToKVPoolHost
from hicache.stats import CacheStats
from hicache.streams import CpuStreams, CudaStreams, Delay, Event, make_streams
from hicache.tp_group import SingleRankGroup, TPGroup

__all__ = [
    "HiCacheAck",
    "HiCacheController",
    "InflightSlots",
    "LayerDoneCounter",
    "LayerLoadingEvent",
]

logger = logging.getLogger(__name__)


class HiCacheAck(NamedTuple):
    """One launched copy. The first three fields are SGLang's."""

    start_event: Event
    finish_event: Event
    node_ids: list[int]
    host_indices: torch.Tensor  # CPU int64, as allocated
    device_indices: torch.Tensor  # int64 on the device allocator's device, as allocated
    nbytes: int
    producer_id: int = -1  # LayerDoneCounter producer (loads only)
    usages: tuple[CopyUsage, ...] = ()  # what the busy counts hold for this copy


class _CacheOperation(NamedTuple):
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_id: int
    usage: CopyUsage


class HiCacheController:
    """Backups (D2H) and loads (H2D) between one device pool and one host pool.

    Args:
        device_allocator: the device pool's allocator (load() allocates from it).
        device_pool: ``MHATokenToKVPool`` or ``MLATokenToKVPool``.
        host_pool: the matching host pool; its ``allocator`` is ``host_allocator``.
        io_backend: ``"kernel"`` (Triton ops) or ``"direct"`` (per-run copies); must suit the
            host pool's layout (``SUPPORTED_LAYOUT_IO``).
        streams: ``CudaStreams`` / ``CpuStreams``; default from the device pool's device.
        copy_delay: CPU only, when ``streams`` is not given: seconds (or a callable) slept
            before every copy on the side streams, to widen race windows in tests.
        stats: receives bytes moved and copy time as acks complete.
        group: the tensor-parallel cache group that agrees room in the pools (module doc);
            ``None``: a single rank.
    """

    def __init__(
        self,
        device_allocator: TokenToKVPoolAllocator,
        device_pool: MHATokenToKVPool | MLATokenToKVPool,
        host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost,
        io_backend: str = "kernel",
        streams: CudaStreams | CpuStreams | None = None,
        copy_delay: Delay = 0.0,
        stats: CacheStats | None = None,
        group: TPGroup | None = None,
    ) -> None:
        if (host_pool.layout, io_backend) not in SUPPORTED_LAYOUT_IO:
            raise ValueError(
                f"io_backend={io_backend!r} cannot serve host layout {host_pool.layout!r}; "
                f"supported pairs: {sorted(SUPPORTED_LAYOUT_IO)}"
            )
        if device_allocator.page_size != host_pool.page_size:
            raise ValueError("device_allocator and host_pool page sizes differ")
        if device_allocator.size != device_pool.size:
            raise ValueError(
                f"device_allocator size {device_allocator.size} != device_pool size "
                f"{device_pool.size}"
            )
        self.device_allocator = device_allocator
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.host_allocator = host_pool.allocator
        self.io_backend = io_backend
        self.page_size = host_pool.page_size
        self.layer_num = device_pool.layer_num
        self.device = device_pool.device
        self.group = group if group is not None else SingleRankGroup()
        self.stats = stats if stats is not None else CacheStats()
        self.streams = streams if streams is not None else make_streams(self.device, copy_delay)
        self.write_stream = self.streams.new_stream()
        self.load_stream = self.streams.new_stream()
        self.layer_done_counter = LayerDoneCounter(self.layer_num, self.streams)

        self.load_queue: list[_CacheOperation] = []
        self.ack_write_queue: deque[HiCacheAck] = deque()
        self.ack_load_queue: deque[HiCacheAck] = deque()
        # Copies per page, and slots the tree freed while a copy still uses them (held until
        # the copy's ack).
        self._busy = BusyPages(device_allocator, self.host_allocator)
        self._deferred_device = DeferredFrees(device_allocator)
        self._deferred_host = DeferredFrees(self.host_allocator)

    # ------------------------------------------------------------------ D2H
    def write(self, device_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Back up device slots to freshly allocated host slots; launches at once.

        Returns the host slots (CPU int64, same order as ``device_indices``) or ``None`` when the
        host pool is short on any rank of the group (nothing changes). Raises ``ValueError`` for
        malformed indices or slots that a queued, unstarted load will write (their content does
        not exist yet). The copy starts on the write stream after an event recorded now on the
        compute stream (so it reads what the forward wrote). Never blocks, except for the
        group's agreement on room (a collective when ``tp_size > 1``).
        The host copy is readable only after this write's ack (``writing_check``).
        """
        check_indices("device_indices", device_indices, self.page_size)
        if self.load_queue and bool(
            torch.isin(
                device_indices.cpu(), cat_cpu([op.device_indices for op in self.load_queue])
            ).any()
        ):
            raise ValueError(
                "device_indices include slots of a queued load that has not started; "
                "call start_loading() first"
            )
        n = device_indices.numel()
        if not self.group.agree_all(self.host_allocator.can_alloc(n), tag="hicache_write_room"):
            return None
        host_indices = self._commit_alloc(self.host_allocator, n, "host")
        if host_indices.numel() == 0:
            return host_indices
        start = self.streams.new_event(enable_timing=True)
        start.record(self.streams.compute)
        self.write_stream.wait_event(start)
        if self.ack_load_queue:  # a backup may read slots a load is still writing
            self.write_stream.wait_event(self.ack_load_queue[-1].finish_event)
        pool, dev, io = self.host_pool, self.device_pool, self.io_backend

        def backup() -> None:  # index moves run on the write stream too, ordered before the copy
            h, d = self._move_indices(host_indices, device_indices)
            pool.backup_from_device_all_layer(dev, h, d, io)

        self.write_stream.submit(backup)
        finish = self.write_stream.record(self.streams.new_event(enable_timing=True))
        usage = CopyUsage(device_indices, host_indices, host_written=True)
        self._busy.add(usage)
        self.ack_write_queue.append(
            HiCacheAck(
                start,
                finish,
                [node_id],
                host_indices,
                device_indices,
                self._nbytes(host_indices),
                usages=(usage,),
            )
        )
        return host_indices

    def count_finished_writes(self) -> int:
        """Leading backups (launch order) whose copy finished on this rank; 0 for an empty
        queue. Never blocks. The tree agrees the minimum over ranks and pops that many."""
        return _count_finished(self.ack_write_queue)

    def writing_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` backups in launch order (``None``: every leading finished one);
        returns their node ids. Releases deferred frees that no copy uses any more. Never
        blocks for an agreed ``n`` (at most ``count_finished_writes()``); a larger one waits for
        those copies. ``ValueError`` when ``n`` exceeds the queue."""
        count = self._check_count(n, self.ack_write_queue, self.count_finished_writes)
        done: list[int] = []
        for _ in range(count):
            done.extend(self._complete(self.ack_write_queue.popleft(), "d2h"))
        self._release_deferred()
        return done

    def wait_write(self, node_ids: list[int] | None = None) -> list[int]:
        """Block until the backups of ``node_ids`` (all, when ``None``) finish, pop exactly those
        acks, and return their node ids (``writing_check`` will not return them again)."""
        wanted = None if node_ids is None else set(node_ids)
        targets = [
            a for a in self.ack_write_queue if wanted is None or wanted.intersection(a.node_ids)
        ]
        for a in targets:
            a.finish_event.synchronize()
        done: list[int] = []
        for a in targets:
            self.ack_write_queue.remove(a)
            done.extend(self._complete(a, "d2h"))
        self._release_deferred()
        return done

    # ------------------------------------------------------------------ H2D
    def load(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Allocate device slots for ``host_indices`` and queue their H2D copy.

        Returns the device slots (int64 on the device, same order) or ``None`` when the device
        pool is short on any rank of the group (nothing changes). Nothing moves until
        ``start_loading()``. Never blocks, except for the group's agreement on room.
        """
        check_indices("host_indices", host_indices, self.page_size)
        if host_indices.numel() and (
            int(host_indices.min()) < 0 or int(host_indices.max()) >= self.host_pool.size
        ):
            raise ValueError(f"host_indices out of range [0, {self.host_pool.size})")
        n = host_indices.numel()
        if not self.group.agree_all(self.device_allocator.can_alloc(n), tag="hicache_load_room"):
            return None
        device_indices = self._commit_alloc(self.device_allocator, n, "device")
        host_indices = host_indices.cpu()
        usage = CopyUsage(device_indices, host_indices, host_written=False)
        self._busy.add(usage)
        self.load_queue.append(_CacheOperation(host_indices, device_indices, node_id, usage))
        return device_indices

    def start_loading(self) -> int:
        """Launch every queued load as one H2D per layer on the load stream, recording one event
        per layer; returns the producer id (``-1`` when nothing was queued). Never blocks."""
        if not self.load_queue:
            return -1
        ops, self.load_queue = self.load_queue, []
        host_indices = torch.cat([op.host_indices for op in ops])
        device_indices = torch.cat([op.device_indices for op in ops])
        node_ids = [op.node_id for op in ops]
        pid = self.layer_done_counter.update_producer()
        lev = self.layer_done_counter.events[pid]
        lev.start_event.record(self.streams.compute)
        self.load_stream.wait_event(lev.start_event)
        if self.ack_write_queue and self._busy.host_being_written(host_indices):
            # Host slots still being written by a backup: backups finish in launch order, so
            # waiting for the newest covers it.
            self.load_stream.wait_event(self.ack_write_queue[-1].finish_event)
        pool, dev, io = self.host_pool, self.device_pool, self.io_backend
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def load_layer(layer: int) -> None:  # the first layer moves the indices, on this stream
            if not moved:
                moved.append(self._move_indices(host_indices, device_indices))
            pool.load_to_device_per_layer(dev, *moved[0], layer, io)

        for layer in range(self.layer_num):
            self.load_stream.submit(lambda layer=layer: load_layer(layer))
            lev.load_events[layer].record(self.load_stream)
        self.ack_load_queue.append(
            HiCacheAck(
                lev.start_event,
                lev.finish_event,
                node_ids,
                host_indices,
                device_indices,
                self._nbytes(host_indices),
                pid,
                tuple(op.usage for op in ops),
            )
        )
        self.layer_done_counter.set_consumer(pid)
        return pid

    def count_finished_loads(self) -> int:
        """Leading loads (launch order) whose copy finished on this rank; 0 for an empty queue.
        Never blocks."""
        return _count_finished(self.ack_load_queue)

    def loading_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` loads in launch order (``None``: every leading finished one);
        returns their node ids. Never blocks for an agreed ``n`` (as ``writing_check``)."""
        count = self._check_count(n, self.ack_load_queue, self.count_finished_loads)
        done: list[int] = []
        for _ in range(count):
            ack = self.ack_load_queue.popleft()
            done.extend(self._complete(ack, "h2d"))
            self.layer_done_counter.release(ack.producer_id)
        self._release_deferred()
        return done

    # ------------------------------------------------------------------ both
    def wait_all(self) -> tuple[list[int], list[int]]:
        """Block until every launched copy finished; pop all acks. Returns (written node ids,
        loaded node ids). Queued, unstarted loads stay queued."""
        for a in list(self.ack_write_queue) + list(self.ack_load_queue):
            a.finish_event.synchronize()
        return self.writing_check(), self.loading_check()

    # ------------------------------------------------------------------ eviction
    def evict_device(self, device_indices: torch.Tensor) -> int:
        """Return device slots to the allocator; slots a copy still uses are held until its ack
        is popped. Raises ``ValueError`` (nothing changes) on a bad or double free.
        O(freed slots), whatever the number of copies in flight."""
        idx = self._deferred_device.validate(device_indices, "device_indices")
        self._busy.settle()
        self._deferred_device.free_or_defer(idx, self._busy.device_busy(idx.numpy()))
        return device_indices.numel()

    def evict_host(self, host_indices: torch.Tensor) -> int:
        """Return host slots to the host allocator (deferred while a copy uses them, as
        ``evict_device``)."""
        idx = self._deferred_host.validate(host_indices, "host_indices")
        self._deferred_host.free_or_defer(idx, self._busy.host_busy(idx.numpy()))
        return host_indices.numel()

    # ------------------------------------------------------------------ accounting
    def inflight_slots(self) -> InflightSlots:
        """Slots used by launched or queued copies whose acks are not popped (CPU int64)."""
        writes = list(self.ack_write_queue)
        loads = list(self.ack_load_queue)
        return InflightSlots(
            device_read=cat_cpu([a.device_indices for a in writes]),
            device_written=cat_cpu(
                [a.device_indices for a in loads] + [op.device_indices for op in self.load_queue]
            ),
            host_read=cat_cpu(
                [a.host_indices for a in loads] + [op.host_indices for op in self.load_queue]
            ),
            host_written=cat_cpu([a.host_indices for a in writes]),
        )

    def device_in_flight(self) -> int:
        """Device slots the tree freed that the controller holds until a copy's ack."""
        return self._deferred_device.num_slots()

    def host_in_flight(self) -> int:
        """Host slots the tree freed that the controller holds until a copy's ack."""
        return self._deferred_host.num_slots()

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless both allocators are consistent, every slot a copy
        uses is allocated (none is free while a copy reads or writes it), the busy counts equal
        a recount from the copies, and deferred frees are allocated and distinct."""
        self.device_allocator.check_integrity()
        self.host_allocator.check_integrity()
        busy = self.inflight_slots()
        self._busy.settle()
        for name, idx, counts, ps in (
            ("device", busy.device_slots(), self._busy.device, self.device_allocator.page_size),
            ("host", busy.host_slots(), self._busy.host, self.host_allocator.page_size),
            ("host written", busy.host_written, self._busy.host_written, self.page_size),
        ):
            recount = np.bincount(idx.numpy() // ps, minlength=counts.size)
            if not np.array_equal(recount, counts):
                raise AssertionError(f"controller: {name} busy counts disagree with the copies")
        for name, idx, alloc in (
            ("device", busy.device_slots(), self.device_allocator),
            ("host", busy.host_slots(), self.host_allocator),
            ("deferred device", self._deferred_device.slots(), self.device_allocator),
            ("deferred host", self._deferred_host.slots(), self.host_allocator),
        ):
            if not alloc.is_allocated(idx):
                raise AssertionError(f"controller: a {name} slot in use by a copy is free")
        for name, deferred in (("device", self._deferred_device), ("host", self._deferred_host)):
            d = deferred.slots()
            if d.unique().numel() != d.numel():
                raise AssertionError(f"controller: a {name} slot is deferred twice")

    def close(self) -> None:
        """Finish every launched copy: stop the CPU stream threads after their queued work, or
        wait for the CUDA side streams. Acks are not popped (``wait_all`` does that)."""
        if isinstance(self.streams, CpuStreams):
            self.streams.close()
        else:
            self.write_stream.synchronize()
            self.load_stream.synchronize()

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _check_count(n: int | None, queue: deque[HiCacheAck], finished) -> int:
        if n is None:
            return finished()
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(queue):
            raise ValueError(f"n must be an int in [0, {len(queue)}] (acks queued), got {n!r}")
        return n

    def _commit_alloc(self, allocator: TokenToKVPoolAllocator, n: int, tier: str) -> torch.Tensor:
        """The allocation every rank agreed there was room for."""
        slots = allocator.alloc(n)
        if slots is None:
            raise RuntimeError(
                f"rank {self.group.rank}: the {tier} pool has {allocator.available_size()} free "
                f"slots for {n} after the group agreed there was room (allocators diverged)"
            )
        return slots

    def _nbytes(self, indices: torch.Tensor) -> int:
        return indices.numel() * self.host_pool.size_per_token

    def _complete(self, ack: HiCacheAck, direction: str) -> list[int]:
        ack.finish_event.synchronize()  # already done; orders the host after it on CUDA
        for usage in ack.usages:
            self._busy.remove(usage)
        stream = self.write_stream if direction == "d2h" else self.load_stream
        stream.check_error()
        secs = ack.start_event.elapsed_time(ack.finish_event) / 1e3
        self.stats.record_copy(direction, ack.nbytes, secs)
        return ack.node_ids

    def _move_indices(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices where the io backend wants them (as SGLang's ``move_indices``)."""
        if self.io_backend == "kernel":
            return host_indices.to(self.device, non_blocking=True), device_indices
        device_indices = device_indices.cpu()
        if self.host_pool.layout == "layer_first":  # sorted host side: longer contiguous runs
            host_indices, order = host_indices.sort()
            device_indices = device_indices.index_select(0, order)
        return host_indices, device_indices

    def _release_deferred(self) -> None:
        """Free the held slots no copy uses any more. O(held slots)."""
        if self._deferred_device.held:
            self._busy.settle()
            self._deferred_device.release(self._busy.device_busy)
        if self._deferred_host.held:
            self._deferred_host.release(self._busy.host_busy)


def _count_finished(queue: deque[HiCacheAck]) -> int:
    n = 0
    for ack in queue:
        if not ack.finish_event.query():
            break
        n += 1
    return n
