"""The cache's agreement primitives across real ranks (gloo, 2 and 4 processes), the call-site
check that turns a mismatched collective into an error on every rank, and the harness's watchdog
that turns a hang (a rank that skipped a collective) into a failure carrying every rank's stack.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache_prefill.hicache.tp.digest import digest
from hicache_prefill.hicache.tp.group import (
    DEFAULT_TP_TIMEOUT_S,
    TP_TIMEOUT_ENV,
    CollectiveMismatchError,
    DistTPGroup,
    RankDivergenceError,
    SingleRankGroup,
    new_cache_group,
    tp_timeout_s,
)
from tests.support.tp_harness import RanksFailed, RanksHung, run_ranks


# ---------------------------------------------------------------- programs run on every rank
def _catch(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)


def _early_return_tick(group, local_acks: int) -> int:
    """SGLang #26921: a rank with no finished acks returns before the collective."""
    if local_acks == 0:
        return 0  # the bug: rank-local early return
    return group.agree_min(local_acks, tag="acks")


def _primitives(rank: int, world_size: int) -> dict:
    """Each primitive with rank-dependent inputs; every rank returns what it agreed on."""
    g = new_cache_group()
    assert isinstance(g, DistTPGroup) and (g.rank, g.size) == (rank, world_size)
    out: dict = {}
    out["min"] = g.agree_min(10 + rank, tag="acks")
    out["max"] = g.agree_max(10 + rank)
    out["neg_min"] = g.agree_min(-rank)
    out["all_true"] = g.agree_all(True)
    out["all_one_false"] = g.agree_all(rank != world_size - 1)
    out["any_one_true"] = g.agree_any(rank == world_size - 1)
    out["any_false"] = g.agree_any(False)
    out["many"] = g.agree_min_many([5 - rank, rank, 7])
    out["many_empty"] = g.agree_min_many([])
    out["bcast0"] = g.broadcast_object({"batch": [1, 2, rank]} if rank == 0 else None)
    src = world_size - 1
    out["bcast_last"] = g.broadcast_object(("from", rank, torch.arange(3) * rank), src=src)
    g.assert_same("tree", {"nodes": [1, 2, 3], "hash": torch.ones(4)})
    # Ranks 1 and (world_size - 1) hold a different value: every rank raises, naming them.
    odd = {1, world_size - 1}
    try:
        g.assert_same("tree", torch.tensor([1.0 if rank in odd else 0.0]))
        out["diverged"] = None
    except RankDivergenceError as exc:
        out["diverged"] = (exc.tag, exc.differing, str(exc))
    # Only rank 0 has finished acks; the others return early from the ack poll (SGLang
    # #26921) and go on to the eviction agreement: every rank gets CollectiveMismatchError.
    try:
        _early_return_tick(g, local_acks=3 if rank == 0 else 0)
        g.agree_all(True, tag="evict")
        out["mismatch"] = None
    except CollectiveMismatchError as exc:
        out["mismatch"] = exc.sites
    out["many_long"] = g.agree_min_many([rank, -rank, 3 + rank, 9 - rank])
    # Same call site, different number of values.
    try:
        g.agree_min_many([1] * (2 + (rank == 1)), tag="acks")
        out["lengths"] = None
    except CollectiveMismatchError as exc:
        out["lengths"] = str(exc)
    # Rank src cannot pickle its object: every rank raises.
    try:
        g.broadcast_object(threading.Lock() if rank == 0 else None, src=0, tag="batch")
        out["unpicklable"] = None
    except ValueError as exc:
        out["unpicklable"] = str(exc)
    # A collective from another thread raises there, before communicating.
    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _catch(errors, g.agree_min, 1))
    worker.start()
    worker.join()
    out["other_thread"] = repr(errors[0]) if errors else None
    # After the errors above the ranks are still in step.
    out["after"] = g.agree_min(rank + 100)
    g.barrier()
    return out


def _wait_for_ack_that_never_comes() -> None:
    threading.Event().wait()


def _skips_a_collective(rank: int, world_size: int) -> None:
    g = new_cache_group()
    applied = _early_return_tick(g, local_acks=2 if rank == 0 else 0)
    if rank != 0:
        _wait_for_ack_that_never_comes()
    return applied


def _raises_on_one_rank(rank: int, world_size: int) -> None:
    g = new_cache_group()
    if rank == 1:
        raise KeyError("rank-local failure")
    g.agree_min(1, tag="acks")


# ---------------------------------------------------------------- tests with processes
@pytest.mark.parametrize("world_size", [2, 4])
def test_primitives_agree_on_every_rank(world_size):
    outs = run_ranks(_primitives, world_size)
    last = world_size - 1
    for o in outs:
        assert o["min"] == 10 and o["max"] == 10 + last and o["neg_min"] == -last
        assert o["all_true"] is True and o["all_one_false"] is False
        assert o["any_one_true"] is True and o["any_false"] is False
        assert o["many"] == [5 - last, 0, 7] and o["many_empty"] == []
        assert o["bcast0"] == {"batch": [1, 2, 0]}
        assert o["bcast_last"][:2] == ("from", last)
        assert torch.equal(o["bcast_last"][2], torch.arange(3) * last)
        tag, differing, msg = o["diverged"]
        assert tag == "tree" and differing == sorted({1, last})
        assert f"ranks {sorted({1, last})}" in msg
        sites = o["mismatch"]
        assert sites[0][1:] == ("agree_min", "acks")
        assert all(s[1:] == ("agree_all", "evict") for s in sites[1:])
        assert len({s[0] for s in sites}) == 1  # the same (sequence) point on every rank
        assert o["many_long"] == [0, -last, 3, 9 - last]
        assert "rank 0: #" in o["lengths"] and "agree_min_many[2]('acks')" in o["lengths"]
        assert "agree_min_many[3]('acks')" in o["lengths"]
        assert "rank 0 could not pickle" in o["unpicklable"]
        assert "RuntimeError" in o["other_thread"] and "one thread" in o["other_thread"]
        assert o["after"] == 100


