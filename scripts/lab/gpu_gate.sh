#!/usr/bin/env bash
# Issue 48's GPU gate: one commit, one device call (or two, GATE_PART=1 then 2, when the budget
# of one is short), 8 ranks on one GPU under MPS. Runs the GPU suites at N = 2, 8 with command
# buffers on and off, the server suite (recovery, late and held ranks, stale steps) direct and
# staged (all peers, and half of them: two emulated nodes), the protocol suite the same way,
# the server example's faults, killed rank and restart at N = 4, 8, memcheck and racecheck
# with --error-exitcode (each rank's summary line kept), and a 10^6-cycle soak at N = 2.
# Writes $OUT/gate_<commit>.txt: every line starts PASS or FAIL and names the commit; the last
# says GATE PASSED or GATE FAILED. Commit that file with the results.
#   GIT_COMMIT=abc1234 bash scripts/lab/gpu_gate.sh                # docs/notes.md: its time
#   GIT_COMMIT=abc1234 GATE_PART=2 bash scripts/lab/gpu_gate.sh    # the second half only
set -uo pipefail
: "${GIT_COMMIT:?set GIT_COMMIT (computed where the commit was made)}"
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
PART1="server_n8 server_n2 server_n8_nocmdbuf server_n2_nocmdbuf server_n8@staged
  server_n8@staged:4 serve_n8 serve_n4 suite_n2 suite_n8 suite_n2_nocmdbuf suite_n8_nocmdbuf"
PART2="protocol_n8 protocol_n8@staged protocol_n8@staged:4 memcheck_n2 racecheck_n2 soak_n2"
case ${GATE_PART:-all} in
  1) steps=$PART1 ;; 2) steps=$PART2 ;; all) steps="$PART1 $PART2" ;;
  *) echo "GATE_PART=${GATE_PART}: 1, 2 or all"; exit 2 ;;
esac
GATE_FILE="$OUT/gate_${GIT_COMMIT}.txt"
: > "$GATE_FILE"
echo "PASS gate start $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader \
  | head -1), steps: $(echo $steps) @ $GIT_COMMIT" >> "$GATE_FILE"
GATE_FILE=$GATE_FILE STEPS="$(echo $steps)" BUDGET=${BUDGET:-570} bash scripts/lab/gpu_final.sh
# A step must have said PASS; a build failure leaves no step line at all.
if grep -q "^FAIL" "$GATE_FILE" || [ "$(grep -cE "^(PASS|FAIL) [^ ]+ (rc=|not run)" "$GATE_FILE")" -lt "$(echo $steps | wc -w)" ]
then verdict="FAIL GATE FAILED"; else verdict="PASS GATE PASSED"; fi
echo "$verdict: $(grep -c '^PASS' "$GATE_FILE") PASS, $(grep -c '^FAIL' "$GATE_FILE") FAIL lines @ $GIT_COMMIT" >> "$GATE_FILE"
cat "$GATE_FILE"
