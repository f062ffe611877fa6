"""Out-of-range slot indices found by the copy kernel: recorded on the device with no host
synchronization, reported when the copy's completion is checked.

Each launch names a record slot of four int64 words in a per-device buffer both sides reach
without a copy (pinned host memory on CUDA). A copy runs its ops inside ``with
watch_copies(device):``; ``watch.check()`` (after its event synchronized) raises ``KVIndexError``
and frees the slot. Launches outside any watch share slot 0 (:func:`check_unwatched_index_errors`).
A watch never checked keeps its slot, so a late write cannot land in another copy's slot.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from hicache_prefill.kernels.errors import KVIndexError

logger = logging.getLogger(__name__)

WORDS = 4  # per slot: src code, dst code, a bad src index, a bad dst index
CHUNK_SLOTS = 1024  # per buffer chunk (32 KiB); slot 0 of a device's first chunk is shared
_SIDES = (("src_indices", 0, 2), ("dst_indices", 1, 3))  # argument, code word, value word


class LaunchSlot(NamedTuple):
    buffer: torch.Tensor  # int64 [CHUNK_SLOTS * WORDS], pinned host memory on CUDA
    slot: int
    code: int


@dataclass
class _Chunk:
    buffer: torch.Tensor
    words: np.ndarray  # the same memory, read by the host without torch


@dataclass
class _DeviceRecord:
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
    """``cuda`` and ``cuda:0`` are one record."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _report(words: np.ndarray, base: int, describe: object) -> KVIndexError | None:
    """The error recorded at ``words[base:]``, if any; ``describe(code)`` -> ``(op, src, dst)``."""
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
    """The launches of one copy: ``with watch:`` around the op calls, ``check()`` once done."""

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
        self._launches.append((op, src_slots, dst_slots))
        chunk = self._rec.chunks[self._chunk]
        return LaunchSlot(chunk.buffer, self._slot, len(self._launches))

    @property
    def launches(self) -> int:
        return len(self._launches)

    def check(self) -> None:
        """Raise ``KVIndexError`` if a launch skipped an out-of-range pair; free the slot either
        way (idempotent). Only after every launch finished: the slot may serve another copy."""
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
    return CopyWatch(torch.device(device))


def launch_slot(device: torch.device, op: str, src_slots: int, dst_slots: int) -> LaunchSlot:
    """This thread's innermost watch on ``device``, else the device's shared slot 0."""
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
    """Raise ``KVIndexError`` if an unwatched launch on ``device`` skipped an out-of-range pair
    since the last call; clears the record. Call after those copies finished."""
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
