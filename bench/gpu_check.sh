#!/usr/bin/env bash
# One-shot check on a machine with an NVIDIA GPU: GPU-marked tests, then the quick size of every
# benchmark. Logs and JSON go to the folder given as the first argument. Needs only the installed
# torch (CUDA build) and triton; pytest, hypothesis and matplotlib are used when present.
# Budget: about 8 minutes on one H100/H200 (each step has its own timeout).
#
#   bash bench/gpu_check.sh OUT_DIR
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
status=0
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "[gpu_check] $name (limit ${limit}s) ..."
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[gpu_check] $name rc=$rc in $((SECONDS - t0))s; last lines:"
  tail -n 25 "$OUT/$name.log" | sed 's/^/    /'
  [ "$rc" -eq 0 ] || status=1
}

{
  nvidia-smi 2>&1 || echo "nvidia-smi not found"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'device', torch.cuda.get_device_name() \
if torch.cuda.is_available() else 'NO CUDA')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tail -n 3

if "$PY" -c "import pytest" 2>/dev/null; then
  # Modules that need an optional test dependency are reported, not fatal to the others.
  step gpu_tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    --continue-on-collection-errors tests
else
  echo "[gpu_check] pytest not installed: GPU tests skipped" | tee "$OUT/gpu_tests.log"
fi

step bench 330 "$PY" -m bench --out "$OUT"

echo "[gpu_check] done; status=$status; files in $OUT"
exit $status
