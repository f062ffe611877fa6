"""``PageFooters``: the integrity footer of every Mooncake object this project writes: the file
backend's 16-byte footer (CRC-32 of the object's name then its bytes) after the part's bytes, so
damaged bytes and another object's bytes both fail on read. The parts move zero-copy (the
``*_multi_buffers`` calls); the footers go through a per-thread buffer registered with Mooncake.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from hicache_prefill.hicache.storage.file_backend import FOOTER, MAGIC, page_checksum
from hicache_prefill.hicache.storage.mooncake.client import MooncakeClient, error_name

logger = logging.getLogger(__name__)

MIN_SLOTS = 256
PUT_CALL = "batch_put_from_multi_buffers"
GET_CALL = "batch_get_into_multi_buffers"


class PageFooters:
    size = FOOTER.size

    def __init__(self, client: MooncakeClient) -> None:
        self._client = client
        self._local = threading.local()
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []  # kept alive while Mooncake holds them

    def staging(self, n: int) -> torch.Tensor | None:
        """This thread's buffer of ``n`` footers or more; ``None`` (logged) when Mooncake refuses
        to register it."""
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is not None and buf.numel() >= n * self.size:
            return buf
        slots = max(n, MIN_SLOTS, 2 * buf.numel() // self.size if buf is not None else 0)
        new = torch.zeros(slots * self.size, dtype=torch.uint8)
        rc = self._client.register_one(new.data_ptr(), new.numel())
        if rc != 0:
            logger.error("Mooncake refused a footer buffer (%s)", error_name(rc))
            return None
        with self._lock:
            self._buffers.append(new)
            if buf is not None:
                self._client.unregister(buf.data_ptr())
                self._buffers.remove(buf)
        self._local.buf = new
        return new

    def buffers(
        self, buf: torch.Tensor, ptrs: list[int], sizes: list[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """The multi-buffer call's addresses and lengths: each part, then its footer slot."""
        base = buf.data_ptr()
        parts = [[ptr, base + i * self.size] for i, ptr in enumerate(ptrs)]
        return parts, [[size, self.size] for size in sizes]

    def write(self, buf: torch.Tensor, slot: int, name: str, ptr: int, size: int) -> None:
        FOOTER.pack_into(_view(buf), slot * self.size, MAGIC, _checksum(name, ptr, size))

    def holds(self, buf: torch.Tensor, slot: int, name: str, ptr: int, size: int) -> bool:
        return FOOTER.unpack_from(_view(buf), slot * self.size) == (
            MAGIC,
            _checksum(name, ptr, size),
        )


def _view(buf: torch.Tensor) -> memoryview:
    return memoryview(buf.numpy())


def _checksum(name: str, ptr: int, size: int) -> int:
    return page_checksum(name, (ctypes.c_char * size).from_address(ptr))
