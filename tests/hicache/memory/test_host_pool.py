"""Host pools: layouts, sizing, RAM refusal, backup/load round trips bit for bit."""

from __future__ import annotations

import pytest
import torch

import hicache_prefill.hicache.memory.host_ram as host_memory
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import (
    LAYOUTS,
    SUPPORTED_LAYOUT_IO,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    make_host_pool,
)
from tests.support.kv_content import check_device, check_host, write_device

PAIRS = sorted(SUPPORTED_LAYOUT_IO)
L, H, D, C = 3, 2, 8, 12


def device_pool(mla: bool, page: int, size: int = 64, dtype=torch.float32):
    if mla:
        return MLATokenToKVPool(
            size, page, dtype, kv_lora_rank=C - 4, qk_rope_head_dim=4, layer_num=L, device="cpu"
        )
    return MHATokenToKVPool(size, page, dtype, head_num=H, head_dim=D, layer_num=L, device="cpu")


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffer_shapes(mla: bool, layout: str) -> None:
    dev = device_pool(mla, 4, size=16)
    host = make_host_pool(dev, 2.0, 0, layout)
    t, p = 32, 8
    want = {
        (False, "layer_first"): (2, L, t, H, D),
        (False, "page_first"): (2, t, L, H, D),
        (False, "page_first_direct"): (2, p, L, 4, H, D),
        (True, "layer_first"): (L, t, 1, C),
        (True, "page_first"): (t, L, 1, C),
        (True, "page_first_direct"): (p, L, 4, 1, C),
    }[(mla, layout)]
    assert tuple(host.kv_buffer.shape) == want
    assert host.size == t and host.page_num == p and not host.pinned
    assert host.available_size() == t


def test_sizing_by_ratio_and_gb_rounds_up_to_pages() -> None:
    dev = device_pool(False, 16, size=64)
    assert MHATokenToKVPoolHost(dev, 1.1, 0, 16, "layer_first").size == 80  # 70.4 -> 5 pages
    per_token = 2 * L * H * D * 4
    gb = 100 * per_token / 1e9  # 100 tokens -> 7 pages of 16
    assert MHATokenToKVPoolHost(dev, 2.0, gb, 16, "layer_first").size == 112
    with pytest.raises(ValueError, match="page_size"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")
    with pytest.raises(ValueError, match="layout"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_head")


def test_ram_refusal_happens_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("allocated before the RAM check")

    monkeypatch.setattr(host_memory, "alloc_host_buffer", boom)
    dev = device_pool(False, 1)
    with pytest.raises(ValueError, match="hicache_size"):
        MHATokenToKVPoolHost(dev, 2.0, 1e6, 1, "layer_first")  # a petabyte
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: 10 * 1024**3)
    monkeypatch.setattr(host_memory, "host_memory_reserve_bytes", lambda: 10 * 1024**3 - 1000)
    with pytest.raises(ValueError, match="host RAM"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 1, "layer_first")  # 128 tokens x 384 B > 1000 B


def test_pinned_fallback_is_refused_when_its_rounded_size_does_not_fit(monkeypatch) -> None:
    """``cudaHostRegister`` fails; the fallback would pin a power of two: 12.9 GB becomes 16 GB,
    which must fit the RAM budget too, not only the exact size checked before allocating."""
    assert host_memory.pinned_fallback_bytes(int(12.9e9)) == 16 * 1024**3
    assert host_memory.pinned_fallback_bytes(4096) == 4096
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("R", (), {
        "cudaHostRegister": staticmethod(lambda ptr, n, flags: 1)})())  # fmt: skip

    def no_pinning(*args, **kwargs):
        raise AssertionError("pinned past the RAM check")

    dims = (3, 1000)  # 12000 B of float32, rounded to 16384 B
    monkeypatch.setattr(host_memory, "host_memory_reserve_bytes", lambda: 0)
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: 14000)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: (
        no_pinning() if pin_memory else real_empty(*a, **k)))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        host_memory.alloc_host_buffer(dims, torch.float32, pin=True)
    monkeypatch.setattr(host_memory, "host_memory_available_bytes", lambda: 20000)
    with pytest.raises(AssertionError, match="pinned past"):  # fits: the fallback pins
        host_memory.alloc_host_buffer(dims, torch.float32, pin=True)


