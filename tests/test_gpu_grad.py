"""GPU gradient suite through the launcher (skipped, with the reason, where no GPU can run it):
nvshmem gradients against each rank's own oracle and dense layer, 50 training steps, with XLA
command buffers (CUDA graphs) on and off."""

import pytest
from gpu_launch import NEEDS_GPU, run_worker

pytestmark = NEEDS_GPU


@pytest.mark.parametrize("command_buffers", [True, False], ids=["cmdbuf", "no-cmdbuf"])
@pytest.mark.parametrize("n", [2, 8])
def test_gpu_grad_suite_oversubscribed(n, command_buffers):
    r = run_worker("gpu_grad_worker.py", n, "--quick", "--steps", "50", timeout=900,
                   command_buffers=command_buffers)
    assert r.returncode == 0 and "GPU GRAD SUITE PASSED" in r.stdout, r.stdout[-5000:]
    assert f"EP{n}-train-50-steps" in r.stdout
