#!/usr/bin/env bash
# One device call for issue 23's proof: our loop timing (benchmarks/bench_loop.py) and
# pplx-kernels' (shared/peer/loop_pplx.py) by one clock, optionally an older build of ours, then
# benchmarks/loop_compare.py. 8 ranks on GPU 0 under MPS.
#   GIT_COMMIT=abc1234 PEER=.peer [OLD_SRC=.old OLD_COMMIT=8a9226e] [TOKENS=1,4,16,32,64,128] \
#     [LOOP_ARGS="--reps 5"] bash scripts/lab/gpu_loop.sh
# PEER: a copy of shared/peer (an ignored folder, carried); OLD_SRC: an unpacked `git archive`
# of the older commit (it must have bench_loop.py). Work files in /tmp/w, the <= 8 that matter
# copied to $OUT at the end (the device returns at most 8 files).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
W=/tmp/w; mkdir -p "$W"
PY=${PYTHON:-python3}
ROOT=$PWD
TOKENS=${TOKENS:-1,4,16,32,64,128}
KS=${KS:-1,10,50}
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
quiet() { grep -v "grpc\|GRPC\|WatchTasks\|^\[rank [0-9]\] *$\|Connection refused\|proxy variable"; }

LOGS=$W bash "$ROOT/scripts/lab/gpu_build.sh" || exit 1
cd /tmp
echo "== ours (${GIT_COMMIT:?set GIT_COMMIT})"
timeout 450 $PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout 440 -- \
  $PY "$ROOT/benchmarks/bench_loop.py" --out "$W/loop_ours.json" --tokens "$TOKENS" --ks "$KS" \
  ${LOOP_ARGS:-} 2>&1 | quiet | tee "$W/ours.log" | grep "rank 0\]"
if [ -n "${OLD_SRC:-}" ]; then
  echo "== ours at ${OLD_COMMIT:-old}"
  SRC="$ROOT/$OLD_SRC" TARGET=/tmp/oldsite BUILD_DIR=/tmp/jmc_old LOG="$W/old_build.log" \
    bash "$ROOT/scripts/lab/gpu_build.sh" || exit 1
  PYTHONPATH=/tmp/oldsite GIT_COMMIT=${OLD_COMMIT:-old} timeout 450 $PY -m jax_moe_comm.launch \
    -n 8 --oversubscribe --timeout 440 -- $PY "$ROOT/$OLD_SRC/benchmarks/bench_loop.py" \
    --out "$W/loop_old.json" --tokens "$TOKENS" --ks "$KS" --calls 0 --timeline 0 \
    ${LOOP_ARGS:-} 2>&1 | quiet | tee "$W/old.log" | grep "rank 0\]"
fi
if [ -n "${PEER:-}" ]; then
  echo "== pplx-kernels"
  (cd "$ROOT" && timeout 400 $PY "$PEER/loop_pplx.py" --launch 8 --configs V2Lite,R1 \
     --tokens "$TOKENS" --ks "$KS" --timeout 380 --out "$W/loop_pplx.json" 2>&1 | quiet \
     > "$W/pplx.log"; tail -30 "$W/pplx.log")
fi
cd "$ROOT"
args=("ours=$W/loop_ours.json")
[ -f "$W/loop_pplx.json" ] && args+=("pplx=$W/loop_pplx.json")
[ -f "$W/loop_old.json" ] && args+=("${OLD_COMMIT:-old}=$W/loop_old.json")
[ -f "$W/loop_pplx.json" ] && $PY benchmarks/loop_compare.py "$W/loop_compare.md" "${args[@]}"
cat "$W"/*.log > "$W/logs.txt" 2>/dev/null
for f in loop_ours.json loop_pplx.json loop_old.json loop_compare.md loop_compare.png logs.txt; do
  [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"
done
