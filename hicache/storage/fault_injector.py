"""``HiCacheStorageFailureInjector``: SGLang 0.5.23's test injector, on when
``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` (seconds) or ``..._RANDOM_FAILURE`` (a probability)
is set. Before each data call it sleeps ``uniform(0, random_delay_limit)``, then with probability
``failure_prob`` answers SGLang's failure value without calling the backend. Without a seed each
thread draws from its own generator; with one, a locked generator repeats the faults run to run.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from hicache_prefill.hicache.storage.base import HiCacheStorage
from hicache_prefill.hicache.storage.extra_config import read_env_float

logger = logging.getLogger(__name__)

ENV_DELAY = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"
ENV_FAILURE = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"
FAILURE_VALUES: dict[str, Callable[[Any], Any]] = {
    "exists": lambda _key: False,
    "batch_exists": lambda _keys: 0,
    "get": lambda _key: None,
    "batch_get": lambda keys: [None] * len(keys),
    "set": lambda _key: False,
    "batch_set": lambda _keys: False,
    "batch_get_v1": lambda keys: [False] * len(keys),
    "batch_set_v1": lambda keys: [False] * len(keys),
}


def _injected(call: str) -> Callable[..., Any]:
    base = getattr(HiCacheStorage, call)
    first = list(inspect.signature(base).parameters)[1]

    @functools.wraps(base, updated=())  # not its __isabstractmethod__
    def method(self: HiCacheStorageFailureInjector, *args: Any, **kwargs: Any) -> Any:
        if self._fails(call):
            return FAILURE_VALUES[call](args[0] if args else kwargs[first])
        return getattr(self.backend, call)(*args, **kwargs)

    return method


class HiCacheStorageFailureInjector(HiCacheStorage):
    """``injected`` counts the failures answered per call name."""

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

    def _draw(self, fn: Callable[[random.Random], float]) -> float:
        if self._seeded is not None:
            with self._lock:
                return fn(self._seeded)
        rng = getattr(self._local, "rng", None)
        if rng is None:
            rng = self._local.rng = random.Random()
        return fn(rng)

    def _fails(self, call: str) -> bool:
        if self._random_delay_limit > 0:
            self._sleep(self._draw(lambda r: r.uniform(0.0, self._random_delay_limit)))
        if self._failure_prob > 0 and self._draw(lambda r: r.random()) < self._failure_prob:
            with self._lock:
                self.injected[call] += 1
            logger.debug("injected a failure in %s", call)
            return True
        return False

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._backend.register_mem_pool_host(mem_pool_host)

    def clear(self) -> bool | None:
        return self._backend.clear()

    def get_stats(self) -> Any | None:
        return self._backend.get_stats()

    def close(self) -> None:
        self._backend.close()

    exists = _injected("exists")
    batch_exists = _injected("batch_exists")
    get = _injected("get")
    batch_get = _injected("batch_get")
    set = _injected("set")
    batch_set = _injected("batch_set")
    batch_get_v1 = _injected("batch_get_v1")
    batch_set_v1 = _injected("batch_set_v1")


def maybe_wrap_hicache_storage_failure_injector(backend: HiCacheStorage) -> HiCacheStorage:
    delay = read_env_float(ENV_DELAY)
    failure = read_env_float(ENV_FAILURE)
    if delay is None and failure is None:
        return backend
    if delay is not None and not delay >= 0:
        raise ValueError(f"environment variable {ENV_DELAY}={delay} must be >= 0 (seconds)")
    if failure is not None and not 0 <= failure <= 1:
        raise ValueError(f"environment variable {ENV_FAILURE}={failure} must be in [0, 1]")
    logger.info(
        "HiCache storage fault injector on (delay <= %.3fs, failure p=%.3f)",
        delay or 0.0,
        failure or 0.0,
    )
    return HiCacheStorageFailureInjector(backend, delay or 0.0, failure or 0.0)
