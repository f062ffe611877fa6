"""Device pools: one allocation, per-layer views, data_ptr tables, set_kv_buffer."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool


def test_mha_pool_views_share_one_allocation() -> None:
    pool = MHATokenToKVPool(32, 4, torch.float32, head_num=2, head_dim=8, layer_num=3, device="cpu")
    assert pool.kv_buffer.shape == (2, 3, 36, 2, 8)
    for layer in range(3):
        k, v = pool.get_kv_buffer(layer)
        assert k.shape == v.shape == (36, 2, 8)
        assert k.is_contiguous() and v.is_contiguous()
        assert k.untyped_storage().data_ptr() == pool.kv_buffer.untyped_storage().data_ptr()
        assert int(pool.k_data_ptrs[layer]) == k.data_ptr()
        assert int(pool.v_data_ptrs[layer]) == v.data_ptr()
    assert pool.k_data_ptrs.dtype == torch.uint64 and pool.k_data_ptrs.shape == (3,)
    assert pool.data_ptrs.shape == (6,)
    assert pool.item_size == 2 * 8 * 4
    assert pool.get_size_per_token() == 2 * 3 * 64


def test_mha_set_kv_buffer_writes_only_loc() -> None:
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, head_num=1, head_dim=4, layer_num=2, device="cpu")
    loc = torch.tensor([3, 5], dtype=torch.int64)
    k = torch.ones(2, 1, 4)
    pool.set_kv_buffer(1, loc, k, 2 * k)
    assert pool.k_buffer[1][loc].float().eq(1).all() and pool.v_buffer[1][loc].float().eq(2).all()
    assert pool.k_buffer[0].abs().sum() == 0
    assert pool.k_buffer[1].float().sum() == 8  # nothing else touched


@pytest.mark.parametrize(
    "bad",
    [
        dict(layer_id=2),
        dict(loc=torch.tensor([9], dtype=torch.int64)),
        dict(loc=torch.tensor([1], dtype=torch.int32)),
        dict(cache_k=torch.ones(2, 1, 4)),
    ],
)
def test_mha_set_kv_buffer_rejects_bad_input(bad: dict) -> None:
    pool = MHATokenToKVPool(8, 1, torch.float32, head_num=1, head_dim=4, layer_num=2, device="cpu")
    call = dict(
        layer_id=0,
        loc=torch.tensor([1], dtype=torch.int64),
        cache_k=torch.ones(1, 1, 4),
        cache_v=torch.ones(1, 1, 4),
    )
    call.update(bad)
    with pytest.raises(ValueError):
        pool.set_kv_buffer(**call)
    assert pool.kv_buffer.abs().sum() == 0


def test_mla_pool() -> None:
    pool = MLATokenToKVPool(
        16, 16, torch.float32, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2, device="cpu"
    )
    assert pool.kv_buffer_all.shape == (2, 32, 1, 8)
    assert pool.kv_buffer[1].shape == (32, 1, 8)
    assert int(pool.kv_data_ptrs[1]) == pool.kv_buffer[1].data_ptr()
    assert pool.get_value_buffer(0).shape == (32, 1, 6)
    loc = torch.arange(16, 32, dtype=torch.int64)
    pool.set_mla_kv_buffer(1, loc, torch.full((16, 1, 8), 3.0))
    assert pool.kv_buffer[1][16:].eq(3).all() and pool.kv_buffer[1][:16].eq(0).all()
    with pytest.raises(ValueError):
        pool.set_mla_kv_buffer(0, loc, torch.ones(16, 1, 7))


@pytest.mark.parametrize("size,page", [(10, 4), (0, 1), (8, 0)])
def test_pool_rejects_bad_geometry(size: int, page: int) -> None:
    with pytest.raises(ValueError):
        MHATokenToKVPool(size, page, torch.float32, 1, 1, 1, "cpu")


def test_mha_pool_with_narrower_v_heads() -> None:
    """K heads 12 wide, V heads 8 (a 192/128 model scaled down): one allocation, two parts."""
    pool = MHATokenToKVPool(8, 4, torch.float32, head_num=2, head_dim=12, layer_num=2,
                            device="cpu", v_head_dim=8)  # fmt: skip
    assert pool.k_buffer_all.shape == (2, 12, 2, 12) and pool.v_buffer_all.shape == (2, 12, 2, 8)
    assert pool.k_buffer[1].untyped_storage().data_ptr() == (
        pool.v_buffer[0].untyped_storage().data_ptr()
    )
    assert (pool.item_size, pool.v_item_size) == (96, 64)
    assert pool.get_size_per_token() == 2 * (96 + 64)
    assert pool.mem_bytes() == 12 * 2 * (96 + 64)
    with pytest.raises(AttributeError, match="v_buffer_all"):
        pool.kv_buffer  # noqa: B018
    loc = torch.tensor([5, 6])
    pool.set_kv_buffer(1, loc, torch.ones(2, 2, 12), torch.full((2, 2, 8), 2.0))
    assert pool.k_buffer[1][loc].eq(1).all() and pool.v_buffer[1][loc].eq(2).all()
    assert pool.k_buffer_all.sum() == 2 * 2 * 12 and pool.v_buffer_all.sum() == 2 * 2 * 8 * 2
    with pytest.raises(ValueError, match="cache_v"):
        pool.set_kv_buffer(0, loc, torch.ones(2, 2, 12), torch.ones(2, 2, 12))
