"""``make_host_pool``: the host pool class matching a device pool (SGLang builds its host pool
the same way, by the device pool's kind).

The host pools themselves live in ``host_pool_mha`` / ``host_pool_mla``; what they
share (layouts, ``SUPPORTED_LAYOUT_IO``, construction, the allocator, the ``direct`` copies) in
``host_pool_base``; host RAM sizing and pinned allocation in ``host_ram``. Import each
name from its home module.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache.memory.host_pool_mha import MHATokenToKVPoolHost
from hicache.memory.host_pool_mla import MLATokenToKVPoolHost

logger = logging.getLogger(__name__)

HostKVPool = MHATokenToKVPoolHost | MLATokenToKVPoolHost


def make_host_pool(
    device_pool: Any,
    host_to_device_ratio: float,
    host_size: float,
    layout: str,
    pin_memory: bool = True,
) -> HostKVPool:
    """The host pool for ``device_pool``: MLA when it has a latent (``kv_lora_rank``), else MHA.

    ``device_pool``: this project's ``MHATokenToKVPool`` / ``MLATokenToKVPool`` or any device pool
    with SGLang's attributes (see ``MHA_FIELDS`` / ``MLA_FIELDS``).
    """
    cls = MLATokenToKVPoolHost if hasattr(device_pool, "kv_lora_rank") else MHATokenToKVPoolHost
    page_size = getattr(device_pool, "page_size", None)  # the pool refuses a pool without one
    return cls(device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory)
