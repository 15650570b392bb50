#!/usr/bin/env bash
# The session's closing device call, most important first (a call that runs out of time keeps
# what it wrote): build, the GPU suite, the server suite (issue 28), the protocol suite, the
# Flax worker and the parity worker (issue 26), the DeepSeek-style decode example at 8 ranks,
# then a per-cycle sanity run of the loop benchmark (LOOP=tokens). Logs in $OUT (<= 8 files
# come back). STEPS picks steps by name (the case list below: also the soak, the sanitizers and
# the server suite with command buffers off).
#   GIT_COMMIT=abc1234 bash scripts/gpu_final.sh
#   GIT_COMMIT=abc1234 STEPS="server_n2 soak_n2 memcheck_n2" BUDGET=500 bash scripts/gpu_final.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
ROOT=$PWD
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 LOGS=/tmp/final_logs
mkdir -p "$LOGS"
L() { echo "$PY -m jax_moe_comm.launch -n $1 --oversubscribe --timeout $2 --"; }
START=$(date +%s)
BUDGET=${BUDGET:-400}  # seconds: a step that would start later is skipped (the call must end)
step() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) left=$(( BUDGET - $(date +%s) + START ))
  if [ "$left" -lt 30 ]; then echo "-- $name skipped: ${left} s of the budget left" | tee -a "$OUT/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  { grep -E "PASS|FAIL|SUITE PASSED|SUITE FAILED|SOAK|per token|latency|logits|ERROR SUMMARY|RACECHECK SUMMARY|us/cycle|graph " "$LOGS/$name.log" \
      | grep -v "JAX detected proxy" | head -40
    echo "-- $name rc=$rc in $(( $(date +%s) - t0 )) s"; } | tee -a "$OUT/summary.txt"
  tar czf "$OUT/final_logs.tgz" -C /tmp final_logs  # kept as it goes: a cut call keeps it
}
echo "== commit ${GIT_COMMIT:?set GIT_COMMIT}, $(date -u +%FT%TZ)"
bash "$ROOT/scripts/gpu_build.sh" || exit 1
cd /tmp
# STEPS picks and orders the steps (default: the list below without the soak and sanitizers).
STEPS=${STEPS:-suite_n2 server_n2 server_n8 suite_n8 protocol_n4 flax_n8 parity_n2 decode_n8}
NOCB="env XLA_FLAGS=--xla_gpu_enable_command_buffer="
SAN="compute-sanitizer --print-limit 20 --tool"
# A step name may end in @<JMC_TRANSPORT>: suite_n8@staged, protocol_n4@staged:2 (issue 25).
for s in $STEPS; do
  T=""; [[ $s == *@* ]] && T="env JMC_TRANSPORT=${s#*@}"
  case ${s%@*} in
  suite_n2) step $s 200 $T $(L 2 190) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 20 ;;
  suite_n4) step $s 200 $T $(L 4 190) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 20 ;;
  suite_n8) step $s 200 $T $(L 8 190) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 20 ;;
  server_n2|server_n8) step $s 200 $T $(L ${s:8:1} 190) $PY "$ROOT/tests/gpu_server_worker.py" ;;
  server_n2_nocmdbuf) step $s 200 $NOCB $(L 2 190) $PY "$ROOT/tests/gpu_server_worker.py" ;;
  server_n8_nocmdbuf) step $s 200 $NOCB $(L 8 190) $PY "$ROOT/tests/gpu_server_worker.py" ;;
  protocol_n2|protocol_n4|protocol_n8) step $s 200 $T $(L ${s:10:1} 190) $PY "$ROOT/tests/gpu_protocol_worker.py" --quick ;;
  suite_n2_nocmdbuf) step $s 200 $T $NOCB $(L 2 190) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 10 ;;
  protocol_n2_nocmdbuf) step $s 200 $T $NOCB $(L 2 190) $PY "$ROOT/tests/gpu_protocol_worker.py" --quick ;;
  grad_n2) step $s 300 $T $(L 2 290) $PY "$ROOT/tests/gpu_grad_worker.py" --quick ;;
  soak_n2) step $s 300 $T $(L 2 290) $PY "$ROOT/tests/gpu_soak_worker.py" ${SOAK_ARGS:-} ;;
  soak_n8) step $s 300 $T $(L 8 290) $PY "$ROOT/tests/gpu_soak_worker.py" ${SOAK8_ARGS:---cycles 200000} ;;
  memcheck_n2) step $s 240 $T $(L 2 230) $SAN memcheck $PY "$ROOT/tests/gpu_worker.py" --quick --steps 2 ;;
  racecheck_n2) step $s 240 $T $(L 2 230) $SAN racecheck $PY "$ROOT/tests/gpu_worker.py" --quick --steps 2 ;;
  loop_n8) step $s 300 $T $(L 8 290) $PY "$ROOT/benchmarks/bench_loop.py" --tokens ${LOOP_TOKENS:-1,16,128} \
      --calls 0 --timeline 0 --variants graph --out "$OUT/loop_${s/@/_}.json" ;;
  flax_n8) step $s 240 $(L 8 230) $PY "$ROOT/tests/gpu_flax_worker.py" ${FLAX_ARGS:-} ;;
  parity_n2) step $s 200 $(L 2 190) $PY "$ROOT/tests/gpu_parity_worker.py" ;;
  decode_n8) step $s 240 $(L 8 230) $PY "$ROOT/examples/deepseek_decode.py" ${DECODE_ARGS:-} ;;
  *) echo "-- unknown step $s" | tee -a "$OUT/summary.txt" ;;
esac; done
cd "$ROOT"
if [ -n "${LOOP:-}" ] && [ $(( BUDGET - $(date +%s) + START )) -gt 60 ]; then
  TOKENS=${LOOP} bash scripts/gpu_loop.sh > "$LOGS/loop.log" 2>&1
  grep "graph " "$LOGS/loop.log" | head -12
  cp /tmp/w/loop_ours.json "$OUT/" 2>/dev/null
fi
tar czf "$OUT/final_logs.tgz" -C /tmp final_logs
echo "== done in $(( $(date +%s) - START )) s"
