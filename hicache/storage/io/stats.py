"""``StorageStats``: what the storage tier did, counted on the scheduler thread when it applies the
agreed results (tokens unless named ``pages`` or ``ops``)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class StorageStats:
    """Counters since the controller was built.

    Prefetch: ``prefetch_issued`` operations; declined before a query ``prefetch_too_short``
    (below ``prefetch_threshold``) and ``prefetch_rate_limited`` (capacity); after the query
    ``prefetch_revoked`` (below the threshold, no host room, terminated or released before its
    hit was allocated); ``prefetch_hit_tokens`` agreed hits, ``prefetch_fetched_tokens`` tokens
    read into the host pool (agreed), ``prefetch_inserted_tokens`` of those new to the tree,
    ``prefetch_terminated`` operations stopped early by a policy, ``prefetch_released`` by a
    yield or abort of their attempt, ``prefetch_dropped_tokens`` fetched but freed (a released
    attempt, a staging that could not attach); ``prefetch_unused_tokens`` of the inserted
    tokens (cache mode) that their attempt's admission did not load from the host: the
    host-only node was evicted while the request waited (host LRU pressure from other
    prefetches and write-through backups), its load back found no device room, or the device
    held those tokens by then.

    Backup: ``backup_ops``; ``backup_tokens`` stored; ``backup_failed_ops`` (a batch refused or
    an error: the rest of that backup was not tried); ``backup_skipped_ops`` (non-writer ranks).
    """

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
