"""The tree's own cost on a trace, beside SGLang 0.5.23's trees replaying the same operations.

In one fresh (spawned) process, so SGLang's import stubs never reach the caller: this project's
``RadixCache``, SGLang's Python ``RadixCache`` and its ``UnifiedRadixCache`` with the Rust
TreeCore (the drivers of ``bench.cache_ops``, each with its own allocator over a pool of
``capacity`` tokens), one after another. Per request, timed together: match (+ device
indices), lock, allocate (evicting the shortfall), insert, free duplicates, unlock; the key is
built untimed. Peak RSS: the process's resident set sampled every 256 requests
(``/proc/self/statm``), less what it held before the tree was built. Measured on this CPU.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.cache_ops.trace import ProjectDriver, alloc
from bench.trace.load import key_array, load_trace, tokens


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _replay(driver: Any, keys: Any) -> dict[str, float]:
    base = peak = _rss_mib()
    spent, matched, n = 0.0, 0, 0
    clock = time.perf_counter
    for n, key in enumerate(keys, 1):
        p = driver.prepare(key)
        t0 = clock()
        got, indices, node = driver.match(p)
        token = driver.lock(node)
        need = len(key) - got
        slots = alloc(driver, need)
        present = driver.insert(p, torch.cat([indices, slots]), got)
        if present > got and not driver.frees_duplicates:
            driver.allocator.free(slots[: present - got])
        driver.unlock(node, token)
        spent += clock() - t0
        matched += got
        if n % 256 == 0:
            peak = max(peak, _rss_mib())
    if driver.name == "project":
        driver.tree.check_integrity()
    peak = max(peak, _rss_mib())
    return {
        "requests_per_s": round(n / spent, 1),
        "matched_tokens": matched,
        "peak_rss_growth_mib": round(peak - base, 1),
    }


def _run(path: str, limit: int | None, capacity: int, block: int, site: str | None) -> dict:
    torch.set_num_threads(1)
    reqs = load_trace(path, limit)

    def keys() -> Any:
        return (key_array(tokens(r, block)[: r.input_length // block * block]) for r in reqs)

    trees: dict[str, Any] = {"project": lambda: ProjectDriver(capacity, block)}
    out: dict[str, Any] = {"sglang": "skipped"}
    from bench.cache_ops.sglang_trees import SGLangPythonDriver, SGLangRustDriver, load_sglang

    sgl, note = load_sglang(site)
    if sgl is None and site is not None:
        raise RuntimeError(f"--sglang-site {site}: {note}")
    if sgl is None:
        out["sglang"] = f"skipped: {note}"
    else:
        out["sglang"] = f"sglang {note}"
        trees["sglang_python"] = lambda: SGLangPythonDriver(sgl, capacity, block)
        trees["sglang_rust"] = lambda: SGLangRustDriver(sgl, capacity, block)
    for name, make in trees.items():
        driver = make()
        out[name] = _replay(driver, keys())
        del driver
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed pages back before the next tree
    return out


def tree_cost(
    path: Path | str, limit: int | None, capacity: int, block: int, site: str | None
) -> dict[str, Any]:
    """The comparison (module docstring), run in a spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_run, (str(path), limit, capacity, block, site))
    out.update(capacity_tokens=capacity, measured="on this CPU, one process, trees in turn")
    return out
