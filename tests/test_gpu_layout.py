"""GPU checks of issue 12 through the launcher: packed layout with the oracle, the MoE layer
with ragged_dot against the dense layer, Flax decoding (tests/gpu_layout_worker.py). Skipped,
with the reason, where no GPU can run them."""

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


@pytest.mark.parametrize("n", [2, 8])
def test_gpu_layout_suite_oversubscribed(n):
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", str(n),
                        "--oversubscribe", "--timeout", "600", "--", sys.executable,
                        os.path.join(HERE, "gpu_layout_worker.py"), "--quick"],
                       capture_output=True, text=True, timeout=700, cwd=tempfile.gettempdir())
    assert r.returncode == 0 and "GPU LAYOUT SUITE PASSED" in r.stdout, r.stdout[-5000:]
