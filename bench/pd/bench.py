"""``python -m bench.pd [--quick] [--out DIR]``: PD disaggregation over Mooncake on TCP loopback,
measured on this CPU under the loopback shim (a child when needed; start-up ``NOISE`` counted).
Write cost per item size (two engines, scattered items, bytes checked, against an in-memory copy),
fitted as ``kv_transfer_measured`` (a ``CopyPath``). The same over SGLang's wire: whole requests
from a prefill rank to a decode worker process (META in, KV and metadata row written, STATUS out),
scattered pages, bytes checked, beside the engine fit's prediction (``wire``). TTFT with 1 or 2
decode worker processes: cached-prefix prompts arrive (Poisson) at half the prefill rate; a worker
preallocates each after 0.5 to 1.5 prefill times (a busy decode), which optimistic prefill
(attempts 2) uses and attempts 0 waits out; the configurations take turns; each run ends with
``audit`` (``INTEGRITY``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import Column, print_table, write_json
from bench.profile import CopyPath
from hicache_prefill.hicache.storage.mooncake.availability import shim_loaded
from hicache_prefill.prefill.clock import WallClock
from hicache_prefill.prefill.disagg.backends import make_decode_backend
from hicache_prefill.prefill.disagg.mooncake.engine import KVTransferEngine
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry, pool_region
from hicache_prefill.prefill.disagg.mooncake.link import MooncakeBackend, MooncakeConfig
from hicache_prefill.prefill.disagg.mooncake.session_worker import Job, SourceMemory, kv_items
from hicache_prefill.prefill.disagg.protocol import KVPoll, MetadataRow
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor as Executor
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.prefill.scheduler.admission import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    metadata_buffer_count,
)
from hicache_prefill.server_args import ServerArgs, prepare_server_args
from tests.support import harness
from tests.support.loopback import preload_env, skip_reason
from tests.support.mooncake_decode import DecodeWorker, MooncakeDecode, start_workers, wait_for

MEASURED_ON = "a CPU: Mooncake over TCP loopback, wall clock"
NOISE = ("Local segment descriptor not found", "Logging before InitGoogleLogging")
ITEM_SIZES = (2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10)
PROMPT, CACHED, PREFIXES, VOCAB = 256, 204, 4, 1024
FLAGS = (
    "--device cpu --dtype float32 --num-layers 4 --num-attention-heads 8 --head-num 4 "
    f"--head-dim 32 --hidden-size 256 --intermediate-size 768 --vocab-size {VOCAB} --page-size 16 "
    "--max-total-tokens 8192 --chunked-prefill-size 64 --disaggregation-mode prefill "
    "--disaggregation-transfer-backend mooncake --disaggregation-bootstrap-port 0"
).split()
CONFIGS = [(1, 0), (1, 2), (2, 0), (2, 2)]  # (decode workers, optimistic attempts)
INTEGRITY = ("integrity_errors", "kv_mismatches", "decode_leaked_slots", "decode_late_writes")
KV_REL_TOL = 1e-3  # float32 KV against a recompute: reduction order only; wrong KV is ~1
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


def _write(engine: KVTransferEngine, session: str, srcs: list, dsts: list, size: int) -> None:
    if engine.write(session, srcs, dsts, [size] * len(srcs)) != 0:
        raise RuntimeError(f"batch_transfer_sync_write of {size}-byte items failed")


def write_cost(quick: bool) -> dict[str, Any]:
    """Mooncake's write cost per item size (medians) and its fit over the best repeats."""
    total, reps = (8 << 20, 5) if quick else (32 << 20, 9)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4 * total, dtype=np.uint8)
    dst = np.zeros_like(src)
    sender, receiver = KVTransferEngine("127.0.0.1"), KVTransferEngine("127.0.0.1")
    rows = []
    try:
        sender.register([(src.ctypes.data, src.size)])
        receiver.register([(dst.ctypes.data, dst.size)])
        for size in ITEM_SIZES:
            n, src_rows, dst_rows = total // size, src.reshape(-1, size), dst.reshape(-1, size)
            si, di = rng.permutation(len(src_rows))[:n], rng.permutation(len(dst_rows))[:n]
            addrs = [(a.ctypes.data + i * size).tolist() for a, i in ((src, si), (dst, di))]
            write = partial(_write, sender, receiver.session_id, *addrs, size)
            write()
            if not np.array_equal(dst_rows[di], src_rows[si]):
                raise RuntimeError(f"{size}-byte items: the receiver's bytes differ")
            times = timeit.repeat(write, number=1, repeat=reps)
            names = {"dst": dst_rows, "di": di, "src": src_rows, "si": si}  # the in-memory copy
            copy = timeit.repeat("dst[di] = src[si]", number=1, repeat=reps, globals=names)
            t, best, copy_s = statistics.median(times), min(times), statistics.median(copy)
            cells = (size, t / n * 1e6, total / t / 1e9, total / best / 1e9, total / copy_s / 1e9)
            rows.append({c.key: v for c, v in zip(RATE_COLUMNS, cells, strict=True)})
    finally:
        sender.close()
        receiver.close()
    fit = fit_copy_path(ITEM_SIZES, [r["item_bytes"] / r["best_gbps"] / 1e9 for r in rows])
    measured = None if fit is None else {**fit, "measured_on": "cpu loopback", "per": "item"}
    return {"rows": rows, "total_bytes": total, "repeats": reps, "kv_transfer_measured": measured}


