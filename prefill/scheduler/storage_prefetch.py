"""The executor's side of L3 prefetch (SGLang's ``_prefetch_kvcache``,
``check_prefetch_progress``, ``_prefetch_after_device_hit_loss``); no-ops without a storage
tier. Issued at arrival per attempt (``storage_epoch``), checked at admission (re-issued when
the matched prefix shrank), released at a yield and at the outcome.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle
from hicache_prefill.prefill.clock import Clock
from hicache_prefill.prefill.request.state import PrefillRequest

if TYPE_CHECKING:
    from hicache_prefill.hicache.builder import KVCache

logger = logging.getLogger(__name__)

MAX_STORAGE_RETRIES = 8  # SGLang's --hicache-storage-prefetch-retry-max-attempts default


class StoragePrefetch:
    def __init__(self, cache: KVCache, clock: Clock) -> None:
        self.storage = cache.storage
        self.tree = cache.tree
        self.clock = clock
        self.page_size = cache.allocator.page_size

    @staticmethod
    def handle(req: PrefillRequest) -> CacheRequestHandle:
        return CacheRequestHandle(req.rid, req.storage_epoch)

    def _match_len(self, req: PrefillRequest) -> tuple[int, Any]:
        m = self.tree.match_prefix(req.token_ids[: req.num_tokens - 1])
        return m.device_indices.numel() + m.host_hit_length, m.last_host_node

    def on_arrival(self, req: PrefillRequest) -> bool:
        if self.storage is None:
            return False
        matched, anchor = self._match_len(req)
        req.storage_prefetch_last_match_len = matched
        end = (req.num_tokens - 1) // self.page_size * self.page_size
        if end <= matched:
            return False
        return self.storage.prefetch(self.handle(req), anchor, req.token_ids[matched:end], matched)

    def ready(self, req: PrefillRequest) -> bool:
        """Whether ``req`` may be admitted now. Collective under tensor parallelism."""
        if self.storage is None:
            return True
        handle = self.handle(req)
        if not self.storage.check_prefetch_progress(handle, self.clock.now()):
            return False
        if self._device_hit_loss(req, handle):
            return False
        if self.storage.buffer_only:
            req.cached_storage = self.storage.attach_staged(handle, req.token_ids)
        return True

    def _device_hit_loss(self, req: PrefillRequest, handle: CacheRequestHandle) -> bool:
        previous = req.storage_prefetch_last_match_len
        if not previous or self.storage.has_prefetch(handle):
            return False
        current, _ = self._match_len(req)
        if current >= previous:
            return False
        if req.storage_prefetch_retries >= MAX_STORAGE_RETRIES:
            req.storage_prefetch_last_match_len = current
            return False
        req.storage_prefetch_retries += 1
        logger.info(
            "%s: matched prefix shrank from %d to %d tokens; new storage lookup",
            req.rid,
            previous,
            current,
        )
        return self.on_arrival(req)

    def admitted(self, req: PrefillRequest) -> None:
        """After match and lock: host-hit tokens that came from storage; the rest of what the
        prefetch inserted counts as ``prefetch_unused_tokens``."""
        if self.storage is None:
            return
        inserted = 0
        if not self.storage.buffer_only:
            inserted = req.cached_storage = self.storage.take_loaded(self.handle(req))
        req.cached_storage = min(req.cached_storage, req.cached_host)
        self.storage.stats.prefetch_unused_tokens += inserted - req.cached_storage

    def on_yield(self, req: PrefillRequest, matched_len: int) -> None:
        if self.storage is None:
            return
        self.storage.release(self.handle(req))
        req.storage_epoch += 1
        req.storage_prefetch_retries = 0
        req.storage_prefetch_last_match_len = matched_len or None

    def on_outcome(self, req: PrefillRequest) -> None:
        if self.storage is not None:
            self.storage.release(self.handle(req))
