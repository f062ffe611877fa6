"""Wiring of the KV cache from ``ServerArgs`` (:func:`build_kv_cache`), so the executor, the
benches and the tests get the same cache for the same flags. With ``--tp-size N`` every rank builds
its own shard of the KV heads, with the host pool's capacity agreed at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache_prefill.hicache.cache_stats import CacheStats
from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.device_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    device_pool_from_server_args,
)
from hicache_prefill.hicache.tp.agreed import agreed_alloc
from hicache_prefill.hicache.tp.group import SingleRankGroup, TPGroup
from hicache_prefill.hicache.transfer.streams import STREAM_MODES
from hicache_prefill.hicache.tree.hiradix_cache import HiRadixCache
from hicache_prefill.hicache.tree.radix_cache import RadixCache

if TYPE_CHECKING:
    from hicache_prefill.hicache.memory.host_pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost
    from hicache_prefill.hicache.storage.io.controller import HiCacheStorageController
    from hicache_prefill.hicache.transfer.controller import CopyTimer, HiCacheController
    from hicache_prefill.hicache.transfer.streams import Delay, Streams
    from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class KVCache:
    """Everything the prefill side needs from the cache; ``host_pool`` and ``controller`` are
    ``None`` under a device-only ``RadixCache``."""

    device_pool: MHATokenToKVPool | MLATokenToKVPool
    allocator: TokenToKVPoolAllocator
    tree: RadixCache | HiRadixCache
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost | None
    controller: HiCacheController | None
    stats: CacheStats
    group: TPGroup = field(default_factory=SingleRankGroup)
    storage: HiCacheStorageController | None = None

    @property
    def hierarchical(self) -> bool:
        return self.controller is not None

    def check_integrity(self, request_owned: int = 0) -> None:
        """``AssertionError`` on the first break; ``request_owned``: device slots requests hold
        outside the tree right now."""
        self.tree.check_integrity(request_owned=request_owned)
        if self.storage is not None:
            self.storage.check_integrity()

    def alloc_device(self, n: int) -> torch.Tensor | None:
        """``n`` device slots, evicting unlocked tree leaves when short; ``None`` when even
        eviction cannot make room. Every rank evicts the most any rank needs, so all allocate
        or give up together. May block while write_back backs up an evicted leaf."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        g, alloc = self.group, self.allocator
        slots = agreed_alloc(g, alloc, n, pool="device", tag="alloc_device_room")
        if slots is None:
            need = g.agree_max(n - alloc.available_size(), tag="alloc_device_evict")
            self.tree.evict(need)
            slots = agreed_alloc(g, alloc, n, pool="device", tag="alloc_device_room_after_evict")
        return slots

    def close(self) -> None:
        """Stop the storage threads, finish queued copies and stop the CPU stream threads."""
        try:
            if self.storage is not None:
                self.storage.close()
        finally:
            if self.controller is not None:
                self.controller.close()


# Flags that must be equal on every rank (the host pool's capacity is agreed instead).
SAME_ON_EVERY_RANK = (
    "tp_size",
    "page_size",
    "max_total_tokens",
    "enable_hierarchical_cache",
    "hicache_write_policy",
    "hicache_mem_layout",
    "hicache_io_backend",
    "load_back_threshold",
    "hicache_upstream_chunked_insert",
    "use_mla",
    "num_layers",
    "head_num",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "dtype",
    "hicache_storage_backend",
    "hicache_storage_backend_extra_config",
    "hicache_storage_prefetch_policy",
    "hicache_host_memory_mode",
    "served_model_name",
)


