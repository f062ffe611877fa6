"""``bench.mooncake_store``: a bandwidth row over the fake Mooncake (fields, bytes checked,
nothing failed, the store emptied), and a machine without Mooncake reports the benchmark skipped
with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.mooncake_store import bench as mc_bench
from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore
from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster


def test_a_bandwidth_row_moves_and_checks_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FakeCluster()
    monkeypatch.setattr(MooncakeStore, "store_factory", cluster.factory)
    extra = {"master_server_address": "127.0.0.1:1", "protocol": "tcp", "global_segment_size": 0}
    row = mc_bench.measure(extra, page=16, total_bytes=2 << 20, repeats=1)
    assert row["pages"] == 1 and row["object_bytes"] == 16 * 32 * 8 * 128 * 2
    assert row["failed_pages"] == 0 and row["bytes"] == 2 << 20
    assert min(row["put_gbps"], row["get_gbps"], row["memcpy_gbps"]) > 0
    assert cluster.objects == {}  # removed after each repeat


def test_without_mooncake_the_benchmark_reports_itself_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(mc_bench, "skip_reason", lambda module: "import mooncake.store failed (x)")
    assert mc_bench.run(quick=True, out_dir=tmp_path) == {  # no "seconds": the suite adds them
        "skipped": "import mooncake.store failed (x)",
        "integrity": {},
    }
    assert mc_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "skipped: import mooncake.store failed" in capsys.readouterr().out
