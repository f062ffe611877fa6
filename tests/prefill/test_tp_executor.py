"""The optimistic prefill executor on two real tensor-parallel ranks (gloo): rank 0 takes the
requests, every rank schedules the same batches, runs its half of the model and sends its own
shard of the KV heads to its own decode side.

Multi-turn traffic (shared prefixes, a device pool small enough that history spills to the host
and comes back by load back) with optimistic prefill under write_back and under write_through
(``--optimistic-prefill-write-through``), bootstrap delays, forced retries and injected bootstrap
and transfer failures. The ranks differ in what is rank-local: copy delays (ack timing) and the
transfer latency to their decode side (poll states). After every round each rank checks the
executor's integrity and that the KV its decode side received equals the matching slice of the
single-rank model's full recompute; at the end no slot and no lock is left, the trees are equal
on both ranks, and both ranks report the same results.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from hicache_prefill.hicache.tp.digest import tree_state
from hicache_prefill.hicache.tp.group import (
    CollectiveMismatchError,
    RankDivergenceError,
    new_cache_group,
)
from hicache_prefill.prefill.clock import VirtualClock
from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs
from tests.support.harness import KV_ATOL, build_cache, make_executor
from tests.support.tp_harness import run_ranks

CLIENTS = 6
ROUNDS = 3


MLA = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=16)  # fmt: skip


def _args(policy: str, world: int, mla: bool = False) -> ServerArgs:
    return ServerArgs(
        **(MLA if mla else {}), device="cpu", tp_size=world, page_size=4, max_total_tokens=160,
        chunked_prefill_size=32,
        enable_hierarchical_cache=True, hicache_write_policy=policy, hicache_ratio=3.0,
        hicache_mem_layout="layer_first", hicache_io_backend="direct", load_back_threshold=4,
        disaggregation_mode="prefill", optimistic_prefill_attempts=2,
        optimistic_prefill_write_through=policy == "write_through", max_running_requests=3,
        disaggregation_bootstrap_delay="uniform:0,0.03",
        disaggregation_force_not_ready_prob=0.3, disaggregation_bootstrap_failure_prob=0.05,
        disaggregation_transfer_failure_prob=0.05,
    )  # fmt: skip


def _executor(rank: int, policy: str, group: Any, latency_s: float, mla: bool = False) -> Any:
    """This rank's executor; rank-local: how fast its copies finish (rank 0's are delayed) and
    the latency of its sends to its decode side."""
    args = _args(policy, group.size, mla)
    delay_rng = random.Random(f"copy:{rank}")
    cache = build_cache(args, copy_delay=lambda: delay_rng.random() * 0.004 * (rank == 0),
                        group=group)  # fmt: skip
    peer = dataclasses.replace(PeerConfig.from_server_args(args), transfer_latency_s=latency_s)
    return make_executor(args, peer_config=peer, clock=VirtualClock(), cache=cache,
                         cost_model=lambda new, prefix: 1e-3 + 2e-5 * (new + prefix))  # fmt: skip


def _submit_round(ex: Any, rank: int, rnd: int, history: list[list[int]], rng: Any) -> None:
    """Rank 0 sends every client's next turn (the whole history plus a question)."""
    if rank != 0:
        return
    for c in range(CLIENTS):
        history[c] = history[c] + [rng.randrange(512) for _ in range(rng.randint(6, 14))]
        ex.submit(f"c{c}-r{rnd}", history[c])


def _history(rng: Any) -> list[list[int]]:
    return [[rng.randrange(512) for _ in range(rng.randint(20, 36))] for _ in range(CLIENTS)]


