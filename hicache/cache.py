"""Wiring of the KV cache from ``ServerArgs``: pools, allocators, controller, tree, stats.

``build_kv_cache(args)`` is the one place that turns flags into objects, so the executor, the
benches and the tests all get the same cache for the same flags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.allocator import TokenToKVPoolAllocator
from hicache.hiradix_cache import HiRadixCache
from hicache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache.radix_cache import RadixCache
from hicache.stats import CacheStats

if TYPE_CHECKING:
    from hicache.controller import HiCacheController
    from hicache.memory_pool_host_mha import MHATokenToKVPoolHost
    from hicache.memory_pool_host_mla import MLATokenToKVPoolHost
    from hicache.streams import CpuStreams, CudaStreams, Delay
    from server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class KVCache:
    """Everything the prefill side needs from the cache.

    ``tree`` is a ``RadixCache`` when the hierarchical cache is off (``host_pool`` and
    ``controller`` are then ``None``) and a ``HiRadixCache`` when it is on; both take the same
    calls. ``stats`` exists in both modes: the executor records prefix hits into it at admission;
    when on, the tree adds backups, loads and evictions and the controller bytes and copy time.
    """

    device_pool: MHATokenToKVPool | MLATokenToKVPool
    allocator: TokenToKVPoolAllocator
    tree: RadixCache | HiRadixCache
    host_pool: MHATokenToKVPoolHost | MLATokenToKVPoolHost | None
    controller: HiCacheController | None
    stats: CacheStats

    @property
    def hierarchical(self) -> bool:
        return self.controller is not None

    def check_integrity(self, request_owned: int = 0) -> None:
        """Tree, allocators and controller together (``AssertionError`` on the first break);
        the same check as ``tree.check_integrity``.

        ``request_owned``: device slots that requests hold outside the tree right now.
        """
        self.tree.check_integrity(request_owned=request_owned)

    def close(self) -> None:
        """Finish queued copies and stop the CPU stream threads (no-op when off or on CUDA)."""
        if self.controller is not None:
            self.controller.close()


def build_kv_cache(
    args: ServerArgs,
    *,
    copy_delay: Delay = 0.0,
    streams: CudaStreams | CpuStreams | None = None,
) -> KVCache:
    """Build the device pool and allocator (``max_total_tokens`` slots of ``page_size``), and
    with ``enable_hierarchical_cache`` the host pool (``hicache_ratio`` / ``hicache_size``,
    ``hicache_mem_layout``), the controller (``hicache_io_backend``) and a ``HiRadixCache``
    (``hicache_write_policy``, ``load_back_threshold``, ``hicache_upstream_chunked_insert``).

    ``copy_delay`` (tests, CPU only): seconds, or a callable, slept before every copy.
    ``streams``: stream factory to use instead of the default for the device.

    Raises ``ValueError`` for configurations the runtime cannot run (an L3 storage backend,
    ``pp_size > 1``, mamba models, ``disable_radix_cache``) and for a host pool larger than
    the RAM that may be used. Allocates everything up front; nothing blocks afterwards.
    """
    args.check_runtime_supported()
    device = args.resolved_device()
    pool_cls = MLATokenToKVPool if args.use_mla else MHATokenToKVPool
    device_pool = pool_cls.from_server_args(args)
    allocator = TokenToKVPoolAllocator(args.max_total_tokens, args.page_size, device)
    stats = CacheStats()
    if not args.enable_hierarchical_cache:
        tree = RadixCache(allocator, args.page_size, device)
        logger.info("KV cache: device only, %d tokens, page %d", allocator.size, args.page_size)
        return KVCache(device_pool, allocator, tree, None, None, stats)

    from hicache.controller import HiCacheController
    from hicache.memory_pool_host import make_host_pool

    host_pool = make_host_pool(
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
    )
    tree = HiRadixCache(
        controller,
        args.page_size,
        write_policy=args.hicache_write_policy,
        load_back_threshold=args.load_back_threshold,
        upstream_chunked_insert=args.hicache_upstream_chunked_insert,
        stats=stats,
    )
    logger.info(
        "KV cache: device %d + host %d tokens, page %d, %s, %s/%s",
        allocator.size,
        host_pool.size,
        args.page_size,
        args.hicache_write_policy,
        args.hicache_mem_layout,
        args.hicache_io_backend,
    )
    return KVCache(device_pool, allocator, tree, host_pool, controller, stats)
