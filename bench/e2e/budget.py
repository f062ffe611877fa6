"""Which configurations of a benchmark still fit the deadline ``bench/gpu_check.sh`` gives each
step (``bench.common.time_left``): a benchmark skips what it can no longer finish."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from bench.common import time_left


class TimeBudget:
    """Which configurations of a benchmark still fit its deadline (``time_left``): one runs
    while at least 1.5x the slowest so far plus 5 s is left. ``agree``: makes the answer the
    group's (tensor parallelism: every rank skips together). ``skipped``: labels not run."""

    def __init__(self, agree: Callable[[bool], bool] | None = None) -> None:
        self.slowest = 0.0
        self.skipped: list[str] = []
        self._agree = agree

    def allows(self, label: str) -> bool:
        ok = time_left() >= 1.5 * self.slowest + 5
        if self._agree is not None:
            ok = self._agree(ok)
        if not ok:
            self.skipped.append(label)
        return ok

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time one configuration (the slowest sets the margin)."""
        t0 = time.perf_counter()
        yield
        self.slowest = max(self.slowest, time.perf_counter() - t0)
