"""Optimistic prefill: TTFT with 0, 1 and 2 optimistic attempts, L2 under write_back (and under
write_through where ``ServerArgs`` has ``optimistic_prefill_write_through``).

Long inputs of which ``--cached-fraction`` is a shared prefix already cached, Poisson arrivals
at ``--utilization`` of one-at-a-time capacity, and decode peers whose bootstrap takes a delay
uniform on [0.5, 1.5] x ``--delay-scale`` x the prefill time P of one request (measured on the
run's clock). Without optimism a request waits for its peer, then computes; with it, it computes
while the peer bootstraps (yield / park / retry as needed). Variants: ``_with_failures``
(injected bootstrap failures) and ``_forced_retry`` (peers report not-ready to a first attempt,
so every such request yields once: recomputation per yield shows).

Headline: mean TTFT with 0 attempts / with N, per seed and its spread, beside the zero-load
ceiling E[B+P]/E[max(B,P)]; on the wall clock (measured) and each GPU profile (modelled).

    python -m bench.optimistic [--quick] [--out DIR] [--clock wall|profile|both] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from bench.common import number, positive
from bench.e2e.audit import audit, config_summary
from bench.e2e.driver import Driver
from bench.e2e.report import TTFT_COLUMNS, Grid, modes, new_parser, print_tables, sized
from bench.e2e.setup import (
    SharedHostPool,
    mode_label,
    model_args,
    new_executor,
    release_executor,
    shared_model,
)
from bench.e2e.workload import cached_prompts, poisson_arrivals
from bench.profile import GpuProfile
from hicache_prefill.hicache.memory.allocator import page_ceil
from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs

RATIO = "ttft_mean_speedup_vs_0"
WRITE_THROUGH_FLAG = "optimistic_prefill_write_through"
# Workload flags a size fills when not given, and the sizes (``bench.e2e.report.sized``).
WORKLOAD = "num_requests input_len chunk seeds kv_sample_every attempts".split()
SIZES = {
    "quick": (
        (60, 256, 32, (0, 1, 2), 10, (2, 0)),
        (12, 2048, 256, (0, 1), 6, (2, 0)),
        (24, 8192, 1024, (0,), 6, (2, 0)),
    ),
    "full": (
        (400, 1024, 128, (0, 1, 2, 3, 4), 8, (2, 0, 1)),
        (64, 8192, 1024, (0, 1, 2), 8, (2, 0, 1)),
        (64, 32768, 4096, (0, 1, 2), 4, (2, 0, 1)),
    ),
}
KEYS = (
    "ttft_mean_s ttft_p50_s ttft_p90_s successes yields parks aborts retries "
    "recomputed_tokens_per_yield"
).split() + [RATIO]
COLUMNS = [
    *TTFT_COLUMNS,
    ("ok", "successes", 1, ".0f"),
    ("yields", "yields", 1, ".1f"),
    ("parks", "parks", 1, ".1f"),
    ("aborts", "aborts", 1, ".1f"),
    ("recomp/yield", "recomputed_tokens_per_yield", 1, ".1f"),
    ("vs 0", RATIO, 1, ".3f"),
]
VARIANTS = {"": (0.0, 0.0), "_with_failures": (1.0, 0.0), "_forced_retry": (0.0, 1.0)}
"""suffix -> (times --failure-prob, times --forced-retry-prob)."""


def policies() -> list[str]:
    """write_back, and write_through where ``ServerArgs`` lets optimism run under it."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ["write_back"] + (["write_through"] if WRITE_THROUGH_FLAG in names else [])


def ceiling(delay: DelayDistribution, p: float) -> float:
    """``E[B + P] / E[max(B, P)]`` for ``B`` uniform on ``[a, b]`` and a fixed ``P``."""
    a, b = delay.a, delay.b
    if p <= a:
        e_max = (a + b) / 2
    elif p >= b or b == a:
        e_max = p
    else:
        e_max = (p * (p - a) + (b * b - p * p) / 2) / (b - a)
    return ((a + b) / 2 + p) / e_max


