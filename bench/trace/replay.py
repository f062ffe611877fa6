"""A Mooncake-format trace (``timestamp`` ms, ``input_length``, a ``hash_ids`` entry per block,
covering it and all before) replayed by ``lru_hits`` (device-only ``RadixCache``) and
``replay_tiers`` (the product's cache at 4 bytes a token, L3 ``HiCacheFile`` in a temporary
directory, copies drained after each request so it is deterministic; ``check_integrity`` ends it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import astuple, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_prefill.hicache.builder import KVCache, build_kv_cache
from hicache_prefill.hicache.storage.io.workers import CacheRequestHandle
from hicache_prefill.hicache.tree.radix_cache import RadixCache
from hicache_prefill.server_args import ServerArgs

BLOCK = 512
TOKEN_BYTES = 4  # K and V of one layer, one head, head_dim 1, float16
UNBOUNDED = -1  # an L3 tier without a byte budget


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path | str, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests of ``path`` (all when ``None``), in file order."""
    with open(path) as f:
        rows = [json.loads(line) for line in islice((x for x in f if x.strip()), limit)]
    return [Request(r["timestamp"] / 1e3, r["input_length"], tuple(r["hash_ids"])) for r in rows]


def tokens(req: Request, block: int = BLOCK) -> np.ndarray:
    """The prompt's ``input_length`` token ids (int64): block ``h`` is ``h * block`` onwards, so
    equal hash ids give equal tokens and different ones disjoint tokens."""
    n = len(req.hash_ids)
    if n != -(-req.input_length // block) or n == 0:
        raise ValueError(f"{n} hash ids for {req.input_length} tokens of blocks of {block}")
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    return (ids[:, None] * block + np.arange(block, dtype=np.int64)).reshape(-1)[: req.input_length]


@dataclass(frozen=True)
class Tiers:
    """Capacities in tokens; ``host`` 0: device only; ``l3`` 0: none, ``UNBOUNDED``: no budget."""

    device: int
    host: int = 0
    l3: int = 0

    def label(self) -> str:
        s = {UNBOUNDED: "inf", 0: "-"}
        return "/".join(
            s.get(n, f"{n / 2**20:g}Mi" if n >= 2**18 else str(n)) for n in astuple(self)
        )


def lru_hits(reqs: list[Request], capacity: int | None, block: int) -> np.ndarray:
    """Tokens each request finds in an LRU tree of ``capacity`` tokens (``None``: no limit)."""
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
    model = dict(device="cpu", dtype="float16", num_layers=1, head_num=1, head_dim=1)
    pages = dict(max_total_tokens=t.device, page_size=block, load_back_threshold=block)
    hi = dict(enable_hierarchical_cache=bool(t.host), hicache_ratio=max(t.host, 1) / t.device)
    hi.update(hicache_write_policy=policy, hicache_mem_layout="layer_first")
    hi.update(hicache_io_backend="direct", hicache_storage_prefetch_policy="wait_complete")
    if t.l3:
        extra = {"file_storage_path": l3_dir, "prefetch_threshold": block}
        extra.update({"max_size": t.l3 * TOKEN_BYTES} if t.l3 > 0 else {})
        hi.update(hicache_storage_backend="file")
        hi.update(hicache_storage_backend_extra_config=json.dumps(extra))
    return ServerArgs(**model, **pages, **hi)


def _serve(kv: KVCache, key: np.ndarray, rid: str) -> tuple[int, int, int]:
    """One request as the executor serves it: L3 prefetch (``wait_complete``), match, load back,
    lock, allocate, insert, unlock; its (device, host, L3) hit tokens."""
    tree, st = kv.tree, kv.storage

    tick = lambda: (tree.check_hicache_events(), time.sleep(1e-4))
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
    slots = torch.cat([prefix, kv.alloc_device(len(key) - len(prefix))])
    if tree.insert(key, slots) != len(prefix):
        raise AssertionError(f"request {rid}: insert found more than the match")
    tree.dec_lock_ref(last)
    busy = lambda: tree.ongoing_write_through or tree.ongoing_load_back
    while kv.hierarchical and (busy() or (st is not None and st.ops_in_flight())):
        tick()
    tree.check_hicache_events()
    dev, l3 = len(m.device_indices), min(from_l3, len(prefix) - len(m.device_indices))
    return dev, len(prefix) - dev - l3, l3


def replay_tiers(reqs: list[Request], t: Tiers, policy: str, block: int) -> dict[str, Any]:
    """Per-request hit tokens per tier (``hits``), ``pages`` counters and ``wall_s``."""
    if (t.l3 and not t.host) or max(r.input_length // block * block for r in reqs) > t.device:
        raise ValueError(f"{t}: L3 needs a host pool; the device, a prompt's whole pages")
    if "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" in os.environ:
        raise ValueError("unset SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR: it overrides the L3 dir")
    hits = np.zeros((len(reqs), 3), dtype=np.int64)
    seen, recomputed = set(), 0  # hash ids computed before, pages computed again
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
            computed = sum(r.input_length // block for r in reqs) - int(hits.sum()) // block
            pages = {"computed": computed, "backed_up": c.backed_up_tokens // block}
            pages.update(loaded_back=c.loaded_tokens // block, recomputed=recomputed)
            pages["stored_l3"] = s.backup_tokens // block if s else 0
            pages["fetched_l3"] = s.prefetch_inserted_tokens // block if s else 0
        finally:
            kv.close()
    hits_by_tier = dict(zip(("device", "host", "l3"), hits.T, strict=True))
    return {"hits": hits_by_tier, "pages": pages, "wall_s": wall}
