"""Moves KV between the device and host pools asynchronously (SGLang ``HiCacheController``).

Backups (D2H) launch at once; loads (H2D) queue until ``start_loading`` launches one copy per
layer. Each launched copy appends one ``HiCacheAck``, popped in launch order. Only the ``wait_*``
calls block. Invariant (``check_integrity``): no slot returns to its allocator while a copy uses
it; such frees are deferred until the copy's ack. Design: docs/DESIGN.md sections 5 and 10.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple, Protocol

import numpy as np
import torch

from hicache_prefill import kernels
from hicache_prefill.hicache.cache_stats import CacheStats
from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import SUPPORTED_LAYOUT_IO, HostKVPool
from hicache_prefill.hicache.tp.agreed import agreed_alloc
from hicache_prefill.hicache.tp.group import SingleRankGroup, TPGroup
from hicache_prefill.hicache.transfer.busy_pages import (
    BusyPages,
    CopyUsage,
    DeferredFrees,
    InflightSlots,
    cat_cpu,
)
from hicache_prefill.hicache.transfer.errors import BackupError, CopyError, LoadBackError
from hicache_prefill.hicache.transfer.layer_done_counter import LayerDoneCounter, LayerLoadingEvent
from hicache_prefill.hicache.transfer.streams import (
    CpuStreams,
    Delay,
    Event,
    Stream,
    Streams,
    make_streams,
)
from hicache_prefill.kernels import CopyWatch
from hicache_prefill.kernels.ops.checks import slot_indices

logger = logging.getLogger(__name__)


class CopyTimer(Protocol):
    """Modelled copy time (a simulator's seam): its clock, and the seconds one copy of
    ``tokens`` tokens (all layers) takes in ``direction``."""

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None: ...

    def copy_seconds(self, direction: str, tokens: int) -> float: ...


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
    copy_start_event: Event | None = None  # on the side stream, after its waits
    step_events: tuple[Event, ...] = ()  # whose ``error`` fails the copy (else finish_event)
    watch: CopyWatch | None = None  # bad indices found on the device
    ready_at: float | None = None  # a timed copy's modelled end (``CopyTimer``'s clock)


class CacheOperation(NamedTuple):
    """One queued, unstarted load (SGLang ``CacheOperation``)."""

    host_indices: torch.Tensor  # CPU int64
    device_indices: torch.Tensor  # int64 on the device, as allocated
    node_id: int
    usage: CopyUsage


def ack_error(ack: HiCacheAck) -> BaseException | None:
    """The first error of the copy's steps (``None``: it succeeded or has not finished)."""
    for ev in ack.step_events or (ack.finish_event,):
        if ev.error is not None:
            return ev.error
    return None


class HiCacheController:
    """Backups (D2H) and loads (H2D) between one device pool and one host pool.

    ``streams``: a factory, or a CPU mode of ``make_streams``; ``copy_delay`` (CPU) is slept
    before every side-stream copy. ``copy_timer``: an ack is popped only once the timer's clock
    passed its modelled end. ``group``: agrees room in the pools (``None``: one rank).
    """

    def __init__(
        self,
        device_allocator: TokenToKVPoolAllocator,
        device_pool: MHATokenToKVPool | MLATokenToKVPool,
        host_pool: HostKVPool,
        io_backend: str = "kernel",
        streams: Streams | str | None = None,
        copy_delay: Delay = 0.0,
        stats: CacheStats | None = None,
        group: TPGroup | None = None,
        copy_timer: CopyTimer | None = None,
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
        self.device = torch.device(device_pool.device)  # SGLang's pools name it by string
        self.group = group if group is not None else SingleRankGroup()
        self.stats = stats if stats is not None else CacheStats()
        self.copy_timer = copy_timer
        self._stream_free = {"d2h": float("-inf"), "h2d": float("-inf")}  # timed copies' ends
        if streams is None or isinstance(streams, str):
            streams = make_streams(self.device, copy_delay, streams)
        self.streams = streams
        self.write_stream = self.streams.new_stream()
        # Loads gate the next forward layer by layer: their copies go before other side work.
        self.load_stream = self.streams.new_stream(high_priority=True)
        self.layer_done_counter = LayerDoneCounter(self.layer_num, self.streams)

        self.load_queue: list[CacheOperation] = []
        self.ack_write_queue: deque[HiCacheAck] = deque()
        self.ack_load_queue: deque[HiCacheAck] = deque()
        self._busy = BusyPages(device_allocator, self.host_allocator)
        self._deferred_device = DeferredFrees(device_allocator)
        self._deferred_host = DeferredFrees(self.host_allocator)
        # Copies that failed while they ran, by node id, until the tree takes them.
        self._failures: dict[int, CopyError] = {}

    # ------------------------------------------------------------------ writes (D2H)
    def write(self, device_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Back up device slots to new host slots (CPU int64, same order), launched now; ``None``
        when the host pool is short on any rank. ``BackupError`` when the launch fails (host
        slots freed again). The host copy is readable only after the ack."""
        slot_indices(
            "device_indices",
            device_indices,
            n_slots=self.device_allocator.page_table_size * self.page_size,
            page_size=self.page_size,
            device=self.device,
        )
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
        host_indices = agreed_alloc(
            self.group, self.host_allocator, n, pool="host", tag="hicache_write_room"
        )
        if host_indices is None:
            return None
        if host_indices.numel() == 0:
            return host_indices
        try:
            ack = self._launch_backup(device_indices, host_indices, node_id)
        except Exception as exc:
            self._settle_after_failed_launch(self.write_stream)
            self.host_allocator.free(host_indices)
            self.stats.record_copy_failure("d2h")
            raise BackupError(
                f"backup_from_device_all_layer(device_indices=[{n} slots])",
                f"backup of node {node_id} not launched; its {n} host slots were freed",
                [node_id],
                exc,
            ) from exc
        self._busy.add(ack.usages[0])
        self.ack_write_queue.append(ack._replace(ready_at=self._ready_at("d2h", n)))
        return host_indices

    def _launch_backup(
        self, device_indices: torch.Tensor, host_indices: torch.Tensor, node_id: int
    ) -> HiCacheAck:
        """Queue the backup on the write stream; returns its ack, not yet appended."""
        ready = self.streams.new_event()
        ready.record(self.streams.compute)
        self.write_stream.wait_event(ready)
        if self.ack_load_queue:  # a backup may read slots a load is still writing
            self.write_stream.wait_event(self.ack_load_queue[-1].finish_event)
        start = self.write_stream.record(self.streams.new_event(enable_timing=True))
        pool, dev, io = self.host_pool, self.device_pool, self.io_backend
        watch = kernels.watch_copies(self.device)  # bad indices, read at the ack

        def backup() -> None:  # moves the indices on the write stream, before the copy
            h, d = self._move_indices(host_indices, device_indices)
            with watch:
                pool.backup_from_device_all_layer(dev, h, d, io)

        self.write_stream.submit(backup)
        finish = self.write_stream.record(self.streams.new_event(enable_timing=True))
        usage = CopyUsage(device_indices, host_indices, host_written=True)
        return HiCacheAck(
            ready,
            finish,
            [node_id],
            host_indices,
            device_indices,
            self._nbytes(host_indices),
            usages=(usage,),
            copy_start_event=start,
            watch=watch,
        )

    def count_finished_writes(self) -> int:
        """Leading backups whose copy finished on this rank. Never blocks."""
        return self._count_finished(self.ack_write_queue)

    def writing_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` backups (``None``: every leading finished one); their node ids."""
        return self._pop(self.ack_write_queue, n, "d2h")

    def wait_write(self, node_ids: list[int] | None = None) -> list[int]:
        """Block until the backups of ``node_ids`` (``None``: all) finish; pop those acks."""
        wanted = None if node_ids is None else set(node_ids)
        targets = [
            a for a in self.ack_write_queue if wanted is None or wanted.intersection(a.node_ids)
        ]
        self._wait(targets)
        done: list[int] = []
        for a in targets:
            self.ack_write_queue.remove(a)
            done.extend(self._complete(a, "d2h"))
        self._release_deferred()
        return done

    # ------------------------------------------------------------------ loads (H2D)
    def load(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Allocate device slots for ``host_indices`` and queue their H2D copy until
        ``start_loading``; ``None`` when the device pool is short on any rank."""
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
        """Launch every queued load as one H2D per layer; returns the producer id (``-1``: none
        queued). A failed launch raises ``LoadBackError``; the loads stay queued."""
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
        watch = kernels.watch_copies(self.device)  # bad indices, read at the ack
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
        watch: CopyWatch,
    ) -> Event:
        """Queue one H2D per layer on the load stream; ``progress[0]`` is the layer being
        launched. Returns the timing start event."""
        lev.start_event.record(self.streams.compute)
        self.load_stream.wait_event(lev.start_event)
        if self.ack_write_queue and self._busy.host_being_written(host_indices):
            # Backups finish in launch order: waiting for the newest covers the one writing.
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
        """Drop every queued load; returns their node ids. Their device slots stay allocated."""
        ops, self.load_queue = self.load_queue, []
        for op in ops:
            self._busy.remove(op.usage)
        return [op.node_id for op in ops]

    def wait_loads(self) -> None:
        """Block until every launched load finished (acks are not popped)."""
        for ack in self.ack_load_queue:
            ack.finish_event.synchronize()

    def count_finished_loads(self) -> int:
        """Leading loads whose copy finished on this rank. Never blocks."""
        return self._count_finished(self.ack_load_queue)

    def loading_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` loads (``None``: every leading finished one); their node ids."""
        return self._pop(self.ack_load_queue, n, "h2d")

    def wait_all(self) -> tuple[list[int], list[int]]:
        """Block until every launched copy finished; pop all acks: (written, loaded) node ids."""
        self._wait([*self.ack_write_queue, *self.ack_load_queue])
        return self.writing_check(), self.loading_check()

    def _count_finished(self, queue: deque[HiCacheAck]) -> int:
        now = self._timer_now()
        n = 0
        for ack in queue:
            if ack.ready_at is not None and now is not None and ack.ready_at > now:
                break
            if not ack.finish_event.query():
                break
            n += 1
        return n

    def _pop(self, queue: deque[HiCacheAck], n: int | None, direction: str) -> list[int]:
        """Pop ``n`` acks (agreed over the ranks), or the leading finished ones."""
        if n is None:
            n = self._count_finished(queue)
        elif isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(queue):
            raise ValueError(f"n must be an int in [0, {len(queue)}] (acks queued), got {n!r}")
        done: list[int] = []
        for _ in range(n):
            done.extend(self._complete(queue.popleft(), direction))
        self._release_deferred()
        return done

    def next_ack_time(self) -> float | None:
        """When the next timed copy ends, if ahead of the timer's clock; else ``None``."""
        now = self._timer_now()
        ahead = [
            a.ready_at
            for a in (*self.ack_write_queue, *self.ack_load_queue)
            if a.ready_at is not None and now is not None and a.ready_at > now
        ]
        return min(ahead) if ahead else None

    def loads_ready_at(self) -> float | None:
        """The modelled end of the newest unpopped load (``None`` without a timer or load)."""
        times = [a.ready_at for a in self.ack_load_queue if a.ready_at is not None]
        return max(times) if times else None

    def _timer_now(self) -> float | None:
        return None if self.copy_timer is None else self.copy_timer.now()

    def _ready_at(self, direction: str, tokens: int) -> float | None:
        """The end of a timed copy launched now (after the previous one in its direction and,
        for a backup, after the newest load)."""
        if self.copy_timer is None:
            return None
        start = max(self.copy_timer.now(), self._stream_free[direction])
        loads = self.loads_ready_at() if direction == "d2h" else None
        if loads is not None:
            start = max(start, loads)
        end = start + self.copy_timer.copy_seconds(direction, tokens)
        self._stream_free[direction] = end
        return end

    def _wait(self, acks: list[HiCacheAck]) -> None:
        """Block until ``acks`` finish; move a copy timer's clock to their modelled end."""
        for a in acks:
            a.finish_event.synchronize()
        ends = [a.ready_at for a in acks if a.ready_at is not None]
        if ends and self.copy_timer is not None:
            self.copy_timer.wait_until(max(ends))

    def evict_device(self, device_indices: torch.Tensor) -> int:
        """Free device slots; those a copy still uses are held until its ack. ``ValueError``
        (nothing changes) on a bad or double free."""
        idx = self._deferred_device.validate(device_indices, "device_indices")
        self._busy.settle()
        self._deferred_device.free_or_defer(idx, self._busy.device_busy(idx.numpy()))
        return device_indices.numel()

    def evict_host(self, host_indices: torch.Tensor) -> int:
        """Return host slots to the host allocator (deferred as ``evict_device``)."""
        idx = self._deferred_host.validate(host_indices, "host_indices")
        self._deferred_host.free_or_defer(idx, self._busy.host_busy(idx.numpy()))
        return host_indices.numel()

    def _release_deferred(self) -> None:
        if self._deferred_device.held:
            self._busy.settle()
            self._deferred_device.release(self._busy.device_busy)
        if self._deferred_host.held:
            self._deferred_host.release(self._busy.host_busy)

    def inflight_slots(self) -> InflightSlots:
        """Slots used by copies whose acks are not popped (CPU int64)."""
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
        """Freed device slots held until a copy's ack."""
        return self._deferred_device.num_slots()

    def host_in_flight(self) -> int:
        """Freed host slots held until a copy's ack."""
        return self._deferred_host.num_slots()

    def check_integrity(self) -> None:
        """``AssertionError`` unless the allocators, busy counts and deferred frees agree with
        the copies in flight."""
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
        """Finish every launched copy and stop CPU stream threads; acks are not popped."""
        if isinstance(self.streams, CpuStreams):  # inline ones too
            self.streams.close()
        else:
            self.write_stream.synchronize()
            self.load_stream.synchronize()

    def _nbytes(self, indices: torch.Tensor) -> int:
        return indices.numel() * self.host_pool.size_per_token

    def _complete(self, ack: HiCacheAck, direction: str) -> list[int]:
        """Settle a popped ack; a copy that failed is kept for ``take_failure``."""
        ack.finish_event.synchronize()  # already done; orders the host after it on CUDA
        for usage in ack.usages:
            self._busy.remove(usage)
        if direction == "h2d":
            self.layer_done_counter.release(ack.producer_id)
        error = ack_error(ack)
        if error is None and ack.watch is not None:
            try:
                ack.watch.check()
            except kernels.KVIndexError as exc:
                error = exc
        if error is None:
            start = ack.copy_start_event if ack.copy_start_event is not None else ack.start_event
            secs = start.elapsed_time(ack.finish_event) / 1e3
            self.stats.record_copy(direction, ack.nbytes, secs)
            return ack.node_ids
        self.stats.record_copy_failure(direction)
        failure = self._failure(ack, direction, error)
        logger.error("%s", failure)
        for node_id in ack.node_ids:
            self._failures[node_id] = failure
        return ack.node_ids

    @staticmethod
    def _failure(ack: HiCacheAck, direction: str, error: BaseException) -> CopyError:
        ids = ack.node_ids
        if isinstance(error, kernels.KVIndexError):  # the kernel skipped a pair: incomplete copy
            op = f"{error.op}({error.argument})"
            detail = (
                f"the copy of node ids {ids} skipped slot {error.slot} (out of range for "
                f"{error.n_slots} slots) and is incomplete"
            )
        elif direction == "d2h":
            op = (
                f"backup_from_device_all_layer(device_indices=[{ack.device_indices.numel()} slots])"
            )
            detail = f"the backup of node ids {ids} failed while it ran"
        else:
            layer = next((i for i, ev in enumerate(ack.step_events) if ev.error is not None), -1)
            op = f"load_to_device_per_layer(layer_id={layer})"
            detail = f"the load of node ids {ids} failed while it ran"
        return (BackupError if direction == "d2h" else LoadBackError)(op, detail, ids, error)

    def take_failure(self, node_id: int) -> CopyError | None:
        """The error of ``node_id``'s failed copy (``None``: it succeeded); handed out once."""
        return self._failures.pop(node_id, None)

    @staticmethod
    def _settle_after_failed_launch(stream: Stream) -> None:
        """After a launch raised, wait for what the stream already runs before slots are given
        back; its own error is only logged."""
        try:
            stream.synchronize()
        except Exception:  # noqa: BLE001 - the failed launch is what gets reported
            logger.exception("side stream after a failed launch")

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
