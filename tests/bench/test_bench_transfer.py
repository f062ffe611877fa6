"""bench/transfer/bench.py: every timed copy moves exactly the bytes its indices name (on CPU, the
kernel path interpreted), and ``run`` writes its tables' JSON, labelled as CPU numbers, honours
the deadline and keeps the suite contract."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.transfer import bench as bt

ITEM, LAYERS, N, PAGE = 64, 4, 48, 16


def _fill(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("path", [*bt.PATHS, "ceiling"])
def test_every_copy_moves_the_named_bytes(path: str, direction: str) -> None:
    pools = bt.Pools(torch.device("cpu"), ITEM, LAYERS, N, PAGE)
    for i, buf in enumerate((pools.dev, pools.lf, pools.pf, pools.reg)):
        _fill(buf, i)
    before = {k: getattr(pools, k).clone() for k in ("dev", "lf", "pf", "reg")}
    fn, nbytes = pools.copy(direction, path, N, seed=7)
    fn()
    host = {"direct": "lf", "registered": "reg"}.get(path, "pf")
    src, dst = ("dev", host) if direction == "d2h" else (host, "dev")
    for k in before:  # the source and every other buffer are untouched
        if k != dst:
            assert torch.equal(_rows(getattr(pools, k)), _rows(before[k])), f"{k} changed"
    got, want = getattr(pools, dst), before[dst].clone()
    if path == "ceiling":
        flat, s = want.view(-1).view(torch.uint8), getattr(pools, src).view(-1).view(torch.uint8)
        flat[:nbytes] = s[:nbytes]
        assert nbytes == N * 2 * ITEM * (1 if direction == "h2d" else LAYERS)
    else:
        h, d = pools.indices(N, 7)
        layers = [LAYERS // 2] if direction == "h2d" else range(LAYERS)
        s_buf = getattr(pools, src)
        for kv in (0, 1):
            for layer in layers:
                if direction == "h2d":
                    rows = s_buf[kv, layer] if host == "lf" else s_buf[kv][:, layer]
                    want[kv, layer][d] = rows[h]
                elif host == "lf":
                    want[kv, layer][h] = s_buf[kv, layer][d]
                else:
                    want[kv][:, layer][h] = s_buf[kv, layer][d]
    assert torch.equal(_rows(got), _rows(want)), f"{direction} {path}"


TINY = replace(bt.CPU_TINY, tokens=(32, 64), corun_tokens=32, gemm=32, gemm_reps=2, reps=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is bench/gpu_check.sh's")
def test_run_on_cpu_writes_both_tables_labelled_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bt, "CPU_TINY", TINY)
    result = bt.run(quick=True, out_dir=tmp_path)
    head = json.loads((tmp_path / "bench_transfer.json").read_text())
    corun = json.loads((tmp_path / "bench_transfer_corun.json").read_text())
    for doc in (head, corun):
        assert doc["cpu_note"].startswith("CPU numbers") and doc["partial"] is False
        assert doc["skipped_for_time"] == [] and doc["window_left_s"] is None
    got = {(r["direction"], r["tokens"], r["path"]) for r in head["rows"]}
    want = {(d, n, p) for d in ("h2d", "d2h") for n in (32, 64) for p in bt.PATHS}
    assert got == want - {k for k in want if k[2] == "registered"}  # registering needs CUDA
    assert all(r["gbps"] > 0 and r["ceiling_gbps"] > 0 for r in head["rows"])
    paths = [(r["path"], r.get("block_quota")) for r in corun["corun"]]
    want = [(p, None) for p in "none ceiling copy_engine direct".split()] + [("kernel", 2)]
    assert paths == want
    assert all(r["slowdown"] > 0 and r["gemm_tflops"] > 0 for r in corun["corun"])
    assert result["corun"] == corun["corun"] and "h2d 64 tok GB/s" in result["headline"]
    assert "GEMM slowdown beside kernel" in result["headline"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is bench/gpu_check.sh's")
def test_past_its_deadline_a_run_measures_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bt, "CPU_TINY", TINY)
    monkeypatch.setenv("HICACHE_BENCH_DEADLINE", "1")  # long past
    result = bt.run(quick=True, out_dir=tmp_path, part="headline")
    doc = json.loads((tmp_path / "bench_transfer.json").read_text())
    assert doc["rows"] == [] == result["rows"] and doc["headline"] == {}
    assert doc["skipped_for_time"] == ["h2d 32 tokens"] and doc["partial"] is False
    assert doc["window_left_s"] < 0
    assert not (tmp_path / "bench_transfer_corun.json").exists()
