#!/usr/bin/env bash
# The GPU check: one device command of about 540 s (a device command may run 600 s).
#   bash bench/gpu_check.sh OUT [--plan|--dry-run]   (PYTHON= picks the interpreter)
# --plan prints the steps, limits, total and files back; --dry-run runs the same orchestration on
# a CPU at tiny sizes under the limits x GPU_CHECK_SCALE (0.4). Steps: bench/gpu/plan.py, each in
# its own process under `timeout -k GRACE LIMIT`, told HICACHE_BENCH_DEADLINE; logs, JSON and the
# Triton cache stay in a scratch folder. After every step OUT gets results.tar.gz (all so far),
# status.txt, headline.txt (printed last), profile.json, plan.txt. A probe failure ends the run
# with one line `gpu_check: STOP: <cause>` (exit 3); another failed step gives exit 1 at the end.
# Test hooks: GPU_CHECK_LIMIT_<step>=S overrides a limit; GPU_CHECK_STALL_STEP=<step> hangs that
# step's benchmark after two rows (a step killed at its limit must keep its rows).
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh OUT [--plan|--dry-run]}
MODE=${2:-run}
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac
cd "$(dirname "$0")/.." || exit 2
case "$MODE" in
  run | --plan) PLAN_ARGS=() ;;
  --dry-run) PLAN_ARGS=(--dry-run --scale "${GPU_CHECK_SCALE:-0.4}") ;;
  *) echo "usage: bash bench/gpu_check.sh OUT [--plan|--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}  # the device image's python3; here, the venv where it fits the mode
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && { [ "$MODE" != run ] || .venv/bin/python \
    -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }; then
  PY=.venv/bin/python
fi
if [ "$MODE" = --plan ]; then exec "$PY" bench/gpu/plan.py --render; fi

mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
RES=$WORK/results
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RES"
rm -f "$OUT"/{results.tar.gz,status.txt,headline.txt,profile.json,plan.txt}
export PY RES TRITON_CACHE_DIR=$WORK/triton_cache PYTHONUNBUFFERED=1
# Uninstalled, the project is importable as hicache_prefill.* through a namespace of links.
mkdir -p "$WORK/ns/hicache_prefill" || exit 2
ln -s "$PWD"/kernels "$PWD"/hicache "$PWD"/prefill "$PWD"/server_args.py "$WORK/ns/hicache_prefill/"
export PYTHONPATH="$WORK/ns:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A fresh VM's MemAvailable may still be growing: the host pools may use all but 2 GiB of it.
export HICACHE_HOST_MEMORY_RESERVE_BYTES=${HICACHE_HOST_MEMORY_RESERVE_BYTES:-2147483648}
"$PY" bench/gpu/plan.py --render "${PLAN_ARGS[@]}" > "$OUT/plan.txt"
mapfile -t STEPS < <("$PY" bench/gpu/plan.py --steps "${PLAN_ARGS[@]}")
[ "${#STEPS[@]}" -gt 0 ] || { echo "gpu_check: STOP: bench/gpu/plan.py gave no steps"; exit 3; }
: > "$RES/status.txt"

archive() {  # OUT from the results so far: status, headline, profile, one archive of the rest
  cp "$RES/status.txt" "$OUT/status.txt"
  "$PY" bench/gpu/plan.py --headline "$RES" > "$OUT/headline.txt" 2> "$RES/headline.err"
  cp "$OUT/headline.txt" "$OUT/plan.txt" "$RES/"
  if [ -f "$RES/profile.json" ]; then cp "$RES/profile.json" "$OUT/profile.json"; fi
  tar -czf "$WORK/results.tar.gz" -C "$RES" . && mv -f "$WORK/results.tar.gz" "$OUT/"
}

status=0
for line in "${STEPS[@]}"; do
  IFS=$'\t' read -r name limit margin grace cmd <<< "$line"
  override=GPU_CHECK_LIMIT_$name
  limit=${!override:-$limit}
  stall=0
  if [ "$name" = "${GPU_CHECK_STALL_STEP:-}" ]; then stall=2; fi
  t0=$SECONDS
  HICACHE_BENCH_DEADLINE=$(($(date +%s) + limit - margin)) HICACHE_BENCH_STALL_AFTER_ROWS=$stall \
    timeout -k "$grace" "$limit" bash -c "$cmd" < /dev/null > "$RES/$name.log" 2>&1
  rc=$?
  hit=no
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then hit=yes; fi
  echo "$name rc=$rc seconds=$((SECONDS - t0)) limit=$limit hit_limit=$hit" >> "$RES/status.txt"
  archive
  if [ "$name" = probe ] && [ "$rc" -ne 0 ]; then
    stop=$(grep -m 1 '^gpu_check: STOP:' "$RES/probe.log")
    echo "${stop:-gpu_check: STOP: the probe ended with rc=$rc (hit its ${limit} s limit: $hit); \
see probe.log in results.tar.gz}"
    exit 3
  fi
  echo "[gpu_check] $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s, hit it: $hit)"
  if [ "$rc" -ne 0 ]; then status=1; tail -n 5 "$RES/$name.log" | sed 's/^/    /'; fi
done
echo "[gpu_check] done in $SECONDS s, status $status; in $OUT: $(cd "$OUT" && echo *)"
cat "$OUT/headline.txt"
exit "$status"
