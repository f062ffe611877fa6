"""The records the storage threads and the scheduler thread hand each other (SGLang 0.5.23's
``StorageOperation``, ``PrefetchOperation``, ``PrefetchAck`` and ``CacheRequestHandle``).

- ``CacheRequestHandle(rid, attempt)``: every prefetch belongs to one attempt of one request. A
  request that yields or aborts moves to a new attempt, so a late ack of attempt ``N`` finds no
  prefetch of attempt ``N + 1`` to complete (SGLang's ``is_current`` check).
- ``StorageOperation``: one backup: host slots (``len(hash_value) * page_size``, CPU int64) and
  the page keys to store them under; ``completed_tokens`` grows batch by batch on the backup
  thread, which stops at the first failed batch.
- ``PrefetchOperation``: one prefetch: the page-aligned tokens after the matched prefix and the
  last key before them; the query thread sets ``local_hit_pages`` (this rank's existence
  answer), the scheduler sets the agreed ``hash_value`` and the ``host_indices`` it allocated
  for the hit only, the IO thread reads pages into them. ``mark_terminate`` (scheduler) asks
  the threads to stop early; they check it between batches.
- ``PrefetchAck``: the IO thread's cumulative progress (``completed_tokens`` on this rank) after
  each batch, or ``completed_req`` once the operation is done. Every rank emits the same number
  of acks per operation (``ceil(pages / 128) + 1``), failures included, so the scheduler can
  agree them position by position.

Fields written by a thread are read by the scheduler only after the queue hand-off that follows
the write (a ``queue.Queue`` put/get orders them).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

_ids = itertools.count()


class CacheRequestHandle(NamedTuple):
    """One attempt of one request (SGLang's ``CacheRequestHandle(rid, attempt_id)``)."""

    rid: str
    attempt: int


class StorageOperation:
    """One backup of host pages to storage (module docstring)."""

    def __init__(
        self,
        host_indices: torch.Tensor,
        hash_value: list[str],
        *,
        prefix_keys: list[str] | None = None,
        node: Any = None,
        staging: bool = False,
    ) -> None:
        self.id = next(_ids)
        self.host_indices = host_indices
        self.hash_value = hash_value
        self.prefix_keys = prefix_keys
        self.node = node  # the tree node whose host copy is protected until the ack (cache mode)
        self.staging = staging  # buffer_only: the host slots are freed at the ack
        self.completed_tokens = 0
        self.failed = False
        self.error: str | None = None


class PrefetchOperation:
    """One prefetch from storage into the host pool (module docstring)."""

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
        self.local_completed_tokens = 0  # this rank's progress (IO thread)
        self.deadline_expired = False
        self.wait_started: float | None = None  # executor clock of the first blocked poll
        self.done = False  # the completion ack was drained
        self._terminated = threading.Event()

    def mark_terminate(self) -> None:
        self._terminated.set()

    def is_terminated(self) -> bool:
        return self._terminated.is_set()

    def __repr__(self) -> str:
        return (
            f"PrefetchOperation({self.handle}, requested={self.requested_tokens}, "
            f"hit={len(self.hash_value)} pages, completed={self.completed_tokens})"
        )


@dataclass
class PrefetchAck:
    """Progress of one prefetch on this rank: ``completed_tokens`` (cumulative, one per batch)
    or ``completed_req`` (the last ack of the operation)."""

    operation: PrefetchOperation
    completed_tokens: int | None = None
    completed_req: bool = False
