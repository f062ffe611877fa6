"""``MooncakeStoreStats``: what a ``MooncakeStore`` did, counted by the IO threads that call it
(``MooncakeCounters``, lock-protected) and handed out as a frozen snapshot by ``get_stats()``.

Pages count whole pages (every object of the page); objects count Mooncake objects (2 per MHA
page, 1 per MLA page). ``errors`` counts failed objects by Mooncake return code name
(``client.error_name``: ``"-704 OBJECT_NOT_FOUND"``, ``"-200 NO_AVAILABLE_HANDLE"``, ...);
``wrong_size`` the objects a read returned with a size other than the page part's (another
geometry under the same name: a miss, never loaded); ``skipped_unhealthy`` the calls answered as
failures without reaching Mooncake because ``health_check()`` said the master is unreachable;
``call_errors`` the calls the client raised from (logged, answered as failures).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MooncakeStoreStats:
    """A snapshot of the counters (module docstring)."""

    exists_queries: int = 0
    pages_read: int = 0
    pages_read_failed: int = 0
    pages_stored: int = 0
    pages_store_failed: int = 0
    objects_written: int = 0
    objects_already_stored: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    wrong_size: int = 0
    skipped_unhealthy: int = 0
    call_errors: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class MooncakeCounters:
    """Thread-safe counters behind ``MooncakeStoreStats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._n[name] += n

    def error(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._errors[name] += n

    def snapshot(self) -> MooncakeStoreStats:
        with self._lock:
            names = {f.name for f in dataclasses.fields(MooncakeStoreStats)} - {"errors"}
            return MooncakeStoreStats(
                **{k: self._n[k] for k in names}, errors=dict(self._errors)
            )
