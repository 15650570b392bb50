#!/usr/bin/env bash
# From nothing, no root needed: set up .venv, build and install (reused when the sources have
# not changed, so a second run takes the demo's own seconds), run the main job (a MoE layer
# through dispatch/combine on 8 ranks, checked against the dense layer). Extra args go to the
# demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd /tmp
exec "$ROOT/.venv/bin/python" -m jax_moe_comm.demo "$@"