class Optimistic:
    """The benchmark's workload and one configuration's run, for one size."""

    def __init__(self, opts: argparse.Namespace, model: Any, host: SharedHostPool) -> None:
        self.opts = opts
        self.vocab = model_args(opts.use_mla)["vocab_size"]
        self.model = model if model is not None else shared_model(self.server_args(0, "write_back"))
        self.host = host
        self.prefill_s: dict[str, float] = {}

    def server_args(self, attempts: int, policy: str, failure_prob: float = 0.0) -> ServerArgs:
        o = self.opts
        extra = {WRITE_THROUGH_FLAG: True} if policy == "write_through" else {}
        return ServerArgs(
            **model_args(o.use_mla),
            page_size=o.page_size,
            max_total_tokens=page_ceil(6 * o.input_len, o.page_size),
            chunked_prefill_size=o.chunk,
            enable_hierarchical_cache=True,
            hicache_write_policy=policy,
            hicache_ratio=2.0,
            hicache_mem_layout="page_first",
            hicache_io_backend="kernel",
            disaggregation_mode="prefill",
            optimistic_prefill_attempts=attempts,
            disaggregation_bootstrap_failure_prob=failure_prob,
            random_seed=0,
            **extra,
        )

    def prompts(self, seed: int, n: int) -> list[list[int]]:
        o = self.opts
        return cached_prompts(n, o.input_len, o.cached_fraction, o.num_prefixes, self.vocab, seed)

    def _warm(self, ex: Any, prompts: list[list[int]]) -> None:
        """Put the shared prefixes in the cache (not measured)."""
        n = int(self.opts.input_len * self.opts.cached_fraction)
        for i in range(self.opts.num_prefixes):
            ex.submit(f"warm-{i}", prompts[i][:n])
        ex.run_until_idle()
        for res in ex.pop_results():
            ex.decode.release(res.rid)

    def measure_prefill_s(self, profile: GpuProfile | None) -> float:
        """Median prefill latency of one request whose prefix is cached, peers ready at once,
        alone, on this mode's clock: it sets the bootstrap delays and the arrival rate."""
        key = "wall" if profile is None else profile.name
        if key not in self.prefill_s:
            prompts = self.prompts(12345, self.opts.num_prefixes + 5)
            ex, _ = new_executor(
                self.server_args(0, "write_back"),
                PeerConfig(),
                self.opts.input_len * 8,
                self.model,
                profile,
                self.host,
            )
            self._warm(ex, prompts)
            times = []
            for i, p in enumerate(prompts):
                ex.submit(f"p{i}", p)
                ex.run_until_idle()
                (res,) = ex.pop_results()
                times.append(res.prefill_latency)
                ex.decode.release(f"p{i}")
            release_executor(ex, self.host)
            self.prefill_s[key] = statistics.median(times)
        return self.prefill_s[key]

    def delay(self, profile: GpuProfile | None) -> DelayDistribution:
        mean = self.opts.delay_scale * self.measure_prefill_s(profile)
        return DelayDistribution("uniform", 0.5 * mean, 1.5 * mean)

    def run_one(self, profile: GpuProfile | None, seed: int, config: str) -> dict[str, Any]:
        """``config``: ``POLICY:attempts_N[SUFFIX]``."""
        o = self.opts
        policy, rest = config.split(":")
        attempts = int(rest.removeprefix("attempts_")[0])
        fail_x, forced_x = VARIANTS[rest[len("attempts_N") :]]
        prefill_s = self.measure_prefill_s(profile)
        args = self.server_args(attempts, policy, fail_x * o.failure_prob)
        peer = PeerConfig(
            bootstrap_delay=self.delay(profile),
            bootstrap_failure_prob=fail_x * o.failure_prob,
            force_not_ready_prob=forced_x * o.forced_retry_prob,
            seed=seed,
        )
        prompts = self.prompts(seed, o.num_requests)
        arrivals = poisson_arrivals(o.num_requests, o.utilization / prefill_s, seed)
        ex, _ = new_executor(
            args,
            peer,
            o.input_len * (o.num_requests + o.num_prefixes + 2),
            self.model,
            profile,
            self.host,
        )
        self._warm(ex, prompts)
        before = ex.stats.to_dict()
        queue = collections.deque(range(o.num_requests))
        t0 = ex.clock.now()
        driver = Driver(ex, o.num_requests, o.kv_sample_every)

        def pop_request() -> tuple[str, list[int]]:
            i = queue.popleft()
            return f"req-{i}", prompts[i]

        run = driver.drive(
            lambda: t0 + arrivals[queue[0]] if queue else None,
            pop_request,
            on_result=lambda r: None,
            done=lambda: not queue,
        )
        integrity = audit(run)
        stats = {
            k: v - before.get(k, 0) for k, v in ex.stats.to_dict().items() if isinstance(v, int)
        }
        out = config_summary(run)
        used = max((r.attempts for r in run.results), default=0)
        integrity["attempt_budget_exceeded"] = int(used > max(attempts, int(forced_x > 0)))
        recomputed = stats.get("yield_recomputed_tokens", 0)
        out.update(
            integrity=integrity,
            yields=stats["yields"],
            parks=stats["parks"],
            aborts=stats["aborts"],
            retries=stats["retries"],
            failed_requests=sum(r.outcome == Outcome.ABORTED for r in run.results),
            recomputed_tokens=recomputed,
            prefill_s=prefill_s,
            recomputed_tokens_per_yield=recomputed / stats["yields"] if stats["yields"] else None,
        )
        release_executor(ex, self.host)
        return out


