"""``HiCacheStorage``: the interface every L3 backend implements (SGLang 0.5.23's names and return
conventions, one object per KV page under its page key), and ``HiCacheStorageExtraInfo``.

Runtime failures (a missing or damaged object, a full disk, an unreachable server) are results
(``None``, ``False``, a shorter count), never exceptions; bad arguments raise ``ValueError``.
Calls may come from several threads. The v1 calls default to ``get`` / ``set`` over the
registered host pool; zero-copy backends override them. The v2 calls move the KV pool through v1;
sidecar pools (Mamba, SWA, indexer) are not stored (misses).

When SGLang is installed, ``HiCacheStorage`` derives from SGLang's own class (so SGLang's
``StorageBackendFactory`` accepts the backends) and the extra-info, result and pool-name types are
SGLang's; decided once at import (``find_spec``: nothing is imported without SGLang);
``HICACHE_PREFILL_SGLANG_BASE=0`` keeps this module's own classes.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

STORAGE_BATCH_SIZE = 128  # pages per storage IO call (SGLang's constant)
SGLANG_STORAGE_MODULE = "sglang.srt.mem_cache.hicache_storage"
SGLANG_BASE_ENV = "HICACHE_PREFILL_SGLANG_BASE"


def _sglang_storage() -> Any:
    """SGLang's ``hicache_storage`` module, or ``None`` (module docstring)."""
    if os.environ.get(SGLANG_BASE_ENV, "auto").strip().lower() in ("0", "false", "no", "off"):
        return None
    module = sys.modules.get(SGLANG_STORAGE_MODULE)
    if module is not None:
        return module
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.import_module(SGLANG_STORAGE_MODULE)
    except Exception as e:  # noqa: BLE001 - an unusable SGLang leaves the project's own base
        logger.warning(
            "SGLang is installed but %s does not import (%s: %s): the storage backends derive "
            "from this project's own HiCacheStorage, which SGLang's factory refuses",
            SGLANG_STORAGE_MODULE,
            type(e).__name__,
            e,
        )
        return None


SGLANG = _sglang_storage()
"""SGLang's ``hicache_storage`` module when the backends derive from its class, else ``None``."""

ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"

if SGLANG is not None:
    _Base: type = SGLANG.HiCacheStorage
    HiCacheStorageExtraInfo = SGLANG.HiCacheStorageExtraInfo
    PoolTransferResult = SGLANG.PoolTransferResult
    KV_POOL: Any = SGLANG.PoolName.KV
else:
    _Base = ABC
    KV_POOL = "kv"

    @dataclass
    class HiCacheStorageExtraInfo:  # type: ignore[no-redef]
        """``prefix_keys``: the page keys before this call's (only with
        ``hicache_storage_pass_prefix_keys``); ``extra_info``: backend-specific fields."""

        prefix_keys: list[str] | None = None
        extra_info: dict | None = None

    @dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        """SGLang's ``batch_exists_v2`` answer: the usable KV prefix, pages found per pool, and
        the restorable prefix lengths."""

        kv_hit_pages: int
        extra_pool_hit_pages: dict[str, int] = field(default_factory=dict)
        restorable_prefix_pages: list[int] | None = None

        @classmethod
        def empty(cls) -> PoolTransferResult:
            return cls(0, {})

        def update_kv_hit_pages(self, kv_hit_pages: int) -> None:
            self.kv_hit_pages = max(self.kv_hit_pages, kv_hit_pages)

        def update_extra_pool_hit_pages(self, results: dict[str, int]) -> None:
            self.extra_pool_hit_pages.update(results)


def pool_key(name: Any) -> str:
    """A pool name (SGLang's ``PoolName`` or a string) as its string value."""
    return str(getattr(name, "value", name))


