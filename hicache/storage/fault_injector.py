"""``HiCacheStorageFailureInjector``: random delays and failures in front of any backend (SGLang
0.5.23's test injector), for tests and soak runs.

Before each data call it sleeps ``uniform(0, random_delay_limit)`` seconds, then with probability
``failure_prob`` answers SGLang's failure value without calling the backend:

| call | failure value |
|---|---|
| ``exists`` | ``False`` |
| ``batch_exists`` | ``0`` |
| ``get`` | ``None`` |
| ``batch_get`` | ``[None] * len(keys)`` |
| ``set``, ``batch_set`` | ``False`` |
| ``batch_get_v1``, ``batch_set_v1`` | ``[False] * len(keys)`` |

``register_mem_pool_host``, ``clear``, ``get_stats`` and ``close`` pass straight through.

Randomness. Without a seed each thread draws from its own unseeded ``random.Random`` (SGLang: TP
ranks start with one global seed, and their injected faults must differ). With ``seed`` one
``random.Random(seed)`` serves every call under a lock, so a single-threaded sequence of calls
meets the same faults on every run (property tests).

``maybe_wrap_hicache_storage_failure_injector(backend)`` wraps ``backend`` when
``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` (seconds, >= 0) or
``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` (probability in [0, 1]) is set, as SGLang's
factory does; a malformed value raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hicache.storage.base import HiCacheStorage, HiCacheStorageExtraInfo
from hicache.storage.extra_config import read_env_float

logger = logging.getLogger(__name__)

ENV_DELAY = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"
ENV_FAILURE = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"


class HiCacheStorageFailureInjector(HiCacheStorage):
    """A backend behind random delays and failures (module docstring). ``injected`` counts the
    failures answered per call name."""

    def __init__(
        self,
        backend: HiCacheStorage,
        random_delay_limit: float = 0.0,
        failure_prob: float = 0.0,
        *,
        seed: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(backend, HiCacheStorage):
            raise ValueError(f"backend must be a HiCacheStorage, got {type(backend).__name__}")
        if not random_delay_limit >= 0:
            raise ValueError(f"random_delay_limit must be >= 0, got {random_delay_limit!r}")
        if not 0 <= failure_prob <= 1:
            raise ValueError(f"failure_prob must be in [0, 1], got {failure_prob!r}")
        self._backend = backend
        self._random_delay_limit = float(random_delay_limit)
        self._failure_prob = float(failure_prob)
        self._sleep = sleep
        self._seeded = random.Random(seed) if seed is not None else None
        self._lock = threading.Lock()
        self._local = threading.local()
        self.injected: Counter[str] = Counter()

    @property
    def backend(self) -> HiCacheStorage:
        return self._backend

    # --- randomness ----------------------------------------------------------------------------
    def _draw(self, fn: Callable[[random.Random], float]) -> float:
        if self._seeded is not None:
            with self._lock:
                return fn(self._seeded)
        rng = getattr(self._local, "rng", None)
        if rng is None:
            rng = self._local.rng = random.Random()
        return fn(rng)

    def _fails(self, call: str) -> bool:
        """Sleep the injected delay; whether to answer ``call``'s failure value."""
        if self._random_delay_limit > 0:
            self._sleep(self._draw(lambda r: r.uniform(0.0, self._random_delay_limit)))
        if self._failure_prob > 0 and self._draw(lambda r: r.random()) < self._failure_prob:
            with self._lock:
                self.injected[call] += 1
            logger.debug("injected a failure in %s", call)
            return True
        return False

    # --- pass-through --------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._backend.register_mem_pool_host(mem_pool_host)

    def clear(self) -> bool | None:
        return self._backend.clear()

    def get_stats(self) -> Any | None:
        return self._backend.get_stats()

    def close(self) -> None:
        self._backend.close()

    # --- data calls ----------------------------------------------------------------------------
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        if self._fails("get"):
            return None
        return self._backend.get(key, target_location, target_sizes)

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        if self._fails("batch_get"):
            return [None] * len(keys)
        return self._backend.batch_get(keys, target_locations, target_sizes)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if self._fails("set"):
            return False
        return self._backend.set(key, value, target_location, target_sizes)

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if self._fails("batch_set"):
            return False
        return self._backend.batch_set(keys, values, target_locations, target_sizes)

    def exists(self, key: str) -> bool:
        if self._fails("exists"):
            return False
        return self._backend.exists(key)

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        if self._fails("batch_exists"):
            return 0
        return self._backend.batch_exists(keys, extra_info)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if self._fails("batch_get_v1"):
            return [False] * len(keys)
        return self._backend.batch_get_v1(keys, host_indices, extra_info)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if self._fails("batch_set_v1"):
            return [False] * len(keys)
        return self._backend.batch_set_v1(keys, host_indices, extra_info)


def maybe_wrap_hicache_storage_failure_injector(backend: HiCacheStorage) -> HiCacheStorage:
    """``backend`` behind an injector when either test variable is set, else ``backend``."""
    delay = read_env_float(ENV_DELAY)
    failure = read_env_float(ENV_FAILURE)
    if delay is None and failure is None:
        return backend
    if delay is not None and not delay >= 0:
        raise ValueError(f"environment variable {ENV_DELAY}={delay} must be >= 0 (seconds)")
    if failure is not None and not 0 <= failure <= 1:
        raise ValueError(f"environment variable {ENV_FAILURE}={failure} must be in [0, 1]")
    logger.info("HiCache storage fault injector on (delay <= %.3fs, failure p=%.3f)",
                delay or 0.0, failure or 0.0)  # fmt: skip
    return HiCacheStorageFailureInjector(backend, delay or 0.0, failure or 0.0)
