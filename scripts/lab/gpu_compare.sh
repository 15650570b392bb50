#!/usr/bin/env bash
# One device call, three benchmarks side by side (DESIGN §8): this checkout, an older commit of
# ours, and pplx-kernels, all 8 ranks on one GPU under MPS, then benchmarks/compare.py.
#   OLD_SRC=.old PEER=.peer TOKENS=1,4,16,32,64,128 bash scripts/lab/gpu_compare.sh
# OLD_SRC: an unpacked `git archive` of the older commit (OLD_COMMIT names it); PEER: a copy of
# shared/peer. Both are ignored folders carried to the machine. Results in $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
ROOT=$PWD
TOKENS=${TOKENS:-1,4,16,32,64,128}
SAMPLES=${SAMPLES:-100}
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1
quiet() { grep -v "grpc\|GRPC\|WatchTasks\|^\[rank [0-9]\] *$\|Connection refused\|proxy variable"; }

bash "$ROOT/scripts/lab/gpu_build.sh" || exit 1
cd /tmp
echo "== ours ($GIT_COMMIT)"
timeout 300 $PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout 290 -- \
  $PY "$ROOT/benchmarks/bench_all_to_all.py" --out "$OUT/ours" --tokens "$TOKENS" \
  --samples "$SAMPLES" --warmup 10 --matmul 0 ${BENCH_ARGS:-} 2>&1 | quiet | grep "rank 0\]"
if [ -n "${PEER:-}" ]; then
  echo "== pplx-kernels"
  (cd "$ROOT" && timeout 300 bash "$PEER/run_pplx.sh" 8 --out "$OUT/pplx_ep8.json" \
    --tokens "$TOKENS" --samples "$SAMPLES" 2>&1 | quiet | tail -20)
fi
if [ -n "${OLD_SRC:-}" ]; then
  echo "== ours at ${OLD_COMMIT:-old}"
  SRC="$ROOT/$OLD_SRC" TARGET=/tmp/oldsite BUILD_DIR=/tmp/jmc_old LOG="$OUT/old_build.log" \
    bash "$ROOT/scripts/lab/gpu_build.sh" || exit 1
  PYTHONPATH=/tmp/oldsite GIT_COMMIT=${OLD_COMMIT:-old} timeout 300 $PY -m jax_moe_comm.launch \
    -n 8 --oversubscribe --timeout 290 -- $PY "$ROOT/$OLD_SRC/benchmarks/bench_all_to_all.py" \
    --out "$OUT/old" --tokens "$TOKENS" --samples "$SAMPLES" --warmup 10 --matmul 0 \
    --bf16-at= 2>&1 | quiet | grep "rank 0\]"
fi
cd "$ROOT"
args=("ours=$OUT/ours/bench_ep8.json")
[ -f "$OUT/pplx_ep8.json" ] && args+=("pplx=$OUT/pplx_ep8.json")
[ -f "$OUT/old/bench_ep8.json" ] && args+=("${OLD_COMMIT:-old}=$OUT/old/bench_ep8.json")
$PY benchmarks/compare.py "$OUT/compare.md" "${args[@]}"
