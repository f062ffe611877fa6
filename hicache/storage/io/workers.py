"""``StorageWorkers``: a storage backend and its three IO threads (SGLang 0.5.23's prefetch,
prefetch IO and backup threads), the records they hand the scheduler thread, and ``StorageStats``.

Nothing escapes a thread (a backend that raises answers a failure), and every operation yields the
same number of results on every rank, so the scheduler can agree the queues position by position.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

import torch

from hicache_prefill.hicache.storage.base import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageExtraInfo,
)
from hicache_prefill.hicache.storage.hash_keys import page_hashes

logger = logging.getLogger(__name__)

_ids = itertools.count()


class CacheRequestHandle(NamedTuple):
    """One attempt of one request: a late ack of attempt N finds no prefetch of N + 1."""

    rid: str
    attempt: int


@dataclass(eq=False)
class StorageOperation:
    """One backup: host slots and the page keys to store them under."""

    host_indices: torch.Tensor
    hash_value: list[str]
    _: KW_ONLY
    prefix_keys: list[str] | None = None
    node: Any = None  # the tree node whose host copy is protected until the ack (cache mode)
    staging: bool = False  # buffer_only: the host slots are freed at the ack
    id: int = field(init=False, default_factory=lambda: next(_ids))
    completed_tokens: int = field(init=False, default=0)
    failed: bool = field(init=False, default=False)
    error: str | None = field(init=False, default=None)


class PrefetchOperation:
    """One prefetch into the host pool: the query thread sets ``local_hit_pages``, the scheduler
    the agreed ``hash_value`` and ``host_indices``, the IO thread reads into them."""

    def __init__(
        self,
        handle: CacheRequestHandle,
        token_ids: list[int],
        last_hash: str | None,
        *,
        prefix_keys: list[str] | None = None,
        storage_start: int = 0,
    ) -> None:
        self.id = next(_ids)
        self.handle = handle
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.prefix_keys = prefix_keys
        self.storage_start = storage_start  # tokens before the first fetched one
        self.requested_tokens = len(token_ids)
        self.all_hash_values: list[str] = []  # every queried page key (query thread)
        self.local_hit_pages = 0  # this rank's existence answer (query thread)
        self.hash_value: list[str] = []  # agreed hit, then trimmed to what was allocated
        self.host_indices: torch.Tensor | None = None
        self.completed_tokens = 0  # agreed progress (scheduler)
        self.wait_started: float | None = None  # executor clock of the first blocked poll
        self.done = False  # the completion ack was drained
        self._terminated = threading.Event()

    def mark_terminate(self) -> None:
        """Asks the threads to stop between batches."""
        self._terminated.set()

    def is_terminated(self) -> bool:
        return self._terminated.is_set()


@dataclass
class PrefetchAck:
    """This rank's progress after one batch, or ``completed_req`` (the last). Every rank emits
    ``ceil(pages / 128) + 1`` acks per operation, failures included."""

    operation: PrefetchOperation
    completed_tokens: int | None = None
    completed_req: bool = False


@dataclass
class StorageStats:
    """Counted on the scheduler thread from agreed results (tokens unless named ``ops``).
    ``prefetch_revoked``: ended after its query; ``backup_skipped_ops``: non-writer ranks."""

    prefetch_issued: int = 0
    prefetch_too_short: int = 0
    prefetch_rate_limited: int = 0
    prefetch_revoked: int = 0
    prefetch_terminated: int = 0
    prefetch_released: int = 0
    prefetch_hit_tokens: int = 0
    prefetch_fetched_tokens: int = 0
    prefetch_inserted_tokens: int = 0
    prefetch_dropped_tokens: int = 0
    prefetch_unused_tokens: int = 0
    backup_ops: int = 0
    backup_tokens: int = 0
    backup_failed_ops: int = 0
    backup_skipped_ops: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


ZERO_COPY_BACKENDS = frozenset(
    {"hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori", "tensorcast", "seaweedfs"}
)
JOIN_TIMEOUT_S = 10.0
SCRATCH_BYTES = 64 << 20  # flat page buffers each IO thread reuses on the generic path


def uses_zero_copy(backend_name: str, extra_config: dict | None) -> bool:
    if backend_name == "dynamic":
        return bool((extra_config or {}).get("interface_v1"))
    return backend_name in ZERO_COPY_BACKENDS


class StorageWorkers:
    """Threads: query (``query_queue`` -> ``hit_queue``), IO (``io_queue`` -> ``ack_queue``),
    backup (``backup_queue`` -> ``backup_ack_queue``). ``zero_copy``: the v1 calls."""

    def __init__(
        self,
        backend: HiCacheStorage,
        host_pool: Any,
        *,
        zero_copy: bool,
        is_storage_writer: bool = True,
    ) -> None:
        self.backend = backend
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.zero_copy = zero_copy
        self.is_storage_writer = is_storage_writer
        self.query_queue: queue.Queue[PrefetchOperation | None] = queue.Queue()
        self.hit_queue: queue.Queue[PrefetchOperation] = queue.Queue()
        self.io_queue: queue.Queue[PrefetchOperation | None] = queue.Queue()
        self.ack_queue: queue.Queue[PrefetchAck] = queue.Queue()
        self.backup_queue: queue.Queue[StorageOperation | None] = queue.Queue()
        self.backup_ack_queue: queue.Queue[StorageOperation] = queue.Queue()
        self._stop = threading.Event()
        self._scratch: dict[str, list[Any]] = {"io": [], "backup": []}
        self._threads = [
            threading.Thread(
                target=self._loop, args=(q, fn), name=f"hicache-storage-{name}", daemon=True
            )
            for name, q, fn in (
                ("query", self.query_queue, self._query),
                ("io", self.io_queue, self._transfer),
                ("backup", self.backup_queue, self._backup),
            )
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop the threads after the work they hold; ``RuntimeError`` when one does not stop
        within ``JOIN_TIMEOUT_S`` (a backend call that never returns)."""
        if self._stop.is_set():
            return
        self._stop.set()
        for q in (self.query_queue, self.io_queue, self.backup_queue):
            q.put(None)
        alive = []
        for t in self._threads:
            t.join(JOIN_TIMEOUT_S)
            if t.is_alive():
                alive.append(t.name)
        if alive:
            raise RuntimeError(f"storage threads did not stop within {JOIN_TIMEOUT_S} s: {alive}")

    def _loop(self, q: queue.Queue, fn: Callable[[Any], None]) -> None:
        while True:
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                if self._stop.is_set() and q.empty():
                    return
                continue
            fn(item)

    def _query(self, op: PrefetchOperation) -> None:
        """This rank's hit: consecutive stored pages from the first."""
        hits = 0
        try:
            keys = page_hashes(op.token_ids, self.page_size, op.last_hash)
            op.all_hash_values = keys
            if not op.is_terminated():
                for batch, _, extra in self._batches(keys, op.prefix_keys):
                    n = int(self.backend.batch_exists(batch, extra))
                    hits += max(0, min(n, len(batch)))
                    if n < len(batch):
                        break
        except Exception:  # noqa: BLE001 - a failed query is a miss on this rank
            logger.exception("storage existence query failed for %s", op.handle)
            hits = 0
        op.local_hit_pages = hits
        self.hit_queue.put(op)

    def _transfer(self, op: PrefetchOperation) -> None:
        """One progress ack per batch, then one completion ack, whatever happens."""
        ps = self.page_size
        ok, pages = True, 0
        try:
            batches = self._batches(op.hash_value, op.prefix_keys, op.host_indices)
            for batch, slots, extra in batches:
                ok = ok and not op.is_terminated()
                if ok:
                    try:
                        got = self._page_get(op, batch, slots, extra)
                    except Exception:  # noqa: BLE001 - a failed read is a shorter hit
                        logger.exception("storage read failed for %s", op.handle)
                        got = 0
                    if got != len(batch):
                        ok = False
                    pages += got
                self.ack_queue.put(PrefetchAck(op, completed_tokens=pages * ps))
        finally:
            self.ack_queue.put(PrefetchAck(op, completed_req=True))

    def _batches(
        self, keys: list[str], prefix: list[str] | None, host_indices: torch.Tensor | None = None
    ) -> Iterator[tuple[list[str], torch.Tensor | None, HiCacheStorageExtraInfo]]:
        """``(keys, host slots, extra info)`` per batch; the prefix keys grow by each batch."""
        ps = self.page_size
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            slots = None
            if host_indices is not None:
                slots = host_indices[start * ps : (start + len(batch)) * ps]
            yield batch, slots, HiCacheStorageExtraInfo(prefix)
            if prefix is not None:
                prefix = prefix + batch

    def _page_get(
        self,
        op: PrefetchOperation,
        keys: list[str],
        slots: torch.Tensor,
        extra: HiCacheStorageExtraInfo,
    ) -> int:
        pool, ps = self.host_pool, self.page_size
        if self.zero_copy:
            return len(
                list(itertools.takewhile(bool, self.backend.batch_get_v1(keys, slots, extra)))
            )
        targets = self._buffers("io", len(keys))
        pages = self.backend.batch_get(keys, targets)
        if pages is None:
            return 0
        n = 0
        for i, page in enumerate(pages):
            if page is None or op.is_terminated():
                break
            pool.set_from_flat_data_page(int(slots[i * ps]), page)
            n += 1
        return n

    def _buffers(self, thread: str, n: int) -> list[Any]:
        """``n`` flat page buffers: reused ones while they fit in ``SCRATCH_BYTES``."""
        pool = self.host_pool
        if n * pool.page_nbytes > SCRATCH_BYTES:
            return [pool.get_dummy_flat_data_page() for _ in range(n)]
        scratch = self._scratch[thread]
        while len(scratch) < n:
            scratch.append(pool.get_dummy_flat_data_page())
        return scratch[:n]

    def _backup(self, op: StorageOperation) -> None:
        """The first failed batch ends the backup."""
        if self.is_storage_writer:
            try:
                self._page_backup(op)
            except Exception as e:  # noqa: BLE001 - a failed backup is counted, not raised
                logger.exception("storage backup failed after %d tokens", op.completed_tokens)
                op.failed, op.error = True, f"{type(e).__name__}: {e}"
        self.backup_ack_queue.put(op)

    def _page_backup(self, op: StorageOperation) -> None:
        ps, pool = self.page_size, self.host_pool
        for batch, slots, extra in self._batches(op.hash_value, op.prefix_keys, op.host_indices):
            if self.zero_copy:
                ok = all(self.backend.batch_set_v1(batch, slots, extra))
            else:
                bufs = self._buffers("backup", len(batch))
                data = [
                    pool.get_data_page(int(slots[i * ps]), out=buf) for i, buf in enumerate(bufs)
                ]
                ok = bool(self.backend.batch_set(batch, data))
            if not ok:
                logger.warning("storage backup: a batch of %d pages failed", len(batch))
                op.failed, op.error = True, "batch failed"
                return
            op.completed_tokens += ps * len(batch)
