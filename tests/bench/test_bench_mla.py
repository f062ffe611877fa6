"""``--use-mla`` in the end-to-end benchmarks, through their ``run`` on the wall clock: the
multi-turn pair and an optimistic pair run the MLA model over MLA device, host and decode pools
and end with every integrity counter at zero (sampled decode-side latents checked), the L2
configuration with host hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.multiturn import bench as bm
from bench.optimistic import bench as bo

pytestmark = pytest.mark.usefixtures("one_torch_thread")
COMMON = "--use-mla --clock wall --seeds 0 --no-sweeps --kv-sample-every 2".split()


def _clean(integrity: dict[str, int]) -> None:
    assert "kv_mismatches" in integrity and not any(integrity.values()), integrity


def _summary(path: Path) -> dict:
    doc = json.loads(path.read_text())
    assert doc["workload"]["use_mla"] is True and not doc["partial"]
    (mode,) = doc["summary"].values()
    return mode["configs"]


def test_multiturn_with_mla(tmp_path: Path) -> None:
    argv = "--configs device_only write_through --num-clients 3 --num-rounds 3 --request-length 64"
    argv += " --sub-question-input-length 16 --working-set-ratio 3"
    _clean(bm.run(quick=True, out_dir=tmp_path, argv=COMMON + argv.split())["integrity"])
    configs = _summary(tmp_path / "multiturn.json")
    assert set(configs) == {"device_only", "write_through"}
    assert configs["write_through"]["host_hit_tokens"] > 0
    assert configs["device_only"]["host_hit_tokens"] == 0


def test_optimistic_with_mla(tmp_path: Path) -> None:
    argv = "--attempts 2 --policies write_back --num-requests 6 --input-len 64"
    _clean(bo.run(quick=True, out_dir=tmp_path, argv=COMMON + argv.split())["integrity"])
    configs = _summary(tmp_path / "optimistic.json")
    assert {"write_back:attempts_2", "write_back:attempts_0"} <= set(configs)
    assert all(c["ttft_mean_s"] > 0 for c in configs.values())
