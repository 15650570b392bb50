#!/usr/bin/env bash
# Build on the GPU machine and run the GPU suites (and optionally the benchmark) in one go.
#   STAGES="suite protocol protocol_full exit nocmdbuf grad_nocmdbuf sanitizer grad layout server \
#           demo decode bench" bash scripts/lab/gpu_check.sh
# Defaults: every stage but decode and bench. RANKS (default "1 2 4 8") for the suites, QUICK=1 for the
# short versions, BENCH_ARGS for the benchmark. Logs go to $OUT (or ./gpu_logs). Uses the
# machine's python3 and its jax/nanobind/nvshmem.
set -uo pipefail
STAGES=${STAGES:-suite protocol exit nocmdbuf sanitizer demo}
OUT=${OUT:-$PWD/gpu_logs}
export LOGS=$OUT/logs  # one file per stage; packed into $OUT/logs.tgz at the end
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
ROOT=$PWD
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }

echo "== commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import jax, nvidia.nvshmem as n; print('jax', jax.__version__, 'nvshmem at', list(n.__path__)[0])"

echo "== build"
bash "$ROOT/scripts/lab/gpu_build.sh" || exit 1
cd /tmp  # import the installed package, not the source tree
$PY -c "import jax_moe_comm.native as n; print('native:', n.unavailable_reason() or 'available')"

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  grep -E "PASS|FAIL|SUITE|SOAK|TEST|ERROR SUMMARY|RACECHECK SUMMARY|Error|error:|max_err|rank [0-9]+ (after|reported|exits)|rank 0\] (config|result|R1|V2)" \
    "$LOGS/$name.log" | grep -v "JAX detected proxy" | head -60
  echo "-- $name rc=$rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || { status=1; grep -v "grpc\|GRPC\|WatchTasks\|^\[rank [0-9]\] *$" "$LOGS/$name.log" | tail -25; }
}
launch() {  # n, timeout: the launcher's command line (run() needs a program, not a function)
  echo "$PY -m jax_moe_comm.launch -n $1 --oversubscribe --timeout $2 --"
}

Q=""; [ -n "${QUICK:-}" ] && Q="--quick"
if has suite; then
  for n in ${RANKS:-1 2 4 8}; do
    run "gpu_suite_n$n" 400 $(launch "$n" 380) $PY "$ROOT/tests/gpu_worker.py" $Q --steps ${STEPS:-100}
  done
fi
if has protocol; then
  for n in ${PROTOCOL_RANKS:-4 2 8}; do
    run "protocol_n$n" 500 $(launch "$n" 480) $PY "$ROOT/tests/gpu_protocol_worker.py" $Q
  done
fi
if has protocol_full; then  # 200 cycles per DP layout and the 1000-cycle soak, 4 ranks
  run protocol_n4_full 500 $(launch 4 480) $PY "$ROOT/tests/gpu_protocol_worker.py"
fi
if has exit; then
  run protocol_exit_n4 120 $(launch 4 100) $PY "$ROOT/tests/gpu_protocol_worker.py" --exit-test
fi
if has nocmdbuf; then  # command buffers (CUDA graphs) off: the same results
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run gpu_suite_n2_nocmdbuf 300 \
    $(launch 2 280) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 10
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run protocol_n2_nocmdbuf 300 \
    $(launch 2 280) $PY "$ROOT/tests/gpu_protocol_worker.py" --quick
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run gpu_server_worker_n2_nocmdbuf 300 \
    $(launch 2 280) $PY "$ROOT/tests/gpu_server_worker.py"
fi
if has grad_nocmdbuf; then  # gradients and 50 training steps with command buffers off
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run grad_n2_nocmdbuf 400 \
    $(launch 2 380) $PY "$ROOT/tests/gpu_grad_worker.py" --quick
fi
if has sanitizer; then  # out-of-bounds accesses and shared-memory races (N=2, tiny shapes)
  for tool in memcheck racecheck; do
    run "${tool}_n2" 300 $(launch 2 280) compute-sanitizer --tool $tool --print-limit 20 \
      $PY "$ROOT/tests/gpu_worker.py" --quick --steps 2
  done
fi
for w in "$ROOT"/tests/gpu_*_worker.py; do  # workers of other features (grad, layout, ...)
  name=$(basename "$w" .py)
  case "$name" in gpu_protocol_worker) continue;; esac
  stage=${name#gpu_}; has "${stage%_worker}" || continue  # tests/gpu_grad_worker.py: stage grad
  for n in ${EXTRA_RANKS:-2 8}; do run "${name}_n$n" 400 $(launch "$n" 380) $PY "$w" $Q; done
done
if has demo; then
  run demo_n8 300 $(launch 8 280) $PY -m jax_moe_comm.demo --steps 20
fi
if has decode; then  # the jitted MoE layer at decode sizes, command buffers on and off
  run decode_n8 300 $(launch 8 280) $PY "$ROOT/benchmarks/bench_decode.py" --out "$OUT" \
    --label cmdbuf-on ${DECODE_ARGS:-}
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run decode_n8_nocmdbuf 300 $(launch 8 280) \
    $PY "$ROOT/benchmarks/bench_decode.py" --out "$OUT" --label cmdbuf-off ${DECODE_ARGS:-}
fi
if has bench; then
  run bench_n8 590 $(launch 8 580) $PY "$ROOT/benchmarks/bench_all_to_all.py" --out "$OUT" ${BENCH_ARGS:-}
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
echo "== overall status $status"
exit $status
