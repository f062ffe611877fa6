#!/usr/bin/env bash
# One-shot check on a machine with one NVIDIA GPU, built so that a lent GPU is never wasted.
#
#   bash bench/gpu_check.sh OUT_DIR           the check (PYTHON=... chooses the interpreter)
#   bash bench/gpu_check.sh OUT_DIR --plan    print the plan and exit (any machine, no GPU used)
#
# The plan (bench/gpu/plan.py, one source for the steps, their limits and sizes) is printed once
# the probe found a GPU; by its own arithmetic the whole check takes at most its budget
# (GPU_CHECK_BUDGET_S, default 290 s): every step runs under `timeout -k GRACE LIMIT`.
#
#   1. probe (bench.gpu.probe): CUDA torch and a device, triton, a C compiler, Python.h, libcuda,
#      the device attributes the kernels need, trivial Triton launches and reads of registered
#      host memory (tensor argument, int64 and uint64 pointer tables). The first thing missing
#      stops the run with ONE line "gpu_check: STOP: ..." (exit 3) before anything else runs.
#   2. precompile (bench.gpu.precompile): every Triton variant of the later steps compiled in
#      parallel into $OUT/triton_cache (TRITON_CACHE_DIR for every step): the kernel tests in
#      parallel pytest shards, the benchmarks' variants by warm-up launches that copy nothing;
#   3. the other GPU-marked tests; 4. launch cost, block_quota sweep, GEMM co-run with the warps
#      sweep; 5-6. the end-to-end benchmarks on the wall clock, headline configurations first,
#      one pinned host pool each; 7. the transfer grid; 8-9. one MLA run of each end-to-end
#      benchmark (where --use-mla exists); 10. one virtual-clock point and its gap to the wall
#      clock (fidelity.json).
#
# Each step has its own process and limit; a benchmark gets a deadline a few seconds before its
# limit and skips what it can no longer finish. Logs (tests print each test as it starts),
# JSON (rewritten after every row or configuration) and status.txt (a line per step, with the
# kernels it still had to compile) land in OUT_DIR as they happen: a run cut short keeps what it
# measured. Works with torch 2.11 / triton 3.6 and later.
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh OUT_DIR [--plan]}
MODE=${2:-run}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c \
      "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step killed by its time limit still leaves its log
BUDGET=${GPU_CHECK_BUDGET_S:-290}
t_start=$SECONDS

if [ "$MODE" = "--plan" ]; then  # any interpreter with torch (a CPU build will do)
  [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
  GPU_CHECK_BUDGET_S=$BUDGET exec "$PY" -m bench.gpu.plan
elif [ "$MODE" != run ]; then
  echo "usage: bash bench/gpu_check.sh OUT_DIR [--plan]" >&2
  exit 2
fi

# The probe's limit and kill grace (the plan's, which tests/bench/test_gpu_check.py keeps equal);
# every other limit comes from the plan, read once the probe passed.
LIMIT_probe=20 KILL_GRACE_S=2
export TRITON_CACHE_DIR="$OUT/triton_cache"
mkdir -p "$TRITON_CACHE_DIR"
status=0
: > "$OUT/status.txt"

kernels_cached() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }

step() {  # step NAME live|tail COMMAND...   (limit: $LIMIT_<NAME>)
  local name=$1 mode=$2; shift 2
  local lim_var="LIMIT_$name" t0=$SECONDS rc before
  local lim=${!lim_var}
  before=$(kernels_cached)
  echo "[gpu_check] $name (limit ${lim}s, ${t0}s elapsed) ..."
  if [ "$mode" = live ]; then
    HICACHE_BENCH_DEADLINE=$(($(date +%s) + lim - DEADLINE_MARGIN_S)) HICACHE_TEST_PROGRESS=1 \
      timeout -k "$KILL_GRACE_S" "$lim" "$@" 2>&1 | tee "$OUT/$name.log" | sed 's/^/    /'
    rc=${PIPESTATUS[0]}
  else
    HICACHE_BENCH_DEADLINE=$(($(date +%s) + lim - DEADLINE_MARGIN_S)) HICACHE_TEST_PROGRESS=1 \
      timeout -k "$KILL_GRACE_S" "$lim" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    grep -v '^\[test\] start' "$OUT/$name.log" | tail -n 20 | sed 's/^/    /'
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "[gpu_check] $name hit its ${lim}s limit"
    local log last
    for log in "$OUT/$name.log" "$OUT/${name}"_tests_*.log; do  # the test each one was in
      [ -f "$log" ] || continue
      last=$(grep '^\[test\] start' "$log" | tail -n 1)
      [ -n "$last" ] && echo "[gpu_check]   $(basename "$log"): last test started: ${last#* start }"
    done
  fi
  local compiled=$(($(kernels_cached) - before))
  echo "[gpu_check] $name rc=$rc in $((SECONDS - t0))s; compiled $compiled new kernels"
  echo "$name rc=$rc seconds=$((SECONDS - t0)) compiled=$compiled" >> "$OUT/status.txt"
  [ "$rc" -eq 0 ] || status=1
}

skip() {  # skip NAME REASON
  echo "[gpu_check] $1: skipped: $2"
  echo "$1 skipped: $2" >> "$OUT/status.txt"
}

