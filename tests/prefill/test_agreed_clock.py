"""One time on every tensor-parallel rank (``tp_lockstep.sync.AgreedClock`` on a virtual clock).

- Without processes: rank 0 alone waits (the follow protocol's driver does), both ranks take the
  broadcast base and advance alike; both read bitwise the same time.
- Two real ranks (gloo): rank 0 drives a trace alone (submits at arrival times, waits for its
  own next event between steps), rank 1 follows; with transfer latencies and forward costs whose
  sums round differently from one base to the next, every request succeeds and both ranks end
  idle at the same time.
"""

from __future__ import annotations

import types
from typing import Any

from hicache_prefill.hicache.tp.group import new_cache_group
from hicache_prefill.prefill.clock import VirtualClock
from hicache_prefill.prefill.disagg.simulated import DelayDistribution, PeerConfig
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.prefill.tp_lockstep.sync import AgreedClock
from hicache_prefill.server_args import ServerArgs
from tests.support.harness import make_executor
from tests.support.tp_harness import run_ranks


def _rank(rank: int) -> Any:
    return types.SimpleNamespace(rank=rank, size=2)


def test_only_rank_0_waits_and_both_ranks_read_the_same_time() -> None:
    c0, c1 = AgreedClock(VirtualClock(), _rank(0)), AgreedClock(VirtualClock(), _rank(1))
    c0.wait_until(0.1)  # rank 0's driver waits for an arrival; rank 1 is in the broadcast
    base = c0.live_now()
    for c in (c0, c1):
        c.set_base(base)
    for _ in range(2):
        for c in (c0, c1):
            c.advance(0.0011)
    assert c0.now() == c1.now() == 0.1 + 0.0011 + 0.0011  # bitwise, the same float sums
    c1.wait_until(c1.now() - 1.0)  # never backwards
    assert c1.now() == c0.now()


def _args() -> ServerArgs:
    return ServerArgs(
        device="cpu", tp_size=2, page_size=4, max_total_tokens=256, chunked_prefill_size=32,
        enable_hierarchical_cache=True, hicache_write_policy="write_through", hicache_ratio=2.0,
        hicache_mem_layout="layer_first", hicache_io_backend="direct",
        disaggregation_mode="prefill",
    )  # fmt: skip


REQUESTS = 60  # the old per-rank offsets stalled this trace at r44
START = 0.1


def _follow(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 drives alone, as ``bench.e2e.driver.Driver`` does; rank 1 follows."""
    group = new_cache_group()
    args = _args()
    peer = PeerConfig(bootstrap_delay=DelayDistribution("uniform", 0.0003, 0.0071),
                      transfer_latency_s=0.0013, seed=3)  # fmt: skip
    ex = make_executor(args, peer_config=peer, clock=VirtualClock(), group=group,
                       cost_model=lambda new, prefix: 0.0011 + 1e-5 * new)  # fmt: skip
    results: list[tuple[str, str]] = []
    if rank == 0:
        # One request at a time, each sent a gap after the previous one's result: rank 0 alone
        # waits out every gap, and every request's last transfer ends with nothing else pending.
        gaps = [0.0037 * (1 + (5 * i) % 11) for i in range(REQUESTS)]
        next_at = START
        sent = 0
        due_now = 0
        while sent < REQUESTS or not ex.is_idle():
            if sent < REQUESTS and ex.is_idle() and next_at <= ex.clock.now():
                ex.submit(f"r{sent}", [(7 * sent + j) % 500 + 1 for j in range(20 + 3 * sent)])
                sent += 1
            progressed = ex.step()
            ex.drain_cache_events()
            for r in ex.pop_results():
                results.append((r.rid, r.outcome.name))
                next_at = ex.clock.now() + gaps[len(results) - 1]
            if progressed:
                due_now = 0
                continue
            also = next_at if sent < REQUESTS and ex.is_idle() else None
            due_now = ex.wait_for_next_event(due_now, also=also, local=True)
        ex.stop_followers()
    else:
        ex.follow(after_step=ex.drain_cache_events)
    now = ex.clock.now()
    out = {"results": sorted(results), "idle": ex.is_idle(), "now": now}
    ex.cache.close()
    return out


def test_follow_protocol_on_a_virtual_clock_runs_until_idle_at_tp_2() -> None:
    r0, r1 = run_ranks(_follow, 2)
    assert r0["results"] == sorted((f"r{i}", Outcome.SUCCESS.name) for i in range(REQUESTS))
    assert r0["idle"] and r1["idle"]
    assert r0["now"] == r1["now"]  # bitwise: one time on every rank
