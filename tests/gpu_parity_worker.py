"""Parity suite (issue 26), run on every rank by the launcher: the cases of
tests/parity_cases.py (what the CUDA kernels refuse, and what must stay allowed) on the
nvshmem backend, where tests/test_parity.py runs them on the reference backend.

    python -m jax_moe_comm.launch -n N --oversubscribe -- python tests/gpu_parity_worker.py
    python -m jax_moe_comm.launch -n 2 --platform cpu -- \
        python tests/gpu_parity_worker.py --backend reference      # this file itself, on CPU

Prints one `PASS name` / `FAIL name: why` line per case on rank 0, then
`GPU PARITY SUITE PASSED` (or FAILED), and exits non-zero if any case failed on any rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax_moe_comm.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
RANK, WORLD = dist.initialize()

import jax  # noqa: E402

from gpu_harness import Suite, clear_runtime_tokens  # noqa: E402
import parity_cases  # noqa: E402
from jax_moe_comm import testing as T  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nvshmem", choices=("nvshmem", "reference"))
    parser.add_argument("--only", default="", help="comma-separated parts of case names")
    parser.add_argument("--quick", action="store_true", help="accepted (gpu_check.sh)")
    args = parser.parse_args()
    suite = Suite(RANK)
    suite.only = [o for o in args.only.split(",") if o]
    mesh = T.make_mesh(WORLD)
    suite.log(f"world={WORLD} platform={jax.default_backend()} backend={args.backend} "
              f"jax={jax.__version__}")
    ctx = parity_cases.Ctx(mesh=mesh, backend=args.backend, world=WORLD,
                           after_failure=clear_runtime_tokens)
    for name, fn in parity_cases.CASES.items():
        suite.case(f"EP{WORLD}-{name}")(lambda fn=fn: fn(ctx))
    return suite.finish("GPU PARITY SUITE")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
