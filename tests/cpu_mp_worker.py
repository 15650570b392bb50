"""Multi-process CPU run (launched by tests/test_launcher.py): 2 processes x 4 CPU devices,
reference backend over XLA:CPU collectives (gloo), checked against the oracle on each rank."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax_moe_comm.distributed as dist  # noqa: E402

rank, world = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_moe_comm import AllToAll, MoEConfig, testing as T  # noqa: E402

ep = len(jax.devices())
assert ep == 4 * world, jax.devices()
for dp, dtype in ((1, jnp.bfloat16), (2, jnp.float8_e4m3fn)):
    cfg = MoEConfig(num_experts=2 * ep, experts_per_token=3, hidden=256, max_num_tokens=8,
                    world_size=ep, token_replicas=dp, dispatch_dtype=dtype)
    a2a = AllToAll(cfg)
    mesh = T.make_mesh(ep)
    step = T.make_step(a2a, mesh)
    for seed in range(3):
        err = T.run_and_check(a2a, mesh, T.make_inputs(cfg, seed), step=step)
    print(f"process {rank}/{world}: EP{ep} dp{dp} {jnp.dtype(dtype).name} ok, max err {err:.3g}",
          flush=True)
sys.exit(0)
