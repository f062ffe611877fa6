"""The plan of ``bench/gpu_check.sh``: its steps in run order, each one's time limit, what it runs
and the sizes it uses, and the arithmetic that keeps the whole check within its budget (290 s by
default, under the 300 s an operator may have on one H100/H200).

``python -m bench.gpu.plan`` prints the plan (``bash bench/gpu_check.sh OUT --plan`` does, on any
machine: nothing here touches a GPU; the sizes are the GPU sizes of the benchmarks' own tables);
``--shell`` prints the limits and flags as shell assignments for the script. The script prints the
same plan once the probe found a GPU.

Order: what the check exists for first. The probe, then every Triton variant the later steps
launch compiled in parallel into ``$OUT/triton_cache`` (with the kernel tests, run in parallel
shards, since their own launches are what compiles their variants), the other GPU tests, the
copy-kernel sweeps, then the end-to-end benchmarks on the wall clock (the default on CUDA) with
their headline configurations first (optimistic ``attempts_2`` and ``attempts_0`` before
``attempts_1``; multi-turn L2 ``write_through`` vs ``device_only`` before the rest), the transfer
grid, one MLA run of each end-to-end benchmark (where ``--use-mla`` exists), and one
virtual-clock point whose gap to the wall clock is written to ``fidelity.json``.

Arithmetic: every step runs under ``timeout -k KILL_GRACE_S LIMIT``, so it ends within
``LIMIT + KILL_GRACE_S``; the fixed work between steps (environment capture, the plan itself, the
fidelity comparison) is ``FIXED_S``. The plan fits when the sum is within the budget; a budget
too small for it is refused before anything runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from dataclasses import dataclass, field
from typing import Any

BUDGET_S = 290
KILL_GRACE_S = 2
FIXED_S = 9  # env capture, printing the plan, the fidelity comparison (three short processes)
DEADLINE_MARGIN_S = 6  # a benchmark's deadline is this far before its step's limit

# Flags of the short end-to-end runs (word-split by the script; no spaces inside a flag).
MLA_OPTIMISTIC_ARGS = ("--use-mla --policies write_back --num-requests 6 --input-len 2048 "
                       "--chunked-prefill-size 512")  # fmt: skip
MLA_MULTITURN_ARGS = ("--use-mla --configs device_only write_through --num-clients 3 "
                      "--num-rounds 2 --request-length 1024 "
                      "--sub-question-input-length 128")  # fmt: skip
# The virtual point replays the wall run's calibration (the script adds --calibration when the
# wall run wrote one): the same arrival rate, so the two runs see the same workload; host time is
# charged as measured in the run (no host calibration trace: it would not fit the step's limit).
VIRTUAL_ARGS = "--clock virtual --host-time measured --configs device_only write_through"

PRECOMPILE_SHARDS = 8
"""Parallel pytest shards of the kernel tests in the precompile step (16 cores on the device)."""
KERNEL_TEST_FILES = ("tests/kernels/test_kernels_gpu.py",
                     "tests/kernels/test_sgl_kernel_kvcacheio_port.py")  # fmt: skip


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    what: str
    sizes: list[str] = field(default_factory=list)


def _gpu_sizes(module: str) -> dict[str, Any]:
    """The GPU quick sizes of an end-to-end benchmark (its ``SIZES["quick"][1]``)."""
    return importlib.import_module(module).SIZES["quick"][1]


def has_flag(module: str, flag: str) -> bool:
    """Whether an end-to-end benchmark's parser has ``flag`` (e.g. ``--use-mla``, added by the
    MLA work): its ``parse_args`` accepts it."""
    parse = importlib.import_module(module).parse_args
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's complaint, when it lacks it
            parse([flag], True)
    except SystemExit:
        return False
    return True


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _model_sizes() -> tuple[str, int]:
    """The benchmarks' GPU model and its KV bytes per token (all layers, K and V)."""
    from bench.e2e.setup import GPU_MODEL
    from server_args import MODEL_PRESETS

    m = MODEL_PRESETS[GPU_MODEL["model_preset"]]
    per_token = 2 * m["num_layers"] * m["head_num"] * m["head_dim"] * 2  # K and V, bf16
    desc = (f"{GPU_MODEL['model_preset']} ({m['num_layers']} layers, {m['head_num']} KV heads x "
            f"{m['head_dim']}, bf16: {per_token // 1024} KiB of KV per token)")  # fmt: skip
    return desc, per_token


