"""The L3 storage tier: multi-turn conversations whose working set is larger than device and host
memory together, a warm restart in a second process, and L3 bandwidth.

1. **Multi-turn rows** (``bench.multiturn.trace``'s workload, driver and audit; wall clock, so
   storage IO and copies cost what they cost; arrivals at ``--load`` of the device-only prefill
   rate measured at the start): the working set is ``--working-set-ratio``
   (default 8) times the device pool, the host pool ``--hicache-ratio`` (default 2) times the
   device pool. Rows: device only; L2 (``write_through``); L2 + L3 file (``cache`` host memory);
   L3 file with ``buffer_only`` host memory. Per row: TTFT (mean, p50, p90) and the hit tokens
   of each tier (device, L2 host, L3 storage; computed).
2. **Warm restart**: a second process (``bench.l3.restart``) over the directory the L2 + L3 row
   filled submits each conversation's last prompt once; the same over an empty directory (cold).
3. **Bandwidth** (``bench.l3.bandwidth``): the tier's page writes and reads against plain file
   copies of the same bytes, in the same run.

    python -m bench.l3 [--quick] [--out results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.e2e.audit import audit, config_summary
from bench.e2e.report import print_config_table, write_result
from bench.e2e.setup import (
    cpu_note,
    free_memory,
    model_args,
    new_executor,
    on_cuda,
    release_executor,
    shared_model,
)
from bench.l3 import bandwidth
from bench.multiturn import trace
from prefill.disagg.sim_config import PeerConfig
from server_args import ServerArgs

ROWS = {
    "device_only": dict(enable_hierarchical_cache=False),
    "L2": dict(enable_hierarchical_cache=True),
    "L2+L3 file": dict(enable_hierarchical_cache=True, hicache_storage_backend="file"),
    "L3 file buffer_only": dict(enable_hierarchical_cache=True, hicache_storage_backend="file",
                                hicache_host_memory_mode="buffer_only"),
}  # fmt: skip

TABLE = [
    ("TTFT mean ms", "ttft_mean_s", 1e3, ".1f"),
    ("p50 ms", "ttft_p50_s", 1e3, ".1f"),
    ("p90 ms", "ttft_p90_s", 1e3, ".1f"),
    ("dev hit tok", "device_hit_tokens", 1, ".0f"),
    ("L2 hit tok", "l2_hit_tokens", 1, ".0f"),
    ("L3 hit tok", "storage_hit_tokens", 1, ".0f"),
    ("computed tok", "prefill_tokens_computed", 1, ".0f"),
    ("L3 MB written", "l3_written_mb", 1, ".1f"),
]


def row_args(name: str, device_tokens: int, opts: argparse.Namespace, l3_dir: str) -> dict:
    fields = dict(
        **model_args(), **ROWS[name], page_size=opts.page_size, max_total_tokens=device_tokens,
        chunked_prefill_size=opts.chunked_prefill_size, hicache_ratio=opts.hicache_ratio,
        # CPU: the direct io backend (plain copies); the kernel ops run as a torch reference
        # there, which would make every L2/L3 row pay for an emulation.
        hicache_mem_layout="page_first" if on_cuda() else "page_first_direct",
        hicache_io_backend="kernel" if on_cuda() else "direct",
        disaggregation_mode="prefill", random_seed=0,
    )  # fmt: skip
    if fields.get("hicache_storage_backend"):
        fields["hicache_storage_backend_extra_config"] = json.dumps({"file_storage_path": l3_dir})
    return fields


def run_row(name: str, fields: dict, seed: int, rate: float, opts: argparse.Namespace,
            model: Any) -> tuple[dict[str, Any], list[list[int]]]:  # fmt: skip
    args = ServerArgs(**fields)
    conversations = trace.conversations_for(opts, args.vocab_size, seed)
    decode_tokens = trace.decode_tokens_for(conversations, opts)
    ex, cost = new_executor(args, PeerConfig(seed=seed), decode_tokens, model, None)
    run = trace.drive_trace(ex, cost, conversations, rate, seed, name, opts)
    ex.drain_cache_events()
    out = config_summary(run)
    out["integrity"] = audit(run)
    stats = ex.cache.stats
    out["storage_hit_tokens"] = stats.storage_hit_tokens
    out["l2_hit_tokens"] = out["host_hit_tokens"] - stats.storage_hit_tokens
    storage = ex.cache.storage
    if storage is not None:
        out["storage"] = storage.stats.as_dict()
        page_bytes = ex.cache.host_pool.page_nbytes / args.page_size
        out["l3_written_mb"] = storage.stats.backup_tokens * page_bytes / 1e6
    else:
        out["l3_written_mb"] = 0.0
    out["server_args"] = args.to_dict()
    last_prompts = [c.history for c in conversations]
    release_executor(ex)
    return out, last_prompts


def restart(fields: dict, prompts: list[list[int]], out_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: os.path.join(tmp, f"{k}.json") for k in ("args", "prompts", "out")}
        with open(paths["args"], "w", encoding="utf-8") as f:
            json.dump(fields, f)
        with open(paths["prompts"], "w", encoding="utf-8") as f:
            json.dump(prompts, f)
        cmd = [sys.executable, "-m", "bench.l3.restart", "--args", paths["args"],
               "--prompts", paths["prompts"], "--out", paths["out"]]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=1800)
        with open(paths["out"], encoding="utf-8") as f:
            res = json.load(f)
    reqs = res["requests"]
    ttfts = [r["ttft_s"] for r in reqs if r["ok"]]
    return {
        "requests": len(reqs),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "prompt_tokens": sum(r["tokens"] for r in reqs),
        "storage_hit_tokens": sum(r["storage"] for r in reqs),
        "device_hit_tokens": sum(r["device"] for r in reqs),
        "storage": res["storage"],
    }


def measured_rate(fields: dict, model: Any, opts: argparse.Namespace) -> float:
    """``--load`` over the wall time of a from-scratch prefill of the trace's mean prompt
    (device only, three times, one at a time): the arrival rate at that fraction of device-only
    capacity."""
    import time

    args = ServerArgs(**fields)
    convs = trace.conversations_for(opts, args.vocab_size, 0)
    lengths = [len(c.first_prompt) + sum(len(q) + 1 for q in c.questions[:r])
               for c in convs for r in range(c.num_rounds)]  # fmt: skip
    mean_len = max(1, round(sum(lengths) / len(lengths)))
    decode_tokens = -(-4 * mean_len // args.page_size) * args.page_size
    ex, _ = new_executor(args, PeerConfig(), decode_tokens, model, None)
    times = []
    for i in range(3):
        prompt = [(7 * i + 13 * t) % args.vocab_size for t in range(mean_len)]
        t0 = time.perf_counter()
        ex.submit(f"rate{i}", prompt)
        ex.run_until_idle()
        times.append(time.perf_counter() - t0)
        ex.pop_results()
    release_executor(ex)
    return opts.load / (sum(times[1:]) / 2)


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    base = ["--working-set-ratio", "8", "--hicache-ratio", "2", "--clock", "wall"]
    opts = trace.parse_args(base + list(argv), quick)
    if quick:
        opts.num_clients, opts.num_rounds, opts.seeds = 16, 4, [0]
    opts.bandwidth_pages = 64 if quick else 512
    return opts


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    opts = parse_args(argv or [], quick)
    seed = opts.seeds[0]
    working_set, device_tokens = trace.pool_sizes(opts)
    print(f"[l3] working set {working_set} tokens = {working_set / device_tokens:.1f}x the device "
          f"pool ({device_tokens} tokens); host pool {opts.hicache_ratio}x device; wall clock")
    note = cpu_note()
    base_fields = row_args("device_only", device_tokens, opts, "")
    model = shared_model(ServerArgs(**base_fields))
    rate = opts.request_rate or measured_rate(base_fields, model, opts)
    print(f"[l3] arrivals {rate:.2f}/s (load {opts.load:g} of the measured device-only "
          "prefill rate)", flush=True)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="l3_bench_") as root:
        for name in ROWS:
            l3_dir = os.path.join(root, name.replace(" ", "_"))
            fields = row_args(name, device_tokens, opts, l3_dir)
            rows[name], prompts = run_row(name, fields, seed, rate, opts, model)
            free_memory()
            if name == "L2+L3 file":
                warm_fields = fields
                warm_prompts = prompts
        print()
        print_config_table(rows, TABLE)
        cold_fields = dict(warm_fields)
        cold_fields["hicache_storage_backend_extra_config"] = json.dumps(
            {"file_storage_path": os.path.join(root, "empty")})
        restarts = {"warm": restart(warm_fields, warm_prompts, out_dir),
                    "cold": restart(cold_fields, warm_prompts, out_dir)}  # fmt: skip
    for k, r in restarts.items():
        print(f"[l3] restart {k}: {r['requests']} requests, TTFT mean "
              f"{r['ttft_mean_s'] * 1e3:.1f} ms, {r['storage_hit_tokens']} of "
              f"{r['prompt_tokens']} prompt tokens from L3")  # fmt: skip
    bw = bandwidth.measure(opts.bandwidth_pages)
    bandwidth.print_table(bw)
    integrity: dict[str, int] = {}
    for r in rows.values():
        for k, v in (r.get("integrity") or {}).items():
            integrity[k] = integrity.get(k, 0) + int(v)
        integrity["speculative_l3_pages"] = integrity.get("speculative_l3_pages", 0) + int(
            r["executor"].get("speculative_l3_pages", 0))
    summary = {"rows": {k: {kk: v for kk, v in r.items() if kk != "ttft_samples_s"}
                        for k, r in rows.items()}, "integrity": integrity,
               "restart": restarts, "bandwidth": bw, "working_set_tokens": working_set,
               "device_pool_tokens": device_tokens, "request_rate_per_s": rate,
               "note": note}  # fmt: skip
    path = write_result(out_dir, "l3", {"workload": vars(opts), "summary": summary})
    print(f"[l3] integrity: {integrity}")
    print(f"[l3] wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quick = "--quick" in argv
    out = Path("results")
    rest = []
    it = iter(argv)
    for a in it:
        if a == "--quick":
            continue
        if a == "--out":
            out = Path(next(it))
            continue
        rest.append(a)
    run(quick, out, rest)
    return 0
