"""Pools that interoperate with SGLang's both ways.

1. This project's device pools carry every attribute SGLang's host pools and
   ``HiCacheController`` read of a device pool, with SGLang's meaning (the lists below come from
   sglang 0.5.17 ``mem_cache/pool_host/{base,mha,mla}.py`` and ``managers/cache_controller.py``,
   and sglang 0.5.23 ``mem_cache/pool_host/*`` plus the ``MHATokenToKVPool._mha_buffers`` /
   ``_mha_buffer_info`` / ``MLATokenToKVPool._mla_buffer_info`` / ``get_device_pool_infos``
   methods its host assembly calls on the device pool).
2. This project's host pools accept an SGLang-shaped device pool: a stand-in built from those
   attributes only (per-layer tensors allocated one by one, tables built by plain
   ``torch.tensor`` so their alignment is unknown, ``device`` a string, fp8 stored as uint8), and
   back it up and load it back bit for bit, for every (layout, io backend), MHA, MLA, and K / V of
   different head sizes.
"""

from __future__ import annotations

import types

import pytest
import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import SUPPORTED_LAYOUT_IO, make_host_pool

L, H = 3, 2

# Read of an MHA device pool by SGLang (0.5.17 pool_host, 0.5.23 buffer info, controller).
SGLANG_MHA_FIELDS = (
    "size", "page_size", "dtype", "store_dtype", "layer_num", "device", "start_layer",
    "end_layer", "head_num", "head_dim", "v_head_dim", "row_dim", "v_row_dim", "k_buffer",
    "v_buffer", "k_data_ptrs", "v_data_ptrs", "kv_cache_layout", "k_scale_buffer",
    "v_scale_buffer", "model_layer_ids", "layer_shard_enabled", "layer_transfer_counter",
    "register_layer_transfer_counter", "get_key_buffer", "get_value_buffer", "get_kv_buffer",
)  # fmt: skip
SGLANG_MLA_FIELDS = (
    "size", "page_size", "dtype", "store_dtype", "layer_num", "device", "start_layer",
    "end_layer", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "kv_buffer", "data_ptrs",
    "index_head_dim", "dsa_kv_cache_store_fp8", "kv_scale_buffer", "model_layer_ids",
    "layer_shard_enabled", "layer_shard_size", "_owned_local_layer_range",
    "register_layer_transfer_counter", "get_key_buffer", "get_value_buffer",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 1. Our device pools, read the way SGLang reads them
# ---------------------------------------------------------------------------------------------


class RecordingCounter:
    """SGLang's ``LayerDoneCounter`` as the device pool sees it."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_until(self, layer: int) -> None:
        self.waited.append(layer)


@pytest.mark.parametrize("v_head_dim", [8, 4])
def test_mha_device_pool_reads_like_sglang(v_head_dim: int) -> None:
    pool = MHATokenToKVPool(16, 4, torch.bfloat16, H, 8, L, "cpu", v_head_dim=v_head_dim)
    missing = [f for f in SGLANG_MHA_FIELDS if not hasattr(pool, f)]
    assert not missing
    assert pool.store_dtype == torch.bfloat16 and (pool.start_layer, pool.end_layer) == (0, L - 1)
    assert pool.model_layer_ids == tuple(range(L)) and pool.layer_shard_enabled is False
    assert (pool.row_dim, pool.v_row_dim) == (H * 8, H * v_head_dim)
    assert pool.kv_cache_layout == "nhd" and pool.k_scale_buffer is None
    # 0.5.17 concatenates the per-layer lists; 0.5.23 takes tuples of them.
    both = pool.k_buffer + pool.v_buffer
    assert len(both) == 2 * L and tuple(pool.k_buffer)[1] is pool.k_buffer[1]
    assert [b.shape[-1] for b in both] == [8] * L + [v_head_dim] * L
    for table, layers in ((pool.k_data_ptrs, pool.k_buffer), (pool.v_data_ptrs, pool.v_buffer)):
        assert table.dtype == torch.uint64 and table.device == torch.device("cpu")
        assert table.tolist() == [t.data_ptr() for t in layers]
    assert all(t.is_contiguous() for t in both)
    assert pool.get_size_per_token() == L * H * (8 + v_head_dim) * 2


def test_mla_device_pool_reads_like_sglang() -> None:
    pool = MLATokenToKVPool(16, 4, torch.float16, 6, 2, L, "cpu")
    assert not [f for f in SGLANG_MLA_FIELDS if not hasattr(pool, f)]
    assert pool._owned_local_layer_range() == (0, L)  # what _effective_host_layer_num reads
    assert pool.index_head_dim is None and pool.kv_cache_dim == 8
    assert pool.data_ptrs.dtype == torch.uint64
    assert pool.data_ptrs.tolist() == [t.data_ptr() for t in pool.kv_buffer]


@pytest.mark.parametrize("mla", [False, True])
def test_layer_shard_fields_mean_one_shard_holding_every_layer(mla: bool) -> None:
    """SGLang's ``layer_shard_size`` counts the shards the layers are split over (its sharded
    DSA pool requires more than 1; the disaggregation code defaults it to 1). An SGLang host pool
    on the sharded path sizes itself ``ceil(layer_num / layer_shard_size)`` layers and walks
    ``_owned_local_layer_range()``: both must describe all ``layer_num`` layers."""
    pool = (MLATokenToKVPool(16, 4, torch.float16, 6, 2, L, "cpu") if mla
            else MHATokenToKVPool(16, 4, torch.float16, H, 8, L, "cpu"))  # fmt: skip
    assert pool.layer_shard_size == 1
    start, end = pool._owned_local_layer_range()
    host_layers = -(-pool.layer_num // pool.layer_shard_size)  # SGLang 0.5.17's formula
    assert (start, end) == (0, L) and host_layers == end - start == L


@pytest.mark.parametrize("mla", [False, True])
def test_registered_layer_counter_is_waited_on_by_the_accessors(mla: bool) -> None:
    """As SGLang's pools: ``get_*_buffer`` wait for the layer once a counter is registered; the
    raw ``k_buffer`` / ``kv_buffer`` lists (what the host pools copy through) never wait."""
    pool = (MLATokenToKVPool(16, 4, torch.float16, 6, 2, L, "cpu") if mla
            else MHATokenToKVPool(16, 4, torch.float16, H, 8, L, "cpu"))  # fmt: skip
    pool.get_key_buffer(0)  # nothing registered: no wait, no error
    counter = RecordingCounter()
    pool.register_layer_transfer_counter(counter)
    pool.get_key_buffer(2)
    pool.get_value_buffer(1)
    if not mla:
        pool.get_kv_buffer(0)
    assert counter.waited == ([2, 1] if mla else [2, 1, 0])


# ---------------------------------------------------------------------------------------------
# 2. Our host pools on an SGLang-shaped device pool
# ---------------------------------------------------------------------------------------------


def sglang_mha_pool(size: int, page: int, head_dim: int, v_head_dim: int, seed: int,
                    fp8: bool = False) -> types.SimpleNamespace:  # fmt: skip
    """What an SGLang ``MHATokenToKVPool`` exposes, and nothing else: per-layer buffers of
    ``size + page`` slots allocated one by one, uint64 tables from ``torch.tensor``, a string
    device; fp8 stored as uint8 (``dtype`` fp8, ``store_dtype`` uint8)."""
    gen = torch.Generator().manual_seed(seed)
    store = torch.uint8 if fp8 else torch.bfloat16

    def layer(d: int) -> torch.Tensor:
        if fp8:
            return torch.randint(0, 256, (size + page, H, d), dtype=torch.uint8, generator=gen)
        return torch.randn(size + page, H, d, generator=gen).to(store)

    k = [layer(head_dim) for _ in range(L)]
    v = [layer(v_head_dim) for _ in range(L)]
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    return types.SimpleNamespace(
        size=size, page_size=page, layer_num=L, device="cpu", start_layer=0, end_layer=L - 1,
        dtype=torch.float8_e4m3fn if fp8 else store, store_dtype=store, head_num=H,
        head_dim=head_dim, v_head_dim=v_head_dim, k_buffer=k, v_buffer=v,
        k_data_ptrs=table(k), v_data_ptrs=table(v), layer_shard_enabled=False,
    )  # fmt: skip


def sglang_mla_pool(size: int, page: int, seed: int) -> types.SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(size + page, 1, 12, generator=gen).to(torch.bfloat16) for _ in range(L)]
    return types.SimpleNamespace(
        size=size, page_size=page, layer_num=L, device="cpu", start_layer=0, end_layer=L - 1,
        dtype=torch.bfloat16, store_dtype=torch.bfloat16, kv_lora_rank=8, qk_rope_head_dim=4,
        kv_cache_dim=12, kv_buffer=kv, index_head_dim=None, layer_shard_enabled=False,
        data_ptrs=torch.tensor([t.data_ptr() for t in kv], dtype=torch.uint64),
    )  # fmt: skip


def _parts(pool: object) -> list[list[torch.Tensor]]:
    return [pool.kv_buffer] if hasattr(pool, "kv_lora_rank") else [pool.k_buffer, pool.v_buffer]


def our_asymmetric_pool(page: int, seed: int) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(32, page, torch.bfloat16, H, 12, L, "cpu", v_head_dim=8)
    gen = torch.Generator().manual_seed(seed)
    for t in (pool.k_buffer_all, pool.v_buffer_all):
        t.copy_(torch.randn(t.shape, generator=gen))
    return pool


POOLS = {
    "mha": lambda page, seed: sglang_mha_pool(32, page, 8, 8, seed),
    "ours-k192-v128": our_asymmetric_pool,
    "mha-k192-v128": lambda page, seed: sglang_mha_pool(32, page, 12, 8, seed),
    "mha-fp8": lambda page, seed: sglang_mha_pool(32, page, 16, 16, seed, fp8=True),
    "mla": lambda page, seed: sglang_mla_pool(32, page, seed),
}


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("layout, io", sorted(SUPPORTED_LAYOUT_IO))
@pytest.mark.parametrize("page", [1, 4])
def test_host_pool_backs_an_sglang_shaped_device_pool(kind: str, layout: str, io: str,
                                                      page: int) -> None:  # fmt: skip
    """Back up 8 device slots (all layers), wipe them, load them back layer by layer into other
    slots: every byte comes back, nothing else on the device changes."""
    dev = POOLS[kind](page, seed=page)
    host = make_host_pool(dev, 2.0, 0, layout, pin_memory=False)
    dev_slots = torch.arange(page, page + 8)  # whole pages, past the padding page
    host.alloc(page)  # host slots not starting at 0
    host_slots = host.alloc(8)
    original = [[t.clone() for t in part] for part in _parts(dev)]
    host.backup_from_device_all_layer(dev, host_slots, dev_slots, io)
    for part in _parts(dev):
        for t in part:
            t[dev_slots] = 0
    new_slots = torch.arange(24, 32)  # whole pages too
    for layer in range(L):
        host.load_to_device_per_layer(dev, host_slots, new_slots, layer, io)
    for part, before in zip(_parts(dev), original, strict=True):
        for got, want in zip(part, before, strict=True):
            assert torch.equal(got[new_slots], want[dev_slots])
            untouched = torch.ones(got.shape[0], dtype=torch.bool)
            untouched[new_slots] = False
            untouched[dev_slots] = False
            assert torch.equal(got[untouched], want[untouched])
    host.check_integrity()


def test_host_pool_sizes_parts_by_store_dtype_and_v_head_dim() -> None:
    dev = sglang_mha_pool(32, 4, 16, 8, seed=0, fp8=True)
    host = make_host_pool(dev, 2.0, 0, "page_first", pin_memory=False)
    assert host.dtype == torch.uint8
    assert (host.item_size, host.v_item_size) == (H * 16, H * 8)
    assert host.size_per_token == L * H * (16 + 8)
    assert host.k_buffer.shape[-1] == 16 and host.v_buffer.shape[-1] == 8
    assert host.kv_buffer.numel() == host.size * host.size_per_token  # one allocation


@pytest.mark.parametrize("drop", ["k_data_ptrs", "head_dim", "page_size"])
def test_a_device_pool_without_sglang_fields_is_refused(drop: str) -> None:
    dev = sglang_mha_pool(32, 4, 8, 8, seed=0)
    delattr(dev, drop)
    with pytest.raises(ValueError, match=drop):
        make_host_pool(dev, 2.0, 0, "layer_first", pin_memory=False)
