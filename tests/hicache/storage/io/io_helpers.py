"""Helpers of the storage-tier tests: a shared in-memory backend that can be held at a gate,
made to fail chosen batches or miss chosen keys, and records its calls; a cache over it; writes
of deterministic KV (``tests/support/kv_content``) and a drain of every tier's acks."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch

from hicache_prefill.hicache.builder import build_kv_cache
from hicache_prefill.hicache.storage.base import HiCacheStorage
from hicache_prefill.server_args import ServerArgs
from tests.support.kv_content import write_device

STORES: dict[str, dict[str, torch.Tensor]] = {}
"""Pages of each named store (shared by every backend built with that ``store`` name)."""


class TestStorage(HiCacheStorage):
    """An in-memory backend (built as a registered non-built-in name: ``(config, kwargs)``).

    ``gate``: cleared, every data call waits at it. ``fail_set_batches``: indices of
    ``batch_set`` calls that fail. ``missing``: keys ``exists`` / ``get`` do not see.
    ``calls``: ``(call, number of keys)`` in order."""

    __test__ = False
    last: TestStorage | None = None

    def __init__(self, storage_config: Any = None, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        self.pages = STORES.setdefault(extra.get("store", "default"), {})
        self.suffix = f"_{storage_config.model_name}_{storage_config.tp_rank}"
        self.gate = threading.Event()
        self.gate.set()
        self.fail_set_batches: set[int] = set()
        self.missing: set[str] = set()
        self.calls: list[tuple[str, int]] = []
        self._sets = 0
        self._lock = threading.Lock()
        TestStorage.last = self

    def _record(self, call: str, n: int) -> None:
        self.gate.wait()
        with self._lock:
            self.calls.append((call, n))

    def get(self, key, target_location=None, target_sizes=None):
        page = None if key in self.missing else self.pages.get(key + self.suffix)
        if page is None or page.numel() != target_location.numel() * target_location.element_size():
            return None
        target_location.view(torch.uint8).reshape(-1).copy_(page)
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self._record("batch_get", len(keys))
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self.pages[key + self.suffix] = value.contiguous().view(torch.uint8).reshape(-1).clone()
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        self._record("batch_set", len(keys))
        with self._lock:
            index, self._sets = self._sets, self._sets + 1
        if index in self.fail_set_batches:
            return False
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key):
        return key not in self.missing and key + self.suffix in self.pages

    def batch_exists(self, keys, extra_info=None):
        self._record("batch_exists", len(keys))
        return super().batch_exists(keys, extra_info)


DYNAMIC = {
    "backend_name": "test_memory",
    "module_path": "tests.hicache.storage.io.io_helpers",
    "class_name": "TestStorage",
}
"""The extra-config keys that load ``TestStorage`` as the ``dynamic`` backend."""


def cache_args(
    store: str, *, policy: str = "write_through", mode: str = "cache", page: int = 4,
    tokens: int = 64, threshold: int = 8, extra: dict | None = None, **kw: Any,
) -> ServerArgs:  # fmt: skip
    """A tiny hierarchical cache with the ``test_memory`` backend of store ``store``."""
    config = {"store": store, "prefetch_threshold": threshold, **DYNAMIC, **(extra or {})}
    base = dict(
        device="cpu", num_layers=2, head_num=1, head_dim=4, max_total_tokens=tokens,
        page_size=page, enable_hierarchical_cache=True, hicache_write_policy=policy,
        hicache_storage_backend="dynamic", hicache_host_memory_mode=mode,
        hicache_storage_backend_extra_config=json.dumps(config), load_back_threshold=page,
    )  # fmt: skip
    base.update(kw)
    return ServerArgs(**base)


def build(store: str, **kw: Any) -> tuple[Any, TestStorage]:
    kv = build_kv_cache(cache_args(store, **kw))
    return kv, TestStorage.last


def compute(kv: Any, tokens: list[int]) -> torch.Tensor:
    """What a request does: match, compute the rest (deterministic KV), insert; unlocked."""
    m = kv.tree.match_prefix(tokens)
    assert m.host_hit_length == 0, "load back first"
    have = m.device_indices.numel()
    new = kv.alloc_device(len(tokens) - have)
    assert new is not None
    write_device(kv.device_pool, new, tokens[have:], range(have, len(tokens)))
    slots = torch.cat([m.device_indices, new])
    present = kv.tree.insert(tokens, slots)
    assert present == have
    return slots


def drain(kv: Any, timeout_s: float = 20.0) -> None:
    """Tick until no L2 copy and no storage operation is in flight."""
    deadline = time.monotonic() + timeout_s
    tree = kv.tree
    while tree.ongoing_write_through or tree.ongoing_load_back or kv.storage.ops_in_flight():
        tree.check_hicache_events()
        kv.check_integrity()
        if time.monotonic() > deadline:
            raise TimeoutError(f"storage not drained: {kv.storage.prefetches.ongoing}")
        time.sleep(0.001)
    tree.check_hicache_events()


def tick_until(kv: Any, cond: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        kv.tree.check_hicache_events()
        kv.check_integrity()
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)
