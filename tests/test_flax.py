"""The Flax NNX module (jax_moe_comm.flax.MoE) and the two examples that use it."""

import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_env import child_env

nnx = pytest.importorskip("flax.nnx", reason="flax is an optional extra: pip install "
                                             "jax_moe_comm[flax]")

from jax_moe_comm.flax import MoE  # noqa: E402
from jax_moe_comm.moe import dense_forward  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_module_matches_dense_layer_and_compiles_once(axis_type):
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((4,), ("ep",), axis_types=(kind,), devices=jax.devices()[:4])
    moe = MoE(num_experts=8, experts_per_token=3, hidden=128, ffn=256, max_num_tokens=8,
              mesh=mesh, rngs=nnx.Rngs(0))
    assert moe.config.world_size == 4 and moe.a2a.layout == "packed"
    traces = []

    @nnx.jit
    def step(m, x, n):
        traces.append(1)
        return m(x, n)

    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(np.asarray(v)) for k, v in moe._params().items()}
    for n in ([8, 8, 8, 8], [3, 0, 8, 1]):
        x = rng.standard_normal((32, 128)).astype(jnp.bfloat16)
        y = np.asarray(step(moe, jnp.asarray(x), jnp.array(n, jnp.int32)), np.float32)
        for r in range(4):
            ref = dense_forward(moe.layer, params, jnp.asarray(x[8 * r:8 * r + 8]), n[r])
            np.testing.assert_allclose(y[8 * r:8 * r + 8], np.asarray(ref, np.float32),
                                       atol=0.05)
    assert len(traces) == 1
    moe.close()


def test_module_refuses_an_axis_the_mesh_lacks():
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match=r"axis_name='ep' is not an axis of the mesh, whose "
                                         r"axes are \('data',\)"):
        MoE(num_experts=8, experts_per_token=2, hidden=128, ffn=128, max_num_tokens=4,
            mesh=mesh, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("script, args, expect", [
    ("flax_train.py", ["--steps", "8"], "decreasing: OK"),
    ("flax_decode.py", ["--steps", "4"], "traced 1x"),
])
def test_example_runs(script, args, expect):
    env = child_env()
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout and "backend=reference" in r.stdout, r.stdout