def run(
    quick: bool = True, out_dir: Path = Path("bench-out"), argv: list[str] | None = None
) -> dict:
    """Every configuration under every clock mode and seed; returns the suite's summary."""
    opts = parse_args(argv or [], quick)
    out_dir = opts.out or out_dir
    pols = [p for p in policies() if p in opts.policies]
    grid = Grid(
        "optimistic",
        out_dir,
        RATIO,
        lambda c: c.replace(c[c.index(":") + 1 :][:10], "attempts_0"),
        {"workload": vars(opts)},
    )
    model, ceilings = None, {}
    for profile in modes(opts):
        o = sized(opts, WORKLOAD, SIZES, quick, modelled=profile is not None)
        configs = [
            f"{p}:attempts_{a}{v}"
            for v in VARIANTS
            for p in pols
            for a in o.attempts
            if not (v == "_with_failures" and p != "write_back")
        ]
        host = SharedHostPool()
        bench = Optimistic(o, model, host)
        model = bench.model
        key, label = mode_label(profile)
        p = bench.measure_prefill_s(profile)
        delay = bench.delay(profile)
        ceilings[key] = {
            "prefill_s": p,
            "delay_low_s": delay.a,
            "delay_high_s": delay.b,
            "ceiling_zero_load": ceiling(delay, p),
            "arrival_rate_per_s": o.utilization / p,
        }
        print(
            f"[optimistic] {label}: {o.num_requests} requests of {o.input_len} tokens "
            f"({o.cached_fraction:.0%} cached); prefill {p * 1e3:.2f} ms; bootstrap uniform "
            f"[{delay.a * 1e3:.2f}, {delay.b * 1e3:.2f}] ms; zero-load ceiling "
            f"{ceiling(delay, p):.3f}; seeds {o.seeds}",
            flush=True,
        )
        grid.run([profile], o.seeds, configs, bench.run_one)
        if o.sweeps and profile is not None:  # the ratio against the bootstrap delay
            pair = ["write_back:attempts_2", "write_back:attempts_0"]
            for scale in (0.5, 2.0):
                sweep = Optimistic(
                    argparse.Namespace(**{**vars(o), "delay_scale": scale}), model, host
                )
                grid.run([profile], o.seeds[:1], pair, sweep.run_one, suffix=f"_delay_{scale:g}")
        host.release()
    summary = grid.summary(KEYS)
    for mode, body in summary.items():
        body.update(ceilings.get(mode, {}))
    print(f"\n[optimistic] mean over seeds; {RATIO}")
    print_tables(summary, COLUMNS, RATIO, "mean TTFT speedup vs 0 attempts")
    path = grid.write(summary=summary)
    print(f"[optimistic] wrote {path}")
    return grid.result(summary, RATIO, ceilings=ceilings)


def parse_args(argv: list[str], quick: bool) -> argparse.Namespace:
    p = new_parser("python -m bench.optimistic", __doc__)
    p.add_argument("--num-requests", type=positive(int))
    p.add_argument("--input-len", type=positive(int))
    p.add_argument("--cached-fraction", type=number(float, 0.0, 1.0, low_ok=True), default=0.8)
    p.add_argument("--num-prefixes", type=positive(int), default=4)
    p.add_argument(
        "--utilization",
        type=float,
        default=0.25,
        help="Arrival rate as a fraction of one-at-a-time prefill capacity.",
    )
    p.add_argument(
        "--delay-scale",
        type=float,
        default=1.0,
        help="Mean bootstrap delay / the prefill time of one request.",
    )
    p.add_argument(
        "--failure-prob",
        type=float,
        default=0.1,
        help="Bootstrap failure probability of the _with_failures rows.",
    )
    p.add_argument(
        "--forced-retry-prob",
        type=float,
        default=0.5,
        help="Probability a peer reports not-ready to a first attempt (_forced_retry).",
    )
    p.add_argument("--page-size", type=positive(int), default=16)
    p.add_argument(
        "--chunked-prefill-size",
        dest="chunk",
        type=int,
        help="Small enough that the uncached part takes several chunks.",
    )
    p.add_argument(
        "--attempts",
        type=int,
        nargs="+",
        choices=(0, 1, 2),
        help="Attempt counts (0, the baseline, is always run).",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=["write_back", "write_through"],
        choices=("write_back", "write_through"),
    )
    opts = p.parse_args(argv)
    if opts.attempts is not None and 0 not in opts.attempts:
        opts.attempts = [*opts.attempts, 0]
    return opts
