"""Mooncake's write cost per item size on TCP loopback, against a copy of the same items in memory,
and its least-squares ``CopyPath`` (``bench.pd``'s first table).

Per item size, ``total`` bytes go as items scattered over a source buffer to scattered places of
another engine's registered buffer (both engines in this process: the bytes still cross
Mooncake's TCP transport), by ``KVTransferEngine.write`` (``batch_transfer_sync_write`` calls of
at most 1024 items); the receiver's bytes are checked once per size. The fit is
``seconds per item = latency_s + item_bytes / (gbps * 1e9)`` over each size's best repeat, so
``latency_s`` is a cost per item (one contiguous run of one layer's K or V).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.profile import CopyPath
from prefill.disagg.mooncake.engine import KVTransferEngine

ITEM_SIZES = (2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10)


def fit_copy_path(item_bytes: Sequence[float], seconds: Sequence[float]) -> dict[str, float] | None:
    """Least squares of ``seconds = latency_s + item_bytes / (gbps * 1e9)``; a negative latency
    is refitted as 0; ``None`` when the fit finds no positive cost per byte."""
    x, y = np.asarray(item_bytes, dtype=float), np.asarray(seconds, dtype=float)
    (lat, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
    if lat < 0:
        lat, per_byte = 0.0, float(x @ y / (x @ x))
    if per_byte <= 0:
        return None
    path = CopyPath(float(lat), 1e-9 / float(per_byte))
    residual = max(abs(path.seconds(b) - s) / s for b, s in zip(x, y, strict=True))
    return {"latency_s": path.latency_s, "gbps": path.gbps, "max_rel_residual": float(residual)}


def _times(reps: int, fn: Callable[..., Any], *args: Any) -> list[float]:
    """Seconds of each of ``reps`` calls ``fn(*args)``."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def _write(engine: KVTransferEngine, session: str, srcs: list, dsts: list, size: int) -> None:
    if engine.write(session, srcs, dsts, [size] * len(srcs)) != 0:
        raise RuntimeError(f"batch_transfer_sync_write of {size}-byte items failed")


def _copy(dst: np.ndarray, di: np.ndarray, src: np.ndarray, si: np.ndarray) -> None:
    dst[di] = src[si]


def measure(quick: bool) -> dict[str, Any]:
    """The table's rows and ``kv_transfer_measured`` (module docstring)."""
    total, reps = (8 << 20, 5) if quick else (32 << 20, 9)
    space = 4 * total
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, space, dtype=np.uint8)
    dst = np.zeros(space, dtype=np.uint8)
    sender, receiver = KVTransferEngine("127.0.0.1"), KVTransferEngine("127.0.0.1")
    rows = []
    try:
        sender.register([(src.ctypes.data, space)])
        receiver.register([(dst.ctypes.data, space)])
        for size in ITEM_SIZES:
            n = total // size
            si, di = rng.permutation(space // size)[:n], rng.permutation(space // size)[:n]
            call = (
                sender,
                receiver.session_id,
                (src.ctypes.data + si * size).tolist(),
                (dst.ctypes.data + di * size).tolist(),
                size,
            )
            _write(*call)
            src_rows, dst_rows = src.reshape(-1, size), dst.reshape(-1, size)
            if not np.array_equal(dst_rows[di], src_rows[si]):
                raise RuntimeError(f"{size}-byte items: the receiver's bytes differ")
            times = _times(reps, _write, *call)
            copy = statistics.median(_times(reps, _copy, dst_rows, di, src_rows, si))
            t, best = statistics.median(times), min(times)
            rows.append(
                {
                    "item_bytes": size,
                    "items": n,
                    "us_per_item": t / n * 1e6,
                    "gbps": total / t / 1e9,
                    "best_gbps": total / best / 1e9,
                    "best_s_per_item": best / n,
                    "memcpy_gbps": total / copy / 1e9,
                }
            )
    finally:
        sender.close()
        receiver.close()
    fit = fit_copy_path([r["item_bytes"] for r in rows], [r["best_s_per_item"] for r in rows])
    measured = None if fit is None else {**fit, "measured_on": "cpu loopback", "per": "item"}
    return {"rows": rows, "total_bytes": total, "repeats": reps, "kv_transfer_measured": measured}
