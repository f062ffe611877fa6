"""Mooncake's transfer rate on loopback per item size, against a memcpy measured in the same run,
and the transfer cost model fitted to it (``bench.pd``'s first table).

For each item size, ``total`` bytes are written as items scattered over a source buffer in this
process to scattered places in a receiver process's registered buffer (``bench.pd.receiver``),
with ``batch_transfer_sync_write`` calls of at most 1024 items (the project's limit,
``prefill.disagg.mooncake.engine.MAX_ITEMS_PER_CALL``). Every size is checked once: the sha256 of
the receiver's items equals the source's. Ceilings of the same run: a contiguous single-thread
copy of ``total`` bytes (``np.copyto``), and the same scattered items copied in memory (numpy
row gather and scatter) in this process.

Cost model: a least-squares fit of ``seconds per item = latency_per_item + item_bytes /
bandwidth`` over the item sizes (each size's best repeat; the fit of the medians beside it)
gives the per-item latency and the
bandwidth the virtual clock's transfer model can use (a send of ``k`` page runs of a
``2L``-buffer MHA pool is ``2L * k`` items: ``2L * k * latency_per_item + bytes / bandwidth``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.mooncake.loopback import die_with_parent, preload_env
from prefill.disagg.mooncake.engine import MAX_ITEMS_PER_CALL, KVTransferEngine

logger = logging.getLogger(__name__)

KiB = 1024
ITEM_SIZES = (2 * KiB, 8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB)
_REPO = Path(__file__).resolve().parents[2]


class Receiver:
    """A ``bench.pd.receiver`` process (under the loopback shim, dies with this process)."""

    def __init__(self, size: int) -> None:
        env = preload_env()
        env["PYTHONPATH"] = os.pathsep.join([str(_REPO), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("GLOG_minloglevel", "2")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.pd.receiver", str(size)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=_REPO, env=env,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError("bench.pd.receiver did not start")
        info = json.loads(line)
        self.session, self.ptr, self.pid = info["session"], info["ptr"], info["pid"]

    def digest(self, items: list[tuple[int, int]]) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": "digest", "items": items}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["digest"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


def _memcpy_gbps(nbytes: int, reps: int) -> float:
    """Contiguous copy of ``nbytes`` (``np.copyto``: one thread, no OpenMP threads spinning on
    shared cores), median of ``reps``, GB/s."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _scattered_copy_gbps(src: np.ndarray, size: int, si: np.ndarray, di: np.ndarray,
                         reps: int) -> float:  # fmt: skip
    """The same scattered items copied in memory (row gather then scatter), GB/s."""
    rows = src.reshape(-1, size)
    dst = np.zeros_like(rows)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst[di] = rows[si]
        times.append(time.perf_counter() - t0)
    return len(si) * size / statistics.median(times) / 1e9


def fit_cost(rows: list[dict[str, Any]], key: str = "best_us_per_item") -> dict[str, float | None]:
    """Least squares of ``seconds per item = latency_per_item + item_bytes / bandwidth`` over the
    rows (one point per item size: each size's best repeat by default, the engine's cost with
    the least interference from other jobs on the machine; ``key="us_per_item"`` for medians).
    ``None`` for a coefficient the fit does not find positive (then the other is refitted
    alone)."""
    x = np.array([[1.0, r["item_bytes"]] for r in rows])
    y = np.array([r[key] * 1e-6 for r in rows])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if b <= 0:
        a, b = float(np.mean(y)), 0.0
    elif a <= 0:
        a, b = 0.0, float(np.dot(x[:, 1], y) / np.dot(x[:, 1], x[:, 1]))
    pred = x @ np.array([a, b])
    return {
        "latency_per_item_s": float(a) if a > 0 else None,
        "bandwidth_Bps": float(1 / b) if b > 0 else None,
        "max_rel_residual": float(np.max(np.abs(pred - y) / y)),
    }


def measure(quick: bool) -> dict[str, Any]:
    """The table's rows, the ceilings and the fitted model (module docstring)."""
    total = (8 if quick else 32) << 20
    reps = 5 if quick else 9
    space = 4 * total
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, space, dtype=np.uint8)
    receiver = Receiver(space)
    engine = KVTransferEngine("127.0.0.1")
    engine.register([(src.ctypes.data, src.nbytes)])
    rows = []
    load_before = os.getloadavg()[0]
    try:
        memcpy = _memcpy_gbps(total, reps)
        for size in ITEM_SIZES:
            n = total // size
            si = rng.permutation(space // size)[:n]
            di = rng.permutation(space // size)[:n]
            srcs = (src.ctypes.data + si * size).tolist()
            dsts = (receiver.ptr + di * size).tolist()
            lens = [size] * n
            rc = engine.write(receiver.session, srcs, dsts, lens)  # warm-up and check
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write rc={rc} for {size}-byte items")
            want = hashlib.sha256(b"".join(src[s * size:(s + 1) * size].tobytes() for s in si))
            got = receiver.digest([(int(d) * size, size) for d in di])
            if got != want.hexdigest():
                raise RuntimeError(f"{size}-byte items: the receiver's bytes differ")
            rep_times = []
            for _ in range(reps):
                t_rep = 0.0
                for i in range(0, n, MAX_ITEMS_PER_CALL):
                    j = i + MAX_ITEMS_PER_CALL
                    t0 = time.perf_counter()
                    rc = engine.write(receiver.session, srcs[i:j], dsts[i:j], lens[i:j])
                    dt = time.perf_counter() - t0
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_write rc={rc}")
                    t_rep += dt
                rep_times.append(t_rep)
            t, best = statistics.median(rep_times), min(rep_times)
            scattered = _scattered_copy_gbps(src, size, si, di, reps)
            rows.append({
                "item_bytes": size, "items": n, "calls": -(-n // MAX_ITEMS_PER_CALL),
                "ms": t * 1e3, "us_per_item": t / n * 1e6, "gbps": total / t / 1e9,
                "best_us_per_item": best / n * 1e6, "best_gbps": total / best / 1e9,
                "memcpy_gbps": memcpy, "scattered_memcpy_gbps": scattered,
                "vs_memcpy": total / t / 1e9 / memcpy, "checked": True,
            })  # fmt: skip
    finally:
        engine.close()
        receiver.stop()
    model = fit_cost(rows)
    model["from_medians"] = fit_cost(rows, "us_per_item")
    model.update(max_items_per_call=MAX_ITEMS_PER_CALL,
                 note="seconds of a call = items * latency_per_item_s + bytes / bandwidth_Bps")
    return {"rows": rows, "total_bytes": total, "repeats": reps, "transfer_model": model,
            "loadavg_1m": [load_before, os.getloadavg()[0]]}  # fmt: skip
