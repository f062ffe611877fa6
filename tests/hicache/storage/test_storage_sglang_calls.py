"""The calls SGLang 0.5.23's storage controller makes beyond the v1 ones
(``register_mem_host_pool_v2``, ``on_host_pools_registered``, ``batch_exists_v2`` /
``batch_get_v2`` / ``batch_set_v2``), a config of SGLang's class (``as_storage_config``), the
``dynamic`` factory's constructor shape, and ``MooncakeStore`` over a host pool without
``page_regions()``: here without SGLang (its own classes run in ``make sglang-check``)."""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
import torch

from hicache_prefill.hicache.storage.base import KV_POOL, PoolTransferResult
from hicache_prefill.hicache.storage.config import as_storage_config
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore, host_regions
from tests.hicache.storage.helpers import fill_random, host_pool, same_slots
from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster

PAGE = 4


@dataclass
class SGLangShapedConfig:
    """SGLang's ``HiCacheStorageConfig`` fields (no ``format_tag``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = "Org/Model"
    extra_config: dict | None = field(default_factory=dict)


def transfer(name, keys, starts=None, policy="all_pages"):
    idx = None
    if starts is not None:
        idx = torch.tensor([s * PAGE + t for s in starts for t in range(PAGE)])
    return types.SimpleNamespace(name=name, keys=keys, host_indices=idx, hit_policy=policy)


def test_sglang_config_keeps_its_name_and_bytes_unless_a_tag_is_set():
    cfg = as_storage_config(SGLangShapedConfig())
    assert (cfg.model_name, cfg.format_tag) == ("Org/Model", None)
    cfg = as_storage_config(SGLangShapedConfig(extra_config={"storage_format_tag": "none"}))
    assert (cfg.model_name, cfg.format_tag) == ("Org/Model", None)
    cfg = as_storage_config(SGLangShapedConfig(extra_config={"storage_format_tag": "bf16-x"}))
    assert (cfg.model_name, cfg.format_tag) == ("Org/Model-bf16-x", "bf16-x")
    assert "storage_format_tag" not in cfg.extra_config
    with pytest.raises(ValueError, match="storage_format_tag"):
        as_storage_config(SGLangShapedConfig(extra_config={"storage_format_tag": 3}))


def test_v2_calls_move_the_kv_pool_and_miss_sidecars(tmp_path):
    pool = host_pool("mha", "page_first")
    fill_random(pool, seed=3)
    # SGLang's dynamic factory: cls(config, kwargs) with its keyword dict
    backend = HiCacheFile(SGLangShapedConfig(extra_config={"file_storage_path": str(tmp_path)}), {})
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, "kv")
    backend.register_mem_host_pool_v2(pool, "mamba")
    backend.on_host_pools_registered()
    keys = page_hashes(list(range(3 * PAGE)), PAGE)
    assert backend.batch_set_v2([transfer(KV_POOL, keys, [0, 1, 2])]) == {KV_POOL: [True] * 3}
    assert backend.batch_set_v2([transfer("mamba", keys, [0, 1, 2])]) == {"mamba": [False] * 3}
    r = backend.batch_exists_v2(keys + ["f" * 64])
    assert isinstance(r, PoolTransferResult)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [1, 2, 3])
    assert backend.batch_exists_v2(keys, [transfer("mamba", keys[-1:])]).kv_hit_pages == 0
    with pytest.raises(ValueError, match="hit policy"):
        backend.batch_exists_v2(keys, [transfer("mamba", keys, policy="block_groups")])
    assert backend.batch_get_v2([transfer(KV_POOL, keys, [5, 6, 7])]) == {KV_POOL: [True] * 3}
    assert same_slots(pool, list(range(5 * PAGE, 8 * PAGE)), pool, list(range(3 * PAGE)))
    assert backend.batch_get_v2([transfer(KV_POOL, keys, [5])]) == {KV_POOL: [False] * 3}
    assert (tmp_path / f"{keys[0]}_Org-Model_0_1.bin").stat().st_size > 0  # SGLang's name


def test_host_regions_without_page_regions():
    t = torch.zeros(2, 64)
    assert host_regions(types.SimpleNamespace(kv_buffer=t)) == [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())]  # fmt: skip
    k, v = torch.zeros(8), torch.zeros(16)
    regions = host_regions(types.SimpleNamespace(get_hybrid_pool_buffer=lambda: [(k, v), k]))
    assert sorted(n for _, n in regions) == [32, 64]


class NoRegions:
    """A host pool without ``page_regions()`` (as SGLang's are)."""

    def __init__(self, pool):
        self._pool = pool

    def __getattr__(self, name):
        if name == "page_regions":
            raise AttributeError(name)
        return getattr(self._pool, name)


def test_mooncake_over_a_host_pool_without_page_regions(monkeypatch):
    cluster = FakeCluster()
    monkeypatch.setattr(MooncakeStore, "store_factory", cluster.factory)
    pool = host_pool("mha", "page_first")
    fill_random(pool, seed=5)
    wrapped = NoRegions(pool)
    extra = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp",
             "global_segment_size": 0, "interface_v1": 1}  # fmt: skip
    store = MooncakeStore(SGLangShapedConfig(extra_config=extra), {})
    store.register_mem_pool_host(wrapped)
    assert cluster.clients[0].registered  # the pool's buffer
    keys = page_hashes(list(range(2 * PAGE)), PAGE)
    slots = torch.arange(0, 2 * PAGE)
    assert store.batch_set_v1(keys, slots) == [True, True]
    assert store.batch_get_v1(keys, slots + 4 * PAGE) == [True, True]
    assert same_slots(pool, list(range(4 * PAGE, 6 * PAGE)), pool, list(range(2 * PAGE)))
    assert sorted(cluster.objects)[0] == f"Org-Model_{sorted(keys)[0]}_0_k"
    store.close()
