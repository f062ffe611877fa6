"""A request's device KV through the cache's tree (SGLang ``init_next_round_input``,
``cache_unfinished_req``, ``release_kv_cache``).

Slot ownership of one attempt (half-open token ranges): ``[0, tree_len)`` is the tree's, held by
ONE lock on ``last_node``; ``[tree_len, len(slots))`` is the request's (computed KV not yet
inserted, and the rest of its last page). ``release`` runs only when no send to a live peer
still reads those slots. A host backup issued from an insert for an attempt not finalized is
counted in ``stats.speculative_l2_pages`` (it stays 0).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hicache.memory.allocator import page_ceil
from prefill.executor_stats import ExecutorStats
from prefill.request.speculative_l3_pages import SpeculativeL3Pages
from prefill.request.state import PrefillRequest

if TYPE_CHECKING:
    from hicache.builder import KVCache

logger = logging.getLogger(__name__)


class RequestKV:
    """Admission, allocation, chunk insertion and release of requests' device slots; with an
    L3 tier, ``l3_pages`` tracks the pages pending attempts insert."""

    def __init__(self, cache: KVCache, stats: ExecutorStats) -> None:
        self.cache = cache
        self.tree = cache.tree
        self.cache_stats = cache.stats
        self.stats = stats
        self.allocator = cache.allocator
        self.page_size = cache.allocator.page_size
        self.device = cache.allocator.device
        self.l3_pages: SpeculativeL3Pages | None = None
        if cache.storage is not None:
            self.l3_pages = SpeculativeL3Pages(self.page_size, stats)
            cache.storage.add_write_observer(self.l3_pages.observe)

    def _pages(self, n: int) -> int:
        """``n`` rounded up to whole pages."""
        return page_ceil(n, self.page_size)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` device slots (a multiple of page_size), evicting unlocked tree leaves when
        short; ``None`` when even eviction cannot make room. May block while write_back backs
        up an evicted leaf. Agreed over tensor-parallel ranks (``KVCache.alloc_device``)."""
        return self.cache.alloc_device(n)

    # ------------------------------------------------------------------ admission
    def match_and_lock(self, req: PrefillRequest) -> None:
        """Match the request's prefix (at most ``n - 1`` tokens, so one token is computed),
        start a load-back of a host hit, and lock the deepest device node. Sets ``slots``,
        ``tree_len``, ``computed_len``, ``last_node``, ``cached_device``, ``cached_host``. A request
        whose load back failed in this attempt (``skip_load_back``) recomputes host hits."""
        if req.slots is not None or req.last_node is not None:
            raise RuntimeError(f"{req.rid}: match_and_lock of a request that already holds KV")
        m = self.tree.match_prefix(req.token_ids[: req.num_tokens - 1])
        prefix = m.device_indices
        last = m.last_device_node
        loaded = 0
        if m.host_hit_length > 0 and not req.skip_load_back:
            host_indices, node = self.tree.init_load_back(m.last_host_node, m.host_hit_length)
            if host_indices is not None and host_indices.numel() > 0:
                prefix = torch.cat([prefix, host_indices.to(prefix.device)])
                last = node
                loaded = host_indices.numel()
        self.tree.inc_lock_ref(last)
        req.slots = prefix.to(self.device, torch.int64)
        req.tree_len = req.computed_len = prefix.numel()
        req.last_node = last
        req.cached_device = prefix.numel() - loaded
        req.cached_host = loaded

    def alloc_extend(self, req: PrefillRequest, n: int) -> bool:
        """Make room for ``n`` more tokens after ``computed_len``; ``False`` (nothing changed)
        when the pool is full even after eviction."""
        if req.slots is None:
            raise RuntimeError(f"{req.rid}: alloc_extend of a request without slots")
        need = self._pages(req.computed_len + n) - req.slots.numel()
        if need <= 0:
            return True
        new = self.alloc(need)
        if new is None:
            return False
        req.slots = torch.cat([req.slots, new])
        return True

    # ------------------------------------------------------------------ chunk boundaries
    def cache_unfinished(self, req: PrefillRequest, chunked: bool) -> None:
        """Insert the computed whole pages into the tree and move the request's lock to the new
        deepest node. ``slots[tree_len:present]`` duplicate KV another request inserted and are
        freed; ``slots[present:end]`` become the tree's (no in-flight send reads them: checked).
        """
        if req.slots is None:
            raise RuntimeError(f"{req.rid}: cache_unfinished of a request without slots")
        end = req.computed_len // self.page_size * self.page_size
        if end <= req.tree_len:
            return
        if req.start_send_idx > max(req.tree_len, req.peer.decode_prefix_len):
            raise RuntimeError(f"{req.rid}: a send covers tokens not yet in the tree")
        key = req.token_ids[:end]
        backed_up = self.cache_stats.backed_up_tokens
        present = self.tree.insert(key, req.slots[:end], chunked=chunked)
        issued = self.cache_stats.backed_up_tokens - backed_up
        if issued and req.pending_bootstrap:
            self.stats.speculative_l2_pages += page_ceil(issued, self.page_size) // self.page_size
            logger.error("%s: an insert of a pending attempt backed up %d tokens", req.rid, issued)
        if req.pending_bootstrap and self.l3_pages is not None and present < end:
            self.l3_pages.record(req, key, present, end)
        if present < req.tree_len:  # before the free below: it would free tree-owned slots
            raise RuntimeError(f"{req.rid}: locked prefix {req.tree_len} > present {present}")
        if present > req.tree_len:
            self.allocator.free(req.slots[req.tree_len : present])
        m = self.tree.match_prefix(key)
        if m.device_indices.numel() != end:
            raise RuntimeError(
                f"{req.rid}: inserted {end} tokens, {m.device_indices.numel()} device-resident"
            )
        self.tree.inc_lock_ref(m.last_device_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = m.last_device_node
        req.slots = torch.cat([m.device_indices.to(self.device), req.slots[end:]])
        req.tree_len = end

    # ------------------------------------------------------------------ release
    def release(self, req: PrefillRequest) -> int:
        """Unlock ``last_node`` and free ``slots[tree_len:]``; clears the request's slot state.
        Returns the slots freed. Idempotent."""
        freed = 0
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        if req.slots is not None and req.slots.numel() > req.tree_len:
            owned = req.slots[req.tree_len :]
            self.allocator.free(owned)
            freed = owned.numel()
        req.slots = None
        req.last_node = None
        req.tree_len = 0
        req.computed_len = 0
        return freed
