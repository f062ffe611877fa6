"""The modelled copy streams of the virtual clock: when each stream is busy, and how compute
that overlaps a busy stream is slowed (the co-run slowdown, ``bench.clock.corun``).

``CopyTimeline`` keeps one FIFO per stream (``load``: H2D load backs, ``write``: D2H backups):
``occupy(stream, now, seconds, after)`` books the next ``seconds`` of that stream from
``max(now, free_at, after)`` and returns ``(start, end)``. With ``shared=True`` both names are
one FIFO: on a machine without CUDA the controller's two stream threads run their copies under
one process-wide lock (``hicache.transfer.streams.CPU_COPY_LOCK``), so a load waits for the
backups queued before it, and the other way round. The union of the busy intervals of both
streams is what compute overlaps; ``compute_end(start, work_s, factor)`` is when ``work_s``
seconds of compute that starts at ``start`` ends if it progresses at ``1 / factor`` while any
stream is busy (a factor of 1: ``start + work_s``). Intervals that ended are dropped as the
clock passes them (``trim``), so the state stays as small as the copies in flight.
"""

from __future__ import annotations

import bisect
import logging

logger = logging.getLogger(__name__)

__all__ = ["CopyTimeline"]

STREAMS = ("load", "write")


class CopyTimeline:
    """Busy intervals of the modelled copy streams (see the module docstring)."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self.free_at = dict.fromkeys(STREAMS, 0.0)
        self._starts: list[float] = []  # disjoint busy intervals, sorted
        self._ends: list[float] = []

    def occupy(
        self, stream: str, now: float, seconds: float, after: float = 0.0
    ) -> tuple[float, float]:
        """Book ``seconds`` of ``stream`` after its earlier work, not before ``now`` nor
        ``after`` (a dependency on the other stream)."""
        if stream not in self.free_at:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        start = max(self.free_at[stream], now, after)
        end = start + seconds
        for name in STREAMS if self.shared else (stream,):
            self.free_at[name] = end
        if end > start:
            self._add(start, end)
        return start, end

    def _add(self, start: float, end: float) -> None:
        i = bisect.bisect_left(self._ends, start)  # first interval ending at or after start
        j = i
        while j < len(self._starts) and self._starts[j] <= end:
            start = min(start, self._starts[j])
            end = max(end, self._ends[j])
            j += 1
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def trim(self, now: float) -> None:
        """Forget intervals that ended by ``now``."""
        k = bisect.bisect_right(self._ends, now)
        if k:
            del self._starts[:k]
            del self._ends[:k]

    def busy_intervals(self) -> list[tuple[float, float]]:
        return list(zip(self._starts, self._ends, strict=True))

    def compute_end(self, start: float, work_s: float, factor: float) -> float:
        """End of ``work_s`` seconds of compute from ``start``, slowed by ``factor`` inside busy
        intervals."""
        if factor <= 1.0 or work_s <= 0:
            return start + max(work_s, 0.0)
        t, left = start, work_s
        i = bisect.bisect_right(self._ends, t)  # first interval ending after t
        while left > 0:
            if i >= len(self._starts):
                return t + left
            s, e = self._starts[i], self._ends[i]
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
            i += 1
        return t