class HiCacheStorage(_Base):  # type: ignore[valid-type,misc]
    mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called once, after construction, before any v1 call."""
        self.mem_pool_host = mem_pool_host

    @abstractmethod
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """Read ``key`` into ``target_location``; that tensor, or ``None`` on a miss."""

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError(f"{type(self).__name__}.batch_get needs one target location per key")
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    @abstractmethod
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store ``value`` under ``key``; ``True`` when stored or already present."""

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Stops at the first failure (SGLang's backends); ``True`` only if all succeeded."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"{type(self).__name__}.batch_set needs one value per key")
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (and, where the backend can tell, readable)."""

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys`` exist consecutively from the first."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """A page is written into the pool only after it was read whole."""
        pool = self._v1_pool()
        if not host_indices_fit(keys, host_indices, pool.page_size, "batch_get_v1"):
            return [False] * len(keys)
        results = []
        for key, start in zip(
            keys, host_indices.reshape(-1)[:: pool.page_size].tolist(), strict=True
        ):
            page = self.get(key, pool.get_dummy_flat_data_page())
            if page is not None:
                pool.set_from_flat_data_page(start, page)
            results.append(page is not None)
        return results

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self._v1_pool()
        if not host_indices_fit(keys, host_indices, pool.page_size, "batch_set_v1"):
            return [False] * len(keys)
        return [
            self.set(key, pool.get_data_page(start, flat=True))
            for key, start in zip(
                keys, host_indices.reshape(-1)[:: pool.page_size].tolist(), strict=True
            )
        ]

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool of SGLang's pool group by name. The KV pool is the anchor registered by
        ``register_mem_pool_host``; other (sidecar) pools are recorded, their pages are misses."""
        pools = self.__dict__.setdefault("registered_pools", {})
        pools[pool_key(host_pool_name)] = host_pool
        if pool_key(host_pool_name) != pool_key(KV_POOL):
            logger.warning(
                "%s: host pool %r is not stored (only the KV pool is); its pages are misses",
                type(self).__name__,
                pool_key(host_pool_name),
            )

    def on_host_pools_registered(self) -> None:  # noqa: B027 - optional hook
        """SGLang's controller: the first round of registrations is over."""

    def _kv_transfer(self, transfer: Any) -> bool:
        """Whether ``transfer`` is the KV pool's, over the anchor pool."""
        if pool_key(transfer.name) != pool_key(KV_POOL):
            return False
        pool = self.__dict__.get("registered_pools", {}).get(pool_key(KV_POOL))
        return pool is None or pool is self.mem_pool_host

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[Any] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """SGLang's semantics: the KV prefix, cut by each extra pool's hit policy (a sidecar
        pool, never stored here, cuts it to 0)."""
        kv_pages = self.batch_exists(keys, extra_info) if keys else 0
        hits: dict[Any, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            policy = pool_key(transfer.hit_policy)
            if policy not in (ALL_PAGES, TRAILING_PAGES):
                raise ValueError(f"Unsupported pool hit policy: {transfer.hit_policy}")
            if not self._kv_transfer(transfer):
                restorable = []
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _v2(self, transfers: list[Any], extra_info: Any, v1: Any) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if not keys or not self._kv_transfer(transfer) or transfer.host_indices is None:
                results[transfer.name] = [False] * len(keys)
                continue
            results[transfer.name] = v1(keys, transfer.host_indices, extra_info)
        return results

    def batch_get_v2(
        self, transfers: list[Any], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        """``{pool name: [bool per key]}``; the KV pool's through ``batch_get_v1``."""
        return self._v2(transfers, extra_info, self.batch_get_v1)

    def batch_set_v2(
        self, transfers: list[Any], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        """``{pool name: [bool per key]}``; the KV pool's through ``batch_set_v1``."""
        return self._v2(transfers, extra_info, self.batch_set_v1)

    def clear(self) -> bool | None:
        return None

    def get_stats(self) -> Any | None:
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Release what the backend holds (files, connections); idempotent."""

    def _v1_pool(self) -> Any:
        if self.mem_pool_host is None:
            raise ValueError(
                f"{type(self).__name__}: register_mem_pool_host before calling the v1 interface"
            )
        return self.mem_pool_host


def host_indices_fit(keys: list[str], host_indices: Any, page_size: int, call: str) -> bool:
    """Whether ``host_indices`` is a tensor of ``page_size`` slots per key; logged if not (SGLang's
    backends then answer all ``False``)."""
    n = int(host_indices.numel()) if isinstance(host_indices, torch.Tensor) else -1
    if n != len(keys) * page_size:
        logger.error(
            "%s: %d keys need %d host indices, got %d", call, len(keys), len(keys) * page_size, n
        )
        return False
    return True
