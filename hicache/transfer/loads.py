"""The controller's H2D path (SGLang ``HiCacheController.load`` / ``start_loading`` /
``loading_check``): the load queue, its launch layer by layer, and its acks.

- ``load(h)``: device room is agreed over the group, fresh device slots ``d`` are allocated and
  the operation waits in ``load_queue``; nothing moves yet. ``d`` is written and ``h`` read from
  this call until the ack is popped (a ``write`` of ``d`` before the launch is refused).
- ``start_loading()`` launches every queued load as one H2D copy per layer on the load stream,
  recording a per-layer event (``LayerDoneCounter``, which the forward waits on layer by
  layer). It waits for the compute stream, and for the newest backup when a backup is still
  writing some of the host slots it reads (backups finish in launch order). A launch that fails
  leaves the loads queued and raises ``LoadBackError``; ``cancel_loads()`` drops queued loads.
  A layer that fails while it runs (thread CPU streams) makes that layer's wait raise
  ``LoadBackError`` (``LayerDoneCounter.wait_until``) and is reported at the ack.
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
from hicache.transfer.errors import LoadBackError
from kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
    from hicache.memory.host_pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost
    from hicache.stats import CacheStats
    from hicache.tp.group import TPGroup
    from hicache.transfer.layer_done_counter import LayerDoneCounter, LayerLoadingEvent
    from hicache.transfer.streams import Event, Stream, Streams

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
    stats: CacheStats
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
        per layer; returns the producer id (``-1`` when nothing was queued). Never blocks.

        The copy is planned once for every layer (indices concatenated and checked by the host
        pool) before anything changes; the per-layer calls then skip the host pool's
        re-validation. Raises ``LoadBackError`` naming the layer when a launch fails (CUDA and
        inline CPU streams launch in ``submit``): the layers already launched are waited for,
        and the queue, the busy counts and the layer counter are as before the call, so the
        loads stay queued; ``cancel_loads`` drops them. Blocks only on that failure path.
        """
        if not self.load_queue:
            return -1
        ops = list(self.load_queue)
        host_indices = torch.cat([op.host_indices for op in ops])
        device_indices = torch.cat([op.device_indices for op in ops])
        node_ids = [op.node_id for op in ops]
        self.host_pool.check_copy_args(host_indices, device_indices, self.io_backend)
        counter = self.layer_done_counter
        consumer = counter.consumer_index
        pid = counter.update_producer(node_ids)
        lev = counter.events[pid]
        progress = [-1]  # the layer being launched
        watch = kernels.watch_copies(self.device_pool.device)  # bad indices, read at the ack
        try:
            copy_start = self._launch_loads(lev, host_indices, device_indices, progress, watch)
        except Exception as exc:
            self._settle_after_failed_launch(self.load_stream)
            counter.release(pid)
            counter.set_consumer(consumer)
            self.stats.record_copy_failure("h2d")
            layer = progress[0]
            op = "start_loading" if layer < 0 else f"load_to_device_per_layer(layer_id={layer})"
            raise LoadBackError(
                op,
                f"{len(ops)} queued loads ({host_indices.numel()} tokens, node ids {node_ids}) "
                "were not launched; they stay queued (cancel_loads drops them)",
                node_ids,
                exc,
            ) from exc
        self.load_queue = []
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
                copy_start_event=copy_start,
                step_events=tuple(lev.load_events),
                watch=watch,
                ready_at=self._ready_at("h2d", host_indices.numel()),
            )
        )
        counter.set_consumer(pid)
        return pid

    def _launch_loads(
        self,
        lev: LayerLoadingEvent,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        progress: list[int],
        watch: kernels.CopyWatch,
    ) -> Event:
        """Queue one H2D per layer on the load stream (CUDA and inline streams run them here,
        and raise here); ``progress[0]`` is the layer being launched; every layer's ops run
        under ``watch`` (bad indices the kernel skipped, read at the ack). Returns the timing
        start event, recorded on the load stream after its waits."""
        lev.start_event.record(self.streams.compute)
        self.load_stream.wait_event(lev.start_event)
        if self.ack_write_queue and self._busy.host_being_written(host_indices):
            # Host slots still being written by a backup: backups finish in launch order, so
            # waiting for the newest covers it.
            self.load_stream.wait_event(self.ack_write_queue[-1].finish_event)
        copy_start = self.load_stream.record(self.streams.new_event(enable_timing=True))
        pool, dev, io = self.host_pool, self.device_pool, self.io_backend
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def load_layer(layer: int) -> None:  # the first layer moves the indices, on this stream
            if not moved:
                moved.append(self._move_indices(host_indices, device_indices))
            with watch:
                pool.load_to_device_per_layer(dev, *moved[0], layer, io, validate=False)

        for layer in range(self.layer_num):
            progress[0] = layer
            self.load_stream.submit(lambda layer=layer: load_layer(layer))
            lev.load_events[layer].record(self.load_stream)
        return copy_start

    def cancel_loads(self) -> list[int]:
        """Drop every queued, unstarted load (after ``start_loading`` raised, or to give up on
        them): their busy counts are lowered; the device slots ``load`` returned stay allocated,
        the caller's to free (``evict_device``). Returns their node ids. Never blocks."""
        ops, self.load_queue = self.load_queue, []
        for op in ops:
            self._busy.remove(op.usage)
        return [op.node_id for op in ops]

    def wait_loads(self) -> None:
        """Block until every launched load finished on this rank (acks are not popped)."""
        for ack in self.ack_load_queue:
            ack.finish_event.synchronize()

    def count_finished_loads(self) -> int:
        """Leading loads (launch order) whose copy finished on this rank; 0 for an empty queue.
        Never blocks."""
        return count_finished(self.ack_load_queue, self._timer_now())

    def loading_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` loads in launch order (``None``: every leading finished one);
        returns their node ids. Never blocks for an agreed ``n`` (as ``writing_check``)."""
        count = ack_count(n, self.ack_load_queue, self._timer_now())
        done: list[int] = []
        for _ in range(count):
            ack = self.ack_load_queue.popleft()
            done.extend(self._complete(ack, "h2d"))
            self.layer_done_counter.release(ack.producer_id)
        self._release_deferred()
        return done
