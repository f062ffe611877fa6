"""This project's device pools as SGLang 0.5.23's buffer descriptions (``device_pool_info``), for
host pools that take one instead of the device pool. Imports SGLang only when called."""

from __future__ import annotations

from typing import Any


def sglang_buffer_info(device_pool: Any) -> Any:
    """``MHABufferInfo`` (pool with ``k_buffer``) or ``MLABufferInfo`` over the pool's own tensors
    and pointer tables (no copy); ``ImportError`` when SGLang has no ``device_pool_info``."""
    from sglang.srt.mem_cache import device_pool_info as info

    if hasattr(device_pool, "k_buffer"):
        k, v = tuple(device_pool.k_buffer), tuple(device_pool.v_buffer)
        return info.MHABufferInfo(
            buffers=info.KVBuffers(
                k=k,
                v=v,
                k_data_ptrs=device_pool.k_data_ptrs,
                v_data_ptrs=device_pool.v_data_ptrs,
                layout=info.KVBufferLayout.NHD,
            ),
            page_size=device_pool.page_size,
            head_num=device_pool.head_num,
            head_dim=device_pool.head_dim,
            v_head_dim=device_pool.v_head_dim,
            dtype=device_pool.store_dtype,
            device=k[0].device,
        )
    buffers = tuple(device_pool.kv_buffer)
    return info.MLABufferInfo(
        buffers=buffers,
        data_ptrs=device_pool.data_ptrs,
        layer_indices=tuple(range(device_pool.layer_num)),
        device_layer_num=device_pool.layer_num,
        page_size=device_pool.page_size,
        kv_lora_rank=device_pool.kv_lora_rank,
        qk_rope_head_dim=device_pool.qk_rope_head_dim,
        kv_cache_dim=device_pool.kv_cache_dim,
        dtype=device_pool.store_dtype,
        device=buffers[0].device,
    )


def sglang_device_pool_infos(device_pool: Any) -> tuple[Any, ...]:
    """SGLang 0.5.23's ``get_device_pool_infos()``: one ``DevicePoolInfo`` of the KV pool."""
    from sglang.srt.mem_cache.device_pool_info import DevicePoolInfo
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return (
        DevicePoolInfo(
            pool_name=PoolName.KV,
            indices_from_pool=PoolName.KV,
            layer_ids=tuple(device_pool.model_layer_ids),
            buffer_info=sglang_buffer_info(device_pool),
        ),
    )
