"""The trace replay: token expansion, hit rates per tier of a hand-made trace, the LRU tree against
a plain block count, write-policy counters and the TTFT model, each checked by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.profile import CopyPath, ForwardCost, GpuProfile
from bench.trace import bench as trace_bench
from bench.trace.bench import DEFAULT_TRACE, ttft
from bench.trace.replay import UNBOUNDED, Request, Tiers, load_trace, lru_hits, replay_tiers, tokens
from hicache_prefill.hicache.builder import KVCache


def req(*ids: int, n: int | None = None, at: float = 0.0) -> Request:
    return Request(at, n or 4 * len(ids), ids)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the ``check_integrity`` calls that end each replay (each raises on a break)."""
    calls, original = [], KVCache.check_integrity

    def spy(self: KVCache, request_owned: int = 0) -> None:
        original(self, request_owned)
        calls.append(len(self.tree.all_nodes()))

    monkeypatch.setattr(KVCache, "check_integrity", spy)
    return calls


def test_blocks_expand_to_shared_prefixes_and_a_partial_last_block() -> None:
    a, b = tokens(req(3, 7, 9, n=10), 4), tokens(req(3, 8, n=6), 4)
    assert a.tolist() == [12, 13, 14, 15, 28, 29, 30, 31, 36, 37]
    assert b[:4].tolist() == a[:4].tolist() and not set(b[4:]) & set(a[4:])
    assert len(tokens(load_trace(DEFAULT_TRACE, 1)[0])) == 6758  # 13 blocks of 512 and one of 166
    with pytest.raises(ValueError, match="hash ids"):
        tokens(req(1, 2, n=9), 4)


# Pages of 4 tokens. Device 8, host 16, L3 unbounded, write_through; every page is backed up to
# the host and, at its ack, to L3. R1-R3 fill the device one at a time (each pushes the previous
# one to the host); R3's backup finds the host full and drops R1 (LRU host-only). R4 = R1 + a
# partial block: L3 has R1's pages -> fetched, loaded back (8 L3 tokens); the fetch drops R2 from
# the host. R5 = R2: from L3 again (it drops R3). R6 = R5: on the device. R7 = R1 + 1 token: R1's
# host copy (made by the fetch) is loaded back: a host hit.
HAND = [req(0, 1), req(2, 3), req(4, 5), req(0, 1, 6, n=10), req(2, 3), req(2, 3)]
HAND.append(req(0, 1, 7, n=9))


def test_hand_made_trace_hits_each_tier_as_computed_by_hand(checks: list[int]) -> None:
    r = replay_tiers(HAND, Tiers(8, 16, UNBOUNDED), "write_through", 4)
    assert {k: v.tolist() for k, v in r["hits"].items()} == {
        "device": [0, 0, 0, 0, 0, 8, 0],
        "host": [0, 0, 0, 0, 0, 0, 8],
        "l3": [0, 0, 0, 8, 8, 0, 0],
    }
    # 16 pages in all: 6 computed (R1-R3), 6 hit, R4 and R7's partial blocks are not pages
    assert r["pages"] == dict(
        computed=6, backed_up=6, loaded_back=6, recomputed=0, stored_l3=6, fetched_l3=4
    )
    # Device only, 16 tokens: R1..R5 each evict the oldest; R6 and R7 hit the device.
    d = replay_tiers(HAND, Tiers(16), "write_through", 4)
    assert d["hits"]["device"].tolist() == [0, 0, 0, 0, 0, 8, 8] == lru_hits(HAND, 16, 4).tolist()
    assert d["pages"]["recomputed"] == 4  # R4's and R5's pages had been computed before
    assert len(checks) == 2 and checks[0] > 0


def test_lru_tree_matches_a_plain_block_count_and_the_real_device_tree(checks: list[int]) -> None:
    reqs = load_trace(DEFAULT_TRACE, 300)
    seen: set[int] = set()
    expected = []
    for r in reqs:  # blocks seen before, from the first, whole blocks only
        full = r.hash_ids[: r.input_length // 512]
        hit = next((i for i, h in enumerate(full) if h not in seen), len(full))
        expected.append(512 * hit)
        seen.update(r.hash_ids)
    unbounded = lru_hits(reqs, None, 512)
    assert unbounded.tolist() == expected and unbounded.sum() > 0
    assert lru_hits(reqs, 10**9, 512).tolist() == expected
    small = lru_hits(reqs, 2**18, 512)
    assert small.sum() < unbounded.sum()
    real = replay_tiers(reqs, Tiers(2**18), "write_through", 512)["hits"]["device"]
    assert real.tolist() == small.tolist() and len(checks) == 1


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policy_counters_are_consistent(policy: str, checks: list[int]) -> None:
    reqs = load_trace(DEFAULT_TRACE, 150)
    r = replay_tiers(reqs, Tiers(2**18, 2**19), policy, 512)
    p, hits = r["pages"], sum(int(v.sum()) for v in r["hits"].values()) // 512
    assert p["computed"] + hits == sum(x.input_length // 512 for x in reqs)
    assert p["loaded_back"] == (r["hits"]["host"].sum()) // 512 <= p["backed_up"]
    assert p["recomputed"] <= p["computed"] and p["stored_l3"] == p["fetched_l3"] == 0
    if policy == "write_through":  # every computed page is backed up (the host has room)
        assert p["backed_up"] == p["computed"]
    else:
        assert p["backed_up"] < p["computed"]
    assert len(checks) == 1


def test_ttft_model_of_two_requests_by_hand() -> None:
    # Forward: 10 ms a new token, nothing else; H2D: 1 ms a token; L3 read: 2 ms a token.
    kernel = CopyPath(latency_s=0.0, gbps=1.0)
    cost, paths = ForwardCost(0.0, 0.01, 0.0), {"kernel": kernel}
    prof = GpuProfile("t", "modelled", "test", "test", 1, 10**6, cost, paths, paths, kernel, 0.0)
    hits = {"device": np.array([0, 10]), "host": np.array([0, 20]), "l3": np.array([0, 20])}
    # R1 at 0: 100 new -> 1.0 s. R2 at 0.5 (x2 scale: 1.0): 50 new (0.5 s) + 40 loaded (0.04 s);
    # its L3 read ends at 1.04, the server frees at 1.0 -> 1.04 + 0.54 = 1.58: TTFT 0.58.
    r = ttft(np.array([0.0, 0.5]), np.array([100, 100]), hits, prof, l3_gbps=0.5, scale=2.0)
    assert r["ttft_mean_s"] == pytest.approx((1.0 + 0.58) / 2)
    assert r["prefill_gpu_mean_s"] == pytest.approx((1.0 + 0.54) / 2)
    assert r["ttft_p90_s"] == pytest.approx(1.0 - 0.1 * 0.42)


def test_cli_writes_the_report(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        trace_bench.main(["--help"])
    assert "--quick" in capsys.readouterr().out
    assert trace_bench.main(["--quick", "--requests", "120", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "trace.json").read_text())
    assert res["requests"] == 120 and 0 < res["hit_rate_unbounded_capacity"] < 1
    assert {r["label"] for r in res["tiers"]} >= {"1Mi/-/-", "1Mi/4Mi/inf"}
    assert res["tree_cost"]["project"]["requests_per_s"] > 0
    assert "modelled from profile h200" in res["ttft"]["h200"]["source"]
    assert (tmp_path / "trace.md").read_text().count("|---") >= 5
