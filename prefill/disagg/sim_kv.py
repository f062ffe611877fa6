"""The simulated decode side's KV: its pool, the simulated RDMA read of a send into it, and what
landed. The one place of the decode simulation that tells an MHA pool (K and V buffers per layer)
from an MLA pool (one latent buffer per layer); ``sim_side`` and ``sim_peer`` call only this.

- ``decode_pool_like(src_pool, size)``: a zeroed pool of the prefill pool's kind and geometry.
- ``copy_send(src_pool, dst_pool, src, dst, block_quota)``: every layer's KV of prefill slots
  ``src`` into decode slots ``dst`` through the project's copy ops. CUDA: one all-layer kernel
  over the pools' ``data_ptr`` tables, queued on the current (compute) stream, so it reads the KV
  after the forward that wrote it (MLA: ``kernels.transfer_kv_all_layer_mla`` on the latent
  tables; MHA: ``kernels.transfer_kv_all_layer`` on K and V, or one ``_mla`` call per buffer when
  K and V heads differ in width, since a table carries no width). CPU: the direct op
  (``kernels.transfer_kv_direct``: one ``copy_`` per run of consecutive slots and layer buffer),
  under the lock the side streams' copies take.
- ``read_kv(pool, slots)``: what a pool holds at ``slots``, one tensor per buffer kind, each
  ``[L, n, ...]``: ``(k, v)`` for MHA, ``(kv,)`` for MLA, in the order
  ``PagedTransformer.forward_reference`` returns its caches.
- ``write_kv(pool, slots, kv)``: the inverse, ``read_kv``'s tensors written at ``slots`` (a
  replay's scratch pool seeded with what decode received).
"""

from __future__ import annotations

import logging

import torch

import kernels
from hicache.memory.device_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool
from hicache.transfer.streams import CPU_COPY_LOCK

__all__ = ["copy_send", "decode_pool_like", "read_kv", "write_kv"]

logger = logging.getLogger(__name__)


def decode_pool_like(src_pool: KVPool, size: int) -> KVPool:
    """The decode instance's pool: ``src_pool``'s kind and geometry (layers, KV heads and their
    widths or the latent's, dtype, page size, device), ``size`` slots, zeroed."""
    p = src_pool
    if isinstance(p, MLATokenToKVPool):
        return MLATokenToKVPool(size, p.page_size, p.dtype, p.kv_lora_rank, p.qk_rope_head_dim,
                                p.layer_num, p.device)  # fmt: skip
    return MHATokenToKVPool(size, p.page_size, p.dtype, p.head_num, p.head_dim, p.layer_num,
                            p.device, v_head_dim=p.v_head_dim)  # fmt: skip


def _buffers(pool: KVPool) -> list[list[torch.Tensor]]:
    """The pool's per-layer buffers, one list per kind (MLA: the latent; MHA: K, then V)."""
    if isinstance(pool, MLATokenToKVPool):
        return [pool.kv_buffer]
    return [pool.k_buffer, pool.v_buffer]


def copy_send(
    src_pool: KVPool,
    dst_pool: KVPool,
    src: torch.Tensor,
    dst: torch.Tensor,
    block_quota: int,
    wait: bool = False,
) -> None:
    """Copy every layer's KV of ``src_pool`` slots ``src`` into ``dst_pool`` slots ``dst``
    (int64 ``[n]`` each; pools of one kind and geometry). ``block_quota``: programs of the CUDA
    kernel. ``wait``: on CUDA, block until the copy finished (CPU copies always have). Mutates
    ``dst_pool`` at ``dst`` only; raises ``ValueError`` for pools of different kinds."""
    if isinstance(src_pool, MLATokenToKVPool) != isinstance(dst_pool, MLATokenToKVPool):
        raise ValueError(
            f"dst_pool: {type(dst_pool).__name__} cannot receive a {type(src_pool).__name__}'s KV"
        )
    if src_pool.device.type == "cpu":
        with CPU_COPY_LOCK:  # the side streams' copies touch the same pool
            kernels.transfer_kv_direct(
                [t for kind in _buffers(src_pool) for t in kind],
                [t for kind in _buffers(dst_pool) for t in kind],
                src, dst, page_size=1,
            )  # fmt: skip
        return
    s, d, layers = src.to(src_pool.device), dst.to(dst_pool.device), src_pool.layer_num
    if isinstance(src_pool, MLATokenToKVPool):
        kernels.transfer_kv_all_layer_mla(
            src_pool.data_ptrs, dst_pool.data_ptrs, s, d, src_pool.item_size, layers,
            block_quota=block_quota,
        )  # fmt: skip
    elif src_pool.v_item_size == src_pool.item_size:
        kernels.transfer_kv_all_layer(
            src_pool.k_data_ptrs, dst_pool.k_data_ptrs, src_pool.v_data_ptrs,
            dst_pool.v_data_ptrs, s, d, src_pool.item_size, layers, block_quota=block_quota,
        )  # fmt: skip
    else:  # K and V of different widths: one table copy per buffer, each with its width
        for tables, item in (("k_data_ptrs", src_pool.item_size),
                             ("v_data_ptrs", src_pool.v_item_size)):  # fmt: skip
            kernels.transfer_kv_all_layer_mla(
                getattr(src_pool, tables), getattr(dst_pool, tables), s, d, item, layers,
                block_quota=block_quota,
            )  # fmt: skip
    if wait:
        torch.cuda.current_stream(src_pool.device).synchronize()


def read_kv(pool: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of what ``pool`` holds at ``slots`` (int64 ``[n]``), one ``[L, n, ...]`` tensor per
    buffer kind: MHA ``(k [L, n, H, D], v [L, n, H, D_v])``, MLA ``(kv [L, n, 1, C],)``."""
    return tuple(torch.stack([layer[slots] for layer in kind]) for kind in _buffers(pool))


def write_kv(pool: KVPool, slots: torch.Tensor, kv: tuple[torch.Tensor, ...]) -> None:
    """Write ``kv`` (as ``read_kv`` returns it: one ``[L, n, ...]`` tensor per buffer kind, any
    device) at ``pool`` slots ``slots`` (int64 ``[n]``). ``ValueError`` (pool unchanged) when
    the number of kinds, layers or tokens differs."""
    kinds = _buffers(pool)
    fits = len(kv) == len(kinds) and all(
        tuple(t.shape[:2]) == (len(k), len(slots)) for t, k in zip(kv, kinds, strict=True)
    )
    if not fits:
        shapes = [tuple(t.shape) for t in kv]
        raise ValueError(f"kv: {shapes} does not fit {len(kinds)} kinds of {pool.layer_num} "
                         f"layers at {len(slots)} slots")  # fmt: skip
    for tensors, layers in zip(kv, kinds, strict=True):
        for layer, buf in enumerate(layers):
            buf[slots] = tensors[layer].to(buf.device, buf.dtype)
