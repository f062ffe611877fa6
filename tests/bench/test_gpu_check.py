"""``bench/gpu_check.sh`` on a machine without a GPU: the plan's arithmetic fits one device
command, ``--plan`` prints it, the GPU-marked test files are the ones the plan names, a run
without CUDA stops with one line naming the cause, and ``--dry-run`` runs the same orchestration
end to end: every step inside its limit, at most 8 files of allowed names in OUT, and a step
killed at its limit (forced) keeps its partial numbers in the archive."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from bench.gpu import plan
from bench.gpu.probe import CUDA_ONLY
from bench.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")


def test_the_plan_fits_one_device_command_in_the_order_asked() -> None:
    steps = plan.steps()
    want = "probe device_tests transfer corun multiturn optimistic profile".split()
    assert [s.name for s in steps] == want
    limits = {s.name: s.limit_s for s in steps}
    assert limits["probe"] == 60 and limits["device_tests"] <= 80 and limits["profile"] <= 40
    assert limits["transfer"] <= 60 and limits["corun"] <= 60
    assert 180 <= limits["multiturn"] + limits["optimistic"] <= 200
    total = plan.total_s(steps)
    assert total == sum(s.limit_s + plan.GRACE_S + plan.OVERHEAD_S for s in steps)
    assert 520 <= total <= 545 and plan.DEVICE_LIMIT_S - total >= 55
    assert all(0 <= s.margin_s < s.limit_s / 4 for s in steps)
    assert len(plan.FILES_BACK) <= 8 and all(NAME.match(f) for f in plan.FILES_BACK)
    dry = plan.steps(dry=True, scale=0.5)
    assert [s.limit_s for s in dry] == [math.ceil(s.limit_s / 2) for s in steps]
    mt, opt = (s.command(True) for s in dry[4:6])
    assert mt.endswith("--num-clients 2 --num-rounds 2 --request-length 64")
    assert "--configs device_only write_through" in mt and "--attempts 2 0" in opt
    assert "--num-requests 6 --input-len 64" in opt and "--clock wall" in opt


def test_the_plan_names_every_gpu_marked_test_file() -> None:
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu|mark\.gpu", p.read_text())
    }
    assert set(plan.GPU_TESTS) <= marked <= set(plan.GPU_TESTS) | set(plan.KERNEL_TESTS)
    assert all((ROOT / f).exists() for f in plan.KERNEL_TESTS)


def test_plan_mode_prints_the_plan_and_runs_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--plan"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == plan.render(plan.steps(), dry=False)
    assert re.match(r"gpu_check plan: 7 steps, 539 s at most .* 600 s", proc.stdout)
    assert "files back in OUT (at most 8): results.tar.gz" in proc.stdout
    assert not out.exists()


@NO_CUDA
def test_without_cuda_the_check_stops_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpu_check: STOP: no CUDA device: torch.cuda.is_available() is ")
    status = (out / "status.txt").read_text().splitlines()
    assert len(status) == 1 and status[0].startswith("probe rc=3 ")
    assert {p.name for p in out.iterdir()} <= set(plan.FILES_BACK)
    assert not list(tmp_path.glob("gpu_check.*"))  # the scratch folder is removed


def _member(tar: tarfile.TarFile, name: str) -> str:
    f = tar.extractfile(f"./{name}")
    assert f is not None, name
    return f.read().decode()


@NO_CUDA
def test_the_dry_run_runs_every_step_in_its_window_and_keeps_a_killed_steps_rows(
    tmp_path: Path,
) -> None:
    """The transfer step is made to hang after its second row under a 10 s limit."""
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "GPU_CHECK_STALL_STEP": "transfer",
        "GPU_CHECK_LIMIT_transfer": "10",
    }
    env.pop("PYTHON", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(plan.FILES_BACK) and len(files) <= 8
    assert not list(tmp_path.glob("gpu_check.*"))
    rows = [
        dict(kv.split("=") for kv in line.split()[1:])
        for line in (out / "status.txt").read_text().splitlines()
    ]
    names = [line.split()[0] for line in (out / "status.txt").read_text().splitlines()]
    assert names == [s.name for s in plan.STEPS]
    for name, row in zip(names, rows, strict=True):
        if name == "transfer":
            assert (
                row["rc"] in ("124", "137") and row["hit_limit"] == "yes" and row["limit"] == "10"
            )
        else:
            assert row["rc"] == "0" and row["hit_limit"] == "no", (name, proc.stdout)
            assert int(row["seconds"]) <= int(row["limit"])
    with tarfile.open(out / "results.tar.gz") as tar:
        assert _member(tar, "transfer.log").count("  h2d  ") == 2  # the two rows it printed
        partial = json.loads(_member(tar, "bench_transfer.json"))
        assert partial["partial"] is True and len(partial["rows"]) == 2
        assert partial["window_left_s"] > 0
        corun = json.loads(_member(tar, "bench_transfer_corun.json"))
        assert corun["partial"] is False and corun["window_left_s"] > 0
        assert json.loads(_member(tar, "probe.json"))["skipped_cpu"] == list(CUDA_ONLY)
        tests = json.loads(_member(tar, "device_tests.json"))
        assert {k: v["rc"] for k, v in tests.items()} == dict.fromkeys(
            ("kernel_tests", "gpu_tests", "precompile"), 0
        )
    headline = (out / "headline.txt").read_text()
    assert "bench_transfer.json: (CPU, partial: 2 rows)" in headline
    assert re.search(r"multiturn\.json: device_only [\d.]+ ms .*write_through [\d.]+ ms", headline)
    assert re.search(r"optimistic\.json: \S*attempts_2 [\d.]+ ms .*attempts_0 [\d.]+ ms", headline)
    assert "unreadable" not in headline and "probe.json: cpu; 4 GB register - s" in headline
    assert proc.stdout.rstrip().endswith(headline.rstrip())
    prof = load_profile(out / "profile.json")
    assert prof.kind == "measured" and prof.gpu.startswith("CPU")
    assert "bench_transfer_corun.json" in prof.sources["corun_slowdown"]
