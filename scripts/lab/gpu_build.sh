#!/usr/bin/env bash
# Build and install the package with the GPU machine's own python3 (no registry there).
#   bash scripts/lab/gpu_build.sh                       # this checkout, into the environment
#   SRC=.old TARGET=/tmp/oldsite BUILD_DIR=/tmp/jmc_old LOG=/tmp/w/old_build.log \
#     bash scripts/lab/gpu_build.sh                     # an older tree beside it (PYTHONPATH=TARGET)
set -euo pipefail
OUT=${OUT:-$PWD/gpu_logs}; LOG=${LOG:-${LOGS:-$OUT}/build.log}; mkdir -p "$(dirname "$LOG")"
PY=${PYTHON:-python3}
target=()
[ -n "${TARGET:-}" ] && target=(--target "$TARGET")
t0=$(date +%s)
if ! (cd "${SRC:-.}" && $PY -m pip install --no-build-isolation --no-deps -q "${target[@]}" \
    -C cmake.define.JMC_CUDA=ON -C cmake.define.JMC_CUDA_ARCHS="${JMC_CUDA_ARCHS:-90}" \
    -C build-dir="${BUILD_DIR:-/tmp/jmc_build}" .) > "$LOG" 2>&1; then
  tail -40 "$LOG"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
