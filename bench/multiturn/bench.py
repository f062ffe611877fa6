"""Multi-turn conversations through the prefill executor: device cache only vs the L2 cache under
each write policy (SGLang ``bench_multiturn`` style, output length 1).

Each client starts with a ``--request-length`` prompt; every later round appends a
``--sub-question-input-length`` question to the whole history. Requests leave a ready queue at
Poisson times, at most ``--max-parallel`` in flight, at ``--load`` times the rate a device-only
server prefills the trace's prompts from scratch (measured on the run's own clock). The device
pool holds 1 / ``--working-set-ratio`` of the working set, so history spills to L2.

Headline: mean TTFT of device-only / mean TTFT of each configuration, per seed, with its spread
over seeds, on the wall clock (measured) and on each GPU profile (modelled).

    python -m bench.multiturn [--quick] [--out DIR] [--clock wall|profile|both] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
from pathlib import Path
from typing import Any

from bench.common import positive
from bench.e2e.audit import audit, config_summary
from bench.e2e.driver import Driver, TraceRun
from bench.e2e.report import TTFT_COLUMNS, Grid, modes, new_parser, print_tables, sized
from bench.e2e.setup import (
    SharedHostPool,
    mode_label,
    model_args,
    new_executor,
    release_executor,
    shared_model,
)
from bench.e2e.workload import Conversation, make_conversations
from bench.profile import GpuProfile
from hicache_prefill.hicache.memory.allocator import page_ceil
from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.server_args import ServerArgs

CONFIGS = {  # in run order: the headline (L2 write_through vs device-only) first
    "device_only": dict(enable_hierarchical_cache=False),
    "write_through": dict(enable_hierarchical_cache=True, hicache_write_policy="write_through"),
    "write_back": dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
    "write_through_selective": dict(
        enable_hierarchical_cache=True, hicache_write_policy="write_through_selective"
    ),
}
# Workload flags a size fills when not given (``sized``), and the sizes: quick / full, each for
# the CPU's wall clock, a CPU run on a GPU profile (the GPU workload cut to seconds of CPU model
# work), and CUDA.
WORKLOAD = (
    "num_clients num_rounds request_length sub_question_input_length max_parallel seeds "
    "kv_sample_every chunked_prefill_size"
).split()
SIZES = {
    "quick": (
        (24, 5, 192, 48, 4, (0, 1, 2), 20, 512),
        (8, 3, 1024, 128, 4, (0, 1, 2), 8, 4096),
        (8, 3, 2048, 256, 4, (0,), 4, 4096),
    ),
    "full": (
        (64, 6, 384, 96, 8, (0, 1, 2, 3, 4), 8, 512),
        (16, 4, 2048, 256, 8, (0, 1, 2), 8, 4096),
        (32, 5, 4096, 512, 16, (0, 1, 2), 4, 4096),
    ),
}
RATIO = "ttft_mean_speedup_vs_device_only"
KEYS = (
    "ttft_mean_s ttft_p50_s ttft_p90_s device_hit_tokens host_hit_tokens "
    "prefill_tokens_computed backed_up_tokens loaded_tokens"
).split() + [RATIO]
COLUMNS = [
    *TTFT_COLUMNS,
    ("dev hit tok", "device_hit_tokens", 1, ".0f"),
    ("host hit tok", "host_hit_tokens", 1, ".0f"),
    ("computed tok", "prefill_tokens_computed", 1, ".0f"),
    ("vs dev-only", RATIO, 1, ".3f"),
]


class MultiTurn:
    """The benchmark's workload, pools and one configuration's run."""

    def __init__(self, opts: argparse.Namespace, model: Any, host: SharedHostPool) -> None:
        self.opts = opts
        self.vocab = model_args(opts.use_mla)["vocab_size"]
        self.working_set = sum(c.tokens() for c in self.conversations(0))
        longest = opts.request_length + (opts.num_rounds - 1) * (opts.sub_question_input_length + 1)
        page = opts.page_size
        device = int(self.working_set / opts.working_set_ratio) // page * page
        self.device_tokens = max(device, page_ceil(2 * longest, page))
        requests = opts.num_clients * opts.num_rounds
        self.decode_tokens = (requests // opts.kv_sample_every + opts.max_parallel + 2) * (
            page_ceil(longest + opts.num_rounds, page)
        )
        self.model = model if model is not None else shared_model(self.server_args("device_only"))
        self.host = host
        self.rates: dict[str, float] = {}

    def conversations(self, seed: int) -> list[Conversation]:
        o = self.opts
        return make_conversations(
            o.num_clients,
            o.num_rounds,
            o.request_length,
            o.sub_question_input_length,
            self.vocab,
            seed,
        )

    def server_args(self, config: str) -> ServerArgs:
        o = self.opts
        return ServerArgs(
            **model_args(o.use_mla),
            **CONFIGS[config],
            page_size=o.page_size,
            max_total_tokens=self.device_tokens,
            chunked_prefill_size=o.chunked_prefill_size,
            hicache_ratio=o.hicache_ratio,
            hicache_mem_layout="page_first",
            hicache_io_backend="kernel",
            disaggregation_mode="prefill",
            random_seed=0,
        )

    def rate(self, profile: GpuProfile | None) -> float:
        """Requests/s: ``--load`` / the mean time to prefill one prompt of each round from
        scratch, alone, device only, on this mode's clock."""
        key = "wall" if profile is None else profile.name
        if key not in self.rates:
            o = self.opts
            rng = random.Random(12345)
            lengths = [
                o.request_length + r * (o.sub_question_input_length + 1)
                for r in range(o.num_rounds)
            ]
            ex, _ = new_executor(
                self.server_args("device_only"),
                PeerConfig(),
                page_ceil(4 * max(lengths), o.page_size),
                self.model,
                profile,
                self.host,
            )
            times = []
            for i, n in enumerate([lengths[0], *lengths]):  # the first one warms up
                ex.submit(f"p{i}", [rng.randrange(1, self.vocab) for _ in range(n)])
                ex.run_until_idle()
                (res,) = ex.pop_results()
                times.append(res.prefill_latency)
                ex.decode.release(f"p{i}")
            release_executor(ex, self.host)
            self.rates[key] = o.load / statistics.fmean(times[1:])
        return self.rates[key]

    def run_one(self, profile: GpuProfile | None, seed: int, config: str) -> dict[str, Any]:
        rate = self.rate(profile)
        args = self.server_args(config)
        ex, timing = new_executor(
            args, PeerConfig(seed=seed), self.decode_tokens, self.model, profile, self.host
        )
        run = self.drive(ex, self.conversations(seed), rate, seed)
        out = {**config_summary(run), "integrity": audit(run), "arrival_rate_per_s": rate}
        if timing is not None:
            out["modelled_forward_s"] = timing.forward_s
        release_executor(ex, self.host)
        return out

    def drive(self, ex: Any, convs: list[Conversation], rate: float, seed: int) -> TraceRun:
        """Each conversation's rounds in turn (a round once the previous one's result is back),
        sent at Poisson times, at most ``--max-parallel`` in flight."""
        driver = Driver(ex, self.opts.max_parallel, self.opts.kv_sample_every)
        ready = collections.deque((c, 0.0) for c in range(len(convs)))
        prompts: dict[str, tuple[int, list[int]]] = {}
        rng = random.Random(seed)
        next_at = [ex.clock.now()]

        def next_due() -> float | None:
            return max(next_at[0], ready[0][1]) if ready else None

        def pop_request() -> tuple[str, list[int]]:
            c, _ = ready.popleft()
            prompt = convs[c].next_prompt()
            rid = f"c{c}-r{convs[c].round}"
            prompts[rid] = (c, prompt)
            next_at[0] = max(next_at[0], ex.clock.now()) + rng.expovariate(rate)
            return rid, prompt

        def on_result(res: Any) -> None:
            c, prompt = prompts[res.rid]
            convs[c].complete_round(prompt)
            if not convs[c].done:
                ready.append((c, res.finish_time))

        return driver.drive(
            next_due, pop_request, on_result, done=lambda: all(c.done for c in convs)
        )


