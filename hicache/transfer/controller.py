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

One copy, step by step (who owns each step):

1. room: ``write`` / ``load`` agree over the group that the destination pool has room,
   allocate fresh slots there and raise the busy counts (``hicache.tp.agreed.agreed_alloc``,
   ``BusyPages``);
2. launch: a backup starts at once on the write stream (``writes``); a load waits
   in ``load_queue`` until ``start_loading`` launches every queued one as one H2D per layer,
   each layer with its event (``loads``, ``LayerDoneCounter``);
3. count: ``count_finished_writes`` / ``count_finished_loads``: this rank's leading finished
   acks (``HiCacheAck``, completed in launch order; ``acks``);
4. pop: ``writing_check(n)`` / ``loading_check(n)`` / ``wait_write`` pop acks in launch order,
   record bytes and copy time in ``stats`` and lower the busy counts (``_complete`` here);
5. free: slots the tree freed while a copy still used them (``evict_device`` /
   ``evict_host``, deferred) return to their allocator once no copy uses them
   (``_release_deferred`` here, ``DeferredFrees``).

A copy that fails (``errors``): every argument is checked before step 1 allocates; a launch
that still fails (CUDA and ``"inline"`` CPU streams launch inside ``submit``, on this thread)
is rolled back in the call (``write`` frees its host slots, ``start_loading`` leaves its loads
queued for ``cancel_loads``) and raises one ``BackupError`` / ``LoadBackError`` naming the op
and argument. A copy that fails while it runs (thread-backed CPU streams) completes its ack
normally (busy counts lowered, slots allocated as before) and the failure is handed to the tree
with the ack (``take_failure``); the stream is not poisoned.

Tensor parallelism: each rank has its own controller over its shard of the KV heads, and its
copies finish at their own pace. Two things here are rank-local and are agreed on the
controller's ``group`` (``hicache.tp.group``; ``SingleRankGroup`` at ``tp_size`` 1, where every
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

This file owns the construction, the steps both directions share (1, 4 and 5), eviction and
the accounting ``check_integrity`` verifies; ``writes`` the D2H path,
``loads`` the load queue and the H2D path, ``acks`` the ack record and its
counting; ``busy_pages`` the slot accounting (``BusyPages``, ``InflightSlots``,
``DeferredFrees``); ``layer_done_counter`` the per-layer load events.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

import kernels
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache.memory.host_pool import SUPPORTED_LAYOUT_IO, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hicache.stats import CacheStats
from hicache.tp.group import SingleRankGroup, TPGroup
from hicache.transfer.acks import CopyTimer, HiCacheAck, ack_error, check_indices
from hicache.transfer.busy_pages import BusyPages, DeferredFrees, InflightSlots, cat_cpu
from hicache.transfer.errors import BackupError, CopyError, LoadBackError
from hicache.transfer.layer_done_counter import LayerDoneCounter
from hicache.transfer.loads import CacheOperation, ControllerLoads
from hicache.transfer.streams import (
    CpuStreams,
    CudaStreams,
    Delay,
    InlineStreams,
    Stream,
    make_streams,
)
from hicache.transfer.writes import ControllerWrites

__all__ = ["HiCacheController"]

logger = logging.getLogger(__name__)


