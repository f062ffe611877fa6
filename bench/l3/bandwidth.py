"""L3 read and write bandwidth of the file backend, against plain file copies of the same bytes
measured in the same run.

The tier's own path: the backup thread's page writes (``StorageWorkers._page_backup``: flat
pages of the host pool through ``HiCacheFile.batch_set``, 128 pages per call, temp file and
atomic rename per page) and the prefetch IO thread's reads (``StorageWorkers._transfer``:
``batch_get`` into flat pages, then ``set_from_flat_data_page`` into the host pool), called on
this thread with real operations. Ceilings over the same page count and bytes: one plain file
per page written with one ``write`` and read with one ``readinto`` into its place in one
preallocated buffer of every page (no rename, no host-pool copy), and one file of all the bytes
(sequential). Every path is timed as the best of a few repeats after one warm-up; reads come
from the page cache right after the writes (nothing is dropped), the same for every row.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch

from hicache.memory.device_pool import MHATokenToKVPool
from hicache.memory.host_pool_factory import make_host_pool
from hicache.storage.config import storage_config_for_pool
from hicache.storage.file_backend import HiCacheFile
from hicache.storage.hash_keys import page_hashes
from hicache.storage.io.operations import CacheRequestHandle, PrefetchOperation, StorageOperation
from hicache.storage.io.workers import StorageWorkers

GEOMETRY = dict(layers=8, heads=8, head_dim=128, page=16)  # 512 KiB pages in bfloat16


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _best(fn: Any, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one untimed warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(pages: int, root: str | None = None, repeats: int = 3) -> dict[str, Any]:
    """Seconds (the best of ``repeats``, after a warm-up) and GB/s of each path over ``pages``
    pages; one intra-op torch thread (the copies are small; idle OpenMP threads only spin)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(pages, root, repeats)
    finally:
        torch.set_num_threads(threads)


def _measure(pages: int, root: str | None, repeats: int) -> dict[str, Any]:
    g = GEOMETRY
    tokens = pages * g["page"]
    dev = MHATokenToKVPool(tokens, g["page"], torch.bfloat16, g["heads"], g["head_dim"],
                           g["layers"], "cpu")  # fmt: skip
    host = make_host_pool(dev, 1.5, 0, "page_first")
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    nbytes = pages * host.page_nbytes
    page_bytes = host.page_nbytes
    slots = torch.arange(tokens, dtype=torch.int64)
    keys = page_hashes(list(range(tokens)), g["page"])
    out: dict[str, Any] = {"pages": pages, "page_bytes": page_bytes, "bytes": nbytes,
                           "repeats": repeats}  # fmt: skip
    with tempfile.TemporaryDirectory(dir=root) as d:
        l3_dir = os.path.join(d, "l3")
        backend = HiCacheFile(storage_config_for_pool(
            host, "bench/l3", extra_config={"file_storage_path": l3_dir}))  # fmt: skip
        backend.register_mem_pool_host(host)
        workers = StorageWorkers(backend, host, zero_copy=False)

        def l3_write() -> None:
            backend.clear()  # a write that skips pages already stored would measure nothing
            op = StorageOperation(slots, keys)
            workers._page_backup(op)
            assert op.completed_tokens == tokens and not op.failed

        def l3_read() -> None:
            op = PrefetchOperation(CacheRequestHandle("bench", 0), list(range(tokens)), None)
            op.hash_value, op.host_indices = keys, slots
            workers._transfer(op)
            assert op.local_completed_tokens == tokens

        try:
            out["l3_write_s"] = _best(l3_write, repeats)
            out["l3_read_s"] = _best(l3_read, repeats)
        finally:
            workers.close()
        buf = raw.numpy()[:nbytes]
        plain = os.path.join(d, "plain")
        os.makedirs(plain)

        def files_write() -> None:
            for i in range(pages):
                with open(os.path.join(plain, f"{i}.bin"), "wb") as f:
                    f.write(memoryview(buf[i * page_bytes : (i + 1) * page_bytes]))

        big = os.path.join(d, "one.bin")
        whole = bytearray(nbytes)

        def files_read() -> None:  # each page into its place in one buffer of all of them
            view = memoryview(whole)
            for i in range(pages):
                with open(os.path.join(plain, f"{i}.bin"), "rb", buffering=0) as f:
                    f.readinto(view[i * page_bytes : (i + 1) * page_bytes])

        def one_write() -> None:
            with open(big, "wb") as f:
                f.write(memoryview(buf))

        def one_read() -> None:
            with open(big, "rb", buffering=0) as f:
                view, got = memoryview(whole), 0
                while got < nbytes:
                    got += f.readinto(view[got:])

        out["files_write_s"] = _best(files_write, repeats)
        out["files_read_s"] = _best(files_read, repeats)
        out["one_file_write_s"] = _best(one_write, repeats)
        out["one_file_read_s"] = _best(one_read, repeats)
    for name in ("l3_write", "l3_read", "files_write", "files_read", "one_file_write",
                 "one_file_read"):  # fmt: skip
        out[f"{name}_gbps"] = _gbps(nbytes, out[f"{name}_s"])
    out["l3_write_vs_files"] = out["l3_write_gbps"] / out["files_write_gbps"]
    out["l3_read_vs_files"] = out["l3_read_gbps"] / out["files_read_gbps"]
    return out


def print_table(res: dict[str, Any]) -> None:
    print(f"[l3] bandwidth: {res['pages']} pages of {res['page_bytes'] / 2**10:.0f} KiB "
          f"({res['bytes'] / 2**20:.0f} MiB), page cache, best of {res['repeats']}")
    print(f"{'path':<34}{'write GB/s':>12}{'read GB/s':>12}")
    for label, key in (("L3 file backend (tier path)", "l3"), ("plain file per page", "files"),
                       ("one plain file (sequential)", "one_file")):  # fmt: skip
        print(f"{label:<34}{res[f'{key}_write_gbps']:>12.2f}{res[f'{key}_read_gbps']:>12.2f}")
    print(f"L3 / plain file per page: write {res['l3_write_vs_files']:.2f}, "
          f"read {res['l3_read_vs_files']:.2f}")
