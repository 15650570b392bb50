"""examples/deepseek_decode.py, small, on 8 CPU devices: prefill and decode on two handles,
the breakdown timings, and the logits against the dense-MoE model (~23 s)."""

import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("flax.nnx", reason="flax is an optional extra: pip install jax_moe_comm[flax]")
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "deepseek_decode.py")


def test_deepseek_decode_example_runs_small_and_matches_the_dense_model():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    small = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "128", "--ffn",
             "128", "--experts-per-rank", "2", "--k", "2", "--batch-per-rank", "1", "--prompt",
             "4", "--tokens", "3", "--reps", "2", "--check-every", "2"]
    r = subprocess.run([sys.executable, EXAMPLE, *small], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "backend=reference ranks=8" in out and "2 handles (budgets (1, 4) per rank)" in out
    assert "XLA collectives in the decode step: ['all-to-all']" in out, out
    for part in ("attention", "router", "dispatch", "combine", "experts", "per-token latency"):
        assert part in out, out
    assert "greedy tokens equal 32/32 -> OK" in out, out