# 1. Probe: nothing else runs unless every prerequisite is there.
timeout -k "$KILL_GRACE_S" "$LIMIT_probe" "$PY" -m bench.gpu.probe 2>&1 | tee "$OUT/probe.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  if ! grep -q "^gpu_check: STOP:" "$OUT/probe.log"; then
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "gpu_check: STOP: the probe did not finish in ${LIMIT_probe} s (driver or compiler" \
        "hanging?); see $OUT/probe.log"
    else
      echo "gpu_check: STOP: the probe failed (rc=$rc); see $OUT/probe.log"
    fi
  fi
  echo "probe rc=$rc" >> "$OUT/status.txt"
  exit 3
fi
echo "probe rc=0 seconds=$((SECONDS - t_start))" >> "$OUT/status.txt"
plan_vars=$(GPU_CHECK_BUDGET_S=$BUDGET CUDA_VISIBLE_DEVICES="" "$PY" -m bench.gpu.plan --shell \
  --render-to "$OUT/plan.txt" 2>"$OUT/plan.err")
plan_rc=$?
if [ "$plan_rc" -eq 0 ]; then
  eval "$plan_vars"
else
  echo "gpu_check: STOP: the plan does not fit or does not run (rc=$plan_rc):" \
    "$(tail -n 1 "$OUT/plan.err")"
  exit 3
fi
cat "$OUT/plan.txt"
{
  nvidia-smi 2>&1 || echo "nvidia-smi not found"
  free -g 2>&1 || true
  "$PY" -c "
import importlib
for m in ('pytest', 'hypothesis', 'matplotlib', 'sgl_kernel', 'numpy'):
    try:
        print('python module', m + ':', getattr(importlib.import_module(m), '__version__', 'yes'))
    except Exception:
        print('python module', m + ': no')" 2>&1
} > "$OUT/env.txt" 2>&1
grep "module" "$OUT/env.txt"

# 2-3. Precompile (with the kernel tests, in parallel shards), then the other GPU tests.
if "$PY" -c "import pytest" 2>/dev/null; then
  step precompile tail "$PY" -m bench.gpu.precompile "$OUT" --shards "$PRECOMPILE_SHARDS"
  ignore=()
  if ! "$PY" -c "import hypothesis" 2>/dev/null; then
    # Modules that import hypothesis at the top hold no GPU-marked test; skip collecting them.
    for f in $(grep -rlE "^(from|import) hypothesis" tests --include='test_*.py'); do
      ignore+=("--ignore=$f")
    done
    echo "[gpu_check] hypothesis not installed: not collecting ${ignore[*]}"
  fi
  step gpu_tests tail "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
    --continue-on-collection-errors --ignore=tests/kernels/test_kernels_gpu.py \
    --ignore=tests/kernels/test_sgl_kernel_kvcacheio_port.py ${ignore[@]+"${ignore[@]}"} tests
else
  echo "[gpu_check] pytest not installed: no kernel tests; bench/gpu/smoke.py instead"
  step precompile tail "$PY" -m bench.gpu.precompile "$OUT" --shards 0
  step gpu_tests tail "$PY" -m bench.gpu.smoke
fi

# 4. Launch cost, block_quota sweep and GEMM co-run (warps sweep), line by line.
step transfer_sweep live bash -c "'$PY' -m bench.transfer.launch_cost --out '$OUT' && \
  '$PY' -m bench.transfer --quick --part sweep --out '$OUT'"
# 5-6. End-to-end benchmarks on the wall clock, headline configurations first.
step bench_optimistic live "$PY" -m bench --only optimistic --clock wall --out "$OUT" \
  --summary summary_optimistic.json
step bench_multiturn live "$PY" -m bench --only multiturn --clock wall --out "$OUT" \
  --summary summary_multiturn.json
# 7. The transfer grid.
step transfer_grid live "$PY" -m bench.transfer --quick --part grid --out "$OUT"
# 8-9. One MLA run of each end-to-end benchmark.
# shellcheck disable=SC2086  # the flags are word-split on purpose
if [ "$HAS_MLA_OPTIMISTIC" = 1 ]; then
  step mla_optimistic live "$PY" -m bench.optimistic --quick --clock wall --out "$OUT/mla" \
    $MLA_OPTIMISTIC_ARGS
else
  skip mla_optimistic "bench.optimistic has no --use-mla here"
fi
# shellcheck disable=SC2086
if [ "$HAS_MLA_MULTITURN" = 1 ]; then
  step mla_multiturn live "$PY" -m bench.multiturn --quick --clock wall --out "$OUT/mla" \
    $MLA_MULTITURN_ARGS
else
  skip mla_multiturn "bench.multiturn has no --use-mla here"
fi
# 10. One virtual-clock point of the multi-turn headline, and its gap to the wall clock.
# shellcheck disable=SC2086
# It replays the wall run's calibration (same arrival rate, so the same workload) when it wrote one.
replay=()
if [ -f "$OUT/calibration.json" ]; then replay=(--calibration "$OUT/calibration.json"); fi
step virtual_point live "$PY" -m bench.multiturn --quick --out "$OUT/virtual" $VIRTUAL_ARGS \
  ${replay[@]+"${replay[@]}"}
"$PY" -m bench.gpu.fidelity "$OUT/multiturn.json" "$OUT/virtual/multiturn.json" \
  "$OUT/fidelity.json" 2>&1 | tee "$OUT/fidelity.log"

echo "[gpu_check] done in $((SECONDS - t_start))s of a planned ${PLAN_TOTAL_S}s" \
  "(budget ${BUDGET}s); status=$status; files in $OUT"
exit $status
