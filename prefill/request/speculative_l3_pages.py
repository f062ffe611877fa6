"""Pages that reached L3 storage from KV of an attempt never finalized
(``ExecutorStats.speculative_l3_pages``, asserted 0): a pending attempt's insert records its
page keys, finalize clears them, a stored backup reports its keys (``observe``). At most
``capacity`` keys are remembered.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.prefill.executor_stats import ExecutorStats
from hicache_prefill.prefill.request.state import PrefillRequest

logger = logging.getLogger(__name__)


class SpeculativeL3Pages:
    def __init__(self, page_size: int, stats: ExecutorStats, capacity: int = 1 << 20) -> None:
        self.page_size = page_size
        self.stats = stats
        self.capacity = capacity
        self._owner: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._by_attempt: dict[tuple[str, int], list[str]] = {}

    def record(self, req: PrefillRequest, key: list[int], start: int, end: int) -> None:
        """A pending attempt gave the tree the pages ``key[start:end]`` (page-aligned)."""
        ps = self.page_size
        keys = page_hashes(key[:end], ps)[start // ps :]
        owner = req.key
        self._by_attempt.setdefault(owner, []).extend(keys)
        for k in keys:
            self._owner[k] = owner
            self._owner.move_to_end(k)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def finalized(self, req: PrefillRequest) -> None:
        for k in self._by_attempt.pop(req.key, []):
            if self._owner.get(k) == req.key:
                del self._owner[k]

    def forget(self, req: PrefillRequest) -> None:
        """The request has its outcome: its attempt lists go, recorded keys stay."""
        for owner in [o for o in self._by_attempt if o[0] == req.rid]:
            del self._by_attempt[owner]

    def observe(self, keys: list[str]) -> None:
        for k in keys:
            owner = self._owner.pop(k, None)
            if owner is not None:
                self.stats.speculative_l3_pages += 1
                logger.error(
                    "page %s of %s attempt %d (not finalized) reached L3 storage",
                    k[:12],
                    owner[0],
                    owner[1],
                )
