"""``HiCacheStorage``: the interface every L3 backend implements (SGLang 0.5.23's names and return
conventions, one object per KV page under its page key), and ``HiCacheStorageExtraInfo``.

Runtime failures (a missing or damaged object, a full disk, an unreachable server) are results
(``None``, ``False``, a shorter count), never exceptions; bad arguments raise ``ValueError``.
Calls may come from several threads at once. The v1 calls default to ``get`` / ``set`` over the
registered host pool (the copying path); zero-copy backends override them.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

STORAGE_BATCH_SIZE = 128  # pages per storage IO call (SGLang's constant)


@dataclass
class HiCacheStorageExtraInfo:
    """``prefix_keys``: the page keys before this call's (only with
    ``hicache_storage_pass_prefix_keys``); ``extra_info``: backend-specific fields."""

    prefix_keys: list[str] | None = None
    extra_info: dict | None = None


class HiCacheStorage(ABC):
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
