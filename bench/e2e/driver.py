"""The request driver of the end-to-end benchmarks: requests fed to the executor at their
times, results collected, sends checked against the finalized attempt (``Driver``), and the
per-step settling of a virtual-clock run (``settle``, ``run_until_idle``).

TTFT is measured from the moment the client *sends* a request to the decode side's transfer
``Success`` (as a benchmark client measures it): the send is the request's due time (its Poisson
arrival, or for a later round of a conversation the previous round's result, whichever is
later), or later still when all ``max_parallel`` slots were taken then: the moment a slot freed
(the finish time of the result that freed it). Time a request waited for a slot is not in its
TTFT; time it waited inside the server (queues, bootstrap, chunks, transfer) is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.clock.virtual_cost import CostAccountant
from bench.e2e.strict_audit import ForwardLog
from prefill.executor import OptimisticPrefillExecutor
from prefill.request.state import Outcome, RequestResult

logger = logging.getLogger(__name__)


@dataclass
class TraceRun:
    """What one configuration's run produced. ``ttft`` is keyed by rid (seconds from send)."""

    label: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    executor: OptimisticPrefillExecutor | None = None
    sampled: list[str] = field(default_factory=list)
    ttft: dict[str, float] = field(default_factory=dict)
    cost: CostAccountant | None = None
    unfinalized_sends: int = 0  # results whose sends name an attempt that was not finalized
    kv_max_rel_err: float | None = None  # set by ``audit``
    forward_log: ForwardLog | None = None  # every forward's layout (the strict audit's replay)


def is_virtual(ex: OptimisticPrefillExecutor) -> bool:
    return bool(getattr(ex.clock, "is_virtual", False))


def settle(ex: OptimisticPrefillExecutor, cost: CostAccountant | None = None) -> bool:
    """One scheduler step; on a virtual clock then wait for the cache's real copies (popping
    no ack: the tree pops each at its modelled time), so the next step sees a state that does
    not depend on thread timing."""
    progressed = ex.step()
    if cost is not None:
        cost.settle()
    return progressed


def run_until_idle(ex: OptimisticPrefillExecutor, cost: CostAccountant | None = None) -> None:
    """The executor's own ``run_until_idle``; on a virtual clock every step is followed by the
    wait for the cache's copies (as ``settle`` does)."""
    ex.run_until_idle(after_step=None if cost is None else cost.settle)


class Driver:
    """Feeds requests to an executor at their times and collects results.

    Every ``kv_sample_every``-th success keeps its decode-side KV for ``audit``'s recompute
    checks (the strict one replays its forwards from ``forward_log``, installed here unless
    given); the others release it at once. Results are collected in finish order after each
    step. Each result's sends are checked against the decode peer's finalized attempt: a
    success sent only its last attempt, which was finalized; an aborted request sent nothing or
    only its last attempt (``TraceRun.unfinalized_sends`` counts the others).
    """

    def __init__(
        self,
        executor: OptimisticPrefillExecutor,
        max_parallel: int,
        kv_sample_every: int = 4,
        cost: CostAccountant | None = None,
        forward_log: ForwardLog | None = None,
    ) -> None:
        self.ex = executor
        self.max_parallel = max_parallel
        self.kv_sample_every = kv_sample_every
        self.inflight: set[str] = set()
        self.sent_at: dict[str, float] = {}
        self.slot_free_at = float("-inf")
        log = forward_log if forward_log is not None else ForwardLog(executor)
        self.run = TraceRun(label="", executor=executor, cost=cost, forward_log=log)
        self._successes = 0
        self._sent: dict[str, set[int]] = {}
        self._log_seen = 0

    def _read_send_log(self) -> None:
        log = self.ex.decode.send_log
        for i in range(self._log_seen, len(log)):
            self._sent.setdefault(log[i].rid, set()).add(log[i].attempt)
        self._log_seen = len(log)

    def _check_sends(self, res: RequestResult) -> None:
        sent = self._sent.pop(res.rid, set())
        if res.outcome == Outcome.SUCCESS:
            peer = self.ex.decode.peers.get(res.rid)
            final = None if peer is None else peer.finalized_attempt
            bad = final != res.passes or sent != {res.passes}
        else:
            bad = bool(sent - {res.passes})
        self.run.unfinalized_sends += int(bad)

    def _collect(self, on_result: Callable[[RequestResult], None]) -> None:
        self._read_send_log()
        for res in self.ex.pop_results():
            rid = res.rid
            if rid not in self.inflight:
                continue
            self._check_sends(res)
            if len(self.inflight) >= self.max_parallel:
                self.slot_free_at = res.finish_time
            self.inflight.discard(rid)
            self.run.results.append(res)
            if res.outcome == Outcome.SUCCESS:
                self.run.ttft[rid] = res.finish_time - self.sent_at[rid]
                self._successes += 1
                if (self._successes - 1) % self.kv_sample_every == 0:
                    self.run.sampled.append(rid)
                else:
                    self.ex.release_received(rid)  # (every rank's decode side under TP)
                    self.run.forward_log.forget(rid)
            on_result(res)

    def drive(
        self,
        next_due: Callable[[], float | None],
        pop_request: Callable[[], tuple[str, list[int]]],
        on_result: Callable[[RequestResult], None],
        done: Callable[[], bool],
        progress: Callable[[int], None] | None = None,
    ) -> TraceRun:
        """Run until ``done()`` and the executor is idle. ``next_due()`` is when the next
        request may be sent (None: nothing queued); ``pop_request()`` takes it."""
        start = time.perf_counter()
        due_now = 0
        while True:
            now = self.ex.clock.now()
            due = next_due()
            while due is not None and due <= now and len(self.inflight) < self.max_parallel:
                rid, tokens = pop_request()
                self.ex.submit(rid, tokens)
                self.sent_at[rid] = max(due, self.slot_free_at)
                self.inflight.add(rid)
                due = next_due()
            progressed = settle(self.ex, self.run.cost)
            self._collect(on_result)
            if progress is not None:
                progress(len(self.run.results))
            if done() and not self.inflight and self.ex.is_idle():
                break
            if progressed:
                due_now = 0
                continue
            # Rank 0 drives alone under tensor parallelism (the others follow): local events.
            free = len(self.inflight) < self.max_parallel
            due_now = self.ex.wait_for_next_event(due_now, also=due if free else None, local=True)
        self.run.wall_s = time.perf_counter() - start
        return self.run
