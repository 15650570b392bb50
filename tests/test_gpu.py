"""GPU suite through the launcher (skipped, with the reason, where no GPU can run it)."""

import os
import subprocess
import sys
import tempfile

import pytest

from jax_moe_comm import launch, native

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = launch.gpu_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    GPUS == 0 or not native.available(),
    reason=f"needs a CUDA GPU and the native module ({native.unavailable_reason() or 'no GPU'})")]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_gpu_suite_oversubscribed(n):
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", str(n),
                        "--oversubscribe", "--timeout", "600", "--", sys.executable,
                        os.path.join(HERE, "gpu_worker.py"), "--quick"],
                       capture_output=True, text=True, timeout=700, cwd=tempfile.gettempdir())
    assert r.returncode == 0 and "GPU SUITE PASSED" in r.stdout, r.stdout[-5000:]


@pytest.mark.skipif(GPUS < 2, reason="needs several GPUs (one process per GPU)")
def test_gpu_suite_one_process_per_gpu():
    n = 8 if GPUS >= 8 else 4 if GPUS >= 4 else 2
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", str(n), "--",
                        sys.executable, os.path.join(HERE, "gpu_worker.py")],
                       capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    assert r.returncode == 0 and "GPU SUITE PASSED" in r.stdout, r.stdout[-5000:]
