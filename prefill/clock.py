"""Time sources of the executor and the simulated decode side: ``VirtualClock`` (moves only on
``advance`` / ``wait_until``) and ``WallClock`` (monotonic; ``wait_until`` sleeps)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds since the clock's start."""

    def now(self) -> float: ...

    def advance(self, dt: float) -> None:
        """Account for ``dt`` seconds of modeled work (virtual time only)."""

    def wait_until(self, t: float, poll_s: float | None = None) -> None:
        """Block (wall) or jump (virtual) until ``now() >= t``; ``poll_s``: return after at
        most that much real time."""


class VirtualClock:
    is_virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"dt must be >= 0, got {dt}")
        self._now += dt

    def wait_until(self, t: float, poll_s: float | None = None) -> None:
        self._now = max(self._now, float(t))


class WallClock:
    """``wait_until`` sleeps at most ``max_sleep_s`` per call."""

    is_virtual = False

    def __init__(self, max_sleep_s: float = 0.01) -> None:
        self._t0 = time.monotonic()
        self.max_sleep_s = max_sleep_s

    def now(self) -> float:
        return time.monotonic() - self._t0

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"dt must be >= 0, got {dt}")

    def wait_until(self, t: float, poll_s: float | None = None) -> None:
        delay = min(t - self.now(), self.max_sleep_s)
        if poll_s is not None:
            delay = min(delay, poll_s)
        if delay > 0:
            time.sleep(delay)
