#!/usr/bin/env bash
# One device call for issue 47: the layer's default handle (packed) beside the padded one and
# pplx-kernels by one clock, the layer beside the peer layer, and the GPU suites the kernels'
# change needs. 8 ranks on GPU 0 under MPS. Parts run in PARTS' order until BUDGET seconds
# are spent (a part that would start later is skipped and says so); every file that matters
# is copied to $OUT at the end (at most 8 come back; the rest goes into rest.tgz).
#   GIT_COMMIT=abc1234 PEER=.peer [PARTS="suites loop pplx layer peer"] [TOKENS=1,4,16,32,64,128]
#     [LAYER_TOKENS=1,4,16,128] [BUDGET=540] [LAYER_BUDGET=s] bash scripts/lab/gpu_layer_headline.sh
# LAYER_BUDGET caps the seconds our layer may take (else all but 40 of what is left), so that
# the peer part after it still runs.
# PEER: a copy of shared/peer (an ignored folder, carried); tokamax comes from .whl/ (carried;
# scripts/lab/fetch_wheels.sh fills it).
# Parts:
#   suites  the layout, suite and protocol workers at 8 ranks (gpu_final.sh's steps, no rebuild)
#   loop    bench_loop --variants graph for the layouts of LAYOUTS (default: packed, padded,
#           packed with a capacity of 1.25x the mean load)
#   pplx    pplx-kernels' loop (loop_pplx.py), then loop_compare.py (ours = packed)
#   layer   our layer by one clock (benchmarks/loop_layer.py: forward and forward + backward)
#   peer    the peer layer (benchmarks/layer_pplx.py), then layer_compare.py
set -uo pipefail
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
W=/tmp/w47; mkdir -p "$W"
PY=${PYTHON:-python3}
ROOT=$PWD
TOKENS=${TOKENS:-1,4,16,32,64,128}
LAYER_TOKENS=${LAYER_TOKENS:-1,4,16,128}
KS=${KS:-1,10,50}
PARTS=${PARTS:-suites loop pplx layer peer}
BUDGET=${BUDGET:-540}
START=$(date +%s)
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
quiet() { grep -v "grpc\|GRPC\|WatchTasks\|^\[rank [0-9]\] *$\|Connection refused\|proxy variable"; }
left() { echo $(( BUDGET - $(date +%s) + START )); }
# part NAME NEEDED_S: false (and a line saying so) when fewer than NEEDED_S seconds are left
part() {
  [[ " $PARTS " == *" $1 "* ]] || return 1
  if [ "$(left)" -lt "$2" ]; then echo "-- $1 skipped: $(left) s of the budget left" | tee -a "$W/summary.txt"; return 1; fi
  echo "== $1 at $(( $(date +%s) - START )) s" | tee -a "$W/summary.txt"
}
L8() { echo "$PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout $1 --"; }

