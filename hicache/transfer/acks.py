"""Acks of the controller's launched copies (SGLang ``HiCacheAck``) and how many to pop.

Each launched copy (a backup, or one ``start_loading`` batch of loads) appends one
``HiCacheAck`` to its direction's queue; copies on one stream finish in launch order, so only
a queue's head is ever popped. Under tensor parallelism each rank's copies finish at their own
pace: ``count_finished`` is this rank's number of leading finished acks, the tree agrees the
minimum over the ranks (``hiradix_transfers``), and ``ack_count`` turns the agreed ``n`` (or
``None``: this rank's own count) into how many acks to pop, refusing more than are queued.
``ack_error`` is what failed while the copy ran (thread-backed CPU streams hand a callable's
exception to the next event recorded on its stream), ``None`` for a copy that succeeded.

Each ack carries the ``kernels.CopyWatch`` its copy's ops ran under: when the ack is completed
(after its finish event), ``check_indices`` raises ``kernels.KVIndexError`` naming the op and the
argument if the kernel skipped a pair for an out-of-range index (CUDA without debug checks:
nothing reads the indices on the host, the kernel records the bad pair on the device); the
controller then treats the copy as failed (``take_failure``), like one that raised.

A controller given a ``CopyTimer`` (a simulator's seam) stamps each ack with ``ready_at``, the
time on the timer's clock its modelled copy ends; such an ack counts as finished only once the
clock passed it (and its real copy finished).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple, Protocol

import torch

from hicache.transfer.busy_pages import CopyUsage
from hicache.transfer.streams import Event
from kernels import CopyWatch

logger = logging.getLogger(__name__)

__all__ = ["CopyTimer", "HiCacheAck", "ack_count", "ack_error", "check_indices", "count_finished"]


class CopyTimer(Protocol):
    """Modelled copy time: the clock copies are timed on, and the seconds one copy of
    ``tokens`` tokens (all layers) takes in ``direction`` (``"d2h"`` or ``"h2d"``)."""

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
    # Recorded on the side stream after its waits: copy time starts here, not behind the forward.
    copy_start_event: Event | None = None
    # Events whose ``error`` tells whether the copy failed (``(finish_event,)`` when empty).
    step_events: tuple[Event, ...] = ()
    watch: CopyWatch | None = None  # the copy's launches (bad indices found on the device)
    ready_at: float | None = None  # a timed copy's modelled end (``CopyTimer``'s clock)


def ack_error(ack: HiCacheAck) -> BaseException | None:
    """The first error of the copy's steps (``None``: it succeeded or has not finished)."""
    for ev in ack.step_events or (ack.finish_event,):
        error = getattr(ev, "error", None)
        if error is not None:
            return error
    return None


def check_indices(ack: HiCacheAck) -> None:
    """Raise ``kernels.KVIndexError`` if a launch of ``ack``'s copy skipped a pair for an
    out-of-range index. Call once the copy finished (its finish event synchronized). Reads
    host memory only."""
    if ack.watch is not None:
        ack.watch.check()


def count_finished(queue: deque[HiCacheAck], now: float | None = None) -> int:
    """Leading acks of ``queue`` whose copy finished on this rank (0 for an empty queue); a
    timed ack also needs ``ready_at <= now``. Never blocks (queries the finish events)."""
    n = 0
    for ack in queue:
        if ack.ready_at is not None and now is not None and ack.ready_at > now:
            break
        if not ack.finish_event.query():
            break
        n += 1
    return n


def ack_count(n: int | None, queue: deque[HiCacheAck], now: float | None = None) -> int:
    """How many acks of ``queue`` to pop: ``n`` (an agreed count), or its leading finished ones
    (``count_finished`` at ``now``) when ``None``. Raises ``ValueError`` for an ``n`` that is
    not an int in ``[0, len(queue)]``."""
    if n is None:
        return count_finished(queue, now)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(queue):
        raise ValueError(f"n must be an int in [0, {len(queue)}] (acks queued), got {n!r}")
    return n
