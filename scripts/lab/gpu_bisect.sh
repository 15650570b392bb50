#!/usr/bin/env bash
# Per-cycle cost of several builds of ours in one device call, to find the commit that made a
# row slower (issue 23: main at f97726a is 5-6 µs slower per cycle at 1 token than 505b95c).
# Each commit is a `git archive` unpacked in .old/<commit> (ignored, carried), built into its
# own site directory, and timed by its own bench_loop.py (K cycles in one recorded graph, CUDA
# events, slope; 8 ranks under MPS); the table follows, one column per commit.
#   for c in 505b95c 5228dcc f97726a; do mkdir -p .old/$c && git archive $c | tar x -C .old/$c; done
#   COMMITS="505b95c 5228dcc f97726a" TOKENS=1,16 bash scripts/lab/gpu_bisect.sh
# An entry <commit>+VAR=value[+VAR=value] times the same tree again with those environment
# settings (built once), e.g. a knob's A/B in the same call:
#   COMMITS="d2745f9 d2745f9+JMC_FUSED=always" TOKENS=1,4,16 bash scripts/lab/gpu_bisect.sh
# A setting nothing reads repeats an entry (A B A B, to see the run's own drift; 2026-12-06):
#   COMMITS="$H other+JMC_ACKS=implicit $H+X=1 other+JMC_ACKS=implicit+X=1" ...
# VARIANTS=graph,floor-barrier-2calls adds bench_loop's floor rows to each entry's JSON (the
# table shows `graph`; a tree older than 9369e29 has no floor variants and its entry fails).
# TIMELINE=10 adds each entry's per-phase timeline of one cycle (the kernels' stamps, a
# recorded graph+barrier loop of 10 cycles) to its log, to see where a difference goes.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
W=/tmp/bisect; mkdir -p "$W"
PY=${PYTHON:-python3}
ROOT=$PWD
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
# The table and the logs so far, rewritten after every commit: a call cut by its time limit
# still brings back the commits it finished.
report() {
$PY - "$W" ${COMMITS} > "$OUT/bisect.md" <<'EOF'
import json, os, sys
w, commits = sys.argv[1], sys.argv[2:]
runs = {}
for c in commits:
    p = os.path.join(w, "loop_" + c.replace("+", "_").replace("=", "_") + ".json")
    if os.path.exists(p):
        rows = json.load(open(p))["rows"]
        runs[c] = {(r["config"], r["tokens_per_rank"]): r["fit_event_b_us"] for r in rows
                   if r.get("variant") == "graph" and r.get("fit_event_b_us") is not None}
keys = sorted({k for v in runs.values() for k in v})
print("| config | tokens | " + " | ".join(runs) + " |")
print("|---|---|" + "---|" * len(runs))
for k in keys:
    print(f"| {k[0]} | {k[1]} | " + " | ".join(
        f"{runs[c][k]:.1f}" if k in runs[c] else "" for c in runs) + " |")
EOF
cp "$W"/loop_*.json "$OUT/" 2>/dev/null
cat "$W"/build_*.log "$W"/loop_*.log > "$OUT/bisect_logs.txt" 2>/dev/null
}
for c in ${COMMITS:?set COMMITS (each unpacked in .old/<commit>)}; do
  tree=${c%%+*}  # the entry's tree; what follows a '+' is environment (split below)
  envs=(); [[ $c == *+* ]] && IFS=+ read -ra envs <<< "${c#*+}"
  [ -d "$ROOT/.old/$tree" ] || { echo "-- $c: no .old/$tree"; continue; }
  if [ ! -f "/tmp/site_$tree/.jmc_built" ]; then  # (a failed build leaves no mark)
    SRC="$ROOT/.old/$tree" TARGET="/tmp/site_$tree" BUILD_DIR="/tmp/jmc_$tree" \
      LOG="$W/build_$tree.log" bash "$ROOT/scripts/lab/gpu_build.sh" \
      || { echo "-- $c: build failed"; continue; }
    mkdir -p "/tmp/site_$tree" && touch "/tmp/site_$tree/.jmc_built"
  fi
  (cd /tmp && env "${envs[@]}" PYTHONPATH="/tmp/site_$tree" GIT_COMMIT=$tree timeout ${LIMIT:-120} \
    $PY -m jax_moe_comm.launch -n 8 --oversubscribe --timeout $(( ${LIMIT:-120} - 10 )) -- \
    $PY "$ROOT/.old/$tree/benchmarks/bench_loop.py" \
    --tokens "${TOKENS:-1,16}" --ks "${KS:-1,10,50}" --calls 0 --timeline "${TIMELINE:-0}" \
    --variants "${VARIANTS:-graph}" \
    --out "$W/loop_${c//[+=]/_}.json" > "$W/loop_${c//[+=]/_}.log" 2>&1)
  echo "-- $c rc=$? $(grep -c 'us/cycle' "$W/loop_${c//[+=]/_}.log") rows"
  report
done
report
cat "$OUT/bisect.md"
