"""The prefill side's transfer worker of one decode session (SGLang's ``transfer_worker``): a FIFO
of chunk jobs, a thread and its own ``TransferEngine``, so a frozen decode stalls only its own
queue. Thread and engine start with the first job and end after ``idle_s`` without one (a
registered session that sends no work costs neither). A session whose call failed is
blacklisted until a new REGISTER or a successful probe."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hicache_prefill.prefill.disagg.mooncake.engine import (
    MAX_ITEMS_PER_CALL,
    EngineError,
    KVTransferEngine,
)
from hicache_prefill.prefill.disagg.mooncake.wire import Register

logger = logging.getLogger(__name__)

PROBE_MAX_INTERVAL_S = 300.0
"""SGLang's ``SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S`` default."""

TransferHook = Callable[[str, int, bool, str], None]
"""``hook(rid, chunk_index, last, phase)`` on the worker thread before a call; ``phase`` is
``"before_kv"`` (the chunk's KV) or ``"before_aux"`` (the last chunk's metadata row)."""


@dataclass(frozen=True)
class SourceMemory:
    layer_ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    aux_row_lens: tuple[int, ...]
    regions: tuple[tuple[int, int], ...]


@dataclass(eq=False)
class Job:
    """One send: prefill pages ``src_pages`` to ``dst_pages``, paired by position; the last job
    also writes metadata row ``aux_index`` to the decode row ``dst_aux_index``."""

    room: int
    rid: str
    index: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    last: bool
    aux_index: int = -1
    dst_aux_index: int = -1
    started: float = field(default=0.0)


