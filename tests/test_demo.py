"""The main job as a smoke test: the README's demo command, two steps."""

import os
import subprocess
import sys
import tempfile


def test_demo_runs_and_matches_dense():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.demo", "--steps", "3"],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend=reference ranks=8 platform=cpu" in r.stdout
    assert "-> OK" in r.stdout and "tokens/s" in r.stdout