class HiCacheController(ControllerWrites, ControllerLoads):
    """Backups (D2H) and loads (H2D) between one device pool and one host pool.

    Args:
        device_allocator: the device pool's allocator (load() allocates from it).
        device_pool: ``MHATokenToKVPool`` or ``MLATokenToKVPool``.
        host_pool: the matching host pool; its ``allocator`` is ``host_allocator``.
        io_backend: ``"kernel"`` (Triton ops) or ``"direct"`` (per-run copies); must suit the
            host pool's layout (``SUPPORTED_LAYOUT_IO``).
        streams: a stream factory (``CudaStreams`` / ``CpuStreams`` / ``InlineStreams``), or a
            CPU mode of ``make_streams`` (``"thread"``, ``"inline"``: CUDA's launch semantics on
            the caller's thread); default (``None``) from the device pool's device.
        copy_delay: CPU only, when ``streams`` is not a factory: seconds (or a callable) slept
            before every copy on the side streams, to widen race windows in tests.
        stats: receives bytes moved and copy time as acks complete.
        copy_timer: a simulator's modelled copy time (``hicache.transfer.acks.CopyTimer``): each
            ack gets the ``ready_at`` its copy would end at, FIFO per direction (a backup also
            after the newest load), and is popped only once the timer's clock passed it.
        group: the tensor-parallel cache group that agrees room in the pools (module doc);
            ``None``: a single rank.
    """

    def __init__(
        self,
        device_allocator: TokenToKVPoolAllocator,
        device_pool: MHATokenToKVPool | MLATokenToKVPool,
        host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost,
        io_backend: str = "kernel",
        streams: CudaStreams | CpuStreams | InlineStreams | str | None = None,
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
        self.device = device_pool.device
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
        # Copies per page, and slots the tree freed while a copy still uses them (held until
        # the copy's ack).
        self._busy = BusyPages(device_allocator, self.host_allocator)
        self._deferred_device = DeferredFrees(device_allocator)
        self._deferred_host = DeferredFrees(self.host_allocator)
        # Copies that failed while they ran, by node id, until the tree takes them.
        self._failures: dict[int, CopyError] = {}

    # ------------------------------------------------------------------ both
    def wait_all(self) -> tuple[list[int], list[int]]:
        """Block until every launched copy finished; pop all acks. Returns (written node ids,
        loaded node ids). Queued, unstarted loads stay queued."""
        acks = list(self.ack_write_queue) + list(self.ack_load_queue)
        for a in acks:
            a.finish_event.synchronize()
        self._wait_ready(acks)
        return self.writing_check(), self.loading_check()

    # ------------------------------------------------------------------ modelled copy time
    def next_ack_time(self) -> float | None:
        """When the next timed copy ends, if that is ahead of the timer's clock; ``None``
        without a copy timer or when no timed copy is ahead."""
        now = self._timer_now()
        ahead = [
            a.ready_at
            for a in (*self.ack_write_queue, *self.ack_load_queue)
            if a.ready_at is not None and now is not None and a.ready_at > now
        ]
        return min(ahead) if ahead else None

    def loads_ready_at(self) -> float | None:
        """The modelled end of the newest launched load whose ack is not popped (``None``
        without a copy timer or such a load): a forward reading loaded layers ends after it."""
        times = [a.ready_at for a in self.ack_load_queue if a.ready_at is not None]
        return max(times) if times else None

    def _timer_now(self) -> float | None:
        return None if self.copy_timer is None else self.copy_timer.now()

    def _ready_at(self, direction: str, tokens: int) -> float | None:
        """The end of a timed copy launched now: after the previous copy in its direction
        (and, for a backup, after the newest load, as the streams order it)."""
        if self.copy_timer is None:
            return None
        start = max(self.copy_timer.now(), self._stream_free[direction])
        loads = self.loads_ready_at() if direction == "d2h" else None
        if loads is not None:
            start = max(start, loads)
        end = start + self.copy_timer.copy_seconds(direction, tokens)
        self._stream_free[direction] = end
        return end

    def _wait_ready(self, acks: list[HiCacheAck]) -> None:
        """A blocking wait for timed copies moves the timer's clock to their end."""
        ends = [a.ready_at for a in acks if a.ready_at is not None]
        if ends and self.copy_timer is not None:
            self.copy_timer.wait_until(max(ends))

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
        if isinstance(self.streams, CpuStreams | InlineStreams):
            self.streams.close()
        else:
            self.write_stream.synchronize()
            self.load_stream.synchronize()

    # ------------------------------------------------------------------ internals
    def _nbytes(self, indices: torch.Tensor) -> int:
        return indices.numel() * self.host_pool.size_per_token

    def _complete(self, ack: HiCacheAck, direction: str) -> list[int]:
        """Lower the busy counts of a popped ack and record it in ``stats``; a copy that failed
        while it ran is logged and kept for ``take_failure`` (one error per node id)."""
        ack.finish_event.synchronize()  # already done; orders the host after it on CUDA
        for usage in ack.usages:
            self._busy.remove(usage)
        error = ack_error(ack)
        if error is None:
            try:  # an index the kernel found out of range fails the copy (issue 19)
                check_indices(ack)
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
        cls = BackupError if direction == "d2h" else LoadBackError
        if isinstance(error, kernels.KVIndexError):  # the kernel skipped a pair: incomplete copy
            return cls(
                f"{error.op}({error.argument})",
                f"the copy of node ids {ids} skipped slot {error.slot} (out of range for "
                f"{error.n_slots} slots) and is incomplete",
                ids,
                error,
            )
        if direction == "d2h":
            return BackupError(
                f"backup_from_device_all_layer(device_indices=[{ack.device_indices.numel()} "
                "slots])",
                f"the backup of node ids {ids} failed while it ran",
                ids,
                error,
            )
        layer = next((i for i, ev in enumerate(ack.step_events) if getattr(ev, "error", None)), -1)
        return LoadBackError(
            f"load_to_device_per_layer(layer_id={layer})",
            f"the load of node ids {ids} failed while it ran",
            ids,
            error,
        )

    def take_failure(self, node_id: int) -> CopyError | None:
        """The error of a popped ack whose copy failed while it ran, for ``node_id`` (``None``
        when its copy succeeded); each is handed out once. The tree takes it while applying
        the ack (a failed backup leaves the node device-only, a failed load host-only)."""
        return self._failures.pop(node_id, None)

    def failed_node_ids(self) -> list[int]:
        """Node ids whose failure was not taken yet (``take_failure``)."""
        return list(self._failures)

    @staticmethod
    def _settle_after_failed_launch(stream: Stream) -> None:
        """After a launch raised: wait until what the stream already runs is done (on CUDA,
        layers launched before the failure may still write the slots about to be given back).
        An error of that earlier work is logged; the caller's error is the one raised."""
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

    def _release_deferred(self) -> None:
        """Free the held slots no copy uses any more. O(held slots)."""
        if self._deferred_device.held:
            self._busy.settle()
            self._deferred_device.release(self._busy.device_busy)
        if self._deferred_host.held:
            self._deferred_host.release(self._busy.host_busy)
