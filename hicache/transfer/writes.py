"""The controller's D2H path (SGLang ``HiCacheController.write`` / ``writing_check``): backups
of device slots into fresh host slots, launched at once on the write stream, acked in launch
order.

- ``write(d)``: host room is agreed over the group, fresh host slots ``h`` are allocated, the
  copy waits for the compute stream (it reads what the forward wrote) and, while loads are in
  flight, for the newest load (a backup may read slots a load is still writing). ``d`` is read
  and ``h`` written until the ack is popped; a host copy is readable only after it. Every check
  runs before ``h`` is allocated; a launch that fails (CUDA, inline CPU streams) frees ``h`` and
  raises ``BackupError``, so the call changes nothing. A copy that fails while it runs (thread
  CPU streams) is reported at its ack (``take_failure``).
- ``writing_check(n)`` pops the first ``n`` acks (``None``: the leading finished ones; ``n`` is
  agreed over tensor-parallel ranks by the tree); ``wait_write`` blocks for chosen backups and
  pops exactly those.

``ControllerWrites`` is a base of ``HiCacheController`` and is not built on its own: it uses
the controller's attributes (declared below) and its ``_move_indices``,
``_nbytes``, ``_complete`` and ``_release_deferred``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

import torch

import kernels
from hicache.tp.agreed import agreed_alloc
from hicache.transfer.acks import HiCacheAck, ack_count, count_finished
from hicache.transfer.busy_pages import BusyPages, CopyUsage, cat_cpu
from hicache.transfer.errors import BackupError
from kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
    from hicache.memory.host_pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost
    from hicache.stats import CacheStats
    from hicache.tp.group import TPGroup
    from hicache.transfer.loads import CacheOperation
    from hicache.transfer.streams import Stream, Streams

logger = logging.getLogger(__name__)

__all__ = ["ControllerWrites"]


class ControllerWrites:
    """Backups (D2H) of ``HiCacheController`` (see the module docstring)."""

    # Set by HiCacheController.__init__.
    device_allocator: TokenToKVPoolAllocator
    host_allocator: TokenToKVPoolAllocator
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost
    device_pool: MHATokenToKVPool | MLATokenToKVPool
    io_backend: str
    page_size: int
    device: torch.device
    group: TPGroup
    stats: CacheStats
    streams: Streams
    write_stream: Stream
    load_queue: list[CacheOperation]
    ack_write_queue: deque[HiCacheAck]
    ack_load_queue: deque[HiCacheAck]
    _busy: BusyPages

    def write(self, device_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Back up device slots to freshly allocated host slots; launches at once.

        Returns the host slots (CPU int64, same order as ``device_indices``) or ``None`` when the
        host pool is short on any rank of the group (nothing changes). Raises ``ValueError``
        (nothing changes) for malformed or out-of-range indices, or slots that a queued,
        unstarted load will write (their content does not exist yet): every check runs before
        anything is allocated. Raises ``BackupError`` naming the op when the launch fails
        (CUDA and inline CPU streams launch in ``submit``): the host slots are freed again and
        nothing is queued, so the call changed nothing. A copy that fails while it runs (thread
        CPU streams) is reported by its ack (``take_failure``). The copy starts on the write
        stream after an event recorded now on the compute stream (so it reads what the forward
        wrote). Never blocks, except for the group's agreement on room (a collective when
        ``tp_size > 1``) and, after a failed launch, for the write stream to drain.
        The host copy is readable only after this write's ack (``writing_check``).
        """
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
        """Queue the backup on the write stream (CUDA and inline streams run it here, and raise
        here); returns its ack, not yet appended."""
        ready = self.streams.new_event()
        ready.record(self.streams.compute)
        self.write_stream.wait_event(ready)
        if self.ack_load_queue:  # a backup may read slots a load is still writing
            self.write_stream.wait_event(self.ack_load_queue[-1].finish_event)
        # Timed from the side stream's start, so copy time excludes the wait behind the forward.
        start = self.write_stream.record(self.streams.new_event(enable_timing=True))
        pool, dev, io = self.host_pool, self.device_pool, self.io_backend
        watch = kernels.watch_copies(self.device_pool.device)  # issue 19: bad indices, at the ack

        def backup() -> None:  # index moves run on the write stream too, ordered before the copy
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
        """Leading backups (launch order) whose copy finished on this rank; 0 for an empty
        queue. Never blocks. The tree agrees the minimum over ranks and pops that many."""
        return count_finished(self.ack_write_queue, self._timer_now())

    def writing_check(self, n: int | None = None) -> list[int]:
        """Pop the first ``n`` backups in launch order (``None``: every leading finished one);
        returns their node ids. Releases deferred frees that no copy uses any more. Never
        blocks for an agreed ``n`` (at most ``count_finished_writes()``); a larger one waits for
        those copies. ``ValueError`` when ``n`` exceeds the queue."""
        count = ack_count(n, self.ack_write_queue, self._timer_now())
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
        self._wait_ready(targets)
        done: list[int] = []
        for a in targets:
            self.ack_write_queue.remove(a)
            done.extend(self._complete(a, "d2h"))
        self._release_deferred()
        return done
