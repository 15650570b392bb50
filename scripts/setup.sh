#!/usr/bin/env bash
# Makes .venv from nothing and installs jax_moe_comm into it, building the CUDA/NVSHMEM module
# with nvcc when a CUDA toolkit is present (needs none to run: without a GPU the reference
# backend is used). Sourced by scripts/demo.sh and scripts/test.sh.
#
# The package is built once as a wheel (dist/), and that wheel is what gets installed: the
# tests then check the artefact users install, and JMC_WHEEL names it for them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY="$ROOT/.venv/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check \
  "jax>=0.10.0,<0.12" numpy pytest matplotlib "flax>=0.11" optax "tokamax>=0.0.12,!=0.1.0" \
  "scikit-build-core>=0.10" "nanobind>=2.0" "cmake>=3.24" ninja "nvidia-nvshmem-cu13==3.4.5"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if command -v nvcc >/dev/null; then
  export JMC_CUDA=ON JMC_REQUIRE_NATIVE=1
  echo "setup: building the native module with $(command -v nvcc)"
else
  export JMC_CUDA=OFF
  echo "setup: no nvcc found, reference backend only"
fi
rm -rf "$ROOT/dist"
"$VPY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
  -w "$ROOT/dist" -C cmake.define.JMC_CUDA="$JMC_CUDA" .
JMC_WHEEL=$(ls "$ROOT"/dist/jax_moe_comm-*.whl)
export JMC_WHEEL
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$JMC_WHEEL"
echo "setup: installed $(basename "$JMC_WHEEL")"
