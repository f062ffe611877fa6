"""``python -m bench.pd [--quick] [--out DIR]``: PD disaggregation over Mooncake on TCP loopback,
measured on this CPU: TTFT with decode worker processes (``bench.pd.ttft``), and the write cost
per item size (``write_cost``: two engines here, scattered items, bytes checked, against an
in-memory copy), fitted as ``kv_transfer_measured``, a ``bench.profile.CopyPath`` (least squares
of ``seconds per item = latency_s + bytes / (gbps * 1e9)`` over each size's best repeat). The
measuring process needs the loopback shim: ``main`` / ``run`` start it as a child under it, with
``MC_LOG_LEVEL=ERROR`` (unless set); the line each engine still logs at start-up (``NOISE``) is
counted, not shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Column, print_table, write_json
from bench.profile import CopyPath
from hicache.mooncake import loopback
from hicache.mooncake.availability import module_reason
from prefill.disagg.mooncake.engine import KVTransferEngine

MEASURED_ON = "a CPU: Mooncake over TCP loopback, wall clock"
NOISE = ("Local segment descriptor not found", "Logging before InitGoogleLogging")
ITEM_SIZES = (2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10)
RATE_COLUMNS = [
    Column("item_bytes", "item B", 8),
    Column("us_per_item", "us/item", 9, ".1f"),
    Column("gbps", "GB/s", 8, ".3f"),
    Column("best_gbps", "best GB/s", 10, ".3f"),
    Column("memcpy_gbps", "copy GB/s", 10, ".2f"),
]
TTFT_COLUMNS = [
    Column("config", "config", 24),
    Column("succeeded", "ok", 5),
    Column("ttft_mean_ms", "mean ms", 9, ".1f"),
    Column("ttft_mean_min_ms", "min", 7, ".1f"),
    Column("ttft_mean_max_ms", "max", 7, ".1f"),
    Column("ttft_p90_ms", "p90 ms", 8, ".1f"),
    Column("ttft_speedup_vs_0", "x vs 0", 8, ".2f"),
]


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


def write_cost(quick: bool) -> dict[str, Any]:
    """Rows of Mooncake's write cost per item size, and ``kv_transfer_measured`` (docstring)."""
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
            srcs = (src.ctypes.data + si * size).tolist()
            call = (sender, receiver.session_id, srcs, (dst.ctypes.data + di * size).tolist(), size)
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
                    "us_per_item": t / n * 1e6,
                    "gbps": total / t / 1e9,
                    "best_gbps": total / best / 1e9,
                    "memcpy_gbps": total / copy / 1e9,
                }
            )
    finally:
        sender.close()
        receiver.close()
    sizes = [r["item_bytes"] for r in rows]
    fit = fit_copy_path(sizes, [b / r["best_gbps"] / 1e9 for b, r in zip(sizes, rows, strict=True)])
    measured = None if fit is None else {**fit, "measured_on": "cpu loopback", "per": "item"}
    return {"rows": rows, "total_bytes": total, "repeats": reps, "kv_transfer_measured": measured}


def measure(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Both tables, in this process (the shim loaded); writes the JSON."""
    from bench.pd import ttft
    from prefill.testing.harness import single_torch_thread
    from prefill.testing.mooncake_decode import start_workers

    print(f"[pd] measured on {MEASURED_ON}; write cost per item size (medians)", flush=True)
    cost = write_cost(quick)
    print_table(cost["rows"], RATE_COLUMNS)
    if (path := cost["kv_transfer_measured"]) is not None:
        print(
            f"[pd] least squares: {path['latency_s'] * 1e6:.1f} us per item, {path['gbps']:.3f}"
            f" GB/s (largest residual {path['max_rel_residual']:.0%})"
        )
    print("[pd] TTFT (ms), optimistic prefill attempts 0 and 2, busy decode workers", flush=True)
    workers = start_workers(2, pool_tokens=32768, max_running_requests=64, check_free_pages=False)
    try:
        with single_torch_thread():
            latency = ttft.measure(quick, workers)
    finally:
        for w in workers:
            w.stop()
    print_table(latency["rows"], TTFT_COLUMNS)
    integrity = {k: sum(r["integrity"][k] for r in latency["rows"]) for k in ttft.INTEGRITY}
    payload = {
        "quick": quick,
        "measured_on": MEASURED_ON,
        "kv_transfer_measured": path,
        "rate": cost,
        "ttft": latency,
        "integrity": integrity,
    }
    print(f"[pd] integrity: {integrity}\n[pd] wrote {write_json('bench_pd', payload, out_dir)}")
    return payload


def child(quick: bool, out_dir: Path) -> int:
    """``python -m bench.pd`` under the shim, ``NOISE`` dropped from its stderr (docstring)."""
    cmd = [sys.executable, "-m", "bench.pd", "--out", str(out_dir)] + (["--quick"] if quick else [])
    proc = subprocess.Popen(cmd, env=loopback.preload_env(), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    hidden = 0
    for line in proc.stderr:
        if any(n in line for n in NOISE):
            hidden += 1
        else:
            sys.stderr.write(line)
    print(f"[pd] {hidden} lines of Mooncake start-up logging ({NOISE[0]!r}) not shown")
    return proc.wait()


def skip_reason() -> str | None:
    """Why Mooncake's engine or the shim is not usable here, or ``None``."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before any engine; children inherit it
    reason = module_reason("engine")
    if reason is None:
        try:
            loopback.build_shim()
        except loopback.ShimUnavailable as e:
            reason = str(e)
    return reason


def run(quick: bool = True, out_dir: Path = Path("results")) -> dict[str, Any]:
    """The suite's entry: the summary section, or ``{"skipped": reason}``."""
    if (reason := skip_reason()) is not None:
        print(f"[pd] skipped: {reason}")
        return {"skipped": reason}
    path = out_dir / "bench_pd.json"
    if loopback.shim_loaded():
        payload = measure(quick, out_dir)
    else:
        path.unlink(missing_ok=True)
        rc = child(quick, out_dir)
        if not path.exists():
            raise RuntimeError(f"python -m bench.pd exited {rc} without writing {path}")
        payload = json.loads(path.read_text())
    return {
        "measured_on": payload["measured_on"],
        "kv_transfer_measured": payload["kv_transfer_measured"],
        "gbps_by_item_bytes": {r["item_bytes"]: r["gbps"] for r in payload["rate"]["rows"]},
        "ttft_mean_ms": {r["config"]: r["ttft_mean_ms"] for r in payload["ttft"]["rows"]},
        "integrity": payload["integrity"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pd",
        description="PD disaggregation over Mooncake on TCP loopback, measured on this CPU: the "
        "write cost per item size and TTFT with decode worker processes.",
    )
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (about a minute).")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    args = parser.parse_args(argv)
    if (reason := skip_reason()) is not None:
        print(f"[pd] skipped: {reason}")
        return 0
    if not loopback.shim_loaded():
        return child(args.quick, args.out)
    return 1 if any(measure(args.quick, args.out)["integrity"].values()) else 0
