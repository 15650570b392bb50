"""GPU suite through the launcher (skipped, with the reason, where no GPU can run it)."""

import pytest
from gpu_launch import GPUS, NEEDS_GPU, run_worker

pytestmark = NEEDS_GPU


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_gpu_suite_oversubscribed(n):
    r = run_worker("gpu_worker.py", n, "--quick")
    assert r.returncode == 0 and "GPU SUITE PASSED" in r.stdout, r.stdout[-5000:]


@pytest.mark.skipif(GPUS < 2, reason="needs several GPUs (one process per GPU)")
def test_gpu_suite_one_process_per_gpu():
    n = 8 if GPUS >= 8 else 4 if GPUS >= 4 else 2
    r = run_worker("gpu_worker.py", n, oversubscribe=False, timeout=800)
    assert r.returncode == 0 and "GPU SUITE PASSED" in r.stdout, r.stdout[-5000:]
