"""What the pytest wrappers of the GPU workers share: the skip mark (with the reason) and one
launcher run of a worker script. Imported by tests/test_gpu*.py (pytest puts tests/ on the
path through conftest.py's folder)."""

import os
import subprocess
import sys
import tempfile

import pytest

from jax_moe_comm import launch, native

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = launch.gpu_count()
NEEDS_GPU = [pytest.mark.gpu, pytest.mark.skipif(
    GPUS == 0 or not native.available(),
    reason=f"needs a CUDA GPU and the native module ({native.unavailable_reason() or 'no GPU'})")]


def run_worker(script: str, n: int, *args: str, oversubscribe: bool = True, timeout: int = 600,
               command_buffers: bool = True) -> subprocess.CompletedProcess:
    """`python -m jax_moe_comm.launch -n N [--oversubscribe] -- python tests/SCRIPT ARGS`, from
    a neutral folder (the installed package is imported), output captured."""
    # the CPU suite's fast compile (tests/cpu_env.py) would run the GPU workers unoptimized
    env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    if not command_buffers:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    cmd = [sys.executable, "-m", "jax_moe_comm.launch", "-n", str(n)]
    cmd += ["--oversubscribe"] if oversubscribe else []
    cmd += ["--timeout", str(timeout), "--", sys.executable, os.path.join(HERE, script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 100, env=env,
                          cwd=tempfile.gettempdir())
