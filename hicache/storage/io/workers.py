"""``StorageWorkers``: a storage backend and the three IO threads that drive it (SGLang 0.5.23's
``prefetch_thread_func``, ``prefetch_io_aux_func`` and ``backup_thread_func``).

- **query** (``query_queue`` -> ``hit_queue``): hashes the tokens (``page_hashes``) and asks
  ``batch_exists`` in slices of ``STORAGE_BATCH_SIZE`` pages, stopping at the first short one;
- **IO** (``io_queue`` -> ``ack_queue``): reads the hit pages into the host slots the scheduler
  allocated, batch by batch; after a failure or a termination it keeps emitting one ack per
  batch (the same count on every rank), then one completion ack;
- **backup** (``backup_queue`` -> ``backup_ack_queue``): stores host pages batch by batch; the
  first failed batch ends the backup.

Each thread blocks on its queue (1 s timeouts, to see ``close``) and on the backend's IO; the
scheduler thread never waits for them: it counts what each output queue holds and pops as many
as every rank has (``controller``). What this rank found (hits, pages read, pages written) is
only ever an input to that agreement.

Paths (SGLang's dispatch): zero-copy ``batch_get_v1`` / ``batch_set_v1`` for backends that
implement them (``ZERO_COPY_BACKENDS``, or ``dynamic`` with ``interface_v1`` in the extra
config); otherwise the generic path, ``batch_get`` into flat pages then
``set_from_flat_data_page`` / ``batch_set`` of ``get_data_page`` (``file``). A page is written into
the host pool only after it was read whole; a read that stops early leaves later pages as they
were. A backend that raises is logged and answers as a failure (0 hits, a failed batch); nothing
escapes a thread. Non-writer ranks (MLA ranks other than 0) skip the IO of a backup and ack it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from hicache.storage.base import STORAGE_BATCH_SIZE, HiCacheStorage, HiCacheStorageExtraInfo
from hicache.storage.hash_keys import page_hashes
from hicache.storage.io.operations import PrefetchAck, PrefetchOperation, StorageOperation

logger = logging.getLogger(__name__)

ZERO_COPY_BACKENDS = frozenset(
    {"hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori", "tensorcast", "seaweedfs"}
)
JOIN_TIMEOUT_S = 10.0
SCRATCH_BYTES = 64 << 20
"""Each IO thread keeps up to this many bytes of flat page buffers for the generic path
(reused by every batch that fits, so a batch does not fault in fresh memory)."""


def uses_zero_copy(backend_name: str, extra_config: dict | None) -> bool:
    """SGLang's choice between the v1 (zero-copy) and the generic page calls."""
    if backend_name == "dynamic":
        return bool((extra_config or {}).get("interface_v1"))
    return backend_name in ZERO_COPY_BACKENDS


