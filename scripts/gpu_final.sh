#!/usr/bin/env bash
# The session's closing device call, most important first (a call that runs out of time keeps
# what it wrote): build, the GPU suite, the server suite (issue 28), the protocol suite, the
# Flax worker and the parity worker (issue 26), the DeepSeek-style decode example at 8 ranks,
# then a per-cycle sanity run of the loop benchmark. Logs in $OUT (<= 8 files come back).
#   GIT_COMMIT=abc1234 bash scripts/gpu_final.sh
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
  { grep -E "PASS|FAIL|SUITE PASSED|SUITE FAILED|per token|latency|logits" "$LOGS/$name.log" \
      | grep -v "JAX detected proxy" | head -40
    echo "-- $name rc=$rc in $(( $(date +%s) - t0 )) s"; } | tee -a "$OUT/summary.txt"
  tar czf "$OUT/final_logs.tgz" -C /tmp final_logs
echo "== done in $(( $(date +%s) - START )) s"
}
echo "== commit ${GIT_COMMIT:?set GIT_COMMIT}, $(date -u +%FT%TZ)"
bash "$ROOT/scripts/gpu_build.sh" || exit 1
cd /tmp
step gpu_suite_n2 200 $(L 2 190) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 20
step server_n2 200 $(L 2 190) $PY "$ROOT/tests/gpu_server_worker.py"
step server_n8 200 $(L 8 190) $PY "$ROOT/tests/gpu_server_worker.py"
step gpu_suite_n8 200 $(L 8 190) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 20
step protocol_n4 200 $(L 4 190) $PY "$ROOT/tests/gpu_protocol_worker.py" --quick
[ -f "$ROOT/tests/gpu_flax_worker.py" ] && step flax_n8 240 $(L 8 230) $PY "$ROOT/tests/gpu_flax_worker.py" ${FLAX_ARGS:-}
[ -f "$ROOT/tests/gpu_parity_worker.py" ] && step parity_n2 200 $(L 2 190) $PY "$ROOT/tests/gpu_parity_worker.py"
[ -f "$ROOT/examples/deepseek_decode.py" ] && step decode_n8 240 $(L 8 230) $PY "$ROOT/examples/deepseek_decode.py" ${DECODE_ARGS:-}
cd "$ROOT"
if [ -n "${LOOP:-}" ] && [ $(( BUDGET - $(date +%s) + START )) -gt 60 ]; then
  TOKENS=${LOOP} bash scripts/gpu_loop.sh > "$LOGS/loop.log" 2>&1
  grep "graph " "$LOGS/loop.log" | head -12
  cp /tmp/w/loop_ours.json "$OUT/" 2>/dev/null
fi
tar czf "$OUT/final_logs.tgz" -C /tmp final_logs
echo "== done in $(( $(date +%s) - START )) s"
