"""Put and get bandwidth of ``MooncakeStore`` against a copy of the same objects in memory, same
run; also the node process the benchmark runs it in (``python -m bench.mooncake_store.bandwidth``:
the bare-store commands of ``prefill.testing.node_stores`` plus ``bandwidth``), since a Mooncake
client needs the loopback shim.

The tier's own path, 128 pages per call: ``batch_set_v1`` (``batch_is_exist``, then one
``batch_put_from`` of the missing objects) and ``batch_get_v1`` (one ``batch_get_into`` straight
into other host slots, checked byte for byte), over a host pool of the Llama-3-8B KV shape at TP 1
(64 KiB per token and part: one object is 64 KiB at page 1, 1 MiB at page 16, 4 MiB at page 64).
Each repeat puts fresh keys, reads them back, then removes every object, so the next repeat
reuses segment memory already touched (the untimed first round touches it). The ceiling:
``memmove`` of the same objects between the same slots. Medians of ``repeats``.
"""

from __future__ import annotations

import ctypes
import hashlib
import statistics
import sys
import time
from typing import Any

import torch

from hicache.memory.device_pool import MHATokenToKVPool
from hicache.memory.host_pool_factory import make_host_pool
from hicache.storage.backend_factory import StorageBackendFactory
from hicache.storage.base import STORAGE_BATCH_SIZE
from hicache.storage.config import storage_config_for_pool
from prefill.testing.node_main import Node, main
from prefill.testing.node_stores import STORE_COMMANDS

LAYERS, HEADS, HEAD_DIM = 32, 8, 128  # bfloat16
PAGE_SIZES = (1, 16, 64)


def _calls(fn: Any, keys: list[str], slots: torch.Tensor, page: int) -> int:
    """Pages ``fn`` (``batch_set_v1`` / ``batch_get_v1``) reports done, 128 per call."""
    done = 0
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[s : s + STORAGE_BATCH_SIZE]
        done += sum(fn(batch, slots[s * page : (s + len(batch)) * page]))
    return done


def measure(extra: dict, page: int, total_bytes: int, repeats: int = 3) -> dict[str, Any]:
    """One row: put, get and memcpy GB/s of ``total_bytes`` in pages of ``page`` tokens."""
    pages = max(1, total_bytes // (2 * LAYERS * HEADS * HEAD_DIM * 2 * page))
    tokens = pages * page
    dev = MHATokenToKVPool(tokens, page, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = make_host_pool(dev, 2.0, 0, "page_first")  # sources, then as many destinations
    raw = host.kv_buffer.view(torch.uint8)
    raw[:, :tokens].copy_(torch.randint(0, 256, raw[:, :tokens].shape, dtype=torch.uint8))
    cfg = storage_config_for_pool(host, f"bench/bw{page}", extra_config=extra)
    store = StorageBackendFactory.create_backend("mooncake", cfg, host)
    src = torch.arange(tokens, dtype=torch.int64)
    src_meta, dst_meta = host.get_page_buffer_meta(src), host.get_page_buffer_meta(src + tokens)
    nbytes, failed, times = pages * host.page_nbytes, 0, {"put": [], "get": [], "memcpy": []}
    try:
        store.register_mem_pool_host(host)
        for r in range(repeats + 1):
            keys = [hashlib.sha256(f"bw{page}-{r}-{i}".encode()).hexdigest() for i in range(pages)]
            raw[:, tokens : 2 * tokens].zero_()
            t0 = time.perf_counter()
            failed += pages - _calls(store.batch_set_v1, keys, src, page)
            t1 = time.perf_counter()
            failed += pages - _calls(store.batch_get_v1, keys, src + tokens, page)
            t2 = time.perf_counter()
            if not failed and not torch.equal(raw[:, :tokens], raw[:, tokens : 2 * tokens]):
                raise AssertionError(f"page {page}: the bytes read back differ from those put")
            for d, s, n in zip(dst_meta[0], src_meta[0], src_meta[1], strict=True):
                ctypes.memmove(d, s, n)
            t3 = time.perf_counter()
            store.client.call("remove_all", True)  # forced: objects just read are leased
            if r:  # round 0 touches the segment
                for k, t in (("put", t1 - t0), ("get", t2 - t1), ("memcpy", t3 - t2)):
                    times[k].append(t)
        out = {
            "page_tokens": page,
            "pages": pages,
            "object_bytes": src_meta[1][0],
            "bytes": nbytes,
            "repeats": repeats,
            "failed_pages": failed,
        }
        out |= {f"{k}_gbps": nbytes / statistics.median(t) / 1e9 for k, t in times.items()}
        return out
    finally:
        store.close()


def bandwidth_rows(node: Node, msg: dict) -> Any:
    """The ``bandwidth`` command: ``measure`` for each of ``msg["pages"]`` (rank 0)."""
    if node.rank != 0:
        return None
    return [measure(msg["extra"], p, msg["total_bytes"], msg["repeats"]) for p in msg["pages"]]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'placement':>10}{'page tok':>9}{'object KiB':>11}{'put GB/s':>10}{'get GB/s':>10}"
        f"{'memcpy GB/s':>12}"
    )
    for r in rows:
        print(
            f"{r['placement']:>10}{r['page_tokens']:>9}{r['object_bytes'] >> 10:>11}"
            f"{r['put_gbps']:>10.2f}{r['get_gbps']:>10.2f}{r['memcpy_gbps']:>12.2f}"
        )


if __name__ == "__main__":
    sys.exit(main({**STORE_COMMANDS, "bandwidth": bandwidth_rows}))
