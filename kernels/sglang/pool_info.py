"""Describe this project's device pools in SGLang's own terms, for SGLang versions whose host pools
take a buffer description instead of the device pool (0.5.23: ``MHABufferInfo`` /
``MLABufferInfo`` from ``sglang.srt.mem_cache.device_pool_info``).

Imports SGLang only when called; imports nothing of this project.
"""

from __future__ import annotations

from typing import Any


def sglang_buffer_info(device_pool: Any) -> Any:
    """SGLang's ``MHABufferInfo`` (pool with ``k_buffer``) or ``MLABufferInfo`` (pool with
    ``kv_buffer``) over ``device_pool``'s own tensors and pointer tables (no copy).

    Reads the attributes SGLang's device pools carry: ``k_buffer`` / ``v_buffer`` (per-layer
    ``[T, H, D]`` / ``[T, H, Dv]`` views), ``k_data_ptrs`` / ``v_data_ptrs``, ``head_num``,
    ``head_dim``, ``v_head_dim``, ``page_size``, ``store_dtype``; for MLA ``kv_buffer``,
    ``data_ptrs``, ``layer_num``, ``kv_lora_rank``, ``qk_rope_head_dim``, ``kv_cache_dim``.
    Raises ``ImportError`` when the installed SGLang has no ``device_pool_info`` module.
    """
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
    """SGLang 0.5.23's ``get_device_pool_infos()`` of ``device_pool``: one ``DevicePoolInfo`` of
    the KV pool (``PoolName.KV`` for both names, ``model_layer_ids``, ``sglang_buffer_info``)."""
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
