"""``StorageBackendFactory``: a backend by name (``--hicache-storage-backend``), SGLang 0.5.23's
registry and ``dynamic`` loading: ``file`` is built as ``cls(storage_config)``, ``mooncake`` as
``cls(storage_config, mem_pool_host)``, the others and ``dynamic`` (the extra config's
``module_path`` / ``class_name``) as ``cls(storage_config, kwargs)``. Every backend passes the
fault injector's check; every error is a ``ValueError`` (SGLang raises other types for some).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, ClassVar

from hicache_prefill.hicache.storage.base import HiCacheStorage
from hicache_prefill.hicache.storage.config import HiCacheStorageConfig
from hicache_prefill.hicache.storage.fault_injector import (
    maybe_wrap_hicache_storage_failure_injector,
)

logger = logging.getLogger(__name__)

DYNAMIC = "dynamic"
DYNAMIC_KEYS = ("backend_name", "module_path", "class_name")
BUILT_WITH_CONFIG = frozenset({"file"})
BUILT_WITH_HOST_POOL = frozenset({"mooncake"})


def load_backend_class(module_path: str, class_name: str, backend_name: str) -> type:
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(
            f"storage backend {backend_name!r}: module_path={module_path!r} does not import: {e}"
        ) from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(
            f"storage backend {backend_name!r}: class_name={class_name!r} is not in {module_path}"
        )
    _check_class(cls, backend_name)
    return cls


def _check_class(cls: Any, backend_name: str) -> None:
    if not isinstance(cls, type) or not issubclass(cls, HiCacheStorage):
        raise ValueError(
            f"storage backend {backend_name!r}: class_name={getattr(cls, '__name__', cls)!r} "
            "is not a HiCacheStorage subclass"
        )


class StorageBackendFactory:
    _registry: ClassVar[dict[str, type[HiCacheStorage] | tuple[str, str]]] = {}

    @classmethod
    def register_backend(
        cls, name: str, module_path_or_class: str | type, class_name: str | None = None
    ) -> None:
        """A module path with ``class_name`` (imported when first built), or a class."""
        if not isinstance(name, str) or not name or name == DYNAMIC:
            raise ValueError(f"cannot register a storage backend named {name!r}")
        if isinstance(module_path_or_class, str):
            if not isinstance(class_name, str) or not class_name:
                raise ValueError(f"register_backend({name!r}, module path) needs a class_name")
            entry: type[HiCacheStorage] | tuple[str, str] = (module_path_or_class, class_name)
        else:
            _check_class(module_path_or_class, name)
            entry = module_path_or_class
        if name in cls._registry:
            logger.warning("storage backend %r is already registered; replacing it", name)
        cls._registry[name] = entry

    @classmethod
    def backend_names(cls) -> list[str]:
        return sorted(cls._registry) + [DYNAMIC]

    @classmethod
    def create_backend(
        cls,
        backend_name: str,
        storage_config: HiCacheStorageConfig,
        mem_pool_host: Any = None,
        **kwargs: Any,
    ) -> HiCacheStorage:
        """Wrapped by the fault injector when its variables are set; the caller registers the
        host pool."""
        backend = cls._build(backend_name, storage_config, mem_pool_host, kwargs)
        return maybe_wrap_hicache_storage_failure_injector(backend)

    @classmethod
    def _build(
        cls,
        backend_name: str,
        storage_config: HiCacheStorageConfig,
        mem_pool_host: Any,
        kwargs: dict[str, Any],
    ) -> HiCacheStorage:
        if backend_name == DYNAMIC:
            return cls._build_dynamic(storage_config, kwargs)
        entry = cls._registry.get(backend_name)
        if entry is None:
            raise ValueError(
                f"unknown storage backend {backend_name!r} (--hicache-storage-backend); valid: "
                f"{cls.backend_names()}"
            )
        backend_cls = entry if isinstance(entry, type) else load_backend_class(*entry, backend_name)
        logger.info("creating storage backend %r (%s)", backend_name, backend_cls.__name__)
        if backend_name in BUILT_WITH_CONFIG:
            return backend_cls(storage_config)
        if backend_name in BUILT_WITH_HOST_POOL:
            return backend_cls(storage_config, mem_pool_host)
        return backend_cls(storage_config, kwargs)

    @classmethod
    def _build_dynamic(
        cls, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any]
    ) -> HiCacheStorage:
        extra = storage_config.extra_config or {}
        missing = [k for k in DYNAMIC_KEYS if k not in extra]
        if missing:
            raise ValueError(
                f"storage backend 'dynamic' needs extra config keys {list(DYNAMIC_KEYS)}; "
                f"missing: {missing} (--hicache-storage-backend-extra-config)"
            )
        for key in DYNAMIC_KEYS:
            if not isinstance(extra[key], str) or not extra[key]:
                raise ValueError(
                    f"extra config key {key!r} of the 'dynamic' backend must be a non-empty "
                    f"string, got {extra[key]!r}"
                )
        name = extra["backend_name"]
        backend_cls = load_backend_class(extra["module_path"], extra["class_name"], name)
        logger.info(
            "creating dynamic storage backend %r (%s.%s)",
            name,
            extra["module_path"],
            extra["class_name"],
        )
        return backend_cls(storage_config, kwargs)


StorageBackendFactory.register_backend(
    "file", "hicache_prefill.hicache.storage.file_backend", "HiCacheFile"
)
StorageBackendFactory.register_backend(
    "mooncake", "hicache_prefill.hicache.storage.mooncake.store", "MooncakeStore"
)
