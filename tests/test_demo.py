"""The main job as a smoke test: the README's demo command, two steps."""

import subprocess
import sys
import tempfile

from cpu_env import child_env


def test_demo_runs_and_matches_dense():
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.demo", "--steps", "3"],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend=reference ranks=8 platform=cpu" in r.stdout
    assert "-> OK" in r.stdout and "tokens/s" in r.stdout


def _demo(*args):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "jax_moe_comm.demo", "--steps", "2",
                           "--tokens", "16", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tempfile.gettempdir())


def test_demo_with_a_capacity_factor():
    """--capacity-factor sizes the packed rows from the mean load (16 tokens x k=4 per rank:
    64, so 2.0 holds 128 of the worst case's 512); where nothing drops y matches the dense
    layer; with a capacity far below the load and --overflow drop, the drops are counted and
    those steps are not compared."""
    r = _demo("--capacity-factor", "2.0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "packed capacity: 128 rows per rank (worst case 512, mean load 64), " \
           "overflow=fail" in r.stdout
    assert "-> OK" in r.stdout
    r = _demo("--capacity-factor", "0.25", "--overflow", "drop")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 of 2 steps dropped none on any rank" in r.stdout
    assert "y not compared with the dense layer" in r.stdout


def test_demo_with_a_padded_expert_capacity():
    """--layout padded --capacity-factor sizes the rows per local expert from the mean load
    per expert (16 tokens x k=4 x 8 ranks / 32 experts: 16, so 4.0 holds 64 of the worst
    case's 128) for the batched einsum; y matches the dense layer where nothing drops."""
    r = _demo("--layout", "padded", "--capacity-factor", "4.0", "--expert-gemm", "einsum")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "expert capacity: 64 rows per local expert (worst case 128, mean load 16), " \
           "overflow=fail" in r.stdout
    assert "-> OK" in r.stdout