def run(
    quick: bool = True, out_dir: Path = Path("bench-out"), argv: list[str] | None = None
) -> dict:
    """Every configuration under every clock mode and seed; returns the suite's summary. The
    modelled runs use the CUDA sizes (the profiles model an 8B model on a GPU)."""
    opts = parse_args(argv or [], quick)
    out_dir = opts.out or out_dir
    grid = Grid("multiturn", out_dir, RATIO, lambda c: "device_only", {"workload": vars(opts)})
    rates, model = {}, None
    for profile in modes(opts):
        o = sized(opts, WORKLOAD, SIZES, quick, modelled=profile is not None)
        host = SharedHostPool()  # one per size: every configuration of it shares the pool
        bench = MultiTurn(o, model, host)
        model = bench.model
        print(
            f"[multiturn] {mode_label(profile)[1]}: {o.num_clients} clients x {o.num_rounds} "
            f"rounds of {o.request_length} + {o.sub_question_input_length} tokens; working "
            f"set {bench.working_set} tokens, device pool {bench.device_tokens}; seeds "
            f"{o.seeds}",
            flush=True,
        )
        grid.run([profile], o.seeds, o.configs, bench.run_one)
        if o.sweeps and profile is not None:
            for load in (0.4, 0.95):
                sweep = MultiTurn(argparse.Namespace(**{**vars(o), "load": load}), model, host)
                grid.run(
                    [profile],
                    o.seeds[:1],
                    ["device_only", "write_through"],
                    sweep.run_one,
                    suffix=f"_load_{load:g}",
                )
        rates.update(bench.rates)
        host.release()
    summary = grid.summary(KEYS)
    print(f"\n[multiturn] mean over seeds; {RATIO}")
    print_tables(summary, COLUMNS, RATIO, "mean TTFT speedup vs device-only")
    path = grid.write(summary=summary, arrival_rates_per_s=rates)
    print(f"[multiturn] wrote {path}")
    return grid.result(summary, RATIO)


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    """The flags; workload flags left ``None`` take the size of each mode (``sized``)."""
    p = new_parser("python -m bench.multiturn", __doc__)
    p.add_argument("--num-clients", type=positive(int))
    p.add_argument("--num-rounds", type=positive(int))
    p.add_argument("--request-length", type=positive(int))
    p.add_argument("--sub-question-input-length", type=positive(int))
    p.add_argument(
        "--load",
        type=positive(float),
        default=0.7,
        help="Arrival rate as a fraction of device-only prefill capacity.",
    )
    p.add_argument("--max-parallel", type=positive(int))
    p.add_argument(
        "--working-set-ratio", type=positive(float), default=4.0, help="Working set / device pool."
    )
    p.add_argument("--hicache-ratio", type=positive(float), default=5.0)
    p.add_argument("--page-size", type=positive(int), default=16)
    p.add_argument("--chunked-prefill-size", type=positive(int))
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="Default: all but write_through_selective (quick), all (full).",
    )
    opts = p.parse_args(argv)
    if opts.configs is None:
        opts.configs = list(CONFIGS)[:3] if quick else list(CONFIGS)
    if opts.configs[0] != "device_only":
        opts.configs = ["device_only", *[c for c in opts.configs if c != "device_only"]]
    return opts
