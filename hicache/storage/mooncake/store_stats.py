"""``MooncakeStoreStats``: what a ``MooncakeStore`` did (``MooncakeCounters``, thread-safe).
``pages_*`` count pages, ``objects_*`` objects (2 per MHA page, 1 per MLA); ``errors`` failed
objects by return-code name; ``skipped_unhealthy`` calls answered as failures while the master was
unreachable; ``call_errors`` calls the client raised from.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MooncakeStoreStats:
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
    read_corrupt: int = 0
    skipped_unhealthy: int = 0
    call_errors: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class MooncakeCounters:
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
            return MooncakeStoreStats(**{k: self._n[k] for k in names}, errors=dict(self._errors))