def test_unsupported_layout_io_pair_raises() -> None:
    dev = device_pool(False, 1)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 1, "page_first")
    idx = torch.arange(1, 3)
    with pytest.raises(ValueError, match="io_backend"):
        host.backup_from_device_all_layer(dev, idx, idx, "direct")
    with pytest.raises(ValueError, match="differ in length"):
        host.backup_from_device_all_layer(dev, idx, idx[:1], "kernel")


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout,io", PAIRS)
@pytest.mark.parametrize("page", [1, 16])
def test_backup_then_load_round_trip(mla: bool, layout: str, io: str, page: int) -> None:
    g = torch.Generator().manual_seed(page)
    dev = device_pool(mla, page, size=64, dtype=torch.bfloat16 if page == 1 else torch.float32)
    host = make_host_pool(dev, 2.0, 0, layout)
    dev_alloc_pages = torch.randperm(64 // page, generator=g)[: 32 // page] + 1
    dslots = (dev_alloc_pages[:, None] * page + torch.arange(page)).reshape(-1)
    tokens = torch.randint(0, 100, (32,), generator=g)
    positions = torch.arange(32)
    write_device(dev, dslots, tokens, positions)
    host.alloc(16)  # so host slots do not start at 0
    hslots = host.alloc(32)
    hslots = hslots.view(-1, page)[torch.randperm(32 // page, generator=g)].reshape(-1)
    host.backup_from_device_all_layer(dev, hslots, dslots, io)
    check_host(host, hslots, tokens, positions)
    untouched = torch.arange(16)
    before = [t.clone() for t in host.get_kv_slots(1, untouched)]
    assert all(b.abs().sum() == 0 for b in before)

    # load back into fresh device slots, layer by layer
    new_pages = torch.tensor(sorted(set(range(1, 65 // page)) - set(dev_alloc_pages.tolist())))
    new = (new_pages[: 32 // page, None] * page + torch.arange(page)).reshape(-1)
    snapshot = (dev.kv_buffer if not mla else dev.kv_buffer_all).clone()
    for layer in range(L):
        host.load_to_device_per_layer(dev, hslots, new, layer, io)
    check_device(dev, new, tokens, positions)
    check_device(dev, dslots, tokens, positions)  # the source is unchanged
    after = dev.kv_buffer if not mla else dev.kv_buffer_all
    mask = torch.ones(after.shape[-3], dtype=torch.bool)
    mask[new] = False
    assert torch.equal(after[..., mask, :, :], snapshot[..., mask, :, :])


def test_get_set_slot_helpers() -> None:
    dev = device_pool(True, 4, size=16)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "page_first_direct")
    idx = torch.tensor([5, 6])
    host.set_kv_slots(2, idx, torch.full((2, 1, C), 7.0))
    (kv,) = host.get_kv_slots(2, idx)
    assert kv.eq(7).all() and host.get_kv_slots(1, idx)[0].eq(0).all()
    with pytest.raises(ValueError):
        host.get_kv_slots(0, torch.tensor([32]))
    last_layer = host.get_kv_slots(host.layer_num - 1, idx)[0].clone()
    for bad in (-1, host.layer_num):
        with pytest.raises(ValueError, match="layer_id"):
            host.set_kv_slots(bad, idx, torch.full((2, 1, C), 9.0))
    assert torch.equal(host.get_kv_slots(host.layer_num - 1, idx)[0], last_layer)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_host_pool_is_registered_at_exact_size(layout: str) -> None:
    dev = MHATokenToKVPool(
        48, 16, torch.bfloat16, head_num=2, head_dim=64, layer_num=2, device="cuda"
    )
    host = MHATokenToKVPoolHost(dev, 3.0, 0, 16, layout)
    assert host.pinned and host._registered  # cudaHostRegister, not pin_memory()
    assert host.kv_buffer.is_pinned()
    assert host.mem_bytes() == host.size * host.size_per_token  # exact, no power-of-two rounding
    if layout == "layer_first":
        assert host.k_data_ptrs.device.type == "cuda"
        assert int(host.k_data_ptrs[1]) == host.k_buffer[1].data_ptr()
    host.destroy()
    assert not host._registered
    host.destroy()  # idempotent


def test_cpu_host_pool_is_not_pinned() -> None:
    host = MHATokenToKVPoolHost(device_pool(False, 1), 2.0, 0, 1, "layer_first")
    assert not host.pinned and not host._registered
    assert host.k_data_ptrs.device.type == "cpu"


def test_the_host_ram_reserve_can_be_overridden_and_a_bad_value_is_named(monkeypatch) -> None:
    from hicache_prefill.hicache.memory import host_ram

    monkeypatch.setenv(host_ram.RESERVE_ENV, "1234")
    assert host_ram.host_memory_reserve_bytes() == 1234
    monkeypatch.setenv(host_ram.RESERVE_ENV, "nan")
    with pytest.raises(ValueError, match=host_ram.RESERVE_ENV):
        host_ram.host_memory_reserve_bytes()
