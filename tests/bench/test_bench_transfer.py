"""bench/transfer/bench.py: every timed method moves exactly the named bytes, and ``run`` works.

The method builders are the code the GPU run times; here they run on CPU (the ``triton`` ones
interpreted) at a tiny size and are checked byte for byte, so a wrong argument order or layout
view shows up before any GPU time is spent. On CUDA the same test uses pinned host memory (and
``sgl_kernel`` when it imports).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.transfer import bench as bt

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ITEM = 64  # bytes per token per layer
N = 48  # tokens copied
LAYER = 5


def _fill(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw)


def _host_rows(pools: bt.Pools, layout: str, kv: int, layer: int, ps: int) -> torch.Tensor:
    """``[slots, item]`` bytes of one host layer (a copy)."""
    if layout == "layer_first":
        rows = pools.host[layout][kv, layer]
    elif layout == "page_first":
        rows = pools.host[layout][kv][:, layer]
    else:
        rows = pools.page_first_direct(ps)[kv][:, layer].reshape(-1, ITEM // 2)
    return rows.cpu().contiguous().view(torch.uint8)


def _dev_rows(pools: bt.Pools, kv: int, layer: int) -> torch.Tensor:
    return pools.dev[kv, layer].cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", bt.LAYOUTS)
def test_every_method_copies_the_named_bytes(layout: str, page_size: int) -> None:
    pools = bt.Pools.allocate(DEVICE, ITEM, bt.pool_slots(N))
    pools.page_first_direct(page_size)
    idx = bt.Indices.make(pools, N, page_size, seed=4)
    s_host, d_dev = idx.host_cpu, idx.dev_cpu
    sgl = bt.load_sgl_kernel()

    h2d = bt.h2d_methods(pools, layout, idx, page_size, LAYER, 2, sgl)
    assert h2d, "no method for this layout"
    for name, fn in h2d.items():
        for i, buf in enumerate(pools.host.values()):
            _fill(buf, i)
        pools.dev.zero_()
        fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        for kv in (0, 1):
            got, src = _dev_rows(pools, kv, LAYER), _host_rows(pools, layout, kv, LAYER, page_size)
            assert torch.equal(got[d_dev], src[s_host]), f"h2d {name} kv={kv}"
            untouched = torch.ones(got.shape[0], dtype=torch.bool)
            untouched[d_dev] = False
            assert not got[untouched].any(), f"h2d {name} wrote unnamed slots"
        assert not pools.dev[:, [i for i in range(bt.NUM_LAYERS) if i != LAYER]].any()

    d2h = bt.d2h_methods(pools, layout, idx, page_size, 2, sgl)
    assert d2h
    for name, fn in d2h.items():
        _fill(pools.dev, 9)
        for buf in pools.host.values():
            buf.zero_()
        fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        for kv in (0, 1):
            for layer in range(bt.NUM_LAYERS):
                got = _host_rows(pools, layout, kv, layer, page_size)
                src = _dev_rows(pools, kv, layer)
                assert torch.equal(got[idx.host_cpu], src[idx.dev_cpu]), (
                    f"d2h {name} kv={kv} layer={layer}"
                )
                untouched = torch.ones(got.shape[0], dtype=torch.bool)
                untouched[idx.host_cpu] = False
                assert not got[untouched].any(), f"d2h {name} wrote unnamed slots"


def test_ceiling_copies_the_byte_count() -> None:
    pools = bt.Pools.allocate(DEVICE, ITEM, bt.pool_slots(N))
    _fill(pools.host["layer_first"], 1)
    bt.ceiling_method(pools, "h2d", 1000)()
    dev, host = pools.flat_bytes()
    assert torch.equal(dev[:1000].cpu(), host[:1000].cpu())
    assert not dev[1000:].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is bench/gpu_check.sh's job")
def test_run_on_cpu_writes_json_and_says_cpu_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = replace(bt.CPU_TINY, tokens=(32, 64), page_sizes=(1, 16), rep_ms=1)
    monkeypatch.setattr(bt, "CPU_TINY", tiny)
    threads = torch.get_num_threads()
    result = bt.run(quick=True, out_dir=tmp_path)
    assert torch.get_num_threads() == threads  # restored after the single-threaded CPU run
    data = json.loads((tmp_path / "bench_transfer.json").read_text())
    assert data["cpu_note"] and "CPU numbers" in data["headline"]["note"]
    methods = {r["method"] for r in data["rows"]}
    assert methods == {"ceiling", "direct", "torch_gather"}
    assert all(r["gbps"] > 0 for r in data["rows"] if "gbps" in r)
    assert result["headline"] == data["headline"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is bench/gpu_check.sh's job")
def test_run_writes_each_row_as_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON on disk grows row by row (partial until the end) and each row is printed."""
    tiny = replace(bt.CPU_TINY, tokens=(32,), page_sizes=(1, 16), layouts=("layer_first",),
                   rep_ms=1)  # fmt: skip
    monkeypatch.setattr(bt, "CPU_TINY", tiny)
    seen: list[tuple[bool, int]] = []
    write = bt.Recorder.write

    def spy(self: bt.Recorder) -> Path:
        path = write(self)
        data = json.loads(path.read_text())
        seen.append((data["partial"], len(data["rows"])))
        return path

    monkeypatch.setattr(bt.Recorder, "write", spy)
    result = bt.run(quick=True, out_dir=tmp_path)
    n = len(result["rows"])
    assert n == 2 * 2 * 3  # 2 page sizes x 2 directions x (ceiling, direct, torch_gather)
    assert seen[:n] == [(True, i) for i in range(1, n + 1)]
    assert seen[-1] == (False, n)
    lines = capsys.readouterr().out.splitlines()
    printed = [ln for ln in lines if ln.rstrip().endswith("-") and " 32 " in ln]
    assert [ln.split()[5] for ln in printed] == [r["method"] for r in result["rows"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is bench/gpu_check.sh's job")
def test_run_past_its_deadline_measures_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_BENCH_DEADLINE", "1")  # long past
    result = bt.run(quick=True, out_dir=tmp_path)
    data = json.loads((tmp_path / "bench_transfer.json").read_text())
    assert data["rows"] == [] and result["rows"] == []
    assert data["skipped_for_time"] == ["grid item 2048"]
    assert data["partial"] is False and data["headline"]["note"] == "no rows measured"


def test_the_warps_sweep_keeps_the_bytes_in_flight() -> None:
    """The GEMM co-run's 32 / 16 / 8 warps per program at 2 / 4 / 8 programs keep as many bytes
    of loads outstanding (the planner's numbers for a 2 KiB-item page_first load)."""
    from bench.transfer.measure import bytes_in_flight, warp_points

    n = 1024
    pools = bt.Pools.allocate(DEVICE, 2048, bt.pool_slots(n))
    idx = bt.Indices.make(pools, n, 1, seed=0)
    points = warp_points((32, 16, 8))
    assert points == [(32, 2), (16, 4), (8, 8)]
    flights = {bytes_in_flight(pools, idx, 3, bq, w) for w, bq in points}
    assert len(flights) == 1 and flights.pop() >= 64 * 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is bench/gpu_check.sh's job")
def test_the_sweep_part_says_why_it_is_skipped_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = bt.run(quick=True, out_dir=tmp_path, part="sweep")
    assert "need CUDA" in result["sweep_skipped"]
    assert "skipped: block_quota and warps sweeps" in capsys.readouterr().out
    assert result["gemm_corun"] == [] and result["block_quota_sweep"] == []
