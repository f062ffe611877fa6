"""``bench.pd``: the least-squares ``CopyPath`` recovers a known cost and refuses one it cannot
give; the TTFT rows aggregate repeats; without Mooncake the section reports itself skipped; with
it, the write cost of every item size is measured, checked and fitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pd import bench as pd_bench
from bench.pd.bench import INTEGRITY, ITEM_SIZES, aggregate, fit_copy_path, write_cost
from bench.profile import CopyPath
from hicache_prefill.prefill.model.factory import build_model
from tests.support.loopback import skip_reason
from tests.support.mooncake_decode import start_workers

needs_engine = pytest.mark.skipif(
    skip_reason("engine", shim_in_process=True) is not None, reason="Mooncake unavailable"
)


def test_fit_recovers_a_known_copy_path() -> None:
    truth = CopyPath(50e-6, 2.0)
    fit = fit_copy_path(ITEM_SIZES, [truth.seconds(b) for b in ITEM_SIZES])
    assert fit is not None and fit["max_rel_residual"] < 1e-9
    assert (fit["latency_s"], fit["gbps"]) == pytest.approx((truth.latency_s, truth.gbps))


def test_fit_keeps_the_latency_at_zero_or_refuses_a_free_byte() -> None:
    through_origin = fit_copy_path([1000, 2000, 4000], [0.9e-6, 2.1e-6, 4.0e-6])
    assert through_origin is not None and through_origin["latency_s"] == 0.0
    assert through_origin["gbps"] == pytest.approx(1.0, rel=0.05)
    assert fit_copy_path([2048, 524288], [40e-6, 30e-6]) is None  # larger items cheaper


def test_aggregate_takes_the_median_of_the_runs_means() -> None:
    def run(ttfts: list[float], leaked: int = 0) -> dict:
        integrity = dict.fromkeys(INTEGRITY, 0) | {"decode_leaked_slots": leaked}
        return {"ttfts_ms": ttfts, "requests": 2, "items_per_send": 8.0, "integrity": integrity}

    row = aggregate([run([10, 30]), run([100, 100], leaked=3), run([40])])
    assert (row["ttft_mean_ms"], row["ttft_mean_min_ms"], row["ttft_mean_max_ms"]) == (40, 20, 100)
    assert (row["requests"], row["succeeded"]) == (6, 5)
    assert row["ttft_p90_ms"] == pytest.approx(100) and row["integrity"]["decode_leaked_slots"] == 3


def test_without_mooncake_the_section_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pd_bench, "skip_reason", lambda module: "no wheel (x)")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    section = pd_bench.run(quick=True, out_dir=tmp_path)  # no "seconds": the suite adds them
    assert section == {"skipped": "no wheel (x)", "integrity": {}}
    assert pd_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("[pd] skipped: no wheel (x)") == 2


@needs_engine
def test_the_write_cost_is_measured_checked_and_fitted() -> None:
    res = write_cost(quick=True)  # raises when a write fails or the receiver's bytes differ
    assert [r["item_bytes"] for r in res["rows"]] == list(ITEM_SIZES)
    assert all(0 < r["gbps"] <= r["best_gbps"] for r in res["rows"])
    path = res["kv_transfer_measured"]
    assert path is not None and path["measured_on"] == "cpu loopback"
    CopyPath(path["latency_s"], path["gbps"])  # a valid profile entry


@needs_engine
def test_a_ttft_run_over_a_busy_decode_worker_is_audited_clean() -> None:
    workers = start_workers(1, geometry=pd_bench.geometry(), pool_tokens=4096,
                            max_running_requests=16, check_free_pages=True)  # fmt: skip
    try:
        args = pd_bench.server_args(attempts=2)
        ex = pd_bench.executor(args, build_model(args), workers, {"req-0": 0.05, "req-2": 0.05})
        prompts = [[1 + (7 * i + t) % 1000 for t in range(80)] for i in range(4)]
        run = pd_bench.drive(ex, prompts, [0.0, 0.0, 0.01, 0.02])
    finally:
        workers[0].stop()
    assert run["requests"] == len(run["ttfts_ms"]) == 4 and min(run["ttfts_ms"]) > 0
    assert run["integrity"] == dict.fromkeys(INTEGRITY, 0) and run["items_per_send"] > 0


@needs_engine
def test_whole_requests_over_sglangs_wire_are_measured_and_checked() -> None:
    res = pd_bench.wire_cost(quick=True, engine_fit={"latency_s": 5e-5, "gbps": 3.0})
    assert [r["pages"] for r in res["rows"]] == list(pd_bench.WIRE_PAGES)
    assert all(r["transfer_ms"] > 0 and r["handshake_ms"] > 0 for r in res["rows"])
    assert all(r["items"] == 8 * r["pages"] and r["engine_fit_ms"] > 0 for r in res["rows"])
    assert all(r["direct_ms"] > 0 for r in res["rows"])  # the same items, no control plane
    assert res["item_bytes"] == 16 << 10 and res["fit"]["us_per_item"] > 0
