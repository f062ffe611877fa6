"""A benchmark run the README's plain way leaves the tracked ``results/`` alone: every default
output folder is ``bench-out/`` (ignored by git); only ``make bench`` and the make targets that
name ``--out results`` update the committed results."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_benchmark_defaults_to_the_tracked_results() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "bench").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"""(Path\(|default=|out_dir: .*= )["']results""", line)
    ]
    assert offenders == []


def test_the_default_output_folder_is_ignored_and_make_bench_writes_results() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench-out/summary.json"], cwd=ROOT)
    assert ignored.returncode == 0
    makefile = (ROOT / "Makefile").read_text()
    assert "-m bench --out results" in makefile
