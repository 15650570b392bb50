#!/usr/bin/env bash
# The session's closing device call, most important first (a call that runs out of time keeps
# what it wrote): build, the GPU suite, the server suite (issue 28), the protocol suite, the
# Flax worker and the parity worker (issue 26), the DeepSeek-style decode example at 8 ranks,
# then a per-cycle sanity run of the loop benchmark (LOOP=tokens). Logs in $OUT (<= 8 files
# come back). STEPS picks steps by name (the case list below: also the soak, the sanitizers and
# the server suite with command buffers off).
#   GIT_COMMIT=abc1234 bash scripts/lab/gpu_final.sh
#   GIT_COMMIT=abc1234 STEPS="server_n2 soak_n2 memcheck_n2" BUDGET=500 bash scripts/lab/gpu_final.sh
# Issue 24's figures (the layer step against its floor at 8 ranks, and the grouped-GEMM
# diagnosis on one process; tokamax from the wheels in .whl/, carried with the tree):
#   GIT_COMMIT=abc1234 STEPS="layer_n8 gemm_n1" BUDGET=560 bash scripts/lab/gpu_final.sh
#   -> $OUT/layer_n8.{json,md,png}, $OUT/gemm.{json,md}, summary.txt, final_logs.tgz
set -uo pipefail
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
ROOT=$PWD
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 LOGS=/tmp/final_logs
# JAX's persistent compilation cache across the call's steps: a step that compiles what an
# earlier one did (same ranks, same XLA_FLAGS; e.g. grad_n8@staged then grad_n8@staged:4) skips
# XLA's compiles (2026-12-06, H100: that pair's second cell 32 s instead of 119 s). Set
# JAX_COMPILATION_CACHE_DIR= (empty) for none.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-/tmp/jmc_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
mkdir -p "$LOGS"
# ONE_RANK_PER_GPU=1 (a machine with a GPU per rank, e.g. nvidia-h100-x2): no MPS, rank r on
# GPU r, so peers meet over NVLink, where an early overwrite by relaxed acks could show.
OVERSUBSCRIBE=--oversubscribe; [ "${ONE_RANK_PER_GPU:-0}" = 1 ] && OVERSUBSCRIBE=
L() { echo "$PY -m jax_moe_comm.launch -n $1 $OVERSUBSCRIBE --timeout $2 --"; }
START=$(date +%s)
BUDGET=${BUDGET:-400}  # seconds: a step that would start later is skipped (the call must end)
step() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) left=$(( BUDGET - $(date +%s) + START ))
  if [ "$left" -lt 30 ]; then
    echo "-- $name skipped: ${left} s of the budget left" | tee -a "$OUT/summary.txt"
    gate_line FAIL "$name not run: ${left} s of the budget left"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  gate_step "$name" "$rc" "$(( $(date +%s) - t0 ))"
  { grep -E "PASS|FAIL|SUITE PASSED|SUITE FAILED|SOAK|per token|latency|logits|ERROR SUMMARY|RACECHECK SUMMARY|us/cycle|graph |ratio |fwd\+bwd|bench_layer:|bench_gemm:" "$LOGS/$name.log" \
      | grep -v "JAX detected proxy" | head -40
    echo "-- $name rc=$rc in $(( $(date +%s) - t0 )) s"; } | tee -a "$OUT/summary.txt"
  tar czf "$OUT/final_logs.tgz" -C /tmp final_logs  # kept as it goes: a cut call keeps it
}
left() { echo $(( BUDGET - $(date +%s) + START )); }
# GATE_FILE (scripts/lab/gpu_gate.sh): one line per step and per sanitizer summary, each
# starting PASS or FAIL and naming the commit. A step passes when it exits 0; a sanitizer
# summary line passes when it counts 0 errors or hazards.
gate_line() { [ -n "${GATE_FILE:-}" ] && echo "$1 $2 @ $GIT_COMMIT" >> "$GATE_FILE"; return 0; }
gate_step() {  # name, rc, seconds
  [ -n "${GATE_FILE:-}" ] || return 0
  local verdict=FAIL; [ "$2" = 0 ] && verdict=PASS
  gate_line $verdict "$1 rc=$2 in $3 s"
  # a step's own unprefixed case lines (serve_cases.sh's); the workers' are "[rank r] PASS ..."
  grep -hE "^(PASS|FAIL) " "$LOGS/$1.log" | cut -c1-200 | while read -r line; do
    gate_line "${line%% *}" "  ${line#* }"; done
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS/$1.log" | sed 's/=* *//' | while read -r line; do
    if [[ $line =~ SUMMARY:\ 0\ (errors|hazards) ]]; then gate_line PASS "$1 $line"
    else gate_line FAIL "$1 $line"; fi
  done
}
TK_SITE=/tmp/site
tokamax_site() {  # tokamax and what it needs, carried as wheels in .whl/ (no registry there)
  if [ -d "$ROOT/.whl" ] && [ ! -d "$TK_SITE/tokamax" ]; then
    $PY -m pip install -q --no-index --no-deps --target "$TK_SITE" "$ROOT"/.whl/*.whl \
      > "$LOGS/whl.log" 2>&1 || echo "-- .whl install failed (tokamax rows say why)" | tee -a "$OUT/summary.txt"
    # said once, loudly: the grad suite skips its tokamax cases and still passes without it
    PYTHONPATH="$TK_SITE${PYTHONPATH:+:$PYTHONPATH}" $PY -c "import tokamax" >> "$LOGS/whl.log" \
      2>&1 || echo "-- tokamax" \
      "does not import (no tokamax cases or rows): $(tail -1 "$LOGS/whl.log")" | tee -a "$OUT/summary.txt"
  fi
}
echo "== commit ${GIT_COMMIT:?set GIT_COMMIT}, $(date -u +%FT%TZ)"
# SKIP_BUILD=1: a caller (gpu_layer_headline.sh) built this tree already
[ "${SKIP_BUILD:-0}" = 1 ] || bash "$ROOT/scripts/lab/gpu_build.sh" || exit 1
cd /tmp
# STEPS picks and orders the steps (default: the list below without the soak and sanitizers).
STEPS=${STEPS:-suite_n2 server_n2 server_n8 suite_n8 protocol_n4 flax_n8 parity_n2 decode_n8}
# --error-exitcode: a finding fails the step (its rc), not only its summary line
SAN="compute-sanitizer --error-exitcode 1 --print-limit 20 --tool"
# A step is <what>_n<ranks>[_nocmdbuf][@<JMC_TRANSPORT>], e.g. suite_n8@staged,
# server_n8_nocmdbuf, protocol_n4@staged:2 (issue 25): _nocmdbuf turns XLA's command buffers
# off, @... sets JMC_TRANSPORT for every rank.
for s in $STEPS; do
  name=${s%@*}; vars=()
  [[ $s == *@* ]] && vars+=("JMC_TRANSPORT=${s#*@}")
  if [[ $name == *_nocmdbuf ]]; then
    vars+=("XLA_FLAGS=--xla_gpu_enable_command_buffer="); name=${name%_nocmdbuf}
  fi
  what=${name%_n*}; n=${name##*_n}
  if ! [[ $n =~ ^[0-9]+$ ]]; then echo "-- unknown step $s" | tee -a "$OUT/summary.txt"; continue; fi
  E=(env "${vars[@]}")
  case $what in
  suite) step $s 200 "${E[@]}" $(L $n ${SUITE_TIMEOUT:-190}) $PY "$ROOT/tests/gpu_worker.py" --quick --steps 20 ${SUITE_ARGS:-} ;;
  server) step $s 200 "${E[@]}" $(L $n 190) $PY "$ROOT/tests/gpu_server_worker.py" ;;
  protocol) step $s 200 "${E[@]}" $(L $n 190) $PY "$ROOT/tests/gpu_protocol_worker.py" --quick ;;
  grad) tokamax_site  # packed layers run tokamax's GEMM (grouped_vjp's backward) where it imports
    # (GRAD_ARGS, e.g. "--only fp8": the cases whose names hold one of the substrings)
    step $s 300 "${E[@]}" PYTHONPATH="$TK_SITE${PYTHONPATH:+:$PYTHONPATH}" $(L $n 290) $PY \
      "$ROOT/tests/gpu_grad_worker.py" --quick ${GRAD_ARGS:-} ;;
  soak)  # 10^6 cycles at 2 ranks (~50 s); fewer where ranks share the GPU more
    if [ "$n" -le 2 ]; then soak_args=${SOAK_ARGS:-}; else soak_args=${SOAK8_ARGS:---cycles 200000}; fi
    step $s 300 "${E[@]}" $(L $n 290) $PY "$ROOT/tests/gpu_soak_worker.py" $soak_args ;;
  memcheck|racecheck) step $s 240 "${E[@]}" $(L $n 230) $SAN $what $PY "$ROOT/tests/gpu_worker.py" \
      --quick --steps 2 ;;
  loop) step $s 300 "${E[@]}" $(L $n 290) $PY "$ROOT/benchmarks/bench_loop.py" \
      --tokens ${LOOP_TOKENS:-1,16,128} --calls 0 --timeline 0 --variants graph \
      --out "$OUT/${s//[@:]/_}.json" ;;
  flax) step $s 240 "${E[@]}" $(L $n 230) $PY "$ROOT/tests/gpu_flax_worker.py" ${FLAX_ARGS:-} ;;
  layout)  # packed layout, capacity drop/fail (issue 24), NaN weights, the layer on both layouts
    step $s 240 "${E[@]}" $(L $n 230) $PY "$ROOT/tests/gpu_layout_worker.py" --quick ;;
  serve)  # issue 48: examples/serve_decode.py's faults, the killed rank and the restart
    step $s 240 "${E[@]}" bash "$ROOT/scripts/lab/serve_cases.sh" $n ;;
  parity) step $s 200 "${E[@]}" $(L $n 190) $PY "$ROOT/tests/gpu_parity_worker.py" ;;
  decode) step $s 240 "${E[@]}" $(L $n 230) $PY "$ROOT/examples/deepseek_decode.py" ${DECODE_ARGS:-} ;;
  layer)  # issue 24: the layer step vs its floor; rows not started within its budget are
    # recorded as skipped (it leaves GEMM_RESERVE s for a gemm step after it)
    tokamax_site
    reserve=0; [[ " $STEPS " == *" gemm_n"* ]] && reserve=${GEMM_RESERVE:-170}
    lb=$(( $(left) - reserve - 45 )); [ "$lb" -gt "${LAYER_BUDGET:-300}" ] && lb=${LAYER_BUDGET:-300}
    [ "$lb" -lt 30 ] && lb=30
    step $s $(( lb + 45 )) "${E[@]}" PYTHONPATH="$TK_SITE${PYTHONPATH:+:$PYTHONPATH}" \
      $(L $n $(( lb + 40 ))) $PY "$ROOT/benchmarks/bench_layer.py" \
      --tokens ${LAYER_TOKENS:-1,16,128,512,1024,2048,4096} --budget-s $lb \
      --commit "$GIT_COMMIT" --name "${s//[@:]/_}" --out "$OUT" ${LAYER_ARGS:-} ;;
  gemm)  # issue 24: grouped-GEMM options on one process with each output's error (tokamax was
    # wrong at 128 tokens: 128 first); tokamax = its Mosaic kernel on the H200, _xla its XLA path
    tokamax_site
    gb=$(( $(left) - 30 )); [ "$gb" -gt "${GEMM_BUDGET:-150}" ] && gb=${GEMM_BUDGET:-150}
    step $s $(( gb + 40 )) "${E[@]}" PYTHONPATH="$TK_SITE${PYTHONPATH:+:$PYTHONPATH}" \
      $PY "$ROOT/benchmarks/bench_gemm.py" --configs V2Lite,R1 --tokens ${GEMM_TOKENS:-128,16,1} \
      --options ${GEMM_OPTIONS:-einsum,tokamax,tokamax_alignedwgrad,tokamax_kernelwgrad} \
      --budget-s $gb --out "$OUT" ${GEMM_ARGS:-} ;;
  prefill)  # issue 24: dispatch + combine at prefill sizes by one clock, ours on packed rows
    # (the padded worst case does not fit at 4096), pplx-kernels (PEER: a copy of shared/peer,
    # carried) where it allocates; K back-to-back cycles in one recorded graph, slope over K
    pt=${PREFILL_TOKENS:-512,1024,2048}; ks=${PREFILL_KS:-1,3,6}
    la="--calls 0 --timeline 0 --variants graph --reps 3 --layout packed"
    step $s 200 "${E[@]}" $(L $n 190) $PY "$ROOT/benchmarks/bench_loop.py" --tokens $pt \
      --ks $ks $la --out "$OUT/prefill_ours.json"
    if [ -n "${PREFILL_CAP_TOKENS:-4096}" ]; then  # with a capacity (1.25 x the mean load)
      step ${s}_cap 150 "${E[@]}" $(L $n 140) $PY "$ROOT/benchmarks/bench_loop.py" \
        --configs R1 --tokens ${PREFILL_CAP_TOKENS:-4096} --ks $ks $la --capacity-factor 1.25 \
        --out "$OUT/prefill_ours_cap.json"
    fi
    if [ -n "${PEER:-}" ]; then
      step ${s}_pplx 240 env "${vars[@]}" $PY "$ROOT/$PEER/loop_pplx.py" --launch $n \
        --configs V2Lite,R1 --tokens ${PREFILL_PPLX_TOKENS:-512,1024} --ks $ks --reps 3 \
        --variants graph --timeout 230 --out "$OUT/prefill_pplx.json"
      [ -f "$OUT/prefill_pplx.json" ] && (cd "$ROOT" && $PY benchmarks/loop_compare.py \
        "$OUT/prefill_compare.md" ours=$OUT/prefill_ours.json pplx=$OUT/prefill_pplx.json \
        >> "$LOGS/prefill_compare.log" 2>&1; rm -f "$OUT/prefill_compare.png")
    fi ;;
  *) echo "-- unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
cd "$ROOT"
if [ -n "${LOOP:-}" ] && [ $(( BUDGET - $(date +%s) + START )) -gt 60 ]; then
  TOKENS=${LOOP} bash scripts/lab/gpu_loop.sh > "$LOGS/loop.log" 2>&1
  grep "graph " "$LOGS/loop.log" | head -12
  cp /tmp/w/loop_ours.json "$OUT/" 2>/dev/null
fi
tar czf "$OUT/final_logs.tgz" -C /tmp final_logs
echo "== done in $(( $(date +%s) - START )) s"