def build_kv_cache(
    args: ServerArgs,
    *,
    copy_delay: Delay = 0.0,
    streams: Streams | str | None = None,
    group: TPGroup | None = None,
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost | None = None,
    copy_timer: CopyTimer | None = None,
) -> KVCache:
    """The cache ``args`` describe, allocated up front.

    ``copy_delay`` (tests, CPU only): slept before every copy. ``streams``: a stream factory, or
    a CPU mode of ``make_streams``. ``group``: the cache group (required when ``tp_size`` > 1).
    ``host_pool``: an existing host pool to reuse (one rank; it must match the flags).
    """
    args.check_runtime_supported()
    if isinstance(streams, str) and streams not in STREAM_MODES:
        raise ValueError(f"streams must be one of {STREAM_MODES} or a factory, got {streams!r}")
    tp_size = args.tp_size
    if group is None:
        if tp_size > 1:
            raise ValueError(
                f"group: --tp-size={tp_size} needs the cache group of its ranks "
                "(hicache.tp.group.new_cache_group())"
            )
        group = SingleRankGroup()
    if group.size != tp_size:
        raise ValueError(f"group has {group.size} ranks, --tp-size={tp_size}")
    group.assert_same("server_args", {k: getattr(args, k, None) for k in SAME_ON_EVERY_RANK})
    device = args.resolved_device()
    device_pool = device_pool_from_server_args(args)
    allocator = TokenToKVPoolAllocator(args.max_total_tokens, args.page_size, device)
    stats = CacheStats()
    if not args.enable_hierarchical_cache:
        tree = RadixCache(allocator, args.page_size, device)
        logger.info("KV cache: device only, %d tokens, page %d", allocator.size, args.page_size)
        return KVCache(device_pool, allocator, tree, None, None, stats, group)

    from hicache_prefill.hicache.transfer.controller import HiCacheController

    if host_pool is None:
        host_pool = _agreed_host_pool(args, device_pool, group)
    elif group.size > 1:
        raise ValueError("host_pool: a shared host pool serves one rank (--tp-size 1) only")
    else:
        host_pool.reuse_for(
            device_pool, args.hicache_ratio, args.hicache_size, args.hicache_mem_layout
        )
    controller = HiCacheController(
        allocator,
        device_pool,
        host_pool,
        io_backend=args.hicache_io_backend,
        streams=streams,
        copy_delay=copy_delay,
        stats=stats,
        group=group,
        copy_timer=copy_timer,
    )
    tree = HiRadixCache(
        controller,
        args.page_size,
        write_policy=args.hicache_write_policy,
        load_back_threshold=args.load_back_threshold,
        upstream_chunked_insert=args.hicache_upstream_chunked_insert,
        stats=stats,
    )
    storage = None
    if args.hicache_storage_backend is not None:
        from hicache_prefill.hicache.storage.io.controller import build_storage_controller

        try:
            storage = build_storage_controller(args, tree, host_pool, group)
        except ValueError:
            controller.close()
            host_pool.destroy()
            raise
    logger.info(
        "KV cache%s: device %d + host %d tokens, page %d, %s, %s/%s",
        f" (tp rank {group.rank}/{group.size})" if group.size > 1 else "",
        allocator.size,
        host_pool.size,
        args.page_size,
        args.hicache_write_policy,
        args.hicache_mem_layout,
        args.hicache_io_backend,
    )
    return KVCache(device_pool, allocator, tree, host_pool, controller, stats, group, storage)


def _agreed_host_pool(
    args: ServerArgs, device_pool: MHATokenToKVPool | MLATokenToKVPool, group: TPGroup
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """This rank's host pool, of the smallest capacity any rank asks for. A rank whose pool
    could not be built makes every rank raise ``ValueError``, not wait in a collective."""
    from hicache_prefill.hicache.memory.host_pool import make_host_pool
    from hicache_prefill.hicache.memory.host_ram import host_pool_tokens

    ratio, host_size = args.hicache_ratio, args.hicache_size
    mine = host_pool_tokens(
        device_pool.size, device_pool.get_size_per_token(), args.page_size, ratio, host_size
    )
    size = group.agree_min(mine, tag="host_pool_tokens")
    if size != mine:
        logger.warning(
            "tp rank %d: host pool of %d tokens cut to %d, the smallest of the group's ranks",
            group.rank,
            mine,
            size,
        )
        # The ratio that gives exactly ``size`` tokens (page-aligned), whatever float rounding.
        ratio, host_size = (size + 0.5) / device_pool.size, 0.0
    host_pool, error = None, None
    try:
        host_pool = make_host_pool(device_pool, ratio, host_size, args.hicache_mem_layout)
    except ValueError as exc:
        error = exc
    if not group.agree_all(error is None, tag="host_pool_built"):
        if host_pool is not None:
            host_pool.destroy()
        raise ValueError(
            f"host pool: {error if error is not None else 'another rank could not build its'}"
        ) from error
    if host_pool is None or host_pool.size != size:
        raise RuntimeError(f"host pool of {getattr(host_pool, 'size', None)} tokens, agreed {size}")
    return host_pool
