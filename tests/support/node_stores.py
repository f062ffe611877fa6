"""Bare ``MooncakeStore`` clients in a node process, for the store's fault tests
(``python -m tests.support.node_stores``: these commands only, no model imported).

- ``store_open {name, extra, model, kind, layout, page_size, pool_tokens}``: a host pool (MHA:
  2 layers of 4 heads of 64, or MLA; float32) and a ``MooncakeStore`` built by the factory from
  ``extra`` (the Mooncake keys), registered over it; returns ``page_bytes`` and ``pages``;
- ``store_put {name, start, count, loop}``: stores pages ``start .. start + count`` whose bytes
  are a pure function of the page number (``_pattern``), under keys of that number, one
  ``batch_set_v1`` per pool-full of pages; returns one ``bool`` per page. ``loop``: on a thread,
  from ``start`` upwards without end (``progress`` in ``store_stats``: pages put so far);
- ``store_check {name, start, count, until_gap}``: reads them back into the host pool and counts
  ``ok`` (the bytes written), ``miss`` and ``bad`` (read back wrong). ``until_gap``: stop after
  the first pool-full of pages that all miss, once a page was found (a ``loop`` writer stores
  one pool-full after the other, so nothing of it lies beyond such a gap);
- ``store_stats {name}``: the backend's counters and the loop's ``progress``.

Rank 0 only (other ranks answer ``None``).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from typing import Any

import torch

from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import make_host_pool
from hicache_prefill.hicache.storage.backend_factory import StorageBackendFactory
from hicache_prefill.hicache.storage.config import storage_config_for_pool
from tests.support.node_main import Node, main

logger = logging.getLogger(__name__)


def _pattern(page: int, nbytes: int) -> torch.Tensor:
    """The bytes of test page ``page`` (a pure function of the number)."""
    g = torch.Generator().manual_seed(1_000_003 + page)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def _keys(pages: range) -> list[str]:
    return [hashlib.sha256(f"node-test-page-{p}".encode()).hexdigest() for p in pages]


def store_open(node: Node, msg: dict) -> Any:
    if node.rank != 0:
        return None
    kind, page = msg.get("kind", "mha"), msg.get("page_size", 16)
    size = msg.get("pool_tokens", 256)
    if kind == "mla":
        dev = MLATokenToKVPool(size, page, torch.float32, kv_lora_rank=64, qk_rope_head_dim=16,
                               layer_num=2, device="cpu")  # fmt: skip
    else:
        dev = MHATokenToKVPool(size, page, torch.float32, head_num=4, head_dim=64, layer_num=2,
                               device="cpu")  # fmt: skip
    pool = make_host_pool(dev, 1.0, 0, msg.get("layout", "page_first"))
    cfg = storage_config_for_pool(pool, msg.get("model", "node-test"),
                                  extra_config=msg["extra"])  # fmt: skip
    store = StorageBackendFactory.create_backend("mooncake", cfg, pool)
    store.register_mem_pool_host(pool)
    node.stores[msg["name"]] = (store, pool)
    return {"page_bytes": pool.page_nbytes, "pages": pool.size // page}


def _put_pages(store: Any, pool: Any, pages: range) -> list[bool]:
    ps = pool.page_size
    for i, p in enumerate(pages):
        pool.set_from_flat_data_page(i * ps, _pattern(p, pool.page_nbytes).view(pool.dtype))
    return store.batch_set_v1(_keys(pages), torch.arange(len(pages) * ps, dtype=torch.int64))


def store_put(node: Node, msg: dict) -> Any:
    if node.rank != 0:
        return None
    store, pool = node.stores[msg["name"]]
    batch = pool.size // pool.page_size
    start = msg["start"]
    if not msg.get("loop"):
        out: list[bool] = []
        for s in range(start, start + msg["count"], batch):
            out += _put_pages(store, pool, range(s, min(s + batch, start + msg["count"])))
        return out

    def loop() -> None:
        p = start
        while True:
            _put_pages(store, pool, range(p, p + batch))
            p += batch
            node.progress[msg["name"]] = p

    threading.Thread(target=loop, name="node-put-loop", daemon=True).start()
    return {"started": start}


def store_check(node: Node, msg: dict) -> Any:
    if node.rank != 0:
        return None
    store, pool = node.stores[msg["name"]]
    ps, batch = pool.page_size, pool.size // pool.page_size
    counts = {"ok": 0, "miss": 0, "bad": 0}
    end = msg["start"] + msg["count"]
    for s in range(msg["start"], end, batch):
        pages = range(s, min(s + batch, end))
        got = store.batch_get_v1(_keys(pages), torch.arange(len(pages) * ps, dtype=torch.int64))
        for i, (p, ok) in enumerate(zip(pages, got, strict=True)):
            if not ok:
                counts["miss"] += 1
                continue
            data = pool.get_data_page(i * ps, flat=True).contiguous().view(torch.uint8)
            counts["ok" if torch.equal(data, _pattern(p, pool.page_nbytes)) else "bad"] += 1
        if msg.get("until_gap") and not any(got) and counts["ok"] + counts["bad"]:
            break
    return counts


def store_stats(node: Node, msg: dict) -> Any:
    if node.rank != 0:
        return None
    store, _ = node.stores[msg["name"]]
    return {"backend": store.get_stats().as_dict(), "progress": node.progress.get(msg["name"])}


def store_close(node: Node, msg: dict) -> Any:
    entry = node.stores.pop(msg["name"], None)
    if entry is not None:
        entry[0].close()
    return None


STORE_COMMANDS = {
    "store_open": store_open, "store_put": store_put, "store_check": store_check,
    "store_stats": store_stats, "store_close": store_close,
}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(STORE_COMMANDS))
