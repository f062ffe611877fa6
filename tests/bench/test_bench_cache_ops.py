"""The tree benchmark at its smallest size (keeps it from rotting), and its SGLang loader: a bad
site is refused untouched. Only the refusing path of the loader runs here: a successful
``install`` puts a process-wide import finder in place that stubs packages (PIL, requests,
pydantic) the rest of the suite may import."""

from __future__ import annotations

import json
import sys

import pytest

from bench.cache_ops import sglang_loader
from bench.cache_ops.bench import ALL_OPS, main, run_trace
from bench.cache_ops.sglang_loader import load_sglang, sglang_drivers
from bench.cache_ops.trace import ProjectDriver


def test_trace_runs_and_reports_every_op() -> None:
    row = run_trace(10_000, page_size=16, steps=30, factories=[ProjectDriver])
    assert row["nodes"] > 0
    project = row["trees"]["project"]
    for op in ("match", "miss", "insert", "lock", "unlock"):
        assert project[op]["n"] == 30 and project[op]["mean_us"] > 0
    assert set(project) == set(ALL_OPS) and project["evict_leaf"]["n"] == 3


def test_cli_writes_its_json(tmp_path, capsys) -> None:
    argv = ["--quick", "--sizes", "10000", "--pages", "16", "--steps", "20", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "bench_cache_ops.json").read_text())
    assert data["rows"][0]["trees"]["project"]["match"]["n"] == 20
    assert data["sglang"].startswith("not requested") and "per-op cost" in capsys.readouterr().out


def test_load_sglang_says_why_when_absent() -> None:
    sgl, note = load_sglang()
    assert (sgl is None) == ("not importable" in note)
    if sgl is None:
        assert sglang_drivers(None) == (None, note, {})


def test_site_without_sglang_is_refused_and_nothing_changes(tmp_path) -> None:
    path, meta = list(sys.path), list(sys.meta_path)
    with pytest.raises(ValueError, match="site="):
        sglang_loader.install(str(tmp_path))
    assert sys.path == path and sys.meta_path == meta
    sgl, note = load_sglang(str(tmp_path))
    assert sgl is None and "site=" in note and str(tmp_path) in note
    with pytest.raises(RuntimeError, match="--sglang-site"):
        sglang_drivers(str(tmp_path))
    assert sys.path == path and sys.meta_path == meta
