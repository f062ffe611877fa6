"""Counters of a ``HiCacheFile``: ``FileCounters`` (mutable, thread-safe) and the frozen
``HiCacheFileStats`` snapshot ``HiCacheFile.get_stats()`` returns."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiCacheFileStats:
    """What a ``HiCacheFile`` did since it was built (pages unless named ``bytes``).

    Misses are split by cause: ``read_misses`` (no such file), ``read_bad_size`` (a file of
    another size: truncated, written for another geometry or by an older version),
    ``read_corrupt`` (the page's checksum fails: damaged, or another page's bytes),
    ``read_errors`` (any other IO error). Failed writes likewise: ``write_failures`` (IO errors,
    a full disk), ``writes_refused`` (the byte budget said no). ``evicted_*`` and
    ``budget_bytes`` come from the budget (0 when it is off).
    """

    read_hits: int = 0
    read_misses: int = 0
    read_bad_size: int = 0
    read_corrupt: int = 0
    read_errors: int = 0
    writes: int = 0
    writes_skipped: int = 0
    write_failures: int = 0
    writes_refused: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    budget_bytes: int = 0


_COUNTED = tuple(f.name for f in fields(HiCacheFileStats))


class FileCounters:
    """Thread-safe increments of the ``HiCacheFileStats`` fields the backend itself counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(_COUNTED, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self, **overrides: int) -> HiCacheFileStats:
        with self._lock:
            values = dict(self._values)
        values.update(overrides)
        return HiCacheFileStats(**values)
