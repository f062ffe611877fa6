"""bench.pd's arithmetic: the transfer cost fit recovers a known model, falls back when a
coefficient is not positive, and turns into the simulated peer's transfer fields; the TTFT
aggregation over repeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.clock.copy_fit import CopyFit
from bench.clock.transport import TransferModel
from bench.e2e.calibrated import mooncake_transfer
from bench.optimistic.bench import parse_args
from bench.pd.engine_rate import fit_cost
from bench.pd.transfer_model import peer_transfer_kwargs, virtual_clock_fields
from bench.pd.ttft import aggregate
from prefill.disagg.sim_config import PeerConfig


def _rows(latency_s: float, bandwidth: float) -> list[dict]:
    sizes = [2048, 8192, 32768, 131072, 524288]
    return [{"item_bytes": s, "best_us_per_item": (latency_s + s / bandwidth) * 1e6}
            for s in sizes]  # fmt: skip


def test_fit_recovers_a_known_cost() -> None:
    m = fit_cost(_rows(50e-6, 2e9))
    assert m["latency_per_item_s"] == pytest.approx(50e-6, rel=1e-6)
    assert m["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)
    assert m["max_rel_residual"] < 1e-6


def test_fit_without_a_byte_term_keeps_the_latency() -> None:
    rows = [{"item_bytes": s, "best_us_per_item": 40.0 - s * 1e-6} for s in (2048, 524288)]
    m = fit_cost(rows)
    assert m["bandwidth_Bps"] is None
    assert m["latency_per_item_s"] == pytest.approx(39.7e-6, rel=0.01)


def test_virtual_clock_fields() -> None:
    fields = virtual_clock_fields({"latency_per_item_s": 50e-6, "bandwidth_Bps": 1e9},
                                  {"transfer_items_per_send": 8.0, "sent_bytes_per_send": 4096,
                                   "config": "c"})  # fmt: skip
    assert fields["disaggregation_transfer_latency_s"] == pytest.approx(400e-6)
    assert fields["disaggregation_transfer_bandwidth_gbps"] == pytest.approx(1.0)


def test_the_measured_cost_feeds_the_simulated_peer(tmp_path: Path) -> None:
    """``bench.optimistic --transfer-model``: the simulated peer charges a send the latency and
    bandwidth of a bench_pd.json; bad files are refused naming the flag and the path."""
    path = tmp_path / "bench_pd.json"
    fields = virtual_clock_fields({"latency_per_item_s": 50e-6, "bandwidth_Bps": 2e9},
                                  {"transfer_items_per_send": 8.0, "sent_bytes_per_send": 4096,
                                   "config": "c"})  # fmt: skip
    path.write_text(json.dumps({"virtual_clock_transfer": fields}))
    peer = PeerConfig(**peer_transfer_kwargs(path))
    assert peer.transfer_latency_s == pytest.approx(400e-6)
    assert peer.transfer_bandwidth == pytest.approx(2e9)
    opts = parse_args(["--transfer-model", str(path)], quick=True)
    assert opts.transfer_model == path
    measured = TransferModel.measured(CopyFit("transfer", 1e-4, 5e9))
    mooncake = mooncake_transfer(path, measured)  # what obtain_calibration applies
    assert mooncake.source == "mooncake" and not mooncake.blocking and mooncake.fit is measured.fit
    assert mooncake.peer_fields() == {"transfer_latency_s": pytest.approx(400e-6),
                                      "transfer_bandwidth": pytest.approx(2e9)}  # fmt: skip
    assert TransferModel.from_dict(mooncake.as_dict()).source == "mooncake"  # replayed as such
    (tmp_path / "other.json").write_text("{}")
    for bad, match in ((tmp_path / "none.json", "not a readable"),
                       (tmp_path / "other.json", "no virtual_clock_transfer")):  # fmt: skip
        with pytest.raises(ValueError, match=f"--transfer-model {bad}: {match}"):
            peer_transfer_kwargs(bad)


def test_aggregate_takes_the_median_of_the_runs_means() -> None:
    def run(ttfts: list[float]) -> dict:
        return {"ttfts_ms": ttfts, "requests": len(ttfts), "succeeded": len(ttfts),
                "integrity": {"leaked_slots": 0, "kv_mismatches": 0},
                "transfer": {"items_per_request": 4.0, "items_per_send": 2.0, "bytes": 100},
                "stats": {"sends": 10}}  # fmt: skip

    row = aggregate("x", [run([10, 30]), run([100, 100]), run([40, 40])])
    assert (row["ttft_mean_ms"], row["ttft_mean_min_ms"], row["ttft_mean_max_ms"]) == (40, 20, 100)
    assert row["requests"] == 6 and row["integrity"] == {"leaked_slots": 0, "kv_mismatches": 0}
