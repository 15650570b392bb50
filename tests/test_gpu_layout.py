"""GPU checks of issue 12 through the launcher: packed layout with the oracle, the MoE layer
with ragged_dot against the dense layer, Flax decoding (tests/gpu_layout_worker.py). Skipped,
with the reason, where no GPU can run them."""

import pytest
from gpu_launch import NEEDS_GPU, run_worker

pytestmark = NEEDS_GPU


@pytest.mark.parametrize("n", [2, 8])
def test_gpu_layout_suite_oversubscribed(n):
    r = run_worker("gpu_layout_worker.py", n, "--quick")
    assert r.returncode == 0 and "GPU LAYOUT SUITE PASSED" in r.stdout, r.stdout[-5000:]
