"""One configuration of ``bench.optimistic.bench``: its trace, its ``ServerArgs``, the warm-up of
the shared prefixes, the run and its numbers; and the prefill-time measurement that sets the
bootstrap delays and arrival rates."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from bench.clock.calibrate import Calibration
from bench.clock.host_meter import HostMeter
from bench.clock.trace_copies import CopyRecorder
from bench.e2e.audit import audit, config_summary
from bench.e2e.driver import Driver, run_until_idle
from bench.e2e.setup import SharedHostPool, model_args, new_executor, release_executor
from hicache.memory.allocator import page_ceil
from prefill.disagg.sim_config import DelayDistribution, PeerConfig
from prefill.request.state import Outcome
from server_args import ServerArgs

logger = logging.getLogger(__name__)

POLICIES = ("write_back", "write_through")
WRITE_THROUGH_FLAG = "optimistic_prefill_write_through"


def available_policies() -> list[str]:
    """write_back always; write_through where ``ServerArgs`` has the flag that lets optimistic
    prefill run under it (otherwise the gate resolves its attempts to 0)."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return [p for p in POLICIES if p == "write_back" or WRITE_THROUGH_FLAG in names]


@dataclass
class Trace:
    """What every configuration of one seed and variant replays."""

    opts: argparse.Namespace
    seed: int
    prompts: list[list[int]]
    arrivals: list[float]
    delay: DelayDistribution
    failure_prob: float
    forced_retry_prob: float = 0.0

    @staticmethod
    def server_args(
        opts: argparse.Namespace, attempts: int, failure_prob: float, policy: str
    ) -> ServerArgs:
        page = opts.page_size
        device_tokens = page_ceil(opts.device_pool_inputs * opts.input_len, page)
        extra = {WRITE_THROUGH_FLAG: True} if policy == "write_through" else {}
        return ServerArgs(
            **model_args(opts.use_mla),
            page_size=page,
            max_total_tokens=device_tokens,
            chunked_prefill_size=opts.chunk,
            enable_hierarchical_cache=True,
            hicache_write_policy=policy,
            hicache_ratio=opts.hicache_ratio,
            hicache_mem_layout="page_first",
            hicache_io_backend="kernel",
            disaggregation_mode="prefill",
            optimistic_prefill_attempts=attempts,
            disaggregation_bootstrap_failure_prob=failure_prob,
            random_seed=0,  # model weights: the same in every configuration and seed
            **extra,
        )

    @property
    def prefixes(self) -> list[list[int]]:
        n = int(self.opts.input_len * self.opts.cached_fraction)
        return [self.prompts[i][:n] for i in range(self.opts.num_prefixes)]


def make_trace(
    opts: argparse.Namespace,
    seed: int,
    arrivals: list[float],
    delay: DelayDistribution,
    failure_prob: float,
    forced_retry_prob: float = 0.0,
) -> Trace:
    from bench.e2e.workload import cached_prompts

    vocab = model_args(opts.use_mla)["vocab_size"]
    prompts = cached_prompts(len(arrivals), opts.input_len, opts.cached_fraction,
                             opts.num_prefixes, vocab, seed)  # fmt: skip
    return Trace(opts, seed, prompts, arrivals, delay, failure_prob, forced_retry_prob)


def _warm(ex: Any, prefixes: list[list[int]], cost: Any) -> None:
    """Put the shared prefixes in the cache (not measured)."""
    for i, p in enumerate(prefixes):
        ex.submit(f"warm-{i}", p)
    run_until_idle(ex, cost)
    ex.pop_results()
    for i in range(len(prefixes)):
        ex.decode.release(f"warm-{i}")


