"""``--use-mla`` in the end-to-end benchmarks: the multi-turn and optimistic configurations run the
DeepSeek-shaped MLA model over MLA device, host and decode pools, and end with every integrity
counter at zero, sampled decode-side latents included (checked against the absorbed-form
recompute, and bit for bit against a replay of the same chunked forwards), under write_through
and write_back (with optimistic attempts in the optimistic one).

The benchmarks' CPU model is shrunk (2 layers, latent 32 + rope 16) and a made-up calibration
drives the virtual clock, as in test_bench_e2e.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.e2e import setup as e2e
from bench.e2e.workload import poisson_arrivals
from bench.multiturn import single as mt_single
from bench.multiturn import trace as bm
from bench.optimistic import bench as bo
from bench.optimistic import run as orun
from prefill.model.mla import MLATransformer
from tests.bench.test_bench_e2e import TINY, linear_calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread", "tiny_mla_model")

TINY_MLA = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=16)  # fmt: skip


@pytest.fixture
def tiny_mla_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(e2e, "CPU_MODEL", TINY)
    monkeypatch.setattr(e2e, "CPU_MLA", TINY_MLA)


COUNTS = ("kv_checked_requests", "kv_strict_checked")


def clean(integrity: dict[str, int]) -> bool:
    """Every error counter at zero, and the strict audit replayed every sampled request."""
    checked = integrity["kv_checked_requests"]
    return integrity.get("kv_strict_checked") == checked and not any(
        v for k, v in integrity.items() if k not in COUNTS
    )


def test_model_args_choose_mla_only_with_the_flag() -> None:
    assert e2e.model_args(use_mla=True)["kv_lora_rank"] == 32
    assert "use_mla" not in e2e.model_args()


@pytest.mark.parametrize("name", ["write_through", "write_back"])
def test_multiturn_with_mla(name: str) -> None:
    opts = bm.parse_args(
        ["--use-mla", "--num-clients", "4", "--num-rounds", "3", "--request-length", "64",
         "--sub-question-input-length", "16", "--working-set-ratio", "3",
         "--chunked-prefill-size", "64", "--kv-sample-every", "2", "--seeds", "5"], quick=True,
    )  # fmt: skip
    assert opts.use_mla
    _, device_tokens = bm.pool_sizes(opts)
    cal = linear_calibration()
    args = bm.server_args_for(name, device_tokens, opts)
    model = e2e.shared_model(args)
    assert isinstance(model, MLATransformer)
    res = mt_single.run_config(name, 5, device_tokens, bm.request_rate(opts, cal), opts, model,
                               cal)  # fmt: skip
    assert res["server_args"]["use_mla"] and res["successes"] == 12
    assert clean(res["integrity"]) and res["integrity"]["kv_checked_requests"] == 6
    assert res["host_hit_tokens"] > 0 and res["h2d_bytes"] > 0
    # Bytes moved are latents: 2 layers x (32 + 16) fp32 values per token.
    assert res["h2d_bytes"] == res["loaded_tokens"] * 2 * 48 * 4


def _optimistic(argv: list[str]) -> tuple[Any, Any, Any]:
    opts = bo.parse_args(
        ["--use-mla", "--num-requests", "8", "--input-len", "128", "--chunked-prefill-size", "16",
         "--kv-sample-every", "2", "--seeds", "3", *argv], quick=True,
    )  # fmt: skip
    model = e2e.shared_model(orun.Trace.server_args(opts, 0, 0.0, "write_back"))
    return opts, linear_calibration(), model


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_optimistic_with_mla_and_two_attempts(policy: str) -> None:
    if policy not in orun.available_policies():
        pytest.skip("ServerArgs has no optimistic_prefill_write_through")
    opts, cal, model = _optimistic([])
    prefill_s = orun.calibrate_prefill_s(opts, model, cal)
    delay = orun.DelayDistribution("uniform", 0.5 * prefill_s, 1.5 * prefill_s)
    trace = orun.make_trace(opts, 3, poisson_arrivals(8, 0.5 / prefill_s, 3), delay, 0.0, 0.5)
    res = orun.run_config(trace, 2, policy, model, cal)
    assert res["server_args"]["use_mla"] and res["server_args"]["optimistic_prefill_attempts"] == 2
    assert res["successes"] == 8 and res["optimistic_admissions"] > 0
    assert res["parks"] + res["yields"] > 0
    assert clean(res["integrity"]) and res["integrity"]["kv_checked_requests"] == 4
