"""A request's device KV through the cache's tree (SGLang ``init_next_round_input``,
``cache_unfinished_req``, ``release_kv_cache``). ``slots[:tree_len]`` are the tree's, held by
one lock on ``last_node``; ``slots[tree_len:]`` are the request's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hicache_prefill.hicache.memory.allocator import page_ceil
from hicache_prefill.prefill.executor_stats import ExecutorStats
from hicache_prefill.prefill.request.speculative_l3_pages import SpeculativeL3Pages
from hicache_prefill.prefill.request.state import PrefillRequest

if TYPE_CHECKING:
    from hicache_prefill.hicache.builder import KVCache

logger = logging.getLogger(__name__)


class RequestKV:
    """With an L3 tier, ``l3_pages`` tracks the pages pending attempts insert."""

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

    def match_and_lock(self, req: PrefillRequest) -> None:
        """Match at most ``n - 1`` prompt tokens (one is computed), start a load back of a host
        hit (unless ``skip_load_back``) and lock the deepest device node."""
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
        """Room for ``n`` more tokens; ``False`` (nothing changed) when the pool is full."""
        if req.slots is None:
            raise RuntimeError(f"{req.rid}: alloc_extend of a request without slots")
        need = page_ceil(req.computed_len + n, self.page_size) - req.slots.numel()
        if need <= 0:
            return True
        new = self.cache.alloc_device(need)  # agreed over TP ranks
        if new is None:
            return False
        req.slots = torch.cat([req.slots, new])
        return True

    def cache_unfinished(self, req: PrefillRequest, chunked: bool) -> None:
        """Insert the computed whole pages and move the lock to the new deepest node; slots
        duplicating KV another request inserted are freed."""
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

    def release(self, req: PrefillRequest) -> int:
        """Unlock and free ``slots[tree_len:]``; returns the slots freed. Idempotent."""
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