def calibrate_prefill_s(
    opts: argparse.Namespace, model: Any, cal: Calibration | None, virtual: bool | None = None,
    host_mode: str | None = None, host: SharedHostPool | None = None,
) -> float:  # fmt: skip
    """Median prefill latency (on the benchmark's clock: virtual with ``cal`` unless
    ``virtual`` is False, else wall) of a request whose prefix is cached, peers ready at once,
    one at a time: the bootstrap delays and arrival rates are set from it. ``host``: the
    benchmark's shared host pool."""
    trace = make_trace(opts, 0, [0.0] * (opts.num_prefixes + 3), DelayDistribution(), 0.0)
    args = Trace.server_args(opts, 0, 0.0, "write_back")
    ex, cost = new_executor(args, PeerConfig(seed=0), opts.input_len * 8, model, cal,
                            virtual=virtual, host_mode=host_mode or opts.host_time,
                            host=host)  # fmt: skip
    _warm(ex, trace.prefixes, cost)
    times = []
    for i, p in enumerate(trace.prompts):
        ex.submit(f"cal-{i}", p)
        run_until_idle(ex, cost)
        (res,) = ex.pop_results()
        times.append(res.prefill_latency)
        ex.decode.release(f"cal-{i}")
    release_executor(ex, host)
    times.sort()
    return times[len(times) // 2]


def host_profile(policy: str, attempts: int, forced: bool) -> str:
    """The host-cost profile of a configuration: its policy, with or without optimism (one
    attempt or two: the same work), with or without forced retries."""
    return f"{policy}/attempts_{0 if attempts == 0 else 2}" + ("_forced" if forced else "")


def run_config(
    trace: Trace, attempts: int, policy: str, model: Any, cal: Calibration | None,
    virtual: bool | None = None, host_mode: str | None = None,
    meters: dict[str, list[HostMeter]] | None = None, acks_at_step_end: bool = False,
    host: SharedHostPool | None = None, copies: CopyRecorder | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One configuration on ``trace`` (``virtual``: default whether ``cal`` is given;
    ``host_mode``: default ``--host-time``; ``meters`` receives the run's host meter, which
    then records its samples, under its host profile ``host_profile(...)``;
    ``acks_at_step_end``: see ``new_executor``; ``host``: the benchmark's shared host pool,
    for configurations of its pool size; ``copies``: records the run's real copies)."""
    opts = trace.opts
    args = Trace.server_args(opts, attempts, trace.failure_prob, policy)
    peer = PeerConfig(bootstrap_delay=trace.delay, bootstrap_failure_prob=trace.failure_prob,
                      force_not_ready_prob=trace.forced_retry_prob, seed=trace.seed)
    decode_tokens = opts.input_len * (len(trace.prompts) + opts.num_prefixes + 2)
    profile = host_profile(policy, attempts, trace.forced_retry_prob > 0)
    ex, cost = new_executor(args, peer, decode_tokens, model, cal, virtual=virtual,
                            host_mode=host_mode or opts.host_time,
                            record_host=meters is not None,
                            acks_at_step_end=acks_at_step_end, host_profile=profile,
                            host=host, copies=copies)  # fmt: skip
    if meters is not None and cost is not None and cost.meter is not None:
        meters.setdefault(profile, []).append(cost.meter)
    _warm(ex, trace.prefixes, cost)
    warm = dataclasses.replace(ex.stats)  # counters of the warm-up, not reported
    ledger = ComputeLedger(ex)
    driver = Driver(ex, len(trace.prompts), opts.kv_sample_every, cost)
    queue = collections.deque(range(len(trace.prompts)))
    t0 = ex.clock.now()

    def next_due() -> float | None:
        return t0 + trace.arrivals[queue[0]] if queue else None

    def pop_request() -> tuple[str, list[int]]:
        i = queue.popleft()
        return f"req-{i}", trace.prompts[i]

    run = driver.drive(next_due, pop_request, on_result=lambda r: None, done=lambda: not queue)
    integrity = audit(run)  # first: it pops the acks still ahead on the clock (copy stats)
    out = config_summary(run)
    stats = _minus(ex.stats, warm)
    recomputed = ledger.total_recomputed([r.rid for r in run.results])
    out.update(
        yields=stats.yields, parks=stats.parks, aborts=stats.aborts, retries=stats.retries,
        optimistic_admissions=stats.optimistic_admissions,
        bootstrap_failures=stats.bootstrap_failures,
        attempts_used_max=max((r.attempts for r in run.results), default=0),
        failed_requests=sum(1 for r in run.results if r.outcome == Outcome.ABORTED),
        recomputed_tokens=recomputed,
        recomputed_tokens_per_yield=recomputed / stats.yields if stats.yields else None,
        executor_yield_recomputed_tokens=stats.yield_recomputed_tokens,
        unpublished_dropped_tokens=stats.unpublished_dropped_tokens,
        seed=trace.seed, write_policy=policy,
    )  # fmt: skip
    out["integrity"] = integrity
    out["kv_max_rel_err"] = run.kv_max_rel_err
    # A forced-not-ready request is admitted optimistically once whatever the limit (the
    # upstream hook), so its budget is at least one attempt.
    budget = max(attempts, 1 if trace.forced_retry_prob > 0 else 0)
    if out["attempts_used_max"] > budget:
        out["integrity"]["attempt_budget_exceeded"] = 1
    out["server_args"] = args.to_dict()
    release_executor(ex, host)
    return out


def _minus(stats: Any, before: Any) -> Any:
    """``stats`` less ``before``, counter by counter (lists are left as they are)."""
    out = dataclasses.replace(stats)
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, int):
            setattr(out, f.name, value - getattr(before, f.name))
    return out


class ComputeLedger:
    """Which token positions of each request the executor computed, attempt after attempt:
    wraps ``ex.batch_runner.forward`` (instance attribute) and records, per rid, the range
    ``[computed_len, computed_len + n)`` of every batch entry. ``recomputed(rid)`` is the number
    of positions computed more than once (a retry redoing work a yield did not keep)."""

    def __init__(self, ex: Any) -> None:
        self.ranges: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        forward = ex.batch_runner.forward

        def recording_forward(batch: Any) -> Any:
            for req, n in batch:
                self.ranges[req.rid].append((req.computed_len, req.computed_len + n))
            return forward(batch)

        ex.batch_runner.forward = recording_forward

    def recomputed(self, rid: str) -> int:
        spans = sorted(self.ranges.get(rid, []))
        total = sum(hi - lo for lo, hi in spans)
        union, end = 0, -1
        for lo, hi in spans:
            if hi > end:
                union += hi - max(lo, end)
                end = hi
        return total - union

    def total_recomputed(self, rids: list[str]) -> int:
        return sum(self.recomputed(r) for r in rids)
