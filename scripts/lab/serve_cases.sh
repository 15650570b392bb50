#!/usr/bin/env bash
# Issue 48's server example run as a user would, at N ranks on one GPU (MPS): the faults it
# survives (a bad expert index on one rank, a rank late by 3x the timeout), a killed rank (the
# survivors report it within the timeout and stop; no recover()), then the restarted job.
# Prints PASS/FAIL per case; exits 0 when every case passed. Called by gpu_final.sh's serve step.
#   bash scripts/lab/serve_cases.sh 8
set -uo pipefail
N=${1:?ranks}
PY=${PYTHON:-python3}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LOG=${LOGS:-/tmp}/serve_n$N
mkdir -p "$LOG"
EX="$ROOT/examples/serve_decode.py"
LAST=$(( N - 1 ))
failed=0
verdict() {  # case, condition (0: pass), detail
  if [ "$2" = 0 ]; then echo "PASS serve_n$N $1: $3"; else echo "FAIL serve_n$N $1: $3"; failed=1; fi
}

$PY -m jax_moe_comm.launch -n "$N" --oversubscribe --timeout 200 -- $PY "$EX" --steps 24 \
  --bad-index-at 5 --bad-rank 1 --late-at 12 --late-rank $LAST > "$LOG/faults.log" 2>&1
rc=$?
grep -q "SERVE PASSED" "$LOG/faults.log"; ok=$?
verdict faults $(( rc != 0 || ok != 0 )) "rc=$rc; $(grep -m1 -E "SERVE (PASSED|FAILED)" "$LOG/faults.log")"

# The killed rank: --keep-going, so that the launcher lets the survivors report it.
t0=$(date +%s)
$PY -m jax_moe_comm.launch -n "$N" --oversubscribe --keep-going --timeout 150 -- $PY "$EX" \
  --steps 16 --kill-at 6 --kill-rank $LAST > "$LOG/kill.log" 2>&1
rc=$?
dead=$(grep -c "peer dead" "$LOG/kill.log")
verdict killed $(( rc == 0 || dead != N - 1 )) "rc=$rc, $dead of $(( N - 1 )) survivors named the \
dead peer in $(( $(date +%s) - t0 )) s; $(grep -m1 "peer dead" "$LOG/kill.log" | cut -c1-160)"

$PY -m jax_moe_comm.launch -n "$N" --oversubscribe --timeout 150 -- $PY "$EX" --steps 16 \
  > "$LOG/restart.log" 2>&1
rc=$?
grep -q "SERVE PASSED" "$LOG/restart.log"; ok=$?
verdict restart $(( rc != 0 || ok != 0 )) "rc=$rc; $(grep -m1 -E "SERVE (PASSED|FAILED)" "$LOG/restart.log")"
grep -h "\[serve\]" "$LOG"/*.log | head -60
exit $failed
