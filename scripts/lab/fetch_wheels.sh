#!/usr/bin/env bash
# Fills .whl/ (ignored; carried to the device machine, which has no package index) with
# tokamax and what it needs that the device's image lacks, as wheels for its Python 3.12.
# gpu_final.sh installs them there into /tmp/site. A new checkout has no .whl/: run this
# before the first device call that times tokamax (~37 MB; the carry limit is 64 MiB in all).
#   bash scripts/lab/fetch_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$ROOT/.whl"
# tokamax 0.0.17's Requires-Dist (its METADATA) less what the image has (jax, jaxlib,
# jaxtyping, absl-py, tqdm: the device machine's package list), and pydantic's own needs;
# fire and termcolor since 2026-12-06 (the image's copy went: `import tokamax` failed with
# "No module named 'fire'").
WHEELS=(tokamax==0.0.17 einshape pydantic pydantic-core annotated-types typing-inspection
        qwix immutabledict tensorboardx xprof fire termcolor)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$ROOT/.whl" "${WHEELS[@]}"
du -sh "$ROOT/.whl"
