#!/usr/bin/env bash
# From nothing, no root needed: set up .venv, build and install (reused when up to date), check
# the Bazel files, build the docs, run the whole CPU test suite (8 emulated CPU devices; GPU
# tests skip with their reason where no GPU is present). .ci/run calls this with CI=true.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# BUILD.bazel: buildifier, then Bazel builds _native.so and tests it. Without root and without
# Bazel it says SKIPPED and why; under CI a skip fails.
bash scripts/bazel_check.sh
bash scripts/docs.sh  # mkdocs build --strict
# .venv/bin/pytest (not python -m pytest) keeps the source tree off sys.path, so the tests
# import the installed package with its native module.
set +e
"$ROOT/.venv/bin/pytest" -q -rs tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit $rc
