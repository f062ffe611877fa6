"""A trace through the project's own trees: the LRU curve and the tiered replay.

``lru_hits``: the device-only ``RadixCache`` as a simulated tree (no allocator), trimmed to the
capacity by its own LRU eviction after each insert, so any capacity works. ``replay_tiers``:
``build_kv_cache`` at full size with 1 layer, 1 KV head, head_dim 1, float16 (4 bytes a token):
device pool, host pool, ``HiCacheController`` on inline CPU streams and ``HiRadixCache``; as L3
``HiCacheFile`` in a temporary directory (one file a page, 2 KiB at 512 tokens; ``max_size`` = L3
tokens x 4 bytes, its LRU evicting down to 90% when full). Per request as the executor does: L3
prefetch (``wait_complete``), match, load back, lock, allocate, insert, unlock; then every copy
and storage operation is drained, so a replay is deterministic; ``check_integrity`` ends it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.trace.load import Request, tokens
from hicache.builder import KVCache, build_kv_cache
from hicache.storage.io.operations import CacheRequestHandle
from hicache.tree.radix_cache import RadixCache
from server_args import ServerArgs

TOKEN_BYTES = 4  # K and V of one layer, one head, head_dim 1, float16
UNBOUNDED = -1  # an L3 tier without a byte budget


@dataclass(frozen=True)
class Tiers:
    """Capacities in tokens; ``host`` 0: device only; ``l3`` 0: none, ``UNBOUNDED``: no budget."""

    device: int
    host: int = 0
    l3: int = 0

    def label(self) -> str:
        def size(n: int) -> str:
            return (
                "inf" if n < 0 else "-" if n == 0 else f"{n / 2**20:g}Mi" if n >= 2**18 else str(n)
            )

        return f"{size(self.device)}/{size(self.host)}/{size(self.l3)}"


def lru_hits(reqs: list[Request], capacity: int | None, block: int) -> np.ndarray:
    """Tokens each request finds cached in an LRU tree of ``capacity`` tokens (``None``: no
    limit)."""
    tree = RadixCache(None, block)
    hits = np.zeros(len(reqs), dtype=np.int64)
    for i, r in enumerate(reqs):
        key = tokens(r, block)
        hits[i] = tree.match_prefix(key).device_indices.numel()
        tree.insert(key)
        if capacity is not None and tree.total_size() > capacity:
            tree.evict(tree.total_size() - capacity)
    tree.check_integrity()
    return hits


def _args(t: Tiers, policy: str, block: int, l3_dir: str) -> ServerArgs:
    extra = {"file_storage_path": l3_dir, "prefetch_threshold": block}
    extra.update({"max_size": t.l3 * TOKEN_BYTES} if t.l3 > 0 else {})
    return ServerArgs(
        device="cpu",
        dtype="float16",
        num_layers=1,
        head_num=1,
        head_dim=1,
        max_total_tokens=t.device,
        page_size=block,
        load_back_threshold=block,
        enable_hierarchical_cache=bool(t.host),
        hicache_ratio=max(t.host, 1) / t.device,
        hicache_write_policy=policy,
        hicache_mem_layout="layer_first",
        hicache_io_backend="direct",
        hicache_storage_backend="file" if t.l3 else None,
        hicache_storage_backend_extra_config=json.dumps(extra) if t.l3 else None,
        hicache_storage_prefetch_policy="wait_complete",
    )


def _serve(kv: KVCache, key: np.ndarray, rid: str) -> tuple[int, int, int]:
    """One request (module docstring); its (device, host, L3) hit tokens."""
    tree, st = kv.tree, kv.storage

    def tick() -> None:
        tree.check_hicache_events()
        time.sleep(1e-4)

    from_l3 = 0
    if st is not None:
        m, h = tree.match_prefix(key), CacheRequestHandle(rid, 0)
        start = m.device_indices.numel() + m.host_hit_length
        if st.prefetch(h, m.last_host_node, key[start:].tolist(), start):
            while not st.check_prefetch_progress(h, 0.0):
                tick()
            from_l3 = st.take_loaded(h)
        st.release(h)
    m = tree.match_prefix(key)
    prefix, last = m.device_indices, m.last_device_node
    if m.host_hit_length:
        loaded, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
        tree.ready_to_load_host_cache()
        prefix = torch.cat([prefix, loaded])
    tree.inc_lock_ref(last)
    if tree.insert(key, torch.cat([prefix, kv.alloc_device(len(key) - len(prefix))])) != len(
        prefix
    ):
        raise AssertionError(f"request {rid}: insert found more than the match")
    tree.dec_lock_ref(last)
    while kv.hierarchical and (
        tree.ongoing_write_through
        or tree.ongoing_load_back
        or (st is not None and st.ops_in_flight())
    ):
        tick()
    tree.check_hicache_events()
    dev = len(m.device_indices)
    l3 = min(from_l3, len(prefix) - dev)
    return dev, len(prefix) - dev - l3, l3


def replay_tiers(reqs: list[Request], t: Tiers, policy: str, block: int) -> dict[str, Any]:
    """Per-request hit tokens per tier (``hits``), ``pages`` counters and ``wall_s``."""
    if (t.l3 and not t.host) or max(r.input_length // block * block for r in reqs) > t.device:
        raise ValueError(f"{t}: L3 needs a host pool; the device, a prompt's whole pages")
    if "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" in os.environ:
        raise ValueError("unset SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR: it overrides the L3 dir")
    hits = np.zeros((len(reqs), 3), dtype=np.int64)
    seen: set[int] = set()
    recomputed = 0
    with tempfile.TemporaryDirectory(prefix="trace-l3-") as l3_dir:
        kv = build_kv_cache(_args(t, policy, block, l3_dir), streams="inline" if t.host else None)
        try:
            t0 = time.perf_counter()
            for i, r in enumerate(reqs):
                full = r.input_length // block
                hits[i] = _serve(kv, tokens(r, block)[: full * block], str(i))
                recomputed += sum(x in seen for x in r.hash_ids[int(hits[i].sum()) // block : full])
                seen.update(r.hash_ids[:full])
            wall = time.perf_counter() - t0
            kv.check_integrity()
            c, s = kv.stats, kv.storage.stats if kv.storage is not None else None
            pages = {
                "computed": sum(r.input_length // block for r in reqs) - int(hits.sum()) // block,
                "backed_up": c.backed_up_tokens // block,
                "loaded_back": c.loaded_tokens // block,
                "recomputed": recomputed,
                "stored_l3": s.backup_tokens // block if s else 0,
                "fetched_l3": s.prefetch_inserted_tokens // block if s else 0,
            }
        finally:
            kv.close()
    return {
        "hits": dict(zip(("device", "host", "l3"), hits.T, strict=True)),
        "pages": pages,
        "wall_s": wall,
    }
