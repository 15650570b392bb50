#!/usr/bin/env bash
# From nothing, no root needed: set up .venv, build and install (reused when up to date), build
# the docs, run the CPU test suite (8 emulated CPU devices; GPU tests skip with their reason
# where no GPU is present).
#   bash scripts/test.sh [--quick] [pytest args...]
#     --quick  the quick subset: tests marked slow left out (the gradient matrix, the tests that
#              start several processes, the benchmarks run end to end) and no docs build
# Environment:
#   JMC_FULL_CHECKS=1  also the Bazel check (scripts/bazel_check.sh), which as root installs
#                      Debian's Bazel with apt, and buildifier with npm into ~/.cache. .ci/run
#                      sets it; without it nothing is installed outside .venv.
#   JMC_TEST_WORKERS   pytest-xdist processes (default 2; 1: one process, no xdist). Each holds
#                      its own JAX; the suite's multi-process tests start up to 8 more.
set -euo pipefail
quick=no
if [ "${1:-}" = --quick ]; then quick=yes; shift; fi
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
if [ "${JMC_FULL_CHECKS:-0}" = 1 ]; then
  bash scripts/bazel_check.sh
else
  echo "test: the Bazel check not run (JMC_FULL_CHECKS=1 runs it; it installs Bazel as root)"
fi
[ $quick = yes ] || bash scripts/docs.sh  # mkdocs build --strict
args=(-q -rs)
workers=${JMC_TEST_WORKERS:-2}
[ "$workers" -gt 1 ] && args+=(-n "$workers")
[ $quick = yes ] && args+=(-m "not slow")
# .venv/bin/pytest (not python -m pytest) keeps the source tree off sys.path, so the tests
# import the installed package with its native module.
set +e
"$ROOT/.venv/bin/pytest" "${args[@]}" tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit $rc
