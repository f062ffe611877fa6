"""One host pool for several caches (``build_kv_cache(args, host_pool=...)``,
``bench.e2e.setup.SharedHostPool``): a benchmark registers its pinned pool once for its
calibration and every configuration. A pool is only handed to a cache whose flags ask for exactly
it, with a fresh allocator; anything else raises ``ValueError`` naming what differs and changes
nothing."""

from __future__ import annotations

import dataclasses

import pytest

from bench.e2e.setup import SharedHostPool
from hicache_prefill.hicache.builder import build_kv_cache
from hicache_prefill.server_args import ServerArgs

ARGS = ServerArgs(device="cpu", dtype="float32", num_layers=2, head_num=1, head_dim=4,
                  max_total_tokens=64, page_size=4, enable_hierarchical_cache=True,
                  hicache_ratio=2.0, hicache_write_policy="write_through",
                  hicache_mem_layout="page_first", hicache_io_backend="kernel")  # fmt: skip


def _first_cache_with_a_backup():  # noqa: ANN202
    cache = build_kv_cache(ARGS)
    d = cache.alloc_device(8)
    assert cache.controller.write(d, node_id=1) is not None
    cache.controller.wait_write()
    cache.close()
    return cache


def test_a_second_cache_takes_the_pool_with_a_fresh_allocator() -> None:
    first = _first_cache_with_a_backup()
    pool = first.host_pool
    assert pool.available_size() == pool.size - 8
    second = build_kv_cache(dataclasses.replace(ARGS, hicache_write_policy="write_back"),
                            host_pool=pool)  # fmt: skip
    try:
        assert second.host_pool is pool and pool.device_pool is second.device_pool
        assert pool.available_size() == pool.size  # a fresh allocator
        second.check_integrity()
        d = second.alloc_device(4)
        assert second.controller.write(d, node_id=2) is not None
        second.controller.wait_write()
        second.controller.check_integrity()  # (the host copy is not in the tree: no insert)
    finally:
        second.close()


@pytest.mark.parametrize("change, needle", [
    (dict(hicache_ratio=3.0), "tokens"),
    (dict(hicache_mem_layout="layer_first"), "layout"),
    (dict(head_dim=8), "token shapes"),
    (dict(num_layers=3), "layer_num"),
    (dict(dtype="bfloat16"), "dtype"),
])  # fmt: skip
def test_a_pool_that_does_not_match_is_refused_and_left_as_it_was(change, needle) -> None:  # noqa: ANN001
    first = _first_cache_with_a_backup()
    pool = first.host_pool
    allocator, device_pool = pool.allocator, pool.device_pool
    with pytest.raises(ValueError, match=f"host_pool cannot serve.*{needle}"):
        build_kv_cache(dataclasses.replace(ARGS, **change), host_pool=pool)
    assert pool.allocator is allocator and pool.device_pool is device_pool
    assert pool.available_size() == pool.size - 8


def test_an_mla_device_pool_is_refused_by_an_mha_host_pool() -> None:
    pool = _first_cache_with_a_backup().host_pool
    mla = dataclasses.replace(ARGS, use_mla=True, kv_lora_rank=4, qk_rope_head_dim=2,
                              head_num=None)  # fmt: skip
    with pytest.raises(ValueError, match="host_pool"):
        build_kv_cache(mla, host_pool=pool)


def test_a_benchmark_allocates_one_host_pool_for_all_its_caches() -> None:
    host = SharedHostPool()
    caches = []
    for policy in ("write_back", "write_through", "write_back"):
        cache = host.build(dataclasses.replace(ARGS, hicache_write_policy=policy))
        caches.append(cache)
        cache.close()
    device_only = host.build(dataclasses.replace(ARGS, enable_hierarchical_cache=False))
    assert device_only.host_pool is None
    assert all(c.host_pool is caches[0].host_pool for c in caches)
    host.release()
    assert host.pool is None
