"""``build_storage_controller``: the L3 tier of one rank from ``ServerArgs`` (what
``hicache.builder.build_kv_cache`` calls when ``--hicache-storage-backend`` is set).

Steps: the extra config is split into the controller's settings and the backend's
(``settings.split_extra_config``); the backend's ``HiCacheStorageConfig`` comes from the host
pool (``storage_config_for_pool``: MLA or not, layout, the model name tagged with the page
format) and this rank's place in the group; the factory builds the backend (the fault injector
wraps it when its test variables are set); the host pool is registered; the controller starts
its threads and is attached to the tree. A backend that cannot be built on some rank (an
unknown name, bad settings, an unwritable directory) fails every rank with one ``ValueError``
naming the flag or key, before any thread starts.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache.storage.backend_factory import StorageBackendFactory
from hicache.storage.config import storage_config_for_pool
from hicache.storage.io.controller import HiCacheStorageController
from hicache.storage.io.settings import split_extra_config
from hicache.storage.io.workers import uses_zero_copy

logger = logging.getLogger(__name__)


def build_storage_controller(
    args: Any, tree: Any, host_pool: Any, group: Any
) -> HiCacheStorageController:
    """This rank's storage tier, attached to ``tree`` (module docstring)."""
    name = args.hicache_storage_backend
    backend, error = None, None
    try:
        settings, backend_extra = split_extra_config(
            args.storage_extra_config(),
            page_size=args.page_size,
            prefetch_policy=args.hicache_storage_prefetch_policy,
            host_memory_mode=args.hicache_host_memory_mode,
        )
        config = storage_config_for_pool(
            host_pool, args.storage_model_name(), tp_rank=group.rank, tp_size=group.size,
            extra_config=backend_extra,
        )  # fmt: skip
        backend = StorageBackendFactory.create_backend(name, config, host_pool)
        backend.register_mem_pool_host(host_pool)
    except ValueError as e:
        error = e
    if not group.agree_all(error is None, tag="storage_backend_built"):
        if backend is not None:
            backend.close()
        raise ValueError(
            f"--hicache-storage-backend={name}: "
            f"{error if error is not None else 'another rank could not build its backend'}"
        ) from error
    assert backend is not None
    controller = HiCacheStorageController(
        tree, backend, settings, zero_copy=uses_zero_copy(name, backend_extra),
        is_storage_writer=config.is_storage_writer, backend_name=name,
    )  # fmt: skip
    try:
        tree.attach_storage(controller)
    except ValueError:
        controller.close()
        raise
    logger.info(
        "L3 storage %s (%s, prefetch %s, threshold %d tokens) for model %s",
        name, settings.host_memory_mode, settings.prefetch_policy,
        settings.prefetch_threshold, config.model_name,
    )  # fmt: skip
    return controller
