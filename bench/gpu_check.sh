#!/usr/bin/env bash
# One-shot check on a machine with an NVIDIA GPU, built so that a lent GPU is never wasted:
#
#   1. probe (python -m bench.gpu.probe): CUDA torch and a device, triton, a C compiler, Python.h,
#      libcuda, the device attributes the kernels need (host pointers to registered memory), one
#      trivial Triton launch and two reads of registered host memory. The first thing missing
#      stops the run at once with ONE line "gpu_check: STOP: ..." (exit 3) before any test or
#      benchmark spends GPU time. Without a CUDA torch this takes a few seconds.
#   2. kernel tests in their own process (tests/kernels/test_kernels_gpu.py), then the other GPU-marked
#      tests (without pytest: python -m bench.gpu.smoke);
#   3. the block_quota sweep and GEMM co-run, printed line by line as measured;
#   4. the transfer grid, then the two end-to-end benchmarks at quick size.
#
# Every step runs in its own process under its own time limit (a CUDA error in one cannot poison
# the others; one that runs long cannot starve them), the benchmarks get a matching deadline and
# skip what they can no longer finish. Everything is saved under OUT_DIR as it happens: one log
# per step (written live), JSON rewritten after every row or configuration, and status.txt with
# one line per finished step. The whole run fits GPU_CHECK_BUDGET_S (default 290 s, under the
# 300 s of one H200); works with torch 2.11 / triton 3.6 and later.
#
#   bash bench/gpu_check.sh OUT_DIR            (PYTHON=... to choose the interpreter)
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
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
status=0
t_start=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-290}
: > "$OUT/status.txt"

limit() {  # limit CAP RESERVE: at most CAP seconds, leaving RESERVE for the steps after; >= 10
  local l=$((BUDGET - (SECONDS - t_start) - $2))
  l=$((l < $1 ? l : $1))
  echo $((l > 10 ? l : 10))
}
step() {  # step NAME LIMIT_S live|tail COMMAND...
  local name=$1 lim=$2 mode=$3; shift 3
  local t0=$SECONDS rc
  echo "[gpu_check] $name (limit ${lim}s, ${t0}s elapsed) ..."
  if [ "$mode" = live ]; then
    HICACHE_BENCH_DEADLINE=$(($(date +%s) + lim - 8)) \
      timeout -k 5 "$lim" "$@" 2>&1 | tee "$OUT/$name.log" | sed 's/^/    /'
    rc=${PIPESTATUS[0]}
  else
    HICACHE_BENCH_DEADLINE=$(($(date +%s) + lim - 8)) \
      timeout -k 5 "$lim" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 20 "$OUT/$name.log" | sed 's/^/    /'
  fi
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "[gpu_check] $name hit its ${lim}s limit"
  echo "[gpu_check] $name rc=$rc in $((SECONDS - t0))s"
  echo "$name rc=$rc seconds=$((SECONDS - t0))" >> "$OUT/status.txt"
  [ "$rc" -eq 0 ] || status=1
}

# 1. Probe: nothing else runs unless every prerequisite is there.
timeout -k 5 120 "$PY" -m bench.gpu.probe 2>&1 | tee "$OUT/probe.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  if ! grep -q "^gpu_check: STOP:" "$OUT/probe.log"; then
    [ "$rc" -eq 124 ] && echo "gpu_check: STOP: the probe did not finish in 120 s (driver or" \
      "compiler hanging?); see $OUT/probe.log" || echo "gpu_check: STOP: the probe failed" \
      "(rc=$rc); see $OUT/probe.log"
  fi
  echo "probe rc=$rc" >> "$OUT/status.txt"
  exit 3
fi
echo "probe rc=0 seconds=$((SECONDS - t_start))" >> "$OUT/status.txt"
{
  nvidia-smi 2>&1 || echo "nvidia-smi not found"
  free -g 2>&1 || true
  for m in pytest hypothesis matplotlib sgl_kernel numpy; do
    "$PY" -c "import $m; print('python module $m:', getattr($m, '__version__', 'yes'))" \
      2>/dev/null || echo "python module $m: no"
  done
} > "$OUT/env.txt" 2>&1
grep "module" "$OUT/env.txt"

# 2. Tests: the kernels alone first, in their own process.
if "$PY" -c "import pytest" 2>/dev/null; then
  ignore=()
  if ! "$PY" -c "import hypothesis" 2>/dev/null; then
    # Modules that import hypothesis at the top hold no GPU-marked test; skip collecting them
    # (tests/kernels/test_kernels_gpu.py still imports test_kernels' case tables through a stand-in).
    for f in $(grep -lE "^(from|import) hypothesis" tests/test_*.py); do ignore+=("--ignore=$f"); done
    echo "[gpu_check] hypothesis not installed: not collecting ${ignore[*]}"
  fi
  step kernel_tests "$(limit 60 160)" tail "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    --durations=10 tests/kernels/test_kernels_gpu.py
  step gpu_tests "$(limit 45 120)" tail "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    --durations=10 --continue-on-collection-errors --ignore=tests/kernels/test_kernels_gpu.py \
    ${ignore[@]+"${ignore[@]}"} tests
else
  echo "[gpu_check] pytest not installed: bench/gpu/smoke.py instead of the GPU tests"
  step gpu_smoke "$(limit 90 120)" tail "$PY" -m bench.gpu.smoke
fi

# 3. block_quota sweep and GEMM co-run, line by line.
step transfer_sweep "$(limit 25 95)" live "$PY" -m bench.transfer --quick --part sweep \
  --out "$OUT"
# 4. Benchmarks.
step transfer_grid "$(limit 35 60)" live "$PY" -m bench.transfer --quick --part grid \
  --out "$OUT"
step bench_multiturn "$(limit 60 30)" live "$PY" -m bench --only multiturn --out "$OUT" \
  --summary summary_multiturn.json
step bench_optimistic "$(limit 600 0)" live "$PY" -m bench --only optimistic --out "$OUT" \
  --summary summary_optimistic.json

echo "[gpu_check] done in $((SECONDS - t_start))s; status=$status; files in $OUT"
exit $status
