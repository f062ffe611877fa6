"""``StorageBackendFactory``: a backend by name (``--hicache-storage-backend``), SGLang 0.5.23's
registry and ``dynamic`` loading: built in ``file`` (``cls(storage_config)``) and ``mooncake``
(``cls(storage_config, mem_pool_host)``); registered names and ``dynamic`` (the extra config's
``module_path`` / ``class_name``) are built as ``cls(storage_config, kwargs)``.

Invariants: every class is a ``HiCacheStorage`` subclass; every backend built passes through the
fault injector's check; every error is a ``ValueError`` naming what is wrong (SGLang raises
``ImportError`` / ``AttributeError`` / ``TypeError`` for some). The caller registers the host pool.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from hicache.storage.base import HiCacheStorage
from hicache.storage.config import HiCacheStorageConfig
from hicache.storage.fault_injector import maybe_wrap_hicache_storage_failure_injector

logger = logging.getLogger(__name__)

DYNAMIC = "dynamic"
DYNAMIC_KEYS = ("backend_name", "module_path", "class_name")
BUILT_WITH_CONFIG = frozenset({"file"})
BUILT_WITH_HOST_POOL = frozenset({"mooncake"})


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: a class, or where to import it from."""

    name: str
    module_path: str | None
    class_name: str | None
    cls: type[HiCacheStorage] | None = None

    def load(self) -> type[HiCacheStorage]:
        if self.cls is not None:
            return self.cls
        assert self.module_path is not None and self.class_name is not None
        return load_backend_class(self.module_path, self.class_name, self.name)


def load_backend_class(module_path: str, class_name: str, backend_name: str) -> type:
    """Import ``module_path`` and return its ``HiCacheStorage`` subclass ``class_name``."""
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
    """Builds storage backends by name (module docstring)."""

    _registry: ClassVar[dict[str, BackendEntry]] = {}

    @classmethod
    def register_backend(
        cls, name: str, module_path_or_class: str | type, class_name: str | None = None
    ) -> None:
        """Register ``name``: a module path with ``class_name`` (loaded when first built), or a
        ``HiCacheStorage`` subclass. ``ValueError`` for ``dynamic`` or malformed arguments."""
        if not isinstance(name, str) or not name or name == DYNAMIC:
            raise ValueError(f"cannot register a storage backend named {name!r}")
        if isinstance(module_path_or_class, str):
            if not isinstance(class_name, str) or not class_name:
                raise ValueError(f"register_backend({name!r}, module path) needs a class_name")
            entry = BackendEntry(name, module_path_or_class, class_name)
        else:
            _check_class(module_path_or_class, name)
            entry = BackendEntry(name, None, class_name, module_path_or_class)
        if name in cls._registry:
            logger.warning("storage backend %r is already registered; replacing it", name)
        cls._registry[name] = entry

    @classmethod
    def unregister_backend(cls, name: str) -> None:
        cls._registry.pop(name, None)

    @classmethod
    def backend_names(cls) -> list[str]:
        """Every name ``create_backend`` accepts."""
        return sorted(cls._registry) + [DYNAMIC]

    @classmethod
    def create_backend(
        cls,
        backend_name: str,
        storage_config: HiCacheStorageConfig,
        mem_pool_host: Any = None,
        **kwargs: Any,
    ) -> HiCacheStorage:
        """The backend ``backend_name``, wrapped by the fault injector when its variables are
        set. Constructing it may block (a file backend probes its directory)."""
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
        backend_cls = entry.load()
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


StorageBackendFactory.register_backend("file", "hicache.storage.file_backend", "HiCacheFile")
StorageBackendFactory.register_backend(
    "mooncake", "hicache.storage.mooncake.store", "MooncakeStore"
)
