"""Host KV pools (SGLang ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``): the entry point.

Owns ``make_host_pool`` (the host pool class matching a device pool) and re-exports the host pool
names from the files that hold them, so callers import from here as in SGLang:

- ``host_memory``: RAM available and reserved, host pool sizing, the (pinned) allocation.
- ``memory_pool_host_base``: layouts and ``SUPPORTED_LAYOUT_IO``, construction shared by MHA and
  MLA, the host allocator, slot addressing, the ``direct`` copies.
- ``memory_pool_host_mha`` / ``memory_pool_host_mla``: each pool's buffers and ``kernel`` copies.

The sizing and RAM helpers re-exported here are the same functions, but the pools look them up
in ``host_memory``: a test that replaces one patches it there.
"""

from __future__ import annotations

import logging

from hicache.host_memory import (
    HOST_MEMORY_RESERVE_BYTES,
    host_memory_available_bytes,
    host_memory_reserve_bytes,
    host_pool_tokens,
)
from hicache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache.memory_pool_host_base import IO_BACKENDS, LAYOUTS, SUPPORTED_LAYOUT_IO
from hicache.memory_pool_host_mha import MHATokenToKVPoolHost
from hicache.memory_pool_host_mla import MLATokenToKVPoolHost

__all__ = [
    "HOST_MEMORY_RESERVE_BYTES",
    "IO_BACKENDS",
    "LAYOUTS",
    "SUPPORTED_LAYOUT_IO",
    "HostKVPool",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "host_memory_available_bytes",
    "host_memory_reserve_bytes",
    "host_pool_tokens",
    "make_host_pool",
]

logger = logging.getLogger(__name__)

HostKVPool = MHATokenToKVPoolHost | MLATokenToKVPoolHost


def make_host_pool(
    device_pool: MHATokenToKVPool | MLATokenToKVPool,
    host_to_device_ratio: float,
    host_size: float,
    layout: str,
    pin_memory: bool = True,
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """The host pool class matching ``device_pool`` (MHA or MLA)."""
    cls = (
        MLATokenToKVPoolHost
        if isinstance(device_pool, MLATokenToKVPool)
        else (MHATokenToKVPoolHost)
    )
    return cls(
        device_pool, host_to_device_ratio, host_size, device_pool.page_size, layout, pin_memory
    )
