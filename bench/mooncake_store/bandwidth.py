"""Put and get bandwidth of ``MooncakeStore`` against a memcpy of the same objects measured in the
same run, at pages of 1, 16 and 64 tokens (the ``bandwidth`` command of
``bench.mooncake_store.node``, run inside a node process: a Mooncake client needs the loopback
shim).

The tier's own path: ``batch_set_v1`` (a ``batch_is_exist`` then one ``batch_put_from`` of the
missing objects) and ``batch_get_v1`` (one ``batch_get_into`` straight into the host slots), 128
pages per call as the storage threads call them, over a host pool of the Llama-3-8B KV shape at
TP 1 (32 layers, 8 KV heads of 128, bfloat16: 64 KiB per token and part, so one object is 64 KiB
at page 1, 1 MiB at page 16 and 4 MiB at page 64). Each repeat puts fresh keys (so every object
is written), reads them back into other slots (checked byte for byte), then removes them, so
the next repeat's objects reuse segment memory already touched (a warmed-up store; the first
touch of a segment roughly halves put speed, which the untimed warm-up round absorbs). Ceilings
of the same bytes between the same slots, in the same run: ``memmove`` object by object on one
thread (``memcpy``), and one ``torch`` copy of the whole range on every core (``bulk copy``).
Medians of ``repeats``.

Placement, by who owns the segments on the master: ``local`` (this client's own segment is the
only one: Mooncake copies within the process) or ``remote`` (this client mounts none, another
process owns the only segment: every byte crosses TCP loopback).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import statistics
import time
from typing import Any

import torch

from hicache.memory.device_pool import MHATokenToKVPool
from hicache.memory.host_pool_factory import make_host_pool
from hicache.storage.backend_factory import StorageBackendFactory
from hicache.storage.base import STORAGE_BATCH_SIZE
from hicache.storage.config import storage_config_for_pool

GEOMETRY = dict(layers=32, heads=8, head_dim=128, dtype=torch.bfloat16)
PAGE_SIZES = (1, 16, 64)


def _median_gbps(nbytes: int, times: list[float]) -> float:
    t = statistics.median(times)
    return nbytes / t / 1e9 if t > 0 else 0.0


def measure(extra: dict, page: int, total_bytes: int, repeats: int = 3) -> dict[str, Any]:
    """One row: put, get and memcpy GB/s over ``total_bytes`` of pages of ``page`` tokens."""
    g = GEOMETRY
    per_token = 2 * g["layers"] * g["heads"] * g["head_dim"] * torch.finfo(g["dtype"]).bits // 8
    pages = max(1, total_bytes // (per_token * page))
    tokens = pages * page
    dev = MHATokenToKVPool(tokens, page, g["dtype"], g["heads"], g["head_dim"], g["layers"],
                           "cpu")  # fmt: skip
    host = make_host_pool(dev, 2.0, 0, "page_first")  # sources, then as many destinations
    raw = host.kv_buffer.view(torch.uint8)
    raw[:, : tokens].copy_(torch.randint(0, 256, raw[:, :tokens].shape, dtype=torch.uint8))
    cfg = storage_config_for_pool(host, f"bench/bw{page}", extra_config=extra)
    store = StorageBackendFactory.create_backend("mooncake", cfg, host)
    try:
        store.register_mem_pool_host(host)
        src = torch.arange(tokens, dtype=torch.int64)
        dst = src + tokens
        nbytes = pages * host.page_nbytes
        src_meta = host.get_page_buffer_meta(src)
        dst_meta = host.get_page_buffer_meta(dst)
        puts, gets, copies, bulks, failed = [], [], [], [], 0
        for r in range(repeats + 1):
            keys = [hashlib.sha256(f"bw{page}-{r}-{i}".encode()).hexdigest() for i in range(pages)]
            raw[:, tokens : 2 * tokens].zero_()
            t0 = time.perf_counter()
            ok_put = _calls(store.batch_set_v1, keys, src, page)
            t1 = time.perf_counter()
            ok_get = _calls(store.batch_get_v1, keys, dst, page)
            t2 = time.perf_counter()
            failed += pages - sum(ok_put) + pages - sum(ok_get)
            if not failed and not torch.equal(raw[:, :tokens], raw[:, tokens : 2 * tokens]):
                raise AssertionError(f"page {page}: bytes read back differ from those put")
            t3 = time.perf_counter()
            for d, s, n in zip(dst_meta[0], src_meta[0], src_meta[1], strict=True):
                ctypes.memmove(d, s, n)
            t4 = time.perf_counter()
            bulk = _bulk_copy_s(raw, tokens)
            store.client.call("remove_all", True)  # the next repeat reuses this memory
            if r:  # round 0 warms the segment up
                puts.append(t1 - t0)
                gets.append(t2 - t1)
                copies.append(t4 - t3)
                bulks.append(bulk)
        return {
            "page_tokens": page, "pages": pages, "object_bytes": src_meta[1][0],
            "bytes": nbytes, "repeats": repeats, "failed_pages": failed,
            "put_gbps": _median_gbps(nbytes, puts), "get_gbps": _median_gbps(nbytes, gets),
            "memcpy_gbps": _median_gbps(nbytes, copies),
            "bulk_copy_gbps": _median_gbps(nbytes, bulks),
            "put_us_per_page": statistics.median(puts) / pages * 1e6,
            "get_us_per_page": statistics.median(gets) / pages * 1e6,
        }  # fmt: skip
    finally:
        store.client.call("remove_all", True)  # the next row starts from an empty store
        store.close()


def _bulk_copy_s(raw: torch.Tensor, tokens: int) -> float:
    """Seconds of one copy of the source slots onto the destination slots on every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        t0 = time.perf_counter()
        raw[:, tokens : 2 * tokens].copy_(raw[:, :tokens])
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)


def _calls(fn: Any, keys: list[str], slots: torch.Tensor, page: int) -> list[bool]:
    out: list[bool] = []
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[s : s + STORAGE_BATCH_SIZE]
        out += fn(batch, slots[s * page : (s + len(batch)) * page])
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'placement':>10} {'page':>5} {'object':>9} {'put GB/s':>9} {'get GB/s':>9} "
          f"{'memcpy GB/s':>12} {'bulk GB/s':>10} {'put us/pg':>10} {'get us/pg':>10}")
    for r in rows:
        print(f"{r['placement']:>10} {r['page_tokens']:>5} {r['object_bytes'] >> 10:>7}Ki "
              f"{r['put_gbps']:>9.2f} {r['get_gbps']:>9.2f} {r['memcpy_gbps']:>12.2f} "
              f"{r['bulk_copy_gbps']:>10.2f} {r['put_us_per_page']:>10.0f} "
              f"{r['get_us_per_page']:>10.0f}")  # fmt: skip
