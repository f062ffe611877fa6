"""``bench.soak``: a short soak samples every window (RSS, step cost, live records), keeps its
integrity, keeps the suite's contract (no ``seconds``) and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench import soak


def test_a_short_soak_reports_every_window(tmp_path: Path) -> None:
    res = soak.run(out_dir=tmp_path, sizes=(300, 100, 100))
    assert res["successes"] + res["aborted"] == 300 and res["warmup_requests"] == 100
    assert res["rss_base_mb"] > 0 and res["step_cost_ratio_max"] > 0
    assert res["integrity"] == {"kv_mismatches": 0, "protocol_errors": 0, "speculative_l2_pages": 0}
    assert "seconds" not in res and "windows" not in res  # the suite adds the seconds
    windows = json.loads((tmp_path / "bench_soak.json").read_text())["windows"]
    finished = [w["finished"] for w in windows]  # a sample every 100 finished requests
    assert len(finished) == 3 and finished == sorted(finished) and finished[-1] == 300