echo "== commit ${GIT_COMMIT:?set GIT_COMMIT}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$W/summary.txt"
LOGS=$W bash "$ROOT/scripts/lab/gpu_build.sh" | tee -a "$W/summary.txt" || exit 1
TK_SITE=/tmp/site
if [ -d "$ROOT/.whl" ] && [ ! -d "$TK_SITE/tokamax" ]; then
  $PY -m pip install -q --no-index --no-deps --target "$TK_SITE" "$ROOT"/.whl/*.whl > "$W/whl.log" 2>&1 \
    || echo "-- .whl install failed" | tee -a "$W/summary.txt"
fi
TKP="$TK_SITE${PYTHONPATH:+:$PYTHONPATH}"

if part suites 120; then
  SKIP_BUILD=1 STEPS=${SUITE_STEPS:-"layout_n8 suite_n8 protocol_n8"} BUDGET=$(( $(left) - 300 > 120 ? $(left) - 300 : 120 )) \
    OUT=$W/suites bash "$ROOT/scripts/lab/gpu_final.sh" > "$W/suites.log" 2>&1
  grep -E "^-- |SUITE|FAIL" "$W/suites.log" | head -30 | tee -a "$W/summary.txt"
fi
cd /tmp
if part loop 60; then
  for layout in ${LAYOUTS:-packed padded packed_cap}; do
    args=(--layout "${layout%_cap}")
    [[ $layout == *_cap ]] && args+=(--capacity-factor 1.25)
    [ "$(left)" -lt 45 ] && { echo "-- loop $layout skipped" | tee -a "$W/summary.txt"; continue; }
    timeout $(( $(left) - 10 )) $(L8 $(( $(left) - 15 ))) $PY "$ROOT/benchmarks/bench_loop.py" \
      --out "$W/loop_$layout.json" --tokens "$TOKENS" --ks "$KS" --variants graph --calls 0 \
      --timeline 0 "${args[@]}" 2>&1 | quiet > "$W/loop_$layout.log"
    echo "-- loop $layout rc=$? at $(( $(date +%s) - START )) s" | tee -a "$W/summary.txt"
  done
fi
if part pplx 70; then
  (cd "$ROOT" && timeout $(( $(left) - 5 )) $PY "$PEER/loop_pplx.py" --launch 8 --configs V2Lite,R1 \
     --tokens "$TOKENS" --ks "$KS" --variants graph,eager --timeout $(( $(left) - 10 )) \
     --out "$W/loop_pplx.json" 2>&1 | quiet > "$W/pplx.log")
  echo "-- pplx rc=$? at $(( $(date +%s) - START )) s" | tee -a "$W/summary.txt"
fi
cd "$ROOT"
if [ -f "$W/loop_packed.json" ] && [ -f "$W/loop_pplx.json" ]; then
  args=("ours=$W/loop_packed.json" "pplx=$W/loop_pplx.json")
  for f in padded packed_cap; do [ -f "$W/loop_$f.json" ] && args+=("$f=$W/loop_$f.json"); done
  $PY benchmarks/loop_compare.py "$W/loop_compare.md" "${args[@]}" > /dev/null 2>&1
  cat "$W/loop_compare.md" >> "$W/summary.txt"
fi
if part layer 90; then
  timeout $(( $(left) - 5 )) env PYTHONPATH="$TKP" $(L8 $(( $(left) - 10 ))) $PY \
    "$ROOT/benchmarks/loop_layer.py" --tokens "$LAYER_TOKENS" --commit "$GIT_COMMIT" \
    --budget-s $(( $(left) - 40 < ${LAYER_BUDGET:-100000} ? $(left) - 40 : ${LAYER_BUDGET:-100000} )) \
    --out "$W/layer_ours.json" ${LAYER_ARGS:-} 2>&1 | quiet \
    > "$W/layer_ours.log"
  echo "-- layer rc=$? at $(( $(date +%s) - START )) s" | tee -a "$W/summary.txt"
  grep "rank 0\]" "$W/layer_ours.log" | tail -25 | tee -a "$W/summary.txt"
  cp "$W/layer_ours.json" "$OUT/" 2>/dev/null  # back even if a later part outruns the call
fi
if part peer 70; then
  timeout $(( $(left) - 5 )) $PY benchmarks/layer_pplx.py --launch 8 --peer "$PEER" \
    --tokens "$LAYER_TOKENS" --budget-s $(( $(left) - 40 )) --timeout $(( $(left) - 10 )) \
    --out "$W/layer_pplx.json" ${PEER_ARGS:-} 2>&1 | quiet > "$W/layer_pplx.log"
  echo "-- peer rc=$? at $(( $(date +%s) - START )) s" | tee -a "$W/summary.txt"
  tail -25 "$W/layer_pplx.log" | tee -a "$W/summary.txt"
fi
if [ -f "$W/layer_ours.json" ] && [ -f "$W/layer_pplx.json" ]; then
  $PY benchmarks/layer_compare.py "$W/layer_compare.md" ours="$W/layer_ours.json" \
    pplx="$W/layer_pplx.json" > "$W/layer_compare.log" 2>&1
  tee -a "$W/summary.txt" < "$W/layer_compare.md" 2>/dev/null
fi
echo "== done in $(( $(date +%s) - START )) s" | tee -a "$W/summary.txt"
# What comes back: the summary, the JSONs, the comparisons; every log in rest.tgz.
cp "$W"/summary.txt "$W"/loop_*.json "$W"/layer_*.json "$W"/*compare.md "$W"/*compare.png "$OUT"/ 2>/dev/null
mkdir -p "$W/logs"; cp "$W"/*.log "$W/logs/" 2>/dev/null; cp -r "$W/suites" "$W/logs/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$W" logs
OUT=$OUT bash "$ROOT/scripts/lab/gpu_pack.sh" summary.txt 'loop_packed.json' 'loop_padded.json' \
  'loop_pplx.json' 'layer_ours.json' 'layer_pplx.json' 'loop_compare.md'
