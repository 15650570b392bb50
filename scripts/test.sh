#!/usr/bin/env bash
# From nothing: set up .venv, build and install, run the whole CPU test suite (8 emulated CPU
# devices; GPU tests skip with their reason where no GPU is present). .ci/run calls this.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
bash scripts/bazel_check.sh  # BUILD.bazel: buildifier, then Bazel builds _native.so and tests it
# .venv/bin/pytest (not python -m pytest) keeps the source tree off sys.path, so the tests
# import the installed package with its native module.
set +e
"$ROOT/.venv/bin/pytest" -q -rs tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit $rc
