"""The file backend's page bandwidth against plain file copies of the same bytes, same run.

The tier's path as the storage threads take it, 128 pages per call: a write is ``get_data_page``
of each host page then ``HiCacheFile.batch_set`` (a temporary file and an atomic rename per
page); a read is ``batch_get`` into flat pages then ``set_from_flat_data_page`` into the host
pool. Ceilings: one plain file per page (one ``write``; one ``readinto`` into its place in one
buffer), and one file of all the bytes. Every path: the best of ``repeats`` after a warm-up;
reads come from the page cache, the same for every row.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.memory.device_pool import MHATokenToKVPool
from hicache.memory.host_pool_factory import make_host_pool
from hicache.storage.base import STORAGE_BATCH_SIZE
from hicache.storage.config import storage_config_for_pool
from hicache.storage.file_backend import HiCacheFile
from hicache.storage.hash_keys import page_hashes

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 8, 128, 16  # 512 KiB pages in bfloat16
PATHS = (("L3 file backend", "l3"), ("plain file per page", "files"), ("one file", "one_file"))


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(pages: int, repeats: int = 3) -> dict[str, Any]:
    """GB/s of each path's write and read of ``pages`` pages (module docstring)."""
    dev = MHATokenToKVPool(pages * PAGE, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = make_host_pool(dev, 1.5, 0, "page_first")
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    size, nbytes = host.page_nbytes, pages * host.page_nbytes
    keys = page_hashes(list(range(pages * PAGE)), PAGE)
    batches = [
        range(i, min(i + STORAGE_BATCH_SIZE, pages)) for i in range(0, pages, STORAGE_BATCH_SIZE)
    ]
    flat = [host.get_dummy_flat_data_page() for _ in range(STORAGE_BATCH_SIZE)]
    buf, whole = raw.numpy()[:nbytes], bytearray(nbytes)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        extra = {"file_storage_path": os.path.join(d, "l3")}
        backend = HiCacheFile(storage_config_for_pool(host, "bench/l3", extra_config=extra))
        backend.register_mem_pool_host(host)

        def l3_write() -> None:
            backend.clear()  # a write that skips stored pages would measure nothing
            for b in batches:
                data = [host.get_data_page(p * PAGE, out=flat[i]) for i, p in enumerate(b)]
                assert backend.batch_set([keys[p] for p in b], data)

        def l3_read() -> None:
            for b in batches:
                got = backend.batch_get([keys[p] for p in b], flat[: len(b)])
                for p, page in zip(b, got, strict=True):
                    host.set_from_flat_data_page(p * PAGE, page)

        def files_write() -> None:
            for i in range(pages):
                with open(os.path.join(d, f"{i}.bin"), "wb") as f:
                    f.write(memoryview(buf[i * size : (i + 1) * size]))

        def files_read() -> None:
            view = memoryview(whole)
            for i in range(pages):
                with open(os.path.join(d, f"{i}.bin"), "rb", buffering=0) as f:
                    f.readinto(view[i * size : (i + 1) * size])

        def one_file_write() -> None:
            with open(os.path.join(d, "one.bin"), "wb") as f:
                f.write(memoryview(buf))

        def one_file_read() -> None:
            with open(os.path.join(d, "one.bin"), "rb", buffering=0) as f:
                view, got = memoryview(whole), 0
                while got < nbytes:
                    got += f.readinto(view[got:])

        fns = {
            "l3": (l3_write, l3_read),
            "files": (files_write, files_read),
            "one_file": (one_file_write, one_file_read),
        }
        for key, (write, read) in fns.items():
            seconds[f"{key}_write"] = _best(write, repeats)
            seconds[f"{key}_read"] = _best(read, repeats)
    out: dict[str, Any] = {"pages": pages, "page_bytes": size, "bytes": nbytes, "repeats": repeats}
    out |= {f"{k}_gbps": nbytes / s / 1e9 for k, s in seconds.items()}
    out["l3_write_vs_files"] = out["l3_write_gbps"] / out["files_write_gbps"]
    out["l3_read_vs_files"] = out["l3_read_gbps"] / out["files_read_gbps"]
    return out


def print_table(res: dict[str, Any]) -> None:
    print(
        f"[l3] bandwidth: {res['pages']} pages of {res['page_bytes'] >> 10} KiB, page cache, "
        f"best of {res['repeats']}"
    )
    print(f"{'path':<24}{'write GB/s':>12}{'read GB/s':>12}")
    for label, key in PATHS:
        print(f"{label:<24}{res[f'{key}_write_gbps']:>12.2f}{res[f'{key}_read_gbps']:>12.2f}")
