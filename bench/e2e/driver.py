"""The request driver of the end-to-end benchmarks: requests fed to the executor at their
times, results collected, every result's sends checked against the finalized attempt.

TTFT runs from the client's send to the decode side's transfer ``Success``: the send is the
request's due time, or later when all ``max_parallel`` slots were taken then (the moment one
freed). Time waiting for a slot is not in TTFT; time inside the server is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.prefill.request.state import Outcome, RequestResult


@dataclass
class TraceRun:
    """What one configuration's run produced. ``ttft`` is keyed by rid (seconds from send)."""

    executor: OptimisticPrefillExecutor
    results: list[RequestResult] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)  # successes whose decode KV is kept
    ttft: dict[str, float] = field(default_factory=dict)
    unfinalized_sends: int = 0  # results whose sends name an attempt that was not finalized
    wall_s: float = 0.0


class Driver:
    """Feeds requests to an executor at their times and collects results; every
    ``kv_sample_every``-th success keeps its decode-side KV for the audit."""

    def __init__(self, ex: OptimisticPrefillExecutor, max_parallel: int, kv_every: int) -> None:
        self.ex = ex
        self.max_parallel = max_parallel
        self.kv_every = kv_every
        self.inflight: set[str] = set()
        self.sent_at: dict[str, float] = {}
        self.slot_free_at = float("-inf")
        self.run = TraceRun(ex)
        self._sent: dict[str, set[int]] = {}
        self._log_seen = 0

    def _check_sends(self, res: RequestResult) -> None:
        log = self.ex.decode.send_log
        for i in range(self._log_seen, len(log)):
            self._sent.setdefault(log[i].rid, set()).add(log[i].attempt)
        self._log_seen = len(log)
        sent = self._sent.pop(res.rid, set())
        if res.outcome == Outcome.SUCCESS:
            peer = self.ex.decode.peers.get(res.rid)
            final = None if peer is None else peer.finalized_attempt
            bad = final != res.passes or sent != {res.passes}
        else:
            bad = bool(sent - {res.passes})
        self.run.unfinalized_sends += int(bad)

    def _collect(self, on_result: Callable[[RequestResult], None]) -> None:
        for res in self.ex.pop_results():
            if res.rid not in self.inflight:
                continue
            self._check_sends(res)
            if len(self.inflight) >= self.max_parallel:
                self.slot_free_at = res.finish_time
            self.inflight.discard(res.rid)
            self.run.results.append(res)
            if res.outcome == Outcome.SUCCESS:
                self.run.ttft[res.rid] = res.finish_time - self.sent_at[res.rid]
                if len(self.run.ttft) % self.kv_every == 1 or self.kv_every == 1:
                    self.run.sampled.append(res.rid)
                else:
                    self.ex.release_received(res.rid)
            on_result(res)

    def drive(
        self,
        next_due: Callable[[], float | None],
        pop_request: Callable[[], tuple[str, list[int]]],
        on_result: Callable[[RequestResult], None],
        done: Callable[[], bool],
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
            progressed = self.ex.step()
            self._collect(on_result)
            if done() and not self.inflight and self.ex.is_idle():
                break
            if progressed:
                due_now = 0
                continue
            free = len(self.inflight) < self.max_parallel
            due_now = self.ex.wait_for_next_event(due_now, also=due if free else None)
        self.run.wall_s = time.perf_counter() - start
        return self.run
