"""The end-to-end benchmarks on a GPU profile: the profile's arithmetic, the clock modes, a
modelled multi-turn and optimistic run (deterministic, integrity counters zero, L2 hits where
the cache has a host tier) and the zero-load ceiling computed by hand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.e2e.report import modes
from bench.e2e.setup import ProfileTiming
from bench.multiturn import bench as bm
from bench.optimistic import bench as bo
from bench.profile import CopyPath, ForwardCost, GpuProfile, load_profile
from hicache_prefill.prefill.clock import VirtualClock
from hicache_prefill.prefill.disagg.simulated import DelayDistribution

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MT = (
    "--clock profile --profile h200 --seeds 0 --configs device_only write_through "
    "--num-clients 3 --num-rounds 3 --request-length 96 --sub-question-input-length 16 "
    "--working-set-ratio 3 --kv-sample-every 2"
).split()


def test_the_profiles_load_and_their_costs_add_up() -> None:
    h200 = load_profile("h200")
    assert h200.kind == "modelled" and set(h200.h2d) == {"kernel", "copy_engine", "direct"}
    assert GpuProfile.from_json(h200.to_json()) == h200
    f = ForwardCost(base_s=1.0, per_token_s=0.1, per_pair_s=0.01, floor_s=0.25)
    assert f.seconds(0, 5) == 0.0
    assert f.seconds(2, 3) == pytest.approx(1.0 + 0.2 + 0.01 * (6 + 3))  # 2x3 + 2x3/2 pairs
    assert f.seconds(1, 0) == pytest.approx(1.0 + 0.25)  # the weights' read is the floor
    assert CopyPath(1e-5, 50.0).seconds(50e9) == pytest.approx(1.0 + 1e-5)
    assert h200.copy_s("h2d", 1000) == pytest.approx(8e-6 + 1000 * 131072 / 50e9)
    with pytest.raises(ValueError, match="gbps"):
        CopyPath(0.0, 0.0)
    with pytest.raises(ValueError, match="profile"):
        load_profile("no-such-gpu")


def test_profile_timing_slows_a_forward_beside_a_copy() -> None:
    class Controller:
        ahead: float | None = None

        def next_ack_time(self) -> float | None:
            return self.ahead

    h100 = load_profile("h100")
    timing = ProfileTiming(h100, VirtualClock(), "kernel")
    timing.controller = Controller()
    alone = timing.forward(512, 1024)
    timing.controller.ahead = 1.0
    assert timing.forward(512, 1024) == pytest.approx(alone * (1 + h100.corun_slowdown))
    assert timing.copy_seconds("d2h", 64) == h100.copy_s("d2h", 64, "kernel")


def test_clock_modes() -> None:
    def opts(clock: str | None, profile: list[str] | None) -> argparse.Namespace:
        return argparse.Namespace(clock=clock, profile=profile)

    assert [p and p.name for p in modes(opts(None, None))] == [None, "h100", "h200"]
    assert modes(opts("wall", None)) == [None]
    assert [p.name for p in modes(opts("profile", ["h200"]))] == ["h200"]
    with pytest.raises(ValueError, match="--profile"):
        modes(opts("profile", []))


def test_a_modelled_multiturn_run_is_deterministic_and_clean(tmp_path: Path) -> None:
    first = bm.run(quick=True, out_dir=tmp_path / "a", argv=MT)
    second = bm.run(quick=True, out_dir=tmp_path / "b", argv=MT)
    assert not any(first["integrity"].values()), first["integrity"]
    ratios = first["headline"]["modelled_h200"]
    assert ratios == second["headline"]["modelled_h200"]  # a virtual clock: bit for bit
    doc = json.loads((tmp_path / "a" / "multiturn.json").read_text())
    res = doc["per_seed"]["modelled_h200"]["0"]
    assert res["write_through"]["host_hit_tokens"] > 0
    assert res["device_only"]["host_hit_tokens"] == 0
    base, l2 = res["device_only"]["ttft_mean_s"], res["write_through"]["ttft_mean_s"]
    assert ratios["write_through"][0] == pytest.approx(base / l2)
    assert res["write_through"]["integrity"]["kv_checked_requests"] > 0
    assert doc["modes"]["modelled_h200"] == "modelled from GPU profile h200"


def test_a_modelled_optimistic_run_counts_its_yields(tmp_path: Path) -> None:
    argv = (
        "--clock profile --profile h100 --seeds 0 --attempts 2 --policies write_back "
        "--num-requests 6 --input-len 128 --chunked-prefill-size 32"
    ).split()
    out = bo.run(quick=True, out_dir=tmp_path, argv=argv)
    assert not any(out["integrity"].values()), out["integrity"]
    ratios = out["headline"]["modelled_h100"]
    assert ratios["write_back:attempts_0"] == [1.0, 1.0, 1.0]
    assert ratios["write_back:attempts_2"] is not None
    doc = json.loads((tmp_path / "optimistic.json").read_text())
    forced = doc["per_seed"]["modelled_h100"]["0"]["write_back:attempts_2_forced_retry"]
    assert forced["yields"] > 0 and forced["recomputed_tokens_per_yield"] is not None
    c = out["ceilings"]["modelled_h100"]
    assert c["delay_low_s"] == pytest.approx(0.5 * c["prefill_s"])  # --delay-scale 1
    delay = DelayDistribution("uniform", c["delay_low_s"], c["delay_high_s"])
    assert c["ceiling_zero_load"] == pytest.approx(bo.ceiling(delay, c["prefill_s"]))


def test_the_zero_load_ceiling_by_hand() -> None:
    # B uniform on [1, 3], P = 2: E[B + P] = 4; E[max(B, P)] = (2 * 1 + (9 - 4) / 2) / 2 = 2.25.
    assert bo.ceiling(DelayDistribution("uniform", 1.0, 3.0), 2.0) == pytest.approx(4 / 2.25)
    assert bo.ceiling(DelayDistribution("uniform", 1.0, 3.0), 0.5) == pytest.approx(2.5 / 2)
    assert bo.ceiling(DelayDistribution("uniform", 1.0, 3.0), 4.0) == pytest.approx(6 / 4)
