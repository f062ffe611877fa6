"""The multi-turn benchmark's workload, shared by the single-rank run (``bench.multiturn.single``)
and the tensor-parallel one (``bench.multiturn.tp``): configurations, sizes, the trace, its
arrival rate and pool sizes, the driver loop over it, the table and the command line."""

from __future__ import annotations

import argparse
import collections
import random
from typing import Any

from bench.clock.calibrate import Calibration
from bench.e2e.driver import Driver, TraceRun
from bench.e2e.report import (
    add_common_args,
)
from bench.e2e.setup import model_args, on_cuda
from bench.e2e.workload import make_conversations, working_set_tokens
from hicache.memory.allocator import page_ceil
from server_args import ServerArgs

CONFIGS = {  # in run order: the headline (L2 write_through vs device-only) first
    "device_only": dict(enable_hierarchical_cache=False),
    "write_through": dict(enable_hierarchical_cache=True, hicache_write_policy="write_through"),
    "write_back": dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
    "write_through_selective": dict(
        enable_hierarchical_cache=True, hicache_write_policy="write_through_selective"
    ),
}

SIZES = {
    # (cpu, gpu) workloads
    "quick": (
        dict(num_clients=40, num_rounds=5, request_length=192, sub_question_input_length=48,
             load=0.7, max_parallel=4, seeds=(0, 1, 2), kv_sample_every=20),
        dict(num_clients=8, num_rounds=3, request_length=2048, sub_question_input_length=256,
             load=0.7, max_parallel=4, seeds=(0,), kv_sample_every=4),
    ),
    "full": (
        dict(num_clients=64, num_rounds=6, request_length=384, sub_question_input_length=96,
             load=0.7, max_parallel=8, seeds=(0, 1, 2, 3, 4), kv_sample_every=8),
        dict(num_clients=32, num_rounds=5, request_length=4096, sub_question_input_length=512,
             load=0.7, max_parallel=16, seeds=(0, 1, 2), kv_sample_every=4),
    ),
}  # fmt: skip

RATIO = "ttft_mean_speedup_vs_device_only"

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
    ("vs dev-only", RATIO, 1, ".3f"),
]

HEADLINE_KEYS = (
    "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "device_hit_tokens", "host_hit_tokens",
    "prefill_tokens_computed", "throughput_tok_s", "d2h_bytes", "h2d_bytes", "successes", RATIO,
)  # fmt: skip


def server_args_for(name: str, device_tokens: int, opts: argparse.Namespace) -> ServerArgs:
    return ServerArgs(
        **model_args(opts.use_mla),
        **CONFIGS[name],
        page_size=opts.page_size,
        max_total_tokens=device_tokens,
        chunked_prefill_size=opts.chunked_prefill_size,
        hicache_ratio=opts.hicache_ratio,
        hicache_mem_layout="page_first",
        hicache_io_backend="kernel",
        disaggregation_mode="prefill",
        random_seed=0,  # model weights: the same in every configuration and seed
    )


def conversations_for(opts: argparse.Namespace, vocab: int, seed: int) -> list[Any]:
    return make_conversations(opts.num_clients, opts.num_rounds, opts.request_length,
                              opts.sub_question_input_length, vocab, seed)  # fmt: skip


def longest_prompt(opts: argparse.Namespace) -> int:
    """Tokens of a conversation's last prompt: the first request, then each later round's
    question and the one token answered before it."""
    return opts.request_length + (opts.num_rounds - 1) * (opts.sub_question_input_length + 1)


def full_prefill_s(cal: Calibration, tokens: int, chunk: int) -> float:
    """Calibrated seconds to prefill ``tokens`` from scratch, chunk by chunk."""
    return sum(
        cal.forward.cost([(min(chunk, tokens - k), k)]) for k in range(0, tokens, max(chunk, 1))
    )


def request_rate(opts: argparse.Namespace, cal: Calibration) -> float:
    """Requests per second: ``--request-rate``, or ``--load`` times the device-only capacity:
    1 / the mean calibrated forward time of a from-scratch, chunk-by-chunk prefill of the
    trace's prompts (every round of every conversation, one request at a time; forward cost
    only, without host time or transfers). "0.7 of capacity" is a Poisson rate of 0.7 / that
    mean time."""
    if opts.request_rate is not None:
        return opts.request_rate
    convs = conversations_for(opts, 2, 0)
    lengths = [len(c.first_prompt) + sum(len(q) + 1 for q in c.questions[:r])
               for c in convs for r in range(c.num_rounds)]  # fmt: skip
    mean_s = sum(full_prefill_s(cal, n, opts.chunked_prefill_size) for n in lengths) / len(lengths)
    return opts.load / mean_s


