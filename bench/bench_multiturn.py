"""Multi-turn conversations through the prefill executor: device cache only vs the L2 cache under
each write policy, on one trace (SGLang ``bench_multiturn`` style, output length 1).

Each client starts with a ``--request-length`` prompt; every later round appends a
``--sub-question-input-length`` question to the whole history. Requests leave a ready queue at
Poisson times (``--request-rate``), at most ``--max-parallel`` in flight. The device pool is sized
so the working set is ``--working-set-ratio`` times the pool, so the history spills to L2.

    python -m bench.bench_multiturn [--quick] [--out results]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.e2e import (
    Driver,
    audit,
    bench_main,
    config_summary,
    cpu_note,
    free_memory,
    new_executor,
    on_cuda,
    plot_ttft,
    print_config_table,
    release_executor,
    shared_model,
    sum_integrity,
    time_left,
    write_result,
)
from bench.workload import make_conversations, working_set_tokens
from prefill.bootstrap import PeerConfig
from server_args import ServerArgs

CONFIGS = {
    "device_only": dict(enable_hierarchical_cache=False),
    "write_through": dict(enable_hierarchical_cache=True, hicache_write_policy="write_through"),
    "write_through_selective": dict(
        enable_hierarchical_cache=True, hicache_write_policy="write_through_selective"
    ),
    "write_back": dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
}

# Model geometry for the CPU run: small enough for minutes on 2 cores, heavy enough that a
# prefill costs more than copying its KV back from host memory (as on a GPU with a real model).
CPU_MODEL = dict(
    num_layers=4,
    num_attention_heads=8,
    head_num=4,
    head_dim=32,
    hidden_size=256,
    intermediate_size=768,
    vocab_size=1024,
    dtype="float32",
)
GPU_MODEL = dict(model_preset="llama3-8b-shape", dtype="bfloat16")

SIZES = {
    # (cpu, gpu) workloads
    "quick": (
        dict(num_clients=8, num_rounds=4, request_length=384, sub_question_input_length=96,
             request_rate=16.0, max_parallel=4),
        dict(num_clients=8, num_rounds=3, request_length=2048, sub_question_input_length=256,
             request_rate=8.0, max_parallel=4),
    ),
    "full": (
        dict(num_clients=16, num_rounds=5, request_length=512, sub_question_input_length=128,
             request_rate=16.0, max_parallel=8),
        dict(num_clients=32, num_rounds=5, request_length=4096, sub_question_input_length=512,
             request_rate=4.0, max_parallel=16),
    ),
}  # fmt: skip


TABLE = [
    ("TTFT mean ms", "ttft_mean_s", 1e3, ".1f"),
    ("p50 ms", "ttft_p50_s", 1e3, ".1f"),
    ("p90 ms", "ttft_p90_s", 1e3, ".1f"),
    ("dev hit tok", "device_hit_tokens", 1, ".0f"),
    ("host hit tok", "host_hit_tokens", 1, ".0f"),
    ("computed tok", "prefill_tokens_computed", 1, ".0f"),
    ("D2H MB", "d2h_bytes", 1e-6, ".1f"),
    ("H2D MB", "h2d_bytes", 1e-6, ".1f"),
    ("tok/s", "throughput_tok_s", 1, ".0f"),
    ("vs dev-only", "ttft_mean_speedup_vs_device_only", 1, ".2f"),
]


def server_args_for(name: str, device_tokens: int, opts: argparse.Namespace) -> ServerArgs:
    model = GPU_MODEL if on_cuda() else CPU_MODEL
    return ServerArgs(
        **model,
        **CONFIGS[name],
        page_size=opts.page_size,
        max_total_tokens=device_tokens,
        chunked_prefill_size=opts.chunked_prefill_size,
        hicache_ratio=opts.hicache_ratio,
        hicache_mem_layout="page_first",
        hicache_io_backend="kernel",
        disaggregation_mode="prefill",
        random_seed=opts.seed,
    )


def run_config(
    name: str, device_tokens: int, opts: argparse.Namespace, model: Any = None
) -> dict[str, Any]:
    args = server_args_for(name, device_tokens, opts)
    conversations = make_conversations(
        opts.num_clients, opts.num_rounds, opts.request_length, opts.sub_question_input_length,
        args.vocab_size, opts.seed,
    )  # fmt: skip
    total_requests = sum(c.num_rounds for c in conversations)
    decode_tokens = (
        sum(
            len(c.first_prompt) + sum(len(q) for q in c.questions) + c.num_rounds
            for c in conversations
        )
        * opts.num_rounds
    )
    ex = new_executor(
        args, PeerConfig(seed=opts.seed), decode_pool_tokens=decode_tokens, model=model
    )
    driver = Driver(ex, opts.max_parallel)
    ready: collections.deque[int] = collections.deque(range(len(conversations)))
    prompts: dict[str, tuple[int, list[int]]] = {}
    rng = random.Random(opts.seed)
    state = {"next_at": ex.clock.now()}

    def next_due() -> float | None:
        return state["next_at"] if ready else None

    def pop_request() -> tuple[str, list[int]]:
        c = ready.popleft()
        conv = conversations[c]
        prompt = conv.next_prompt()
        rid = f"c{c}-r{conv.round}"
        prompts[rid] = (c, prompt)
        gap = rng.expovariate(opts.request_rate) if opts.request_rate > 0 else 0.0
        state["next_at"] = max(state["next_at"], ex.clock.now()) + gap
        return rid, prompt

    def on_result(res: Any) -> None:
        c, prompt = prompts[res.rid]
        conversations[c].complete_round(prompt)
        if not conversations[c].done:
            ready.append(c)

    last = [0]

    def progress(n: int) -> None:
        if n - last[0] >= max(1, total_requests // 4) or n == total_requests:
            print(f"    {name}: {n}/{total_requests} requests", flush=True)
            last[0] = n

    run = driver.drive(
        next_due, pop_request, on_result,
        done=lambda: all(c.done for c in conversations), progress=progress,
    )  # fmt: skip
    out = config_summary(run)
    out["integrity"] = audit(run)
    out["kv_max_rel_err"] = run.kv_max_rel_err
    out["server_args"] = args.to_dict()
    release_executor(ex)
    return out


def run(quick: bool = True, out_dir: Path = Path("results"), argv: list[str] | None = None) -> dict:
    """Run every configuration on one trace; returns the summary keyed by configuration."""
    opts = parse_args(argv or [], quick)
    working_set = working_set_tokens(
        make_conversations(
            opts.num_clients, opts.num_rounds, opts.request_length,
            opts.sub_question_input_length, vocab_size=2, seed=opts.seed,
        )
    )  # fmt: skip
    page = opts.page_size
    device_tokens = max(page, (int(working_set / opts.working_set_ratio) // page) * page)
    longest = opts.request_length + (opts.num_rounds - 1) * (opts.sub_question_input_length + 1)
    if device_tokens < 2 * longest:
        device_tokens = ((2 * longest + page - 1) // page) * page
    ratio = working_set / device_tokens
    note = cpu_note()
    print(
        f"[multiturn] working set {working_set} tokens, device pool {device_tokens} tokens "
        f"(working set / device pool = {ratio:.2f}); host pool = {opts.hicache_ratio}x device"
    )
    if note:
        print(f"[multiturn] {note}")
    results: dict[str, Any] = {}
    skipped: list[str] = []
    first = opts.configs[0] if opts.configs else "device_only"
    model = shared_model(server_args_for(first, device_tokens, opts))
    slowest = 0.0
    for name in opts.configs:
        if time_left() < 1.5 * slowest + 5:
            print(f"[multiturn] {name}: skipped, {time_left():.0f} s left", flush=True)
            skipped.append(name)
            continue
        print(f"[multiturn] {name} ...", flush=True)
        t0 = time.perf_counter()
        results[name] = run_config(name, device_tokens, opts, model)
        slowest = max(slowest, time.perf_counter() - t0)
        free_memory()
        # Written after every configuration, so a run cut short still leaves its results.
        write_result(out_dir, "multiturn", {"workload": vars(opts), "note": note,
                                            "partial": True, "configs": results})  # fmt: skip
    del model
    free_memory()
    base = results.get("device_only", {}).get("ttft_mean_s")
    for res in results.values():
        res["ttft_mean_speedup_vs_device_only"] = (
            base / res["ttft_mean_s"] if base and res.get("ttft_mean_s") else None
        )
    print_config_table(results, TABLE)
    summary = {
        **{k: _headline(v) for k, v in results.items()},
        "working_set_tokens": working_set,
        "device_pool_tokens": device_tokens,
        "working_set_over_device_pool": ratio,
        "integrity": sum_integrity(results),
        "note": note,
        "skipped_for_time": skipped,
    }
    doc = {"workload": vars(opts), "note": note, "summary": summary, "configs": results}
    path = write_result(out_dir, "multiturn", doc)
    plot_ttft(
        results, out_dir / "multiturn_ttft.png", "Multi-turn prefill TTFT per cache configuration",
        list(results),
    )  # fmt: skip
    print(f"[multiturn] wrote {path}")
    return summary


def _headline(res: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "device_hit_tokens", "host_hit_tokens",
        "prefill_tokens_computed", "throughput_tok_s", "d2h_bytes", "h2d_bytes",
        "ttft_mean_speedup_vs_device_only",
    )  # fmt: skip
    return {k: res.get(k) for k in keys}


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    cpu, gpu = SIZES["quick" if quick else "full"]
    size = gpu if on_cuda() else cpu
    p = argparse.ArgumentParser(prog="python -m bench.bench_multiturn", description=__doc__)
    p.add_argument("--num-clients", type=int, default=size["num_clients"])
    p.add_argument("--num-rounds", type=int, default=size["num_rounds"])
    p.add_argument("--request-length", type=int, default=size["request_length"])
    p.add_argument(
        "--sub-question-input-length", type=int, default=size["sub_question_input_length"]
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=size["request_rate"],
        help="Poisson rate of submissions (requests/s); <= 0 = as fast as possible.",
    )
    p.add_argument("--max-parallel", type=int, default=size["max_parallel"])
    p.add_argument(
        "--working-set-ratio", type=float, default=4.0, help="Working set / device pool."
    )
    p.add_argument("--hicache-ratio", type=float, default=5.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512 if not on_cuda() else 4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    return p.parse_args(argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(bench_main("multiturn", run))
