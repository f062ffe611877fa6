"""``python -m bench.mooncake_store [--quick] [--out DIR]``: ``MooncakeStore`` (the L3 tier) put /
get bandwidth (``batch_set_v1`` / ``batch_get_v1``, 128 pages a call) against memcpy, on this CPU
over TCP loopback: pages of 1, 16, 64 tokens of Llama-3-8B's KV, objects in the client's segment
(``local``) or another process's (``remote``), bytes checked; clients in node processes (``NODE``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Column, print_table, write_json
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import make_host_pool
from hicache_prefill.hicache.storage.backend_factory import StorageBackendFactory
from hicache_prefill.hicache.storage.base import STORAGE_BATCH_SIZE as BATCH
from hicache_prefill.hicache.storage.config import storage_config_for_pool
from tests.support.loopback import skip_reason
from tests.support.mooncake_master import MooncakeMaster
from tests.support.node_main import Node
from tests.support.node_main import main as node_main
from tests.support.node_process import StoreNode, stop_nodes
from tests.support.node_stores import STORE_COMMANDS

MEASURED_ON = "a CPU: Mooncake over TCP loopback, wall clock"
NODE = "bench.mooncake_store.bench"  # the node processes' entry
LAYERS, HEADS, HEAD_DIM = 32, 8, 128  # bfloat16
PAGE_SIZES = (1, 16, 64)
COLUMNS = [
    Column("placement", "placement", 10),
    Column("page_tokens", "page tok", 9),
    Column("object_bytes", "object B", 10),
    Column("put_gbps", "put GB/s", 10, ".2f"),
    Column("get_gbps", "get GB/s", 10, ".2f"),
    Column("memcpy_gbps", "memcpy GB/s", 12, ".2f"),
]


def _calls(fn: Any, keys: list[str], slots: torch.Tensor, page: int) -> int:
    """Pages ``fn`` (``batch_set_v1`` / ``batch_get_v1``) reports done, 128 per call."""
    starts = range(0, len(keys), BATCH)
    return sum(sum(fn(keys[s : s + BATCH], slots[s * page : (s + BATCH) * page])) for s in starts)


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
            t3 = time.perf_counter()
            for d, s, n in zip(dst_meta[0], src_meta[0], src_meta[1], strict=True):
                ctypes.memmove(d, s, n)
            t4 = time.perf_counter()
            store.client.call("remove_all", True)  # forced: objects just read are leased
            if r:  # round 0 touches the segment
                for k, t in (("put", t1 - t0), ("get", t2 - t1), ("memcpy", t4 - t3)):
                    times[k].append(t)
        out = {"page_tokens": page, "pages": pages, "object_bytes": src_meta[1][0], "bytes": nbytes}
        out |= {"repeats": repeats, "failed_pages": failed}
        return out | {f"{k}_gbps": nbytes / statistics.median(t) / 1e9 for k, t in times.items()}
    finally:
        store.close()


def bandwidth_rows(node: Node, msg: dict) -> list[dict[str, Any]]:
    """The node command ``bandwidth``: ``measure`` for each of ``msg["pages"]``."""
    return [measure(msg["extra"], p, msg["total_bytes"], msg["repeats"]) for p in msg["pages"]]


def placements(mib: int, repeats: int) -> list[dict[str, Any]]:
    """The ``local`` rows, then the ``remote`` ones, from node processes."""
    a, b = (StoreNode(1, module=NODE, name=name, connect=False) for name in "AB")
    seg = f"{2 * mib + 64}mb"  # one repeat's objects at a time
    job = dict(pages=list(PAGE_SIZES), total_bytes=mib << 20, repeats=repeats)
    rows: list[dict[str, Any]] = []
    try:
        a.connect()
        b.connect()
        with MooncakeMaster.start() as local, MooncakeMaster.start() as remote:
            base = {"protocol": "tcp", "local_hostname": "127.0.0.1"}
            extra = {**base, "master_server_address": local.address, "global_segment_size": seg}
            rows += [{"placement": "local", **r} for r in a.first("bandwidth", extra=extra, **job)]
            extra = {**base, "master_server_address": remote.address, "global_segment_size": seg}
            b.first("store_open", name="owner", extra=extra)
            extra = {**extra, "global_segment_size": 0}
            rows += [{"placement": "remote", **r} for r in a.first("bandwidth", extra=extra, **job)]
    finally:
        stop_nodes([a, b])
    return rows


def run(quick: bool = True, out_dir: Path = Path("bench-out")) -> dict[str, Any]:
    """The table and ``bench_mooncake_store.json``; ``{"skipped": reason}`` without Mooncake."""
    if (reason := skip_reason("store")) is not None:
        print(f"[mooncake_store] skipped: {reason}")
        return {"skipped": reason, "integrity": {}}
    mib, repeats = (64, 3) if quick else (256, 5)
    print(f"[mooncake_store] measured on {MEASURED_ON}: {mib} MiB, median of {repeats}", flush=True)
    rows = placements(mib, repeats)
    print_table(rows, COLUMNS)
    integrity = {"failed_pages": sum(r["failed_pages"] for r in rows)}
    summary = {"measured_on": MEASURED_ON, "bandwidth": rows, "integrity": integrity}
    path = write_json("bench_mooncake_store", {"quick": quick, **summary}, out_dir)
    print(f"[mooncake_store] integrity: {integrity}\n[mooncake_store] wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mooncake_store", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (under a minute).")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    args = parser.parse_args(argv)
    return 1 if any(run(args.quick, args.out)["integrity"].values()) else 0


if __name__ == "__main__":
    sys.exit(node_main({**STORE_COMMANDS, "bandwidth": bandwidth_rows}))
