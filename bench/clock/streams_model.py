"""The modelled copy streams of the virtual clock: when each copy runs, and how compute and
copies that overlap slow each other down (the co-run slowdowns, ``bench.clock.corun``).

``CopyTimeline`` keeps one FIFO of ``Booking``s per stream (``load``: H2D load backs,
``write``: D2H backups); with ``shared=True`` both names are one FIFO: on a machine without CUDA
the controller's two stream threads run their copies under one process-wide lock
(``hicache.transfer.streams.CPU_COPY_LOCK``), so a load waits for the backups queued before it,
and the other way round.

- ``occupy(stream, now, seconds, after)`` books ``seconds`` of copy work that may start at
  ``ready = max(now, after)`` (``after``: a dependency on the other stream) and returns the
  ``Booking``; it starts when the copies before it on its FIFO have ended.
- ``compute_end(start, work_s, factor)``: when ``work_s`` seconds of compute that starts at
  ``start`` ends if it progresses at ``1 / factor`` while any copy runs (a factor of 1:
  ``start + work_s``).
- ``resize(booking, seconds, start)``: a booking's duration (and a later start) set after the
  fact (a load back's co-run speed and, on CPU streams, its start are known once the forward
  that consumes it is charged); the copies behind it move.
- ``stretch_copies(a, b, copy_factor)``: compute ran over ``[a, b)``: every copy that
  overlapped it takes ``(copy_factor - 1)`` times the overlap longer, and the copies queued
  behind it on its FIFO start that much later (their ``Booking.end`` moves: it is the modelled
  end a copy's ack waits for). Compute is stretched by the intervals as they were when it
  started; the copies' stretch follows from it.

Bookings that ended are dropped as the clock passes them (``trim``), so the state stays as
small as the copies in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["Booking", "CopyTimeline"]

STREAMS = ("load", "write")


@dataclass
class Booking:
    """One modelled copy: may start at ``ready``, runs ``duration`` seconds (stretched when it
    overlaps compute), ``[start, end)`` on its FIFO."""

    stream: str
    ready: float
    duration: float
    start: float = 0.0
    end: float = 0.0
    stretchable: bool = True  # False: its overlap with compute is already in ``duration``


class CopyTimeline:
    """The copy FIFOs of the virtual clock (see the module docstring)."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self._fifos: dict[str, list[Booking]] = {s: [] for s in ("one",) if shared} or {
            s: [] for s in STREAMS
        }
        self._free_at = dict.fromkeys(self._fifos, 0.0)

    def _key(self, stream: str) -> str:
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
        return "one" if self.shared else stream

    def free_at(self, stream: str) -> float:
        """When the last copy booked on ``stream``'s FIFO ends."""
        return self._free_at[self._key(stream)]

    def occupy(
        self, stream: str, now: float, seconds: float, after: float = 0.0,
        stretchable: bool = True,
    ) -> Booking:  # fmt: skip
        """Book ``seconds`` of ``stream`` after its earlier work, not before ``now`` nor
        ``after``; ``stretchable=False``: the caller already charged its co-run slowdown."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        key = self._key(stream)
        b = Booking(stream, max(now, after), seconds, stretchable=stretchable)
        b.start = max(b.ready, self._free_at[key])
        b.end = b.start + seconds
        self._fifos[key].append(b)
        self._free_at[key] = b.end
        return b

    def resize(self, booking: Booking, seconds: float, start: float | None = None) -> None:
        """Set ``booking``'s duration to ``seconds`` (and its start to ``start``: no earlier
        than it was, it may not start sooner); the copies queued behind it on its FIFO move
        with its end."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if start is not None and start < booking.start:
            raise ValueError(f"start must be >= the booked start {booking.start}, got {start}")
        key = self._key(booking.stream)
        fifo = self._fifos[key]
        if start is not None:
            booking.ready = booking.start = start
        booking.duration = seconds
        booking.end = booking.start + seconds
        at = next((i for i, bk in enumerate(fifo) if bk is booking), None)
        if at is None:  # trimmed: nothing queued behind it is affected
            return
        prev_end = booking.end
        for bk in fifo[at + 1 :]:
            bk.start = max(bk.ready, prev_end)
            bk.end = bk.start + bk.duration
            prev_end = bk.end
        self._free_at[key] = fifo[-1].end

    def trim(self, now: float) -> None:
        """Forget the copies that ended by ``now`` (the front of each FIFO)."""
        for fifo in self._fifos.values():
            k = 0
            while k < len(fifo) and fifo[k].end <= now:
                k += 1
            del fifo[:k]

    def busy_intervals(self) -> list[tuple[float, float]]:
        """The union of the booked copies' ``[start, end)``, sorted and disjoint."""
        spans = sorted((b.start, b.end) for f in self._fifos.values() for b in f if b.end > b.start)
        out: list[tuple[float, float]] = []
        for s, e in spans:
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    def compute_end(self, start: float, work_s: float, factor: float) -> float:
        """End of ``work_s`` seconds of compute from ``start``, slowed by ``factor`` while a
        copy runs."""
        if factor <= 1.0 or work_s <= 0:
            return start + max(work_s, 0.0)
        t, left = start, work_s
        for s, e in self.busy_intervals():
            if e <= t:
                continue
            if t < s:  # free until s
                if t + left <= s:
                    return t + left
                left -= s - t
                t = s
            span = (e - t) / factor  # compute done while this interval lasts
            if left <= span:
                return t + left * factor
            left -= span
            t = e
        return t + left

    def stretch_copies(self, a: float, b: float, copy_factor: float) -> None:
        """Compute ran over ``[a, b)``: slow the copies that overlapped it (module docstring)."""
        if copy_factor <= 1.0 or b <= a:
            return
        for key, fifo in self._fifos.items():
            prev_end = -float("inf")
            for bk in fifo:
                bk.start = max(bk.ready, prev_end, bk.start)
                bk.end = bk.start + bk.duration
                overlap = max(0.0, min(bk.end, b) - max(bk.start, a))
                if overlap > 0 and bk.stretchable:
                    extra = overlap * (copy_factor - 1.0)
                    bk.duration += extra
                    bk.end += extra
                prev_end = bk.end
            if fifo:
                self._free_at[key] = fifo[-1].end
