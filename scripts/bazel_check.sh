#!/usr/bin/env bash
# The Bazel files' check (scripts/test.sh runs it; docs/multi-gpu.md "Bazel"): buildifier must
# find them formatted and lint-clean, then Debian's Bazel 4.2.3 builds the native module with
# nvcc and runs //:cpu_tests against it, offline. Installs what it needs: buildifier with npm
# into a cache folder (no root), bazel-bootstrap and bazel-bootstrap-source with apt (root).
#
# Without root and without Bazel installed, the Bazel build is SKIPPED, saying so (buildifier
# still runs): Debian's Bazel is the only one installable here (the registries have no Bazel 4+
# that runs offline) and apt needs root. Under CI (CI=true) a skip is a failure.
# Uses .venv/bin/python (made by scripts/setup.sh) for jax, nanobind and the NVSHMEM wheel.
#   bash scripts/bazel_check.sh [--tools]
#     --tools  only install the tools (downloads; .ci/run runs this beside scripts/setup.sh)
set -euo pipefail
tools_only=no
if [ "${1:-}" = --tools ]; then tools_only=yes; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILDIFIER_VERSION=8.2.1
MOCKS=/usr/src/bazel-bootstrap/mock_repos  # named in .bazelrc's config debian
t0=$(date +%s)

skip() {  # what did not run and why: a plain SKIPPED line, or under CI a failure
  if [ "${CI:-}" = true ]; then
    echo "bazel_check: FAILED: $* (CI must run the whole Bazel check)" >&2
    exit 1
  fi
  echo "bazel_check: SKIPPED: $*"
}

# Tools.
have_bazel=yes
if ! command -v bazel >/dev/null || [ ! -d "$MOCKS/rules_cc" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bazel_check: installing bazel-bootstrap bazel-bootstrap-source with apt"
    # one apt at a time: .ci/run sets the newest-jax folder up beside this (the same lock)
    flock /tmp/jax_moe_comm-apt.lock sh -c 'apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap \
        bazel-bootstrap-source >/dev/null'
  else
    have_bazel=no
  fi
fi
TOOLS="${XDG_CACHE_HOME:-$HOME/.cache}/jax_moe_comm/buildifier-$BUILDIFIER_VERSION"
BUILDIFIER="$TOOLS/node_modules/.bin/buildifier"
if [ ! -x "$BUILDIFIER" ]; then
  if command -v npm >/dev/null; then
    echo "bazel_check: installing buildifier $BUILDIFIER_VERSION with npm"
    mkdir -p "$TOOLS"
    npm install --prefix "$TOOLS" --no-save --no-audit --no-fund --loglevel=error \
      "@bazel/buildifier@$BUILDIFIER_VERSION" >/dev/null ||
      skip "buildifier: npm could not install @bazel/buildifier@$BUILDIFIER_VERSION (its" \
           "error above; behind a TLS proxy npm needs NODE_EXTRA_CA_CERTS or npm config cafile)"
  else
    skip "buildifier: npm is not installed (apt-get install npm, as root)"
  fi
fi

if [ $tools_only = yes ]; then
  echo "bazel_check: tools installed in $(( $(date +%s) - t0 )) s"
  exit 0
fi

# 1. Format and lint.
if [ -x "$BUILDIFIER" ]; then
  mapfile -t files < <(find . \( -name .git -o -name .venv -o -name build -o -name 'bazel-*' \) \
    -prune -o \( -name BUILD.bazel -o -name BUILD -o -name WORKSPACE -o -name '*.bzl' \) \
    -print | sort)
  echo "bazel_check: $("$BUILDIFIER" --version | head -1) -mode=check -lint=warn ${files[*]}"
  "$BUILDIFIER" -mode=check -lint=warn "${files[@]}"
fi

# 2. Build and test (bazel/local_deps.bzl looks for the toolkit in the same places).
if [ "$have_bazel" = no ]; then
  skip "the Bazel build of the native module: Bazel is not installed, and" \
       "the only Bazel that builds it offline, Debian's bazel-bootstrap 4.2.3, needs root to" \
       "install (apt-get install bazel-bootstrap bazel-bootstrap-source); then run" \
       "bash scripts/bazel_check.sh"
  exit 0
fi
CUDA="${CUDA_PATH:-${CUDA_HOME:-/usr/local/cuda}}"
if [ ! -x "$CUDA/bin/nvcc" ]; then
  if command -v nvcc >/dev/null; then
    echo "bazel_check: nvcc is $(command -v nvcc) but not $CUDA/bin/nvcc: set CUDA_PATH" >&2
    exit 1
  fi
  echo "bazel_check: no CUDA toolkit, so no Bazel build of the native module here"
  exit 0
fi
export JMC_PYTHON="${JMC_PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$JMC_PYTHON" ]; then
  echo "bazel_check: $JMC_PYTHON missing: run scripts/setup.sh first or set JMC_PYTHON" >&2
  exit 1
fi
echo "bazel_check: bazel-bootstrap $(dpkg-query -W -f='${Version}' bazel-bootstrap)," \
     "nvcc $CUDA/bin/nvcc, python $JMC_PYTHON"
trap 'bazel shutdown >/dev/null 2>&1 || true' EXIT  # the idle server would hold ~1 GB
# CI builds one SASS arch (+PTX) to stay in its time budget: nvcc already builds the module once
# for setup.sh; JMC_BAZEL_ARCHS=90,100 mirrors CMake exactly.
bazel test --config=debian --noshow_progress --test_output=all \
  "--//bazel:cuda_archs=${JMC_BAZEL_ARCHS:-90}" //...

# The version script and --exclude-libs must leave PyInit__native as the only export.
exports=$(nm -D --defined-only bazel-bin/jax_moe_comm/_native.so | awk '{print $3}')
if [ "$exports" != PyInit__native ]; then
  echo "bazel_check: _native.so exports more than PyInit__native: $exports" >&2
  exit 1
fi
echo "bazel_check: OK in $(( $(date +%s) - t0 )) s (bazel-bin/jax_moe_comm/_native.so)"