def steps() -> list[Step]:
    """The steps in run order (limits sum, with ``KILL_GRACE_S`` each and ``FIXED_S``, to at
    most ``BUDGET_S``)."""
    from bench.transfer.bench import GPU_QUICK
    from bench.transfer.measure import warp_points

    model, per_token = _model_sizes()
    opt = _gpu_sizes("bench.optimistic.bench")
    mt = _gpu_sizes("bench.multiturn.trace")
    opt_dev = 6 * opt["input_len"]  # --device-pool-inputs 6
    opt_host = 2 * opt_dev  # --hicache-ratio 2
    tq = GPU_QUICK
    items = sorted({*tq.items, *tq.side_items})
    return [
        Step("probe", 20, "prerequisites (CUDA torch, triton, compiler, Python.h, libcuda, "
             "device attributes), trivial Triton launches, registered host memory read as a "
             "tensor and through int64 and uint64 (kernels.data_ptr_table) pointer tables"),
        Step("precompile", 40, "every Triton variant of the later steps into "
             "$OUT/triton_cache (TRITON_CACHE_DIR), in parallel: the kernel tests in "
             f"{PRECOMPILE_SHARDS} pytest shards (their own launches compile their variants; "
             "results in precompile_tests_*.log) and the benchmarks' variants through warm-up "
             "calls with -1 indices (nothing is copied)",
             [f"tests: {' '.join(KERNEL_TEST_FILES)}",
              "benchmarks: the e2e pools (page_first, kernel io) MHA and MLA, the decode-side "
              f"copies, bench.transfer items {items} B in layer_first and page_first at warps "
              f"{sorted(tq.warps)}"]),
        Step("gpu_tests", 20, "the other GPU-marked tests (controller, executor, CUDA paths); "
             "without pytest, bench.gpu.smoke"),
        Step("transfer_sweep", 22, "launch cost of a per-layer load (plan cache on and off), "
             "the block_quota sweep, then the GEMM co-run: copy engine, warps per program at "
             "equal bytes in flight, the other block_quota values",
             [f"sweep tokens {tq.sweep_tokens}, item 2048 B, block_quota {list(tq.block_quotas)}",
              f"co-run: bf16 GEMM 8192^3 x10; (warps, programs) {warp_points(tq.warps)}",
              "launch cost: 32 layers x 16 tokens, 2 KiB items, 3200 calls x 7 rounds"]),
        Step("bench_optimistic", 52, "optimistic prefill on the wall clock, one pinned host "
             "pool for the calibrations and every configuration; headline first",
             [f"model {model}",
              f"{opt['num_requests']} requests x {opt['input_len']} tokens (80% cached), chunk "
              f"{opt['chunk']}, seeds {list(opt['seeds'])}",
              f"device pool {opt_dev} tokens ({_gb(opt_dev * per_token)}), host pool "
              f"{opt_host} tokens ({_gb(opt_host * per_token)}, registered once)",
              "order: write_back attempts_2, attempts_0, write_through attempts_2, attempts_0, "
              "then attempts_1, then _with_failures and _forced_retry"]),
        Step("bench_multiturn", 34, "multi-turn on the wall clock, one pinned host pool; "
             "headline first",
             [f"{mt['num_clients']} clients x {mt['num_rounds']} rounds, first prompt "
              f"{mt['request_length']} tokens, follow-ups {mt['sub_question_input_length']}, "
              f"seeds {list(mt['seeds'])}",
              "order: device_only, write_through, write_back, write_through_selective"]),
        Step("transfer_grid", 12, "the transfer grid (every method against the copy engine)",
             [f"item {list(tq.items)} B, tokens {list(tq.tokens)}, pages {list(tq.page_sizes)}; "
              f"side items {list(tq.side_items)} B at {tq.side_tokens} tokens"]),
        Step("mla_optimistic", 15, "one MLA run of the optimistic benchmark, wall clock; "
             "skipped with a line where the benchmark has no --use-mla",
             [MLA_OPTIMISTIC_ARGS]),
        Step("mla_multiturn", 13, "one MLA run of the multi-turn benchmark, wall clock; "
             "skipped with a line where the benchmark has no --use-mla",
             [MLA_MULTITURN_ARGS]),
        Step("virtual_point", 22, "the multi-turn headline pair on the virtual clock, the "
             "bench_multiturn workload on its replayed calibration ($OUT/calibration.json: the "
             "same arrival rate), host time charged as measured: its ratio and the wall "
             "clock's, and their gap, go to fidelity.json (issue 20, on a GPU)",
             [VIRTUAL_ARGS + " [--calibration $OUT/calibration.json]"]),
    ]  # fmt: skip


