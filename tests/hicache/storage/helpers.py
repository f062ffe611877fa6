"""Helpers of the storage tests: small host pools of every kind, random page content compared
byte for byte slot by slot, and an in-memory ``HiCacheStorage`` (also the ``dynamic`` backend of
the factory tests)."""

from __future__ import annotations

from typing import Any

import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import HostKVPool, make_host_pool
from hicache_prefill.hicache.storage.base import HiCacheStorage

L, H, D, DV, C = 3, 2, 8, 4, 12
KINDS = ("mha", "mha_v", "mla")  # mha_v: V heads narrower than K heads


def device_pool(kind: str, page: int = 4, size: int = 16, dtype: torch.dtype = torch.float32):
    if kind == "mla":
        return MLATokenToKVPool(size, page, dtype, kv_lora_rank=C - 4, qk_rope_head_dim=4,
                                layer_num=L, device="cpu")  # fmt: skip
    v_dim = DV if kind == "mha_v" else None
    return MHATokenToKVPool(size, page, dtype, head_num=H, head_dim=D, layer_num=L,
                            device="cpu", v_head_dim=v_dim)  # fmt: skip


def host_pool(
    kind: str, layout: str, page: int = 4, dtype: torch.dtype = torch.float32, size: int = 16
) -> HostKVPool:
    """A host pool of ``2 * size`` slots over a fresh device pool."""
    return make_host_pool(device_pool(kind, page, size, dtype), 2.0, 0, layout)


def fill_random(host: HostKVPool, seed: int) -> None:
    """Random bytes in every slot (any bit pattern, NaNs included: compare bytes)."""
    gen = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def slot_bytes(host: HostKVPool, slots: torch.Tensor | list[int]) -> list[torch.Tensor]:
    """The bytes of ``slots`` per layer and part, in slot order (layout-independent)."""
    idx = torch.as_tensor(slots, dtype=torch.int64)
    out = []
    for layer in range(host.layer_num):
        for part in host.get_kv_slots(layer, idx):
            out.append(part.contiguous().view(torch.uint8).reshape(idx.numel(), -1).clone())
    return out


def same_slots(a: HostKVPool, a_slots: Any, b: HostKVPool, b_slots: Any) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(slot_bytes(a, a_slots), slot_bytes(b, b_slots), strict=True)
    )


class MemoryStorage(HiCacheStorage):
    """Pages in a dict (bytes), built as a ``dynamic`` backend is: ``(config, kwargs)``."""

    def __init__(self, storage_config: Any = None, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.kwargs = kwargs
        self.pages: dict[str, torch.Tensor] = {}

    def get(self, key, target_location=None, target_sizes=None):
        page = self.pages.get(key)
        if page is None or page.numel() != target_location.numel() * target_location.element_size():
            return None
        target_location.view(torch.uint8).reshape(-1).copy_(page)
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self.pages[key] = value.contiguous().view(torch.uint8).reshape(-1).clone()
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key):
        return key in self.pages

    def clear(self):
        self.pages.clear()
        return True


class NotAStorage:
    """A class that is not a ``HiCacheStorage`` (for the factory's refusal)."""
