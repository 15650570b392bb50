#!/usr/bin/env bash
# The CPU suite's quick subset on the newest jax on the index, which needs a newer Python than
# this machine's (jax >= 0.11: Python >= 3.12; Debian 12 has 3.11): Debian 13's Python 3.13 in
# a debootstrap folder (build/newest-jax/root, kept for the next run), the wheels downloaded
# here for that Python and installed there offline, the source tree on PYTHONPATH (reference
# backend: the native module is built and tested against the oldest jax by scripts/test.sh).
# Needs root (debootstrap, chroot, mounts). .ci/run starts `--setup` (network-bound) beside
# scripts/test.sh and runs the tests after it.
#   bash scripts/test_newest_jax.sh [--setup] [pytest args...]
#     --setup  only set the folder up (Debian, the wheels, the venv), no tests
# JMC_NEWEST_JAX: the jax requirement (default: the newest release the index has).
set -euo pipefail
setup_only=no
if [ "${1:-}" = --setup ]; then setup_only=yes; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
t0=$(date +%s)
say() { echo "newest-jax: $*"; }
if [ "$(id -u)" != 0 ]; then
  if [ "${CI:-}" = true ]; then say "FAILED: needs root (debootstrap, chroot)" >&2; exit 1; fi
  say "SKIPPED: needs root (debootstrap and chroot for Debian 13's Python 3.13)"; exit 0
fi
WORK="$ROOT/build/newest-jax"
CHROOT="$WORK/root"
SUITE=trixie  # Debian 13: Python 3.13
mount_all() {
  mountpoint -q "$CHROOT/proc" || mount -t proc proc "$CHROOT/proc"
  mountpoint -q "$CHROOT/dev" || mount --bind /dev "$CHROOT/dev"
}
unmount_all() { umount "$CHROOT/dev" 2>/dev/null || true; umount "$CHROOT/proc" 2>/dev/null || true; }
if [ ! -x "$CHROOT/usr/bin/python3" ]; then
  command -v debootstrap >/dev/null || {
    say "installing debootstrap with apt"
    # one apt at a time: .ci/run runs this beside scripts/bazel_check.sh (the same lock)
    flock /tmp/jax_moe_comm-apt.lock sh -c 'apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null'
  }
  # The Debian mirror this machine's apt already uses (as scripts/cuda12_toolkit.sh does);
  # DEBIAN_MIRROR overrides it.
  MIRROR=${DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI)|$(LABEL)' 2>/dev/null |
                            awk -F'|' '$2 == "Debian" {print $1; exit}')}
  if [ -z "$MIRROR" ]; then
    say "FAILED: this machine's apt has no Debian mirror configured to borrow: set" \
        "DEBIAN_MIRROR to one (the URL of a Debian archive, as in /etc/apt/sources.list)" >&2
    exit 1
  fi
  say "debootstrap $SUITE (python3, python3-venv) from $MIRROR into $CHROOT"
  unmount_all  # a run cut off mid-way may have left /dev bound inside: never delete through it
  rm -rf --one-file-system "$CHROOT"
  mkdir -p "$WORK"
  debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$CHROOT" \
    "$MIRROR" > "$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
fi
PYV=$("$CHROOT/usr/bin/python3" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null ||
      chroot "$CHROOT" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# Wheels for that Python, fetched here (the folder's Python has no index configured), and the
# venv; skipped when `--setup` has just done both (its stamp is consumed by the next run).
WHEELS="$CHROOT/wheels"
READY="$WORK/ready"
JAX_REQ=${JMC_NEWEST_JAX:-jax}
fresh=no
if [ $setup_only = no ] && [ "$(cat "$READY" 2>/dev/null)" = "$JAX_REQ" ]; then fresh=yes; fi
rm -f "$READY"
if [ $fresh = no ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
    "$JAX_REQ" jaxlib numpy pytest pytest-xdist flax optax 2>&1 | grep -v "^WARNING" || true
fi
trap unmount_all EXIT
mount_all
in_root() { chroot "$CHROOT" /usr/bin/env -i HOME=/root PATH=/venv/bin:/usr/bin:/bin "$@"; }
if [ $fresh = no ]; then
  if [ ! -x "$CHROOT/venv/bin/python" ]; then in_root python3 -m venv /venv; fi
  in_root /venv/bin/pip install -q --disable-pip-version-check --no-index --find-links /wheels \
    --upgrade "$JAX_REQ" jaxlib numpy pytest pytest-xdist flax optax
fi
version=$(in_root /venv/bin/python -c 'import jax; print(jax.__version__)')
say "jax $version, Python $PYV ($(( $(date +%s) - t0 )) s to set up)"
if [ $setup_only = yes ]; then echo "$JAX_REQ" > "$READY"; exit 0; fi
# The source tree as committed plus what is being tested (tracked files, as they are now).
rm -rf --one-file-system "$CHROOT/src"
mkdir -p "$CHROOT/src"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - 2>/dev/null |
  tar -xf - -C "$CHROOT/src"
# Left out: tests/test_build.py builds the package with CMake and nvcc (not in the folder; the
# main leg runs it); and, to keep CI under 15 minutes, the quick subset's slowest repeats of a
# surface covered here by a quicker test (JMC_NEWEST_JAX_ALL=1 runs them too): the Flax batch
# matrix (test_flax_module covers the module) and the Flax examples run as scripts (~125 of
# the subset's 440 CPU-seconds, jax 0.12.1).
# YNNPACK fusions off: jaxlib 0.12's CPU backend fails an f32 reduce_sum inside a fused graph
# ("YNNPACK operation failed: unsupported parameter", docs/notes.md).
left_out=(--ignore=tests/test_build.py)
if [ "${JMC_NEWEST_JAX_ALL:-0}" != 1 ]; then
  left_out+=(--ignore=tests/test_flax_batches.py --ignore=tests/test_flax.py)
fi
set +e
in_root /usr/bin/env -C /src PYTHONPATH=/src JAX_PLATFORMS=cpu \
  XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type=" \
  /venv/bin/python -m pytest -q -rs -p no:cacheprovider -n "${JMC_TEST_WORKERS:-2}" \
  -m "not slow" "${left_out[@]}" tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
say "rc=$rc in $(( $(date +%s) - t0 )) s (jax $version)"
exit $rc