def total_s(plan: list[Step]) -> int:
    """Seconds the whole check may take by the plan: every step at its limit plus the kill
    grace, and the fixed work between steps."""
    return sum(s.limit_s + KILL_GRACE_S for s in plan) + FIXED_S


def render(plan: list[Step], budget_s: int) -> str:
    fits = "fits" if total_s(plan) <= budget_s else "DOES NOT FIT"
    lines = [f"gpu_check plan: {len(plan)} steps, {total_s(plan)} s at most by their limits "
             f"(each + {KILL_GRACE_S} s kill grace, + {FIXED_S} s between steps) of a "
             f"{budget_s} s budget: {fits}"]  # fmt: skip
    t = 0
    for i, s in enumerate(plan, 1):
        t += s.limit_s + KILL_GRACE_S
        lines.append(f"  {i:2d}. {s.name:<17} {s.limit_s:3d} s (done by {t:3d} s)  {s.what}")
        lines += [f"{'':30}- {size}" for size in s.sizes]
    return "\n".join(lines)


def shell(plan: list[Step], budget_s: int) -> str:
    """``LIMIT_<step>=N`` per step, the short runs' flags, whether the end-to-end benchmarks
    have ``--use-mla``, the shard count."""
    out = [f"LIMIT_{s.name}={s.limit_s}" for s in plan]
    out += [f"KILL_GRACE_S={KILL_GRACE_S}", f"DEADLINE_MARGIN_S={DEADLINE_MARGIN_S}",
            f"PRECOMPILE_SHARDS={PRECOMPILE_SHARDS}", f"PLAN_TOTAL_S={total_s(plan)}",
            f"PLAN_BUDGET_S={budget_s}", f"MLA_OPTIMISTIC_ARGS='{MLA_OPTIMISTIC_ARGS}'",
            f"MLA_MULTITURN_ARGS='{MLA_MULTITURN_ARGS}'",
            f"VIRTUAL_ARGS='{VIRTUAL_ARGS}'"]  # fmt: skip
    for module, var in (("bench.optimistic.bench", "HAS_MLA_OPTIMISTIC"),
                        ("bench.multiturn.trace", "HAS_MLA_MULTITURN")):  # fmt: skip
        out.append(f"{var}={1 if has_flag(module, '--use-mla') else 0}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.plan", description=__doc__.split("\n")[0])
    p.add_argument(
        "--budget", type=int, default=int(os.environ.get("GPU_CHECK_BUDGET_S", BUDGET_S))
    )
    p.add_argument("--shell", action="store_true", help="Shell assignments for gpu_check.sh.")
    p.add_argument("--render-to", type=str, default=None,
                   help="With --shell: also write the printed plan to this file.")  # fmt: skip
    args = p.parse_args(argv)
    plan = steps()
    if total_s(plan) > args.budget:
        print(render(plan, args.budget))
        print(f"the plan needs {total_s(plan)} s, the budget is {args.budget} s "
              "(GPU_CHECK_BUDGET_S)", file=sys.stderr if args.shell else sys.stdout,
              flush=True)  # fmt: skip
        return 3
    if args.render_to:
        with open(args.render_to, "w") as f:
            f.write(render(plan, args.budget) + "\n")
    print(shell(plan, args.budget) if args.shell else render(plan, args.budget), flush=True)
    return 0


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a plan never touches a GPU (set before CUDA init)
    sys.exit(main())
