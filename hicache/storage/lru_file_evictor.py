"""``LRUFileEvictor``: the byte budget of a ``HiCacheFile`` directory (SGLang 0.5.23's
``max_size``, ``min_free_space``, ``eviction_ratio``; inert with neither limit set). Only this
rank's page files are tracked and evicted, least recently used first; a key between ``reserve``
and ``commit`` / ``abort`` is never evicted; a refused write reserves nothing. Thread-safe.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from hicache_prefill.hicache.storage.extra_config import read_fraction, read_size

logger = logging.getLogger(__name__)

ENV_MAX_SIZE = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
ENV_MIN_FREE = "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"
ENV_RATIO = "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO"
DEFAULT_EVICTION_RATIO = 0.9


class LRUFileEvictor:
    def __init__(
        self,
        directory: str,
        *,
        owned_suffixes: tuple[str, ...],
        extra_config: Mapping | None = None,
        key_pattern: str = r"[^/]+",
    ) -> None:
        extra = extra_config or {}
        self._key_re = re.compile(key_pattern)
        self.directory = directory
        self.max_size_bytes = read_size(extra, "max_size", ENV_MAX_SIZE)
        self.min_free_bytes = read_size(extra, "min_free_space", ENV_MIN_FREE)
        self.eviction_ratio = read_fraction(
            extra, "eviction_ratio", ENV_RATIO, DEFAULT_EVICTION_RATIO
        )
        self._owned = owned_suffixes
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest first
        self._in_flight: set[str] = set()
        self._total = 0
        self._lock = threading.Lock()
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.refused_writes = 0
        self.enabled = self.max_size_bytes > 0 or self.min_free_bytes > 0
        if not self.enabled:
            return
        fs = self._fs_stats()
        if fs is not None and self.max_size_bytes > 0:
            room = max(0, fs[0] - self.min_free_bytes)
            if self.max_size_bytes > room:
                logger.warning(
                    "HiCacheFile max_size %d B exceeds the filesystem's %d B (minus min_free); "
                    "clamped",
                    self.max_size_bytes,
                    room,
                )
                self.max_size_bytes = room
        self._seed_from_disk()
        with self._lock:
            if self.max_size_bytes > 0 and self._total > self.max_size_bytes:
                self._evict_to_ratio(0)
            self._keep_free_space(0)
        logger.info(
            "HiCacheFile budget: cap %d B (evict to %.2f), min free %d B, %d files / %d B found",
            self.max_size_bytes,
            self.eviction_ratio,
            self.min_free_bytes,
            len(self._lru),
            self._total,
        )

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total

    def owns(self, key: str) -> bool:
        return key.endswith(self._owned)

    def _is_page(self, name: str) -> bool:
        return any(
            name.endswith(s) and self._key_re.fullmatch(name[: len(name) - len(s)])
            for s in self._owned
        )

    def reserve(self, key: str, nbytes: int) -> bool:
        """Admit a write (evicting as needed); an admitted key must be committed or aborted."""
        if not self.enabled:
            return True
        with self._lock:
            if not self.owns(key):
                return self._refuse("HiCacheFile: key %s is not this rank's to write", key)
            if self.max_size_bytes > 0 and nbytes > self.max_size_bytes:
                return self._refuse("HiCacheFile: %s is larger than the cap", key)
            previous = self._lru.pop(key, None)  # an overwrite replaces its own bytes
            if previous is not None:
                self._total -= previous
            refusal = None
            if self.max_size_bytes > 0 and self._total + nbytes > self.max_size_bytes:
                self._evict_to_ratio(nbytes)
                if self._total + nbytes > self.max_size_bytes:
                    refusal = "HiCacheFile: no evictable room for %s"
            if refusal is None and not self._keep_free_space(nbytes):
                refusal = "HiCacheFile: writing %s would breach min_free_space"
            if refusal is not None:
                if previous is not None:  # the old file stays; keep counting it
                    self._lru[key] = previous
                    self._total += previous
                return self._refuse(refusal, key)
            self._lru[key] = nbytes
            self._total += nbytes
            self._in_flight.add(key)
        return True

    def commit(self, key: str) -> None:
        if self.enabled:
            with self._lock:
                self._in_flight.discard(key)

    def abort(self, key: str) -> None:
        if self.enabled:
            with self._lock:
                self._in_flight.discard(key)
                self._total -= self._lru.pop(key, 0)

    def touch(self, key: str, path: str) -> None:
        """Mark ``key`` most recently used, adopting its file if untracked."""
        if not self.enabled or not self.owns(key):
            return
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
            else:
                self._lru[key] = size
                self._total += size

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._in_flight.clear()
            self._total = 0

    def _refuse(self, message: str, key: str) -> bool:
        self.refused_writes += 1
        logger.warning(message, key)
        return False

    def _evict_to_ratio(self, nbytes: int) -> None:
        target = max(0, int(self.max_size_bytes * self.eviction_ratio) - nbytes)
        self._evict_while(lambda _freed: self._total > target)

    def _keep_free_space(self, nbytes: int) -> bool:
        """Evict until writing ``nbytes`` leaves ``min_free_bytes`` free; whether it does."""
        if self.min_free_bytes <= 0:
            return True
        fs = self._fs_stats()
        if fs is None:
            return True  # cannot tell: the write itself will fail if the disk is full
        free = fs[1]
        self._evict_while(lambda freed: free + freed - nbytes < self.min_free_bytes)
        fs = self._fs_stats()  # other writers may have changed it meanwhile
        return fs is None or fs[1] - nbytes >= self.min_free_bytes

    def _evict_while(self, more: Callable[[int], bool]) -> int:
        """Unlink least recently used, not-in-flight files while ``more(bytes freed)`` (caller
        holds the lock)."""
        freed = 0
        skips_left = len(self._lru)
        while self._lru and skips_left > 0 and more(freed):
            key, size = self._lru.popitem(last=False)
            if key in self._in_flight:
                self._lru[key] = size  # a write in progress: keep it, try the next
                skips_left -= 1
                continue
            try:
                os.remove(os.path.join(self.directory, f"{key}.bin"))
                freed += size
            except FileNotFoundError:
                pass  # already gone: drop the entry
            except OSError as e:
                logger.warning("HiCacheFile: could not evict %s: %s", key, e)
                self._lru[key] = size
                self._lru.move_to_end(key, last=False)
                break
            self._total -= size
            self.evicted_files += 1
            self.evicted_bytes += size
            skips_left = len(self._lru)
        return freed

    def _fs_stats(self) -> tuple[int, int] | None:
        try:
            st = os.statvfs(self.directory)
        except (OSError, AttributeError):
            return None
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def _seed_from_disk(self) -> None:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        found = []
        for name in names:
            if not name.endswith(".bin") or not self._is_page(name[:-4]):
                continue
            try:
                st = os.stat(os.path.join(self.directory, name))
            except OSError:
                continue
            found.append((st.st_mtime, name[:-4], st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._total += size
