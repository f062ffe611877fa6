"""Out-of-range slot indices found by the copy kernel: recorded on the device with no host
synchronization, reported when the copy's completion is checked.

Each launch names a record slot of four int64 words (source code, destination code, a bad source
index, a bad destination index) in a per-device buffer both sides reach without a copy (pinned
host memory on CUDA, a CPU tensor otherwise). A copy whose completion is checked runs its ops
inside ``with watch_copies(device):`` on the launching thread, and ``watch.check()`` (after its
event synchronized) raises :class:`kernels.errors.KVIndexError` and frees the slot. Launches
outside any watch share the device's slot 0 (:func:`check_unwatched_index_errors`). A watch never
checked keeps its slot, so a late write cannot land in a slot given to another copy.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kernels.errors import KVIndexError

logger = logging.getLogger(__name__)

__all__ = ["CopyWatch", "LaunchSlot", "check_unwatched_index_errors", "launch_slot", "watch_copies"]

WORDS = 4  # per slot: src code, dst code, a bad src index, a bad dst index
CHUNK_SLOTS = 1024
"""Slots per buffer chunk (32 KiB); slot 0 of a device's first chunk is the shared one."""
_SIDES = (("src_indices", 0, 2), ("dst_indices", 1, 3))  # argument, code word, value word


class LaunchSlot(NamedTuple):
    """What one launch passes the kernel: the record buffer, its slot, the launch's code."""

    buffer: torch.Tensor  # int64 [CHUNK_SLOTS * WORDS], pinned host memory on CUDA
    slot: int
    code: int


@dataclass
class _Chunk:
    buffer: torch.Tensor
    words: np.ndarray  # the same memory, read by the host without torch


@dataclass
class _DeviceRecord:
    """The record buffers of one device and their free slots."""

    device: torch.device
    chunks: list[_Chunk] = field(default_factory=list)
    free: list[tuple[int, int]] = field(default_factory=list)  # (chunk, slot)
    unwatched: dict[tuple[str, int, int], LaunchSlot] = field(default_factory=dict)
    unwatched_by_code: list[tuple[str, int, int]] = field(default_factory=list)

    def grow(self) -> None:
        pin = self.device.type == "cuda"
        buf = torch.zeros(CHUNK_SLOTS * WORDS, dtype=torch.int64, pin_memory=pin)
        index = len(self.chunks)
        self.chunks.append(_Chunk(buf, buf.numpy()))
        first = 1 if index == 0 else 0  # slot 0 of the first chunk: launches outside a watch
        self.free.extend((index, s) for s in range(CHUNK_SLOTS - 1, first - 1, -1))
        logger.debug("index record on %s: chunk %d (%d slots)", self.device, index, CHUNK_SLOTS)


_records: dict[torch.device, _DeviceRecord] = {}
_lock = threading.Lock()
_local = threading.local()
MAX_UNWATCHED_CODES = 4096


def _record(device: torch.device) -> _DeviceRecord:
    rec = _records.get(device)
    if rec is None:
        with _lock:
            rec = _records.get(device)
            if rec is None:
                rec = _DeviceRecord(device)
                rec.grow()
                _records[device] = rec
    return rec


def _key(device: torch.device) -> torch.device:
    """Devices are keyed with an explicit index (``cuda`` and ``cuda:0`` are one record)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _report(words: np.ndarray, base: int, describe: object) -> KVIndexError | None:
    """The error recorded in the slot at ``words[base:]`` (``None`` when it is clean);
    ``describe(code)`` -> ``(op, src_slots, dst_slots)``."""
    for argument, code_word, value_word in _SIDES:
        code = int(words[base + code_word])
        if code:
            op, src_slots, dst_slots = describe(code)  # type: ignore[operator]
            n_slots = src_slots if argument == "src_indices" else dst_slots
            return KVIndexError(
                op,
                argument,
                int(words[base + value_word]),
                n_slots,
                "found by the kernel; the pair was not copied",
            )
    return None


class CopyWatch:
    """The launches of one copy (see the module docstring). Use as ``with watch:`` around the
    op calls, then ``check()`` once the copy finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = _key(torch.device(device))
        self._rec = _record(self.device)
        with _lock:
            if not self._rec.free:
                self._rec.grow()
            self._chunk, self._slot = self._rec.free.pop()
        self._launches: list[tuple[str, int, int]] = []  # (op, src_slots, dst_slots)
        self._checked = False

    def __enter__(self) -> CopyWatch:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stack.pop()

    def add(self, op: str, src_slots: int, dst_slots: int) -> LaunchSlot:
        """Register one launch; returns what it passes the kernel."""
        self._launches.append((op, src_slots, dst_slots))
        chunk = self._rec.chunks[self._chunk]
        return LaunchSlot(chunk.buffer, self._slot, len(self._launches))

    @property
    def launches(self) -> int:
        """Launches made under this watch so far."""
        return len(self._launches)

    def check(self) -> None:
        """Raise :class:`KVIndexError` if a launch of this copy skipped a pair for an
        out-of-range index; give the slot back either way (a second call does nothing). Call it
        only after every launch of the copy finished (its event synchronized): the slot is
        cleared and may serve another copy at once."""
        if self._checked:
            return
        self._checked = True
        words = self._rec.chunks[self._chunk].words
        base = self._slot * WORDS
        error = _report(words, base, lambda code: self._launches[code - 1])
        words[base : base + WORDS] = 0
        with _lock:
            self._rec.free.append((self._chunk, self._slot))
        if error is not None:
            raise error


def watch_copies(device: torch.device | str) -> CopyWatch:
    """A :class:`CopyWatch` for copies launched on ``device`` (the indices' device)."""
    return CopyWatch(torch.device(device))


def launch_slot(device: torch.device, op: str, src_slots: int, dst_slots: int) -> LaunchSlot:
    """The record slot a launch on ``device`` passes the kernel: the innermost watch of this
    thread on that device, else the device's shared slot 0."""
    device = _key(device)
    stack = getattr(_local, "stack", None)
    if stack:
        watch = stack[-1]
        if watch.device == device:
            return watch.add(op, src_slots, dst_slots)
    rec = _record(device)
    key = (op, src_slots, dst_slots)
    launch = rec.unwatched.get(key)
    if launch is None:
        with _lock:
            if len(rec.unwatched_by_code) < MAX_UNWATCHED_CODES:
                rec.unwatched_by_code.append(key)
                launch = LaunchSlot(rec.chunks[0].buffer, 0, len(rec.unwatched_by_code))
                rec.unwatched[key] = launch
            else:  # described without its bounds
                launch = LaunchSlot(rec.chunks[0].buffer, 0, MAX_UNWATCHED_CODES + 1)
    return launch


def check_unwatched_index_errors(device: torch.device | str) -> None:
    """Raise :class:`KVIndexError` if a launch on ``device`` made outside any watch skipped a
    pair for an out-of-range index since the last call; clears the record either way. Reads
    host memory only: call it after those copies finished (e.g. after a synchronization)."""
    device = _key(torch.device(device))
    rec = _records.get(device)
    if rec is None:
        return
    words = rec.chunks[0].words
    table = rec.unwatched_by_code

    def describe(code: int) -> tuple[str, int, int]:
        return table[code - 1] if code <= len(table) else ("a kvcacheio op", -1, -1)

    error = _report(words, 0, describe)
    words[:WORDS] = 0
    if error is not None:
        raise error
