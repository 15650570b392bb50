"""GPU gradient suite through the launcher (skipped, with the reason, where no GPU can run it):
nvshmem gradients against each rank's own oracle and dense layer, 50 training steps, with XLA
command buffers (CUDA graphs) on and off."""

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


@pytest.mark.parametrize("command_buffers", [True, False], ids=["cmdbuf", "no-cmdbuf"])
@pytest.mark.parametrize("n", [2, 8])
def test_gpu_grad_suite_oversubscribed(n, command_buffers):
    env = dict(os.environ)
    if not command_buffers:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", str(n),
                        "--oversubscribe", "--timeout", "900", "--", sys.executable,
                        os.path.join(HERE, "gpu_grad_worker.py"), "--quick", "--steps", "50"],
                       capture_output=True, text=True, timeout=1000, env=env,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0 and "GPU GRAD SUITE PASSED" in r.stdout, r.stdout[-5000:]
    assert f"EP{n}-train-50-steps" in r.stdout