def coalesce(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of page pairs contiguous (+1) on both sides: ``(src starts, dst starts, lengths)``."""
    n = len(src)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [n]])
    return src[starts], dst[starts], ends - starts


def kv_items(src: SourceMemory, reg: Register, job: Job) -> tuple[list[int], list[int], list[int]]:
    """``(srcs, dsts, lens)`` of the job's KV: one item per (layer buffer, run)."""
    s0, d0, n = coalesce(job.src_pages, job.dst_pages)
    lens = np.asarray(src.item_lens, dtype=np.int64)[:, None]
    sp = np.asarray(src.layer_ptrs, dtype=np.int64)[:, None] + s0[None, :] * lens
    dp = np.asarray(reg.kv_ptrs, dtype=np.int64)[:, None] + d0[None, :] * lens
    nb = n[None, :] * lens
    return sp.ravel().tolist(), dp.ravel().tolist(), nb.ravel().tolist()


def aux_items(src: SourceMemory, reg: Register, job: Job) -> tuple[list[int], list[int], list[int]]:
    """One item per metadata buffer, paired by position up to the shorter list, each one row of
    the prefill's length (SGLang's ``send_aux``: both sides have the same row lengths)."""
    srcs, dsts, lens = [], [], []
    for sp, ln, dp in zip(src.aux_ptrs, src.aux_row_lens, reg.aux_ptrs, strict=False):
        srcs.append(sp + ln * job.aux_index)
        dsts.append(dp + ln * job.dst_aux_index)
        lens.append(ln)
    return srcs, dsts, lens


class SessionWorker:
    """The FIFO, thread and engine of one decode session. ``room_failed(room)`` is read before
    each job, ``on_done(job, rc)`` called after it (``rc`` ``None`` when skipped)."""

    def __init__(
        self,
        reg: Register,
        source: SourceMemory,
        host: str,
        room_failed: Callable[[int], bool],
        on_done: Callable[[Job, int | None], None],
        hook: TransferHook | None,
        probe_interval_s: float,
        max_items: int = MAX_ITEMS_PER_CALL,
        idle_s: float = 60.0,
    ) -> None:
        self.session = reg.session
        self.reg = reg
        self.source = source
        self.host = host
        self.room_failed = room_failed
        self.on_done = on_done
        self.hook = hook
        self.probe_interval_s = probe_interval_s
        self.max_items = max_items
        self.idle_s = idle_s
        self.blacklisted: str | None = None  # why, while blacklisted
        self.last_used = time.monotonic()
        self.calls = 0
        self.items = 0
        self.bytes = 0
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._engine: KVTransferEngine | None = None
        self._busy = False
        self._closed = threading.Event()
        self._probing = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.pending = 0  # jobs queued or running

    @property
    def running(self) -> bool:
        """Whether the thread (and so maybe the engine) is up."""
        return self._thread is not None

    def put(self, job: Job) -> None:
        with self._lock:
            self.last_used = time.monotonic()
            self.pending += 1
            self._queue.put(job)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._run, name=f"mc-{self.session}", daemon=True
                )
                self._thread.start()

    def blacklist(self, reason: str) -> None:
        if self.blacklisted is None:
            logger.error("decode session %s blacklisted: %s", self.session, reason)
        self.blacklisted = reason
        if not self._probing and not self._closed.is_set():
            self._probing = True
            threading.Thread(
                target=self._probe_loop, name=f"probe-{self.session}", daemon=True
            ).start()

    def unblacklist(self) -> None:
        if self.blacklisted is not None:
            logger.info("decode session %s usable again", self.session)
        self.blacklisted = None

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop the thread after the queued jobs; whether it ended (a call to a frozen peer may
        still block it, its engine then left to the process)."""
        self._closed.set()
        with self._lock:
            thread = self._thread
            self._queue.put(None)
        if thread is not None:
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                return False
        if self._probing:
            return False
        self._close_engine()
        return True

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _start_engine(self) -> None:
        try:
            engine = KVTransferEngine(self.host)
            engine.register(self.source.regions)
            self._engine = engine
            warm = min(64, self.source.item_lens[0], self.reg.kv_item_lens[0])
            rc = engine.write(
                self.session, [self.source.layer_ptrs[0]], [self.reg.kv_ptrs[0]], [warm]
            )
            if rc != 0:
                self.blacklist(f"first contact (a {warm}-byte write to the padding page) rc={rc}")
        except EngineError as e:
            self.blacklist(str(e))

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty() and not self._probing:
                        self._close_engine()  # idle: thread and engine end
                        self._thread = None
                        return
                continue
            if job is None:
                return
            if self._engine is None and self.blacklisted is None:
                self._start_engine()
            try:
                rc = self._process(job)
            except Exception:  # the worker must go on: the job fails, its room with it
                logger.exception("transfer job of room %d failed", job.room)
                rc = -1
            with self._lock:
                self.pending -= 1
            self.on_done(job, rc)

    def _process(self, job: Job) -> int | None:
        if self.room_failed(job.room):
            return None
        if self.blacklisted is not None or self._engine is None:
            return -1
        job.started = time.monotonic()
        srcs, dsts, lens = kv_items(self.source, self.reg, job)
        if self.hook is not None:
            self.hook(job.rid, job.index, job.last, "before_kv")
        rc = self._write(srcs, dsts, lens)
        if rc == 0 and job.last:
            if self.hook is not None:
                self.hook(job.rid, job.index, job.last, "before_aux")
            rc = self._write(*aux_items(self.source, self.reg, job))
        return rc

    def _write(self, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        if not srcs:
            return 0
        assert self._engine is not None
        rc = self._engine.write(self.session, srcs, dsts, lens, self.max_items)
        self.calls += -(-len(srcs) // self.max_items)
        self.items += len(srcs)
        self.bytes += sum(lens)
        return rc

    def _probe_loop(self) -> None:
        """SGLang's backoff: the interval doubles after each failed probe, up to the maximum."""

        interval = self.probe_interval_s
        try:
            while not self._closed.wait(interval):
                if self.blacklisted is None:
                    return
                if self._engine is not None and self._engine.probe(self.session) == 0:
                    self.unblacklist()
                    return
                interval = min(2 * interval, PROBE_MAX_INTERVAL_S)
        finally:
            self._probing = False
