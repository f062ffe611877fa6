"""The tree's own cost on a trace beside SGLang 0.5.23's trees, measured on this CPU: a spawned
process (SGLang's stubs never reach the caller) replays it through each ``bench.cache_ops`` driver
in turn, timing match, lock, allocate, insert, free, unlock together per request; peak RSS growth
sampled every 256 requests."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import time
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from bench.cache_ops.sglang_loader import sglang_drivers
from bench.cache_ops.trace import ProjectDriver, alloc
from bench.trace.replay import load_trace, tokens


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _replay(driver: Any, keys: Iterable[array]) -> dict[str, float]:
    base = peak = _rss_mib()
    spent, matched, n, clock = 0.0, 0, 0, time.perf_counter
    for n, key in enumerate(keys, 1):
        p = driver.prepare(key)
        t0 = clock()
        got, indices, node = driver.match(p)
        token = driver.lock(node)
        slots = alloc(driver, len(key) - got)
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
    rate, growth = round(n / spent, 1), round(peak - base, 1)
    return {"requests_per_s": rate, "matched_tokens": matched, "peak_rss_growth_mib": growth}


def _run(path: str, limit: int | None, capacity: int, block: int, site: str | None) -> dict:
    torch.set_num_threads(1)
    reqs = load_trace(path, limit)
    sgl, note, trees = sglang_drivers(site)
    out: dict[str, Any] = {"sglang": note if sgl is not None else f"skipped: {note}"}
    for name, make in {"project": ProjectDriver, **trees}.items():
        keys = (tokens(r, block)[: r.input_length // block * block] for r in reqs)
        out[name] = _replay(make(capacity, block), (array("q", k.tobytes()) for k in keys))
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed pages back before the next tree
    return out


def tree_cost(path: Path | str, limit: int | None, cap: int, block: int, site: str | None) -> dict:
    """The comparison (module docstring), run in a spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_run, (str(path), limit, cap, block, site))
    return out | dict(capacity_tokens=cap, measured="on this CPU, one process, trees in turn")
