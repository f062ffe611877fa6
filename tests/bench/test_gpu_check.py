"""``bench/gpu_check.sh`` on a machine without a GPU: its plan fits its budget by its own
arithmetic, ``--plan`` prints it, the script runs its steps in the plan's order with the plan's
limits (checked with a stand-in interpreter that records each command), the probe's kernels read
host memory through uint64 tables, and the fidelity step computes the clocks' gap. The step
without a CUDA torch (one line, exit 3) is ``tests/bench/test_bench_e2e.py``'s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import fidelity, plan

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_the_plan_fits_its_budget_and_orders_the_headline_first() -> None:
    steps = plan.steps()
    assert plan.total_s(steps) == sum(s.limit_s + plan.KILL_GRACE_S for s in steps) + plan.FIXED_S
    assert plan.total_s(steps) <= plan.BUDGET_S == 290
    names = [s.name for s in steps]
    assert names[:2] == ["probe", "precompile"]  # nothing before the probe; compile next
    assert names.index("bench_optimistic") < names.index("transfer_grid")
    assert names.index("bench_multiturn") < names.index("mla_multiturn")
    text = plan.render(steps, plan.BUDGET_S)
    assert "fits" in text and "12.9 GB, registered once" in text
    assert "write_back attempts_2, attempts_0" in text
    assert "order: device_only, write_through, write_back" in text


def test_the_scripts_probe_limit_is_the_plans() -> None:
    """The script runs the probe before it reads the plan, with its own copy of the limit."""
    script = SCRIPT.read_text()
    probe = next(s for s in plan.steps() if s.name == "probe")
    assert f"LIMIT_probe={probe.limit_s} KILL_GRACE_S={plan.KILL_GRACE_S}" in script


def test_plan_shell_assignments_parse() -> None:
    steps = plan.steps()
    values = dict(line.split("=", 1) for line in plan.shell(steps, 290).splitlines())
    assert {f"LIMIT_{s.name}" for s in steps} <= set(values)
    assert values["PLAN_TOTAL_S"] == str(plan.total_s(steps))
    assert values["HAS_MLA_OPTIMISTIC"] in ("0", "1")
    assert values["VIRTUAL_ARGS"] == f"'{plan.VIRTUAL_ARGS}'"


def test_a_budget_too_small_is_refused() -> None:
    assert plan.main(["--budget", "100"]) == 3


def test_gpu_check_plan_prints_the_plan_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "--plan"],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert re.match(r"gpu_check plan: 10 steps, \d+ s at most .* 290 s budget: fits", first)
    assert not (tmp_path / "out" / "status.txt").exists()  # nothing ran


FAKE_PYTHON = """#!/usr/bin/env bash
# Records every command; runs the plan for real, anything else succeeds at once (the wall-clock
# multi-turn run leaves a calibration.json, as the real one does).
echo "$*" >> "$FAKE_LOG"
case "$*" in
  *bench.gpu.plan*) exec "$REAL_PYTHON" "$@" ;;
  *"--only multiturn"*)
    while [ $# -gt 0 ]; do [ "$1" = --out ] && echo '{}' > "$2/calibration.json"; shift; done ;;
esac
exit 0
"""


def test_gpu_check_runs_the_plans_steps_in_order(tmp_path: Path) -> None:
    """With an interpreter that records commands (and pretends the probe passed), the script
    runs each step of the plan in order, under its limit, and says which steps it skipped."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
           "FAKE_LOG": str(log)}  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                          timeout=180, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    modules = [m.group(1) for c in calls if (m := re.search(r"-m (\S+)", c))]
    expected = ["bench.gpu.probe", "bench.gpu.plan", "bench.gpu.precompile", "pytest",
                "bench.transfer.launch_cost", "bench.transfer", "bench", "bench",
                "bench.transfer"]  # fmt: skip
    assert modules[: len(expected)] == expected
    e2e = [c for c in calls if "--only" in c]
    assert "--only optimistic --clock wall" in e2e[0] and "--only multiturn --clock wall" in e2e[1]
    assert modules[-2:] == ["bench.multiturn", "bench.gpu.fidelity"]
    assert plan.VIRTUAL_ARGS in calls[-2]
    assert "--host-time measured" in plan.VIRTUAL_ARGS
    assert f"--calibration {out}/calibration.json" in calls[-2]  # the wall run's, replayed
    status = (out / "status.txt").read_text().splitlines()
    ran = [line.split()[0] for line in status]
    assert ran == ["probe", "precompile", "gpu_tests", "transfer_sweep", "bench_optimistic",
                   "bench_multiturn", "transfer_grid", "mla_optimistic", "mla_multiturn",
                   "virtual_point"]  # fmt: skip
    mla_flag = plan.has_flag("bench.optimistic.bench", "--use-mla")
    assert ("mla_optimistic skipped" in "\n".join(status)) != mla_flag
    assert "gpu_check plan: 10 steps" in proc.stdout  # printed once the probe passed
    assert "(limit 52s," in proc.stdout  # bench_optimistic under the plan's limit


def test_the_probe_reads_host_memory_through_uint64_tables() -> None:
    """The probe's kernels, interpreted on CPU: a host tensor read as a tensor argument and
    through int64 and uint64 (``kernels.data_ptr_table``) pointer tables."""
    from bench.gpu import probe_kernels

    host = torch.arange(300, dtype=torch.int32)
    for how in ("tensor", "int64 table", "uint64 table"):
        dst = torch.zeros_like(host)
        probe_kernels.launch_read_host(host, dst, how)
        assert torch.equal(dst, host + 1), how


def test_fidelity_is_the_virtual_over_the_wall_ratio(tmp_path: Path) -> None:
    def result(folder: str, ratio: float | None) -> Path:
        summary = {"device_only": {"ttft_mean_speedup_vs_device_only": 1.0},
                   "write_through": {"ttft_mean_speedup_vs_device_only": ratio}}  # fmt: skip
        path = tmp_path / folder / "multiturn.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"summary": summary}))
        return path

    wall, virtual = result("wall", 2.0), result("virtual", 2.5)
    out = tmp_path / "fidelity.json"
    assert fidelity.main([str(wall), str(virtual), str(out)]) == 0
    entry = json.loads(out.read_text())["fidelity"]["multiturn/write_through"]
    assert entry == {"virtual": 2.5, "wall": 2.0, "gap": pytest.approx(0.25)}
    assert fidelity.main([str(wall), str(tmp_path / "missing.json"), str(out)]) == 1


def test_the_short_runs_flags_are_the_benchmarks_own() -> None:
    """The MLA runs' and the virtual point's flags parse in the benchmarks' parsers (``--use-mla``
    only where the MLA work added it: the script skips those runs otherwise)."""
    from bench.multiturn.trace import parse_args as multiturn_args
    from bench.optimistic.bench import parse_args as optimistic_args

    for parse, flags, module in (
        (optimistic_args, plan.MLA_OPTIMISTIC_ARGS, "bench.optimistic.bench"),
        (multiturn_args, plan.MLA_MULTITURN_ARGS, "bench.multiturn.trace"),
        (multiturn_args, plan.VIRTUAL_ARGS, "bench.multiturn.trace"),
    ):
        argv = flags.split()
        if not plan.has_flag(module, "--use-mla"):
            argv = [a for a in argv if a != "--use-mla"]
        parse(argv, True)
