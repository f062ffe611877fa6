"""``python -m bench.l3 [--quick] [--out DIR]``: the L3 tier's file backend, measured on this CPU
(wall clock). Writes ``bench_l3.json``.

1. **Restart**: a process serves ``clients`` prompts with L2 + L3 (``write_through``, the file
   backend) one at a time, finishes its backups and exits; a fresh process over the same
   directory serves each prompt extended by a new question (warm), and another over an empty
   directory does the same (cold). Per run: TTFT mean, the share of prompt tokens fetched from L3
   (the hit rate) and ``check_integrity``.
2. **Bandwidth** (``bench.l3.bandwidth``): the backend's page writes and reads against plain
   file copies of the same bytes.
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

from bench.common import write_json
from bench.l3 import bandwidth

MEASURED_ON = "a CPU, wall clock"
DESCRIPTION = "The L3 file backend on this CPU: restart hit rate and TTFT, page bandwidth."
QUESTION = 32  # tokens each restart prompt adds to a served one


def server_args(l3_dir: str, prompt: int) -> dict[str, Any]:
    """``ServerArgs`` fields of every process: a small model, a device pool of two prompts."""
    return dict(
        num_layers=4,
        num_attention_heads=8,
        head_num=4,
        head_dim=32,
        hidden_size=256,
        intermediate_size=768,
        page_size=16,
        max_total_tokens=2 * (prompt + QUESTION),
        chunked_prefill_size=256,
        device="cpu",
        dtype="float32",
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_write_policy="write_through",
        hicache_io_backend="direct",
        hicache_mem_layout="page_first_direct",
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": l3_dir}),
        disaggregation_mode="prefill",
        random_seed=0,
    )


def serve(fields: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """In a fresh process: ``prompts`` one at a time on the wall clock; the cache closed (every
    backup done) before returning."""
    from prefill.clock import WallClock
    from prefill.testing.harness import make_executor, single_torch_thread
    from server_args import ServerArgs

    ex = make_executor(ServerArgs(**fields), clock=WallClock(), keep_received=False)
    ttfts, tokens, from_l3, errors = [], 0, 0, 0
    with single_torch_thread():
        for i, prompt in enumerate(prompts):
            ex.submit(f"p{i}", prompt)
            ex.run_until_idle()
            (r,) = ex.pop_results()
            ttfts.append(r.ttft)
            tokens, from_l3 = tokens + r.num_tokens, from_l3 + r.cached_storage_tokens
        ex.drain_cache_events()
    try:
        ex.check_integrity()
    except AssertionError:
        errors = 1
    storage = ex.cache.storage.stats.as_dict()
    ex.cache.close()
    return {
        "requests": len(prompts),
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3,
        "prompt_tokens": tokens,
        "l3_hit_tokens": from_l3,
        "hit_rate": from_l3 / tokens,
        "integrity_errors": errors,
        "storage": storage,
    }


def _fresh_process(fields: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(serve, (fields, prompts))


def restart(clients: int, prompt: int) -> dict[str, Any]:
    """Fill, then warm and cold restarts (module docstring)."""
    rng = random.Random(0)
    first = [[rng.randrange(1, 512) for _ in range(prompt)] for _ in range(clients)]
    second = [p + [rng.randrange(1, 512) for _ in range(QUESTION)] for p in first]
    with tempfile.TemporaryDirectory(prefix="bench_l3_") as d:
        fill = _fresh_process(server_args(os.path.join(d, "l3"), prompt), first)
        warm = _fresh_process(server_args(os.path.join(d, "l3"), prompt), second)
        cold = _fresh_process(server_args(os.path.join(d, "empty"), prompt), second)
    return {"fill": fill, "warm": warm, "cold": cold}


def run(quick: bool = True, out_dir: Path = Path("results")) -> dict[str, Any]:
    """Both parts; prints them and writes ``bench_l3.json``."""
    clients, prompt, pages = (16, 256, 64) if quick else (64, 1024, 512)
    print(
        f"[l3] measured on {MEASURED_ON}; restart of {clients} prompts of {prompt} tokens",
        flush=True,
    )
    runs = restart(clients, prompt)
    print(f"{'process':<10}{'TTFT mean ms':>14}{'L3 hit tokens':>15}{'hit rate':>10}")
    for name, r in runs.items():
        print(f"{name:<10}{r['ttft_mean_ms']:>14.1f}{r['l3_hit_tokens']:>15}{r['hit_rate']:>10.1%}")
    bw = bandwidth.measure(pages)
    bandwidth.print_table(bw)
    integrity = {"integrity_errors": sum(r["integrity_errors"] for r in runs.values())}
    summary = {"measured_on": MEASURED_ON, "restart": runs, "bandwidth": bw, "integrity": integrity}
    print(f"[l3] integrity: {integrity}")
    print(f"[l3] wrote {write_json('bench_l3', {'quick': quick, **summary}, out_dir)}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.l3", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="Smaller sizes (about a minute).")
    parser.add_argument("--out", type=Path, default=Path("results"), help="Output folder.")
    args = parser.parse_args(argv)
    return 1 if any(run(args.quick, args.out).get("integrity", {}).values()) else 0