def test_watchdog_dumps_every_rank_stack_when_a_rank_skips_a_collective():
    """Rank 1 returns early from the ack poll and waits for an ack; rank 0 blocks in the
    all_reduce. The watchdog fails the run with both stacks instead of hanging."""
    with pytest.raises(RanksHung) as info:
        run_ranks(_skips_a_collective, 2, timeout_s=5)
    err = info.value
    assert err.hung == [0, 1]
    assert "agree_min" in err.stacks[0] and "_early_return_tick" in err.stacks[0]
    assert "_wait_for_ack_that_never_comes" in err.stacks[1]
    assert "_wait_for_ack_that_never_comes" in str(err) and "agree_min" in str(err)


def test_a_rank_that_raises_fails_the_run_without_hanging():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raises_on_one_rank, 2)
    assert "rank-local failure" in info.value.outcomes[1]
    assert "collective #1 agree_min('acks') failed" in info.value.outcomes[0]  # peer is gone


# ---------------------------------------------------------------- one process
def test_single_rank_group_is_the_identity():
    g = SingleRankGroup()
    assert (g.rank, g.size, g.is_first_rank) == (0, 1, True)
    assert g.agree_min(7) == 7 and g.agree_max(-3) == -3
    assert g.agree_all(True) is True and g.agree_any(False) is False
    assert g.agree_min_many([3, 1]) == [3, 1]
    obj = object()
    assert g.broadcast_object(obj) is obj
    g.assert_same("anything", object())  # nothing compared on one rank
    g.barrier()


def test_tp_timeout_defaults_to_two_minutes_and_reads_its_env(monkeypatch):
    monkeypatch.delenv(TP_TIMEOUT_ENV, raising=False)
    assert tp_timeout_s() == DEFAULT_TP_TIMEOUT_S == 120.0
    monkeypatch.setenv(TP_TIMEOUT_ENV, "7.5")
    assert tp_timeout_s() == 7.5
    for bad in ("0", "-3", "soon", "inf"):
        monkeypatch.setenv(TP_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=TP_TIMEOUT_ENV):
            tp_timeout_s()


def test_new_cache_group_without_distributed_is_single_rank():
    assert isinstance(new_cache_group(), SingleRankGroup)


@pytest.mark.parametrize("bad", [1.5, "3", True, None, 1 << 63])
def test_agree_min_rejects_non_ints(bad):
    with pytest.raises(ValueError, match="value"):
        SingleRankGroup().agree_min(bad)


def test_single_rank_broadcast_rejects_other_src():
    with pytest.raises(ValueError, match="src"):
        SingleRankGroup().broadcast_object(1, src=1)


def test_digest_is_stable_and_sensitive():
    t = torch.arange(6, dtype=torch.int64)
    assert digest({"a": [1, 2.5, "x"], "b": t}) == digest({"b": t.clone(), "a": [1, 2.5, "x"]})
    assert digest({1, 2, 3}) == digest({3, 2, 1})
    assert digest(t) != digest(t.to(torch.int32))  # dtype
    assert digest(t) != digest(t.view(2, 3))  # shape
    assert digest(t) != digest(t + (t == 5))  # one element
    assert digest(torch.ones(2, dtype=torch.bfloat16)) != digest(torch.ones(2))
    assert digest([1, [2]]) != digest([[1], 2]) and digest(1) != digest(1.0) != digest(True)
    assert digest(b"ab") != digest("ab")
    assert 0 <= digest("x") < 1 << 62


def test_digest_rejects_objects_without_a_stable_encoding():
    with pytest.raises(ValueError, match="value"):
        digest([object()])


def _skips_with_a_group_timeout(rank: int, world_size: int) -> None:
    g = new_cache_group()  # SGLANG_HICACHE_TP_TIMEOUT, set by the test
    if rank == 0:
        g.agree_min(1, tag="acks")
    else:
        time.sleep(3)  # skipped the collective; exits after rank 0's timeout


def test_group_timeout_turns_a_skipped_collective_into_an_error(monkeypatch):
    monkeypatch.setenv(TP_TIMEOUT_ENV, "1")  # the spawned ranks inherit it
    with pytest.raises(RanksFailed) as info:  # (their default group: time to start up)
        run_ranks(_skips_with_a_group_timeout, 2, collective_timeout_s=120)
    assert "cache group rank 0: collective #1 agree_min('acks') failed" in info.value.outcomes[0]
    assert info.value.outcomes[1] == "ok"
