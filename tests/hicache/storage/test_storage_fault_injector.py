"""The fault injector: SGLang's failure values, pass-through, seeded determinism, delays, and the
environment variables that switch it on."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.storage.fault_injector import (
    HiCacheStorageFailureInjector,
    maybe_wrap_hicache_storage_failure_injector,
)
from tests.hicache.storage.helpers import MemoryStorage, host_pool

K = "k" * 64


def stocked() -> MemoryStorage:
    store = MemoryStorage()
    store.set(K, torch.arange(4, dtype=torch.float32))
    return store


def every_call(store) -> dict:
    """Each data call once (keys present in ``stocked``), with its result."""
    host = host_pool("mha", "page_first")
    store.register_mem_pool_host(host)
    slots = torch.arange(4)
    return {
        "exists": store.exists(K),
        "batch_exists": store.batch_exists([K, K]),
        "get": store.get(K, torch.zeros(4)),
        "batch_get": store.batch_get([K], [torch.zeros(4)]),
        "set": store.set("new", torch.ones(4)),
        "batch_set": store.batch_set(["new2"], [torch.ones(4)]),
        "batch_set_v1": store.batch_set_v1(["page"], slots),
        "batch_get_v1": store.batch_get_v1(["page", "page"], torch.arange(8)),
    }


def test_failure_values_are_sglangs() -> None:
    inner = stocked()
    got = every_call(HiCacheStorageFailureInjector(inner, 0.0, 1.0))
    assert got == {"exists": False, "batch_exists": 0, "get": None, "batch_get": [None],
                   "set": False, "batch_set": False, "batch_set_v1": [False],
                   "batch_get_v1": [False, False]}  # fmt: skip
    assert list(inner.pages) == [K]  # the backend was never called


def test_without_failures_it_passes_through() -> None:
    plain, wrapped = every_call(stocked()), every_call(HiCacheStorageFailureInjector(stocked()))
    assert plain.keys() == wrapped.keys()
    for name in plain:
        a, b = plain[name], wrapped[name]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else str(a) == str(b), name
    always = HiCacheStorageFailureInjector(stocked(), 0.0, 1.0)
    assert always.clear() is True and always.get_stats() is None  # never injected
    always.close()


def test_a_seed_makes_the_faults_repeat() -> None:
    def run(seed: int) -> list[bool]:
        inj = HiCacheStorageFailureInjector(stocked(), 0.0, 0.5, seed=seed)
        return [inj.exists(K) for _ in range(64)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert 10 < sum(run(7)) < 54
    inj = HiCacheStorageFailureInjector(stocked(), 0.0, 0.5, seed=7)
    for _ in range(64):
        inj.exists(K)
    assert inj.injected["exists"] == 64 - sum(run(7))


def test_delays_are_uniform_up_to_the_limit() -> None:
    slept: list[float] = []
    inj = HiCacheStorageFailureInjector(stocked(), 0.25, 0.0, seed=1, sleep=slept.append)
    for _ in range(20):
        assert inj.exists(K)
    assert len(slept) == 20 and all(0 <= s <= 0.25 for s in slept) and len(set(slept)) == 20


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="failure_prob"):
        HiCacheStorageFailureInjector(stocked(), 0.0, 1.5)
    with pytest.raises(ValueError, match="random_delay_limit"):
        HiCacheStorageFailureInjector(stocked(), -1.0)
    with pytest.raises(ValueError, match="HiCacheStorage"):
        HiCacheStorageFailureInjector(object())  # type: ignore[arg-type]


def test_environment_switches_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    store = stocked()
    assert maybe_wrap_hicache_storage_failure_injector(store) is store
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0")
    wrapped = maybe_wrap_hicache_storage_failure_injector(store)
    assert isinstance(wrapped, HiCacheStorageFailureInjector) and wrapped.exists(K)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "soon")
    with pytest.raises(ValueError, match="SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"):
        maybe_wrap_hicache_storage_failure_injector(store)
