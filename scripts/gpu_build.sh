#!/usr/bin/env bash
# Build and install the package with the GPU machine's own python3 (no registry there).
set -euo pipefail
OUT=${OUT:-$PWD/gpu_logs}; LOG=${LOGS:-$OUT}/build.log; mkdir -p "$(dirname "$LOG")"
PY=${PYTHON:-python3}
t0=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps -q \
    -C cmake.define.JMC_CUDA=ON -C cmake.define.JMC_CUDA_ARCHS="${JMC_CUDA_ARCHS:-90}" \
    -C build-dir=/tmp/jmc_build . > "$LOG" 2>&1; then
  tail -40 "$LOG"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
