#!/usr/bin/env bash
# Build on the GPU machine and run the GPU suite (and optionally the benchmark) in one go.
#   bash scripts/gpu_check.sh [quick|full] [bench]
# Logs go to $OUT (or ./gpu_logs). Uses the machine's python3 and its jax/nanobind/nvshmem.
set -uo pipefail
MODE=${1:-full}
BENCH=${2:-}
OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1
status=0

echo "== commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import jax, nvidia.nvshmem as n; print('jax', jax.__version__, 'nvshmem at', list(n.__path__)[0])"

echo "== build"
bash "$(dirname "$0")/gpu_build.sh" || exit 1
cd /tmp  # import the installed package, not the source tree
$PY -c "import jax_moe_comm.native as n; print('native:', n.unavailable_reason() or 'available')"

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "PASS|FAIL|SUITE|Error|error:|max_err|rank 0\] (config|result)" "$OUT/$name.log" | head -60
  echo "-- $name rc=$rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || { status=1; tail -30 "$OUT/$name.log"; }
}

WORKER="$OLDPWD/tests/gpu_worker.py"
Q=""; [ "$MODE" = quick ] && Q="--quick"
for n in ${RANKS:-1 2 4 8}; do
  run "gpu_suite_n$n" 400 $PY -m jax_moe_comm.launch -n $n --oversubscribe --timeout 380 -- \
    $PY "$WORKER" $Q --steps ${STEPS:-100}
done
# Command buffers (CUDA graphs) off: the same results.
XLA_FLAGS=--xla_gpu_enable_command_buffer= run gpu_suite_n2_nocmdbuf 300 \
  $PY -m jax_moe_comm.launch -n 2 --oversubscribe --timeout 280 -- $PY "$WORKER" --quick --steps 10
# Gradients (issue 11): nvshmem against each rank's oracle and dense layer, 50 training steps,
# command buffers on and off.
GRAD="$OLDPWD/tests/gpu_grad_worker.py"
for n in ${GRAD_RANKS:-2 8}; do
  run "gpu_grad_n$n" 900 $PY -m jax_moe_comm.launch -n $n --oversubscribe --timeout 880 -- \
    $PY "$GRAD" $Q --steps 50
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run "gpu_grad_n${n}_nocmdbuf" 900 \
    $PY -m jax_moe_comm.launch -n $n --oversubscribe --timeout 880 -- $PY "$GRAD" --quick --steps 50
done
run demo_train_n8 300 $PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout 280 -- \
  $PY -m jax_moe_comm.demo --train --steps 20
run demo_n8 300 $PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout 280 -- \
  $PY -m jax_moe_comm.demo --steps 20
if [ -n "$BENCH" ]; then
  run bench_n8 580 $PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout 560 -- \
    $PY "$OLDPWD/benchmarks/bench_all_to_all.py" --out "$OUT" ${BENCH_ARGS:-}
fi
echo "== overall status $status"
exit $status
