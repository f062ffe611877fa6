"""Metadata buffer indices of the prefill side (SGLang ``ReqToMetadataIdxAllocator``).

A request needs one metadata buffer (where its first output token and transfer metadata are
written for the decode side) from its optimistic admission or its finalize until its outcome,
and gives it back when it falls back to the bootstrap queue. SGLang sizes the pool at
``2 * max_running_requests`` on the prefill side; with no buffer free, a request stays in the
bootstrap queue. That bounds how many requests can hold an optimistic attempt at once.
"""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 2048
"""``max_running_requests`` when unset: the floor of SGLang's derived value."""


def metadata_buffer_count(max_running_requests: int) -> int:
    """SGLang's prefill-side pool size: twice ``max_running_requests`` (headroom)."""
    return 2 * max_running_requests


class ReqToMetadataIdxAllocator:
    """``size`` buffer indices, handed out first-free-first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.free_slots: deque[int] = deque(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        """One index, or ``None`` when all are in use."""
        return self.free_slots.popleft() if self.free_slots else None

    def free(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise ValueError(f"index {index} is not a buffer of this pool (size {self.size})")
        self.free_slots.append(index)