WIRE_GEOMETRY = KVGeometry("mha", 4, 16, "float32", 8, 32, 32)  # 16 KiB a page of one buffer
WIRE_PAGES = (4, 16, 64, 256)
WIRE_COLUMNS = [
    Column("pages", "pages", 6),
    Column("items", "items", 6),
    Column("mbytes", "MB", 7, ".2f"),
    Column("handshake_ms", "META ms", 8, ".2f"),
    Column("transfer_ms", "send ms", 8, ".2f"),
    Column("us_per_item", "us/item", 8, ".1f"),
    Column("gbps", "GB/s", 7, ".3f"),
    Column("direct_ms", "direct ms", 10, ".2f"),
    Column("engine_fit_ms", "engine fit", 11, ".2f"),
]


def _until(pred: Any, timeout_s: float = 30.0) -> None:
    if not wait_for(pred, timeout_s, step_s=0.001):  # the executor polls each 1 ms too
        raise RuntimeError("a PD request did not reach its state in time")


def wire_cost(quick: bool, engine_fit: dict[str, float] | None) -> dict[str, Any]:
    """Whole requests over SGLang's wire (module docstring): per request size the median time
    from ``create_peer`` to ``WaitingForInput`` (the decode's META) and from ``init`` to
    ``Success`` (KV items and the ten metadata rows written, STATUS pushed), and a least-squares
    ``seconds = fixed + items * per_item`` over the sizes."""
    reps = 5 if quick else 9
    geo, ps = WIRE_GEOMETRY, WIRE_GEOMETRY.page_size
    tokens = (max(WIRE_PAGES) * 2 + 1) * ps
    pool = geo.make_pool(tokens)
    rng = np.random.default_rng(0)
    for layer in [*pool.k_buffer, *pool.v_buffer]:
        layer.copy_(torch.from_numpy(rng.standard_normal(layer.shape, dtype=np.float32)))
    backend = MooncakeBackend(pool, WallClock(), MooncakeConfig(bootstrap_port=0), 8)
    worker = DecodeWorker(geo, pool_tokens=tokens, check_free_pages=False).wait_ready()
    decode = MooncakeDecode(backend, [worker], owned=[worker])
    item = geo.item_lens()[0]
    rows = []
    try:
        for pages in WIRE_PAGES:
            n = pages * ps
            src_pages = torch.from_numpy(rng.permutation(tokens // ps - 1)[:pages] + 1)
            slots = (src_pages[:, None] * ps + torch.arange(ps)).flatten()
            boot, send = [], []
            for r in range(reps + 1):  # the first is a warm-up, its bytes checked
                rid = f"wire-{pages}-{r}"
                t0 = time.perf_counter()
                link = decode.create_peer(rid, n)
                _until(lambda link=link: link.poll() == KVPoll.WaitingForInput)
                t1 = time.perf_counter()
                link.init(1)
                link.send(1, 0, n, slots, last=True, metadata=MetadataRow(0, 1, 0))
                _until(lambda link=link: link.poll() == KVPoll.Success)
                t2 = time.perf_counter()
                if r == 0:
                    _, k, v = decode.received_kv(rid)
                    bufs = (pool.k_buffer, pool.v_buffer)
                    want = [torch.stack([x[slots] for x in b]) for b in bufs]
                    if not (torch.equal(k, want[0]) and torch.equal(v, want[1])):
                        raise RuntimeError(f"{pages}-page request: the decode's KV differs")
                else:
                    boot.append(t1 - t0)
                    send.append(t2 - t1)
                decode.release(rid)
            items = 2 * geo.layer_num * pages
            t = statistics.median(send)
            fit = None
            if engine_fit is not None:
                fit = items * (engine_fit["latency_s"] + item / (engine_fit["gbps"] * 1e9)) * 1e3
            rows.append({"pages": pages, "items": items, "mbytes": items * item / 1e6,
                         "handshake_ms": statistics.median(boot) * 1e3, "transfer_ms": t * 1e3,
                         "us_per_item": t / items * 1e6, "gbps": items * item / t / 1e9,
                         "engine_fit_ms": fit})  # fmt: skip
        direct_ms(backend, pool, rows, reps)
    finally:
        decode.close()
    x = np.asarray([r["items"] for r in rows], dtype=float)
    y = np.asarray([r["transfer_ms"] / 1e3 for r in rows])
    (fixed, per_item), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
    return {
        "rows": rows,
        "item_bytes": item,
        "repeats": reps,
        "fit": {"fixed_ms": float(fixed) * 1e3, "us_per_item": float(per_item) * 1e6,
                "gbps_at_item": item / float(per_item) / 1e9},  # fmt: skip
    }


def direct_ms(backend: MooncakeBackend, pool: Any, rows: list[dict[str, Any]], reps: int) -> None:
    """Each row's items written by one engine of this process straight into the decode worker's
    pool (its REGISTER's pointers, pages from 1), no control plane: ``direct_ms``."""
    (session,) = backend.transport.sessions.values()
    src = SourceMemory(session.worker.source.layer_ptrs, session.worker.source.item_lens, (), (),
                       ())  # fmt: skip
    engine = KVTransferEngine("127.0.0.1")
    try:
        engine.register([pool_region(pool)])
        for row in rows:
            pages = np.arange(1, row["pages"] + 1)
            job = Job(0, "direct", 0, pages * 2 + 1, pages, last=False)  # scattered sources
            items = kv_items(src, session.reg, job)
            write = partial(_write, engine, session.reg.session, items[0], items[1], items[2][0])
            write()
            row["direct_ms"] = statistics.median(timeit.repeat(write, number=1, repeat=reps)) * 1e3
    finally:
        engine.close()


def server_args(attempts: int) -> ServerArgs:
    """The prefill server: a small float32 model on the CPU, Mooncake transport on loopback."""
    return prepare_server_args([*FLAGS, "--optimistic-prefill-attempts", str(attempts)])


def geometry() -> KVGeometry:
    """The KV geometry of ``server_args``'s model: a decode worker's pool has it too."""
    return KVGeometry.from_pool(harness.build_cache(server_args(0)).device_pool)


def executor(args: ServerArgs, model: Any, workers: list, delays: dict[str, float]) -> Executor:
    """A wall-clock executor; its decode ``workers`` preallocate ``rid`` ``delays[rid]`` s late."""
    cache, clock = harness.build_cache(args), WallClock()
    rows = metadata_buffer_count(DEFAULT_MAX_RUNNING_REQUESTS)
    backend = make_decode_backend(args, cache.device_pool, clock, rows, 0, keep_received=True)
    decode = MooncakeDecode(backend, workers, owned=[], delay_s=lambda rid: delays.get(rid, 0.0))
    return Executor(args, cache=cache, model=model, clock=clock, decode=decode)


def one_by_one(ex: Executor, prompts: list[list[int]], tag: str) -> list[Any]:
    """Each prompt alone until its result (returned); its decode KV released."""
    out = []
    for i, p in enumerate(prompts):
        ex.submit(f"{tag}-{i}", p)
        ex.run_until_idle()
        out += ex.pop_results()
        ex.release_received(f"{tag}-{i}")
    return out


def drive(ex: Executor, prompts: list[list[int]], arrivals: list[float]) -> dict[str, Any]:
    """``req-i`` submitted ``arrivals[i]`` s from now; steps until every result is in; ``audit``."""
    t0, sent, due_now, results, ttfts, kept = ex.clock.now(), 0, 0, 0, [], []
    while results < len(prompts):
        while sent < len(prompts) and t0 + arrivals[sent] <= ex.clock.now():
            ex.submit(f"req-{sent}", prompts[sent])
            sent += 1
        progressed = ex.step()
        for r in ex.pop_results():
            results += 1
            if r.outcome == Outcome.SUCCESS:
                ttfts.append((r.finish_time - t0 - arrivals[int(r.rid[4:])]) * 1e3)
                if len(ttfts) % 4 == 1:
                    kept.append(r.rid)  # its decode KV is checked by the audit
                else:
                    ex.release_received(r.rid)
        nxt = t0 + arrivals[sent] if sent < len(prompts) else None
        due_now = 0 if progressed else ex.wait_for_next_event(due_now, also=nxt, local=True)
    items = sum(s["items"] for s in ex.decode.backend.transport.stats()["sessions"].values())
    out = {"ttfts_ms": ttfts, "requests": results, "items_per_send": items / max(ex.stats.sends, 1)}
    return out | {"integrity": audit(ex, kept)}


def audit(ex: Executor, kept: list[str]) -> dict[str, int]:
    """``INTEGRITY`` of a run (module docstring); closes the prefill side."""
    out = dict.fromkeys(INTEGRITY, 0)
    ex.drain_cache_events()
    try:
        ex.check_integrity()
    except AssertionError:
        out["integrity_errors"] = 1
    for rid in kept:
        error = harness.kv_max_rel_error(harness.decode_kv_and_reference(ex, rid))
        out["kv_mismatches"] += error > KV_REL_TOL
        ex.release_received(rid)
    ex.decode.close()
    freed = lambda s: s["held"] == 0 and s["free_tokens"] == s["pool_tokens"]
    for w in ex.decode.workers:
        wait_for(lambda w=w: freed(w.call("stats")[0]), 30)
        stats = w.call("stats")[0]
        out["decode_leaked_slots"] += stats["pool_tokens"] - stats["free_tokens"]
        out["decode_late_writes"] += stats["late_writes"]
    return out


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats: median (min, max) of their mean TTFT, p90 of all; sums."""
    means = sorted(statistics.fmean(r["ttfts_ms"]) for r in runs if r["ttfts_ms"])
    pooled = [t for r in runs for t in r["ttfts_ms"]]
    return {
        "requests": sum(r["requests"] for r in runs),
        "succeeded": len(pooled),
        "ttft_mean_ms": statistics.median(means) if means else None,
        "ttft_mean_min_ms": min(means, default=None),
        "ttft_mean_max_ms": max(means, default=None),
        "ttft_p90_ms": float(np.percentile(pooled, 90)) if pooled else None,
        "items_per_send": statistics.fmean(r["items_per_send"] for r in runs),
        "integrity": {k: sum(r["integrity"][k] for r in runs) for k in INTEGRITY},
    }


def ttft_rows(quick: bool, workers: list[DecodeWorker]) -> dict[str, Any]:
    """The TTFT table's rows (module docstring)."""
    n, repeats = (40, 3) if quick else (160, 5)
    rng = random.Random(1)
    draw = lambda k: [rng.randrange(1, VOCAB) for _ in range(k)]
    prefixes = [draw(CACHED) for _ in range(PREFIXES)]
    prompts = [prefixes[i % PREFIXES] + draw(PROMPT - CACHED) for i in range(n + 5)]
    model = build_model(server_args(0))
    ex = executor(server_args(0), model, workers[:1], {})
    one_by_one(ex, prefixes, "warm")
    prefill_s = statistics.median(r.prefill_latency for r in one_by_one(ex, prompts[n:], "cal"))
    ex.decode.close()
    delays = {f"req-{i}": rng.uniform(0.5, 1.5) * prefill_s for i in range(n)}
    arrivals = np.cumsum([rng.expovariate(0.5 / prefill_s) for _ in range(n)]).tolist()
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for r in range(repeats):
        for k, attempts in CONFIGS[r % 4 :] + CONFIGS[: r % 4]:
            ex = executor(server_args(attempts), model, workers[:k], delays)
            one_by_one(ex, prefixes, "warm")
            runs[(k, attempts)].append(drive(ex, prompts[:n], arrivals))
    rows = [
        {"config": f"{k} worker(s), attempts {a}", "workers": k, "attempts": a, **aggregate(rs)}
        for (k, a), rs in runs.items()
    ]
    for base, opt in zip(rows[0::2], rows[1::2], strict=True):
        if base["ttft_mean_ms"] and opt["ttft_mean_ms"]:
            opt["ttft_speedup_vs_0"] = base["ttft_mean_ms"] / opt["ttft_mean_ms"]
    info = {"prefill_ms": prefill_s * 1e3, "arrival_rate_per_s": 0.5 / prefill_s}
    return {"rows": rows, "requests": n, "repeats": repeats, **info}


def measure(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Both tables, in this process (the shim loaded); writes ``bench_pd.json``."""
    print(f"[pd] measured on {MEASURED_ON}; write cost per item size (medians)", flush=True)
    cost = write_cost(quick)
    print_table(cost["rows"], RATE_COLUMNS)
    if (path := cost["kv_transfer_measured"]) is not None:
        fit = f"{path['latency_s'] * 1e6:.1f} us per item, {path['gbps']:.3f} GB/s"
        print(f"[pd] least squares: {fit} (largest residual {path['max_rel_residual']:.0%})")
    print(f"[pd] SGLang's wire, whole requests of {WIRE_GEOMETRY.item_lens()[0] >> 10} KiB items "
          "to a decode worker process (medians; direct: the same items by one engine call, no "
          "control plane; engine fit: the line above's prediction)", flush=True)
    wire = wire_cost(quick, path)
    print_table(wire["rows"], WIRE_COLUMNS)
    wf = wire["fit"]
    print(f"[pd] least squares over request sizes: {wf['fixed_ms']:.2f} ms a request + "
          f"{wf['us_per_item']:.1f} us per item ({wf['gbps_at_item']:.3f} GB/s)")
    print("[pd] TTFT (ms), optimistic prefill attempts 0 and 2, busy decode workers", flush=True)
    workers = start_workers(2, geometry=geometry(), pool_tokens=32768, max_running_requests=64,
                            check_free_pages=False)  # fmt: skip
    try:
        with harness.single_torch_thread():
            latency = ttft_rows(quick, workers)
    finally:
        for w in workers:
            w.stop()
    print_table(latency["rows"], TTFT_COLUMNS)
    integrity = {k: sum(r["integrity"][k] for r in latency["rows"]) for k in INTEGRITY}
    payload = {"quick": quick, "measured_on": MEASURED_ON, "kv_transfer_measured": path}
    payload |= {"rate": cost, "wire": wire, "ttft": latency, "integrity": integrity}
    print(f"[pd] integrity: {integrity}\n[pd] wrote {write_json('bench_pd', payload, out_dir)}")
    return payload


def run(quick: bool = True, out_dir: Path = Path("bench-out")) -> dict[str, Any]:
    """The summary section (measured here or in a child under the shim), or ``skipped``."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before any engine; children inherit it
    if (reason := skip_reason("engine")) is not None:
        print(f"[pd] skipped: {reason}")
        return {"skipped": reason, "integrity": {}}
    path = out_dir / "bench_pd.json"
    if shim_loaded():
        payload = measure(quick, out_dir)
    else:
        path.unlink(missing_ok=True)  # the child's: under the shim, NOISE dropped and counted
        cmd = [sys.executable, "-m", "bench.pd", "--out", str(out_dir)] + ["--quick"] * quick
        proc = subprocess.Popen(cmd, env=preload_env(), stderr=subprocess.PIPE, text=True)
        hidden = 0
        for line in proc.stderr:
            if any(n in line for n in NOISE):
                hidden += 1
            else:
                sys.stderr.write(line)
        print(f"[pd] {hidden} lines of Mooncake start-up logging ({NOISE[0]!r}) not shown")
        rc = proc.wait()
        if not path.exists():
            raise RuntimeError(f"python -m bench.pd exited {rc} without writing {path}")
        payload = json.loads(path.read_text())
    section = {k: payload[k] for k in ("measured_on", "kv_transfer_measured", "integrity")}
    section["wire_fit"] = payload["wire"]["fit"]
    section["memcpy_gbps_by_item_bytes"] = {
        r["item_bytes"]: r["memcpy_gbps"] for r in payload["rate"]["rows"]
    }
    section["gbps_by_item_bytes"] = {r["item_bytes"]: r["gbps"] for r in payload["rate"]["rows"]}
    section["ttft_mean_ms"] = {r["config"]: r["ttft_mean_ms"] for r in payload["ttft"]["rows"]}
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (about a minute).")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="Output folder.")
    args = parser.parse_args(argv)
    return 1 if any(run(args.quick, args.out)["integrity"].values()) else 0