def decode_tokens_for(conversations: list[Any], opts: argparse.Namespace) -> int:
    """Decode-side pool: the sampled successes keep their KV until the audit; the others free
    it."""
    total_requests = sum(c.num_rounds for c in conversations)
    longest = page_ceil(max(working_set_tokens([c]) for c in conversations), opts.page_size)
    return (total_requests // opts.kv_sample_every + opts.max_parallel + 2) * longest


def drive_trace(
    ex: Any, cost: Any, conversations: list[Any], rate: float, seed: int, name: str,
    opts: argparse.Namespace, max_requests: int | None = None, forward_log: Any = None,
    quiet: bool = False,
) -> TraceRun:  # fmt: skip
    """Submit the conversations' rounds to ``ex`` (rank 0's under tensor parallelism) at
    Poisson times, each round once the previous one's result is back, at most
    ``--max-parallel`` in flight, until every conversation is done (or, with ``max_requests``,
    until that many were sent and answered)."""
    total_requests = sum(c.num_rounds for c in conversations)
    cap = total_requests if max_requests is None else min(max_requests, total_requests)
    sent = [0]
    driver = Driver(ex, opts.max_parallel, opts.kv_sample_every, cost, forward_log)
    ready: collections.deque[tuple[int, float]] = collections.deque(
        (c, 0.0) for c in range(len(conversations))
    )
    prompts: dict[str, tuple[int, list[int]]] = {}
    rng = random.Random(seed)
    state = {"next_at": ex.clock.now()}

    def next_due() -> float | None:
        return max(state["next_at"], ready[0][1]) if ready and sent[0] < cap else None

    def pop_request() -> tuple[str, list[int]]:
        sent[0] += 1
        c, _ = ready.popleft()
        conv = conversations[c]
        prompt = conv.next_prompt()
        rid = f"c{c}-r{conv.round}"
        prompts[rid] = (c, prompt)
        state["next_at"] = max(state["next_at"], ex.clock.now()) + rng.expovariate(rate)
        return rid, prompt

    def on_result(res: Any) -> None:
        c, prompt = prompts[res.rid]
        conversations[c].complete_round(prompt)
        if not conversations[c].done:
            ready.append((c, res.finish_time))

    last = [0]

    def progress(n: int) -> None:
        if quiet:
            return
        if n - last[0] >= max(1, total_requests // 2) or n == total_requests:
            print(f"    {name} seed {seed}: {n}/{total_requests} requests", flush=True)
            last[0] = n

    return driver.drive(
        next_due, pop_request, on_result,
        done=lambda: sent[0] >= cap or all(c.done for c in conversations), progress=progress,
    )  # fmt: skip


def pool_sizes(opts: argparse.Namespace) -> tuple[int, int]:
    """(working set tokens, device pool tokens): the pool holds 1 / ``working_set_ratio`` of the
    working set, and at least two of the longest prompts."""
    working_set = working_set_tokens(conversations_for(opts, 2, 0))
    page = opts.page_size
    device_tokens = max(page, (int(working_set / opts.working_set_ratio) // page) * page)
    longest = longest_prompt(opts)
    if device_tokens < 2 * longest:
        device_tokens = page_ceil(2 * longest, page)
    return working_set, device_tokens


def add_ratios(results: dict[str, Any]) -> None:
    base = results.get("device_only", {}).get("ttft_mean_s")
    for res in results.values():
        res[RATIO] = base / res["ttft_mean_s"] if base and res.get("ttft_mean_s") else None


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    cpu, gpu = SIZES["quick" if quick else "full"]
    size = gpu if on_cuda() else cpu
    p = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__)
    p.add_argument("--num-clients", type=int, default=size["num_clients"])
    p.add_argument("--num-rounds", type=int, default=size["num_rounds"])
    p.add_argument("--request-length", type=int, default=size["request_length"])
    p.add_argument(
        "--sub-question-input-length", type=int, default=size["sub_question_input_length"]
    )
    p.add_argument("--load", type=float, default=size["load"],
                   help="Arrival rate as a fraction of device-only prefill capacity.")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson rate of submissions (requests/s); overrides --load.")
    p.add_argument("--max-parallel", type=int, default=size["max_parallel"])
    p.add_argument(
        "--working-set-ratio", type=float, default=4.0, help="Working set / device pool."
    )
    p.add_argument("--hicache-ratio", type=float, default=5.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512 if not on_cuda() else 4096)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--tp", type=int, default=1, help="Tensor-parallel ranks (bench/tp_multiturn).")
    add_common_args(p, size["seeds"], size["kv_sample_every"])
    opts = p.parse_args(argv)
    if "device_only" not in opts.configs:
        p.error("--configs must include device_only (the baseline of the ratios)")
    return opts  # fmt: skip