class StorageWorkers:
    """The backend and its IO threads (module docstring).

    Args:
        backend: the ``HiCacheStorage`` (its host pool already registered).
        host_pool: the host pool pages are read into and written from.
        zero_copy: use ``batch_get_v1`` / ``batch_set_v1`` (see ``uses_zero_copy``).
        is_storage_writer: ``False`` on MLA ranks other than 0 (backups are skipped, acked).
    """

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
            threading.Thread(target=self._loop, args=(q, fn), name=f"hicache-storage-{name}",
                             daemon=True)
            for name, q, fn in (
                ("query", self.query_queue, self._query),
                ("io", self.io_queue, self._transfer),
                ("backup", self.backup_queue, self._backup),
            )
        ]  # fmt: skip
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ scheduler side
    def submit_query(self, op: PrefetchOperation) -> None:
        self.query_queue.put(op)

    def submit_io(self, op: PrefetchOperation) -> None:
        self.io_queue.put(op)

    def submit_backup(self, op: StorageOperation) -> None:
        self.backup_queue.put(op)

    def close(self) -> None:
        """Stop the threads after the work they hold (sentinels, then joins of up to 10 s
        each). ``RuntimeError`` when one does not stop (a backend call that never returns)."""
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

    # ------------------------------------------------------------------ threads
    def _loop(self, q: queue.Queue, fn: Any) -> None:
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
        """This rank's hit: consecutive stored pages from the first, in 128-page slices."""
        hits = 0
        try:
            keys = page_hashes(op.token_ids, self.page_size, op.last_hash)
            op.all_hash_values = keys
            prefix = op.prefix_keys
            if not op.is_terminated():
                for start in range(0, len(keys), STORAGE_BATCH_SIZE):
                    batch = keys[start : start + STORAGE_BATCH_SIZE]
                    n = int(self.backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix)))
                    hits += max(0, min(n, len(batch)))
                    if n < len(batch):
                        break
                    if prefix is not None:
                        prefix = prefix + batch
        except Exception:  # noqa: BLE001 - a failed query is a miss on this rank
            logger.exception("storage existence query failed for %s", op.handle)
            hits = 0
        op.local_hit_pages = hits
        self.hit_queue.put(op)

    def _transfer(self, op: PrefetchOperation) -> None:
        """Read the hit pages into ``op.host_indices``; one progress ack per batch, then one
        completion ack, whatever happens."""
        ps = self.page_size
        ok, pages, prefix = True, 0, op.prefix_keys
        try:
            for start in range(0, len(op.hash_value), STORAGE_BATCH_SIZE):
                if ok and op.is_terminated():
                    ok = False
                if ok:
                    batch = op.hash_value[start : start + STORAGE_BATCH_SIZE]
                    assert op.host_indices is not None
                    slots = op.host_indices[start * ps : (start + len(batch)) * ps]
                    try:
                        got = self._page_get(op, batch, slots, HiCacheStorageExtraInfo(prefix))
                    except Exception:  # noqa: BLE001 - a failed read is a shorter hit
                        logger.exception("storage read failed for %s", op.handle)
                        got = 0
                    if got != len(batch):
                        ok = False
                    pages += got
                    if prefix is not None:
                        prefix = prefix + batch
                op.local_completed_tokens = pages * ps
                self.ack_queue.put(PrefetchAck(op, completed_tokens=pages * ps))
        finally:
            self.ack_queue.put(PrefetchAck(op, completed_req=True))

    def _page_get(self, op: PrefetchOperation, keys: list[str], slots: Any, extra: Any) -> int:
        pool, ps = self.host_pool, self.page_size
        if self.zero_copy:
            results = self.backend.batch_get_v1(keys, slots, extra)
            n = 0
            for ok in results:
                if not ok:
                    break
                n += 1
            return n
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
        """``n`` flat page buffers for one batch of ``thread``: reused ones while ``n`` pages fit
        in ``SCRATCH_BYTES``, fresh ones otherwise (the backend may keep none of them)."""
        pool = self.host_pool
        if n * pool.page_nbytes > SCRATCH_BYTES:
            return [pool.get_dummy_flat_data_page() for _ in range(n)]
        scratch = self._scratch[thread]
        while len(scratch) < n:
            scratch.append(pool.get_dummy_flat_data_page())
        return scratch[:n]

    def _backup(self, op: StorageOperation) -> None:
        """Store ``op``'s pages batch by batch; the first failed batch ends the backup."""
        if self.is_storage_writer:
            try:
                self._page_backup(op)
            except Exception as e:  # noqa: BLE001 - a failed backup is counted, not raised
                logger.exception("storage backup failed after %d tokens", op.completed_tokens)
                op.failed, op.error = True, f"{type(e).__name__}: {e}"
        self.backup_ack_queue.put(op)

    def _page_backup(self, op: StorageOperation) -> None:
        ps, pool = self.page_size, self.host_pool
        prefix = op.prefix_keys
        for start in range(0, len(op.hash_value), STORAGE_BATCH_SIZE):
            batch = op.hash_value[start : start + STORAGE_BATCH_SIZE]
            slots = op.host_indices[start * ps : (start + len(batch)) * ps]
            extra = HiCacheStorageExtraInfo(prefix)
            if self.zero_copy:
                ok = all(self.backend.batch_set_v1(batch, slots, extra))
            else:
                bufs = self._buffers("backup", len(batch))
                data = [pool.get_data_page(int(slots[i * ps]), out=buf)
                        for i, buf in enumerate(bufs)]  # fmt: skip
                ok = bool(self.backend.batch_set(batch, data))
            if not ok:
                logger.warning("storage backup: a batch of %d pages failed", len(batch))
                op.failed, op.error = True, "batch failed"
                return
            if prefix is not None:
                prefix = prefix + batch
            op.completed_tokens += ps * len(batch)