def _serve(rank: int, world: int, policy: str, mla: bool = False) -> dict[str, Any]:
    group = new_cache_group()
    ex = _executor(rank, policy, group, latency_s=0.002 + 0.004 * rank, mla=mla)
    args = ex.args
    if rank == 0:  # who may do what
        peer = ex.decode.create_peer("x", 3)
        with pytest.raises(ValueError, match="peer: under tensor parallelism"):
            ex.submit("x", [1, 2, 3], peer=peer)
        peer.fail()  # and forgotten by the decode side
        with pytest.raises(ValueError, match="follow: only ranks other than 0"):
            ex.follow()
    else:
        with pytest.raises(ValueError, match=f"submit: rank {rank} of a tensor-parallel group"):
            ex.submit("x", [1, 2, 3])
        with pytest.raises(ValueError, match="stop_followers: only rank 0"):
            ex.stop_followers()
    held_back = [0]
    agree = group.agree_min_many

    def recorded(values: list[int], tag: str = "agree_min_many") -> list[int]:
        out = agree(values, tag=tag)
        held_back[0] += tag == "peer_polls" and out != list(values)
        return out

    group.agree_min_many = recorded
    h0, h1 = ex.model.shard.kv_heads  # MLA: (0, 1), the whole latent on every rank
    full = build_model(dataclasses.replace(args, tp_size=1))  # the single-rank model

    rng = random.Random(0)  # the workload (only rank 0 submits it)
    history = _history(rng)
    results: list[tuple] = []
    checked = 0
    for rnd in range(ROUNDS):
        _submit_round(ex, rank, rnd, history, rng)
        ex.run_until_idle(check=True)
        for res in sorted(ex.pop_results(), key=lambda r: r.rid):
            results.append((res.rid, res.outcome.name, res.first_token, res.num_tokens,
                            res.cached_device_tokens, res.cached_host_tokens, res.attempts,
                            res.passes, res.yields, res.parked))  # fmt: skip
            if res.outcome != Outcome.SUCCESS:
                continue
            dpl, *got = ex.decode.received_kv(res.rid)  # K and V, or MLA's latent
            ids = torch.tensor(ex.decode.peers[res.rid].token_ids)
            _, *ref = full.forward_reference(ids)
            assert len(got) == len(ref) == (1 if mla else 2)
            for g, r in zip(got, ref, strict=True):
                torch.testing.assert_close(g, r[:, dpl:, h0:h1], atol=KV_ATOL, rtol=KV_ATOL)
            ex.decode.release(res.rid)
            checked += 1
    ex.drain_cache_events()
    ex.check_integrity()
    tree = ex.tree
    group.assert_same("tree", tree_state(tree))
    leaked = ex.allocator.size - ex.allocator.available_size() - tree.total_size()
    out = {
        "results": results,
        "kv_checked": checked,
        "leaked_slots": leaked,
        "leaked_locks": sum(1 for x in tree.all_nodes() if x.lock_ref),
        "polls_held_back": held_back[0],
        "kv_heads": (h0, h1),
        "stats": {k: v for k, v in ex.stats.to_dict().items() if k != "ttft_samples"},
        "cache": ex.cache.stats.as_dict(),
    }
    ex.cache.close()
    return out


@pytest.mark.parametrize(
    "policy, mla",
    [("write_back", False), ("write_through", False), ("write_back", True)],
    ids=["write_back", "write_through", "write_back-mla"],
)
def test_two_ranks_serve_optimistic_prefill_like_one(policy, mla):
    """MLA: the ranks split the query heads; each holds, backs up and sends the whole latent."""
    outs = run_ranks(_serve, 2, policy, mla)
    r0, r1 = outs
    assert [o["kv_heads"] for o in outs] == ([(0, 1), (0, 1)] if mla else [(0, 1), (1, 2)])
    # Same schedule, same outcomes (first tokens included: logits are summed over the ranks).
    assert r0["results"] == r1["results"]
    for key in ("optimistic_admissions", "yields", "parks", "successes", "aborts", "sends",
                "forward_passes", "computed_tokens", "speculative_l2_pages"):  # fmt: skip
        assert r0["stats"][key] == r1["stats"][key], key
    for o in outs:
        assert o["leaked_slots"] == 0 and o["leaked_locks"] == 0
        assert o["kv_checked"] == r0["stats"]["successes"] > 0
        assert o["stats"]["speculative_l2_pages"] == 0
    # The paths this run is about were reached.
    s, c = r0["stats"], r0["cache"]
    assert s["optimistic_admissions"] > 0 and s["yields"] > 0 and s["aborts"] > 0, s
    assert c["loaded_tokens"] > 0 and c["backed_up_tokens"] > 0, c
    assert sum(o["polls_held_back"] for o in outs) > 0, "no poll ever differed between ranks"
    # Each rank moved its own shard: the same tokens, half the bytes of the whole model (MLA:
    # the whole latent on each).
    assert r0["cache"]["backed_up_tokens"] == r1["cache"]["backed_up_tokens"]
    assert r0["cache"]["d2h_bytes"] == r1["cache"]["d2h_bytes"] > 0


def _own_polls(rank: int, world: int) -> tuple[str, str]:
    """Rank 1 (whose sends land sooner) acts on its own peer polls: it enters the agreement but
    uses its local states. Returns the error this rank raised and its message."""
    group = new_cache_group()
    ex = _executor(rank, "write_back", group, latency_s=0.006 - 0.004 * rank)
    if rank == 1:
        each = ex.polls.each

        def own(reqs: Any) -> Any:
            return [(r, r.peer.poll()) for r, _ in each(reqs)]

        ex.polls.each = own
    rng = random.Random(0)
    history = _history(rng)
    try:
        for rnd in range(ROUNDS):
            _submit_round(ex, rank, rnd, history, rng)
            ex.run_until_idle()
    except (RankDivergenceError, CollectiveMismatchError) as exc:
        return type(exc).__name__, str(exc)
    finally:
        ex.cache.close()
    return "none", ""


def test_a_rank_acting_on_its_own_poll_is_caught():
    """Rank 1 completes a transfer rank 0 still sees in flight; the ranks' queues differ and
    they stop at the same point with the same error (a batch or collective that differs)."""
    outs = run_ranks(_own_polls, 2)
    assert outs[0][0] == outs[1][0] != "none", outs
