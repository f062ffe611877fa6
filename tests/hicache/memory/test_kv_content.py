"""The KV content helpers themselves: empty slot lists are a no-op, and a check still catches a
single wrong element and a length mismatch."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import LAYOUTS, make_host_pool
from tests.support.kv_content import check_device, check_host, write_device, write_host

PAGE = 4


def device_pool(mla: bool) -> MHATokenToKVPool | MLATokenToKVPool:
    if mla:
        return MLATokenToKVPool(
            16, PAGE, torch.float32, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=2, device="cpu"
        )
    return MHATokenToKVPool(
        16, PAGE, torch.float32, head_num=2, head_dim=8, layer_num=2, device="cpu"
    )


def snapshot(buf: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of a pool's buffer (one tensor, or MLA's per-layer list)."""
    return [t.clone() for t in (buf if isinstance(buf, list) else [buf])]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("empty", [[], torch.empty(0, dtype=torch.int64)], ids=["list", "tensor"])
def test_empty_slot_lists_write_nothing_and_check_passes(mla, layout, empty) -> None:
    dev = device_pool(mla)
    host = make_host_pool(dev, 2.0, 0, layout)
    dev_before, host_before = snapshot(dev.kv_buffer), snapshot(host.kv_buffer)
    write_device(dev, empty, empty, empty)
    write_host(host, empty, empty, empty)
    check_device(dev, empty, empty, empty)
    check_host(host, empty, empty, empty)
    for before, after in ((dev_before, dev.kv_buffer), (host_before, host.kv_buffer)):
        assert all(map(torch.equal, before, snapshot(after)))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_checks_still_catch_one_bad_element_and_length_mismatch(mla) -> None:
    dev = device_pool(mla)
    slots, tokens, positions = [4, 5, 9], [7, 8, 7], [0, 1, 2]
    write_device(dev, slots, tokens, positions)
    check_device(dev, slots, tokens, positions)
    buf = dev.kv_buffer[1] if mla else dev.v_buffer[1]
    buf[9].view(-1)[3] += 1
    with pytest.raises(AssertionError, match="slot 9 .* layer 1"):
        check_device(dev, slots, tokens, positions)
    with pytest.raises(ValueError, match="differ in length"):
        check_device(dev, [], tokens, positions)
