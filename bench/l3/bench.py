"""``python -m bench.l3 [--quick] [--out DIR]``: the L3 file backend, measured on this CPU. Restart:
a process serves prompts with L2 + L3 (``FLAGS``) and exits; fresh ones serve them extended by a
question over its directory (warm) or an empty one (cold): TTFT, L3 hit rate, ``check_integrity``.
Bandwidth: the tier's page writes and reads, 128 pages a call, against a plain file per page.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import time_ms, write_json
from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool
from hicache_prefill.hicache.memory.host_pool import make_host_pool
from hicache_prefill.hicache.storage.base import STORAGE_BATCH_SIZE as BATCH
from hicache_prefill.hicache.storage.config import storage_config_for_pool
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.prefill.clock import WallClock
from hicache_prefill.server_args import prepare_server_args
from tests.support.harness import make_executor, single_torch_thread

MEASURED_ON = "a CPU, wall clock"
FLAGS = (
    "--device cpu --dtype float32 --num-layers 4 --num-attention-heads 8 --head-num 4 "
    "--head-dim 32 --hidden-size 256 --intermediate-size 768 --page-size 16 "
    "--chunked-prefill-size 256 --disaggregation-mode prefill --enable-hierarchical-cache "
    "--hicache-ratio 2 --hicache-write-policy write_through --hicache-io-backend direct "
    "--hicache-mem-layout page_first_direct --hicache-storage-backend file"
).split()
QUESTION = 32  # tokens a restart prompt adds to a served one
LAYERS, HEADS, HEAD_DIM, PAGE = 8, 8, 128, 16  # bandwidth: 512 KiB pages in bfloat16


def serve(argv: list[str], prompts: list[list[int]]) -> dict[str, Any]:
    """In a fresh process: ``prompts`` one at a time on the wall clock, the backups finished."""
    ex = make_executor(prepare_server_args(argv), clock=WallClock(), keep_received=False)
    results = []
    with single_torch_thread():
        for i, prompt in enumerate(prompts):
            ex.submit(f"p{i}", prompt)
            ex.run_until_idle()
            results += ex.pop_results()
        ex.drain_cache_events()
    try:
        ex.check_integrity()
        errors = 0
    except AssertionError:
        errors = 1
    storage = ex.cache.storage.stats.as_dict()
    ex.cache.close()
    tokens, hits = sum(r.num_tokens for r in results), sum(r.cached_storage_tokens for r in results)
    ttft_ms = statistics.fmean(r.ttft for r in results) * 1e3
    out = {"requests": len(results), "ttft_mean_ms": ttft_ms, "prompt_tokens": tokens}
    out |= {"l3_hit_tokens": hits, "hit_rate": hits / tokens}
    return out | {"integrity_errors": errors, "storage": storage}


def restart(clients: int, prompt: int) -> dict[str, dict[str, Any]]:
    """The fill, warm and cold processes (module docstring)."""
    rng = random.Random(0)
    first = [[rng.randrange(1, 512) for _ in range(prompt)] for _ in range(clients)]
    second = [p + [rng.randrange(1, 512) for _ in range(QUESTION)] for p in first]
    plan = {"fill": ("l3", first), "warm": ("l3", second), "cold": ("empty", second)}
    size, out = ["--max-total-tokens", str(2 * (prompt + QUESTION))], {}
    with tempfile.TemporaryDirectory(prefix="bench_l3_") as d:
        for name, (folder, prompts) in plan.items():
            extra = json.dumps({"file_storage_path": os.path.join(d, folder)})
            argv = [*FLAGS, *size, "--hicache-storage-backend-extra-config", extra]
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                out[name] = pool.apply(serve, (argv, prompts))
    return out


def bandwidth(pages: int) -> dict[str, Any]:
    """GB/s of the tier's page writes and reads, and of plain files (module docstring)."""
    dev = MHATokenToKVPool(pages * PAGE, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = make_host_pool(dev, 1.5, 0, "page_first")
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    size, nbytes = host.page_nbytes, pages * host.page_nbytes
    keys = page_hashes(list(range(pages * PAGE)), PAGE)
    batches = [range(pages)[i : i + BATCH] for i in range(0, pages, BATCH)]
    flat = [host.get_dummy_flat_data_page() for _ in range(BATCH)]
    data, back = raw.numpy().reshape(-1)[:nbytes], bytearray(nbytes)
    with tempfile.TemporaryDirectory(prefix="bench_l3_") as d:
        extra = {"file_storage_path": os.path.join(d, "l3")}
        backend = HiCacheFile(storage_config_for_pool(host, "bench/l3", extra_config=extra))
        backend.register_mem_pool_host(host)

        def l3_write() -> None:
            backend.clear()  # a write that skips stored pages would measure nothing
            for b in batches:
                pages_b = [host.get_data_page(p * PAGE, out=flat[i]) for i, p in enumerate(b)]
                assert backend.batch_set([keys[p] for p in b], pages_b)

        def l3_read() -> None:
            for b in batches:
                got = backend.batch_get([keys[p] for p in b], flat[: len(b)])
                for p, page in zip(b, got, strict=True):
                    host.set_from_flat_data_page(p * PAGE, page)

        def files_write() -> None:
            for i in range(pages):
                Path(d, f"{i}.bin").write_bytes(data[i * size : (i + 1) * size])

        def files_read() -> None:
            for i in range(pages):
                with open(os.path.join(d, f"{i}.bin"), "rb", buffering=0) as f:
                    f.readinto(memoryview(back)[i * size : (i + 1) * size])

        fns, cpu = (l3_write, l3_read, files_write, files_read), torch.device("cpu")
        gbps = {f"{f.__name__}_gbps": nbytes / time_ms(f, cpu, rep_ms=0).median / 1e6 for f in fns}
    return {"pages": pages, "page_bytes": size, "bytes": nbytes, **gbps}


def run(quick: bool = True, out_dir: Path = Path("bench-out")) -> dict[str, Any]:
    """Both parts; prints them and writes ``bench_l3.json``."""
    clients, prompt, pages = (16, 256, 64) if quick else (64, 1024, 512)
    print(f"[l3] measured on {MEASURED_ON}; restart over {clients} prompts of {prompt} tokens")
    runs = restart(clients, prompt)
    print(f"{'process':<10}{'TTFT mean ms':>14}{'L3 hit tokens':>15}{'hit rate':>10}")
    for name, r in runs.items():
        print(f"{name:<10}{r['ttft_mean_ms']:>14.1f}{r['l3_hit_tokens']:>15}{r['hit_rate']:>10.1%}")
    bw = bandwidth(pages)
    print(f"[l3] bandwidth: {pages} pages of {bw['page_bytes'] >> 10} KiB, median of 3, page cache")
    print(f"{'path':<22}{'write GB/s':>12}{'read GB/s':>12}")
    for label, k in (("L3 file backend", "l3"), ("plain file per page", "files")):
        print(f"{label:<22}{bw[f'{k}_write_gbps']:>12.2f}{bw[f'{k}_read_gbps']:>12.2f}")
    integrity = {"integrity_errors": sum(r["integrity_errors"] for r in runs.values())}
    summary = {"measured_on": MEASURED_ON, "restart": runs, "bandwidth": bw, "integrity": integrity}
    print(f"[l3] integrity: {integrity}")
    print(f"[l3] wrote {write_json('bench_l3', {'quick': quick, **summary}, out_dir)}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.l3", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (seconds).")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    args = parser.parse_args(argv)
    return 1 if any(run(args.quick, args.out)["integrity"].values()) else 0
