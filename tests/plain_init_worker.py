"""A user script that knows nothing of the launcher: plain jax.distributed.initialize(), then
the reference backend across processes (launched by tests/test_launcher.py)."""

import jax
import jax.numpy as jnp

import jax_moe_comm as jmc  # importing it lets initialize() read JAX_NUM_PROCESSES/PROCESS_ID

jax.distributed.initialize()
n = jax.process_count()
cfg = jmc.MoEConfig(num_experts=2 * n, experts_per_token=2, hidden=128, max_num_tokens=4,
                    world_size=n)
from jax_moe_comm import testing as T  # noqa: E402

a2a = jmc.AllToAll(cfg)
err = T.run_and_check(a2a, T.make_mesh(n), T.make_inputs(cfg, 0))
print(f"plain init: process {jax.process_index()} of {n}, {jnp.dtype(cfg.dispatch_dtype).name}"
      f" ok", flush=True)
