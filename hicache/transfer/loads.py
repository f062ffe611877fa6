"""The controller's H2D path (SGLang ``HiCacheController.load`` / ``start_loading`` /
``loading_check``): the load queue, its launch layer by layer, and its acks.

- ``load(h)``: device room is agreed over the group, fresh device slots ``d`` are allocated and
  the operation waits in ``load_queue``; nothing moves yet. ``d`` is written and ``h`` read from
  this call until the ack is popped (a ``write`` of ``d`` before the launch is refused).
- ``start_loading()`` launches every queued load as one H2D copy per layer on the load stream,
  recording a per-layer event (``LayerDoneCounter``, which the forward waits on layer by
  layer). It waits for the compute stream, and for the newest backup when a backup is still
  writing some of the host slots it reads (backups finish in launch order).
- ``loading_check(n)`` pops the first ``n`` load acks (``None``: the leading finished ones; ``n``
  is agreed over tensor-parallel ranks by the tree) and releases their layer counters.

``ControllerLoads`` is a base of ``HiCacheController`` and is not built on its own: it uses
the controller's attributes (declared below) and its ``_move_indices``,
``_nbytes``, ``_complete`` and ``_release_deferred``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

import kernels
from hicache.tp.agreed import agreed_alloc
from hicache.transfer.acks import HiCacheAck, ack_count, count_finished
from hicache.transfer.busy_pages import BusyPages, CopyUsage
from kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
    from hicache.memory.host_pool_mha import MHATokenToKVPoolHost
    from hicache.memory.host_pool_mla import MLATokenToKVPoolHost
    from hicache.tp.group import TPGroup
    from hicache.transfer.layer_done_counter import LayerDoneCounter
    from hicache.transfer.streams import Stream, Streams

logger = logging.getLogger(__name__)

__all__ = ["CacheOperation", "ControllerLoads"]


class CacheOperation(NamedTuple):
    """One queued, unstarted load (SGLang ``CacheOperation``)."""

    host_indices: torch.Tensor  # CPU int64
    device_indices: torch.Tensor  # int64 on the device, as allocated
    node_id: int
    usage: CopyUsage


class ControllerLoads:
    """Loads (H2D) of ``HiCacheController`` (see the module docstring)."""

    # Set by HiCacheController.__init__.
    device_allocator: TokenToKVPoolAllocator
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost
    device_pool: MHATokenToKVPool | MLATokenToKVPool
    io_backend: str
    page_size: int
    group: TPGroup
    layer_num: int
    streams: Streams
    load_stream: Stream
    layer_done_counter: LayerDoneCounter
    load_queue: list[CacheOperation]
    ack_write_queue: deque[HiCacheAck]
    ack_load_queue: deque[HiCacheAck]
    _busy: BusyPages

    def load(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Allocate device slots for ``host_indices`` and queue their H2D copy.

        Returns the device slots (int64 on the device, same order) or ``None`` when the device
        pool is short on any rank of the group (nothing changes). Nothing moves until
        ``start_loading()``. Never blocks, except for the group's agreement on room.
        """
        slot_indices("host_indices", host_indices, page_size=self.page_size)
        if host_indices.numel() and (
            int(host_indices.min()) < 0 or int(host_indices.max()) >= self.host_pool.size
        ):
            raise ValueError(f"host_indices out of range [0, {self.host_pool.size})")
        n = host_indices.numel()
        device_indices = agreed_alloc(
            self.group, self.device_allocator, n, pool="device", tag="hicache_load_room"
        )
        if device_indices is None:
            return None
        host_indices = host_indices.cpu()
        usage = CopyUsage(device_indices, host_indices, host_written=False)
        self._busy.add(usage)
        self.load_queue.append(CacheOperation(host_indices, device_indices, node_id, usage))
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
        watch = kernels.watch_copies(self.device_pool.device)  # issue 19: bad indices, at the ack

        def load_layer(layer: int) -> None:  # the first layer moves the indices, on this stream
            if not moved:
                moved.append(self._move_indices(host_indices, device_indices))
            with watch:
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
                watch,
            )
        )
        self.layer_done_counter.set_consumer(pid)
        return pid

    def count_finished_loads(self) -> int:
        """Leading loads (launch order) whose copy finished on this rank; 0 for an empty queue.
        Never blocks."""
        return count_finished(self.ack_load_queue)

    def loading_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` loads in launch order (``None``: every leading finished one);
        returns their node ids. Never blocks for an agreed ``n`` (as ``writing_check``)."""
        count = ack_count(n, self.ack_load_queue)
        done: list[int] = []
        for _ in range(count):
            ack = self.ack_load_queue.popleft()
            done.extend(self._complete(ack, "h2d"))
            self.layer_done_counter.release(ack.producer_id)
        self._release_deferred()
        return done
