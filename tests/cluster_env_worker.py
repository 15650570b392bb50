"""A user script started by a cluster manager (tests/test_cluster_env.py fakes the variables
srun or mpirun set): jax_moe_comm.distributed.initialize() defers to JAX's own cluster
detection, then dispatch + combine on the reference backend across the processes (XLA:CPU
collectives over gloo), checked against the numpy oracle of jax_moe_comm.testing.

argv[1]: the initialization timeout in seconds (a missing task must fail, not hang)."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax_moe_comm.distributed as dist  # noqa: E402

env = dist.scheduler()
print(f"detected {env.name if env else None}", flush=True)
try:
    rank, world = dist.initialize(timeout_s=float(sys.argv[1]))
except RuntimeError as e:
    print(f"INIT FAILED: {e}", flush=True)
    sys.exit(3)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src import distributed  # noqa: E402

from jax_moe_comm import AllToAll, MoEConfig, testing as T  # noqa: E402

ep = len(jax.devices())
assert (rank, world) == (jax.process_index(), jax.process_count()), (rank, world)
assert ep == 2 * world and len(jax.local_devices()) == 2, jax.devices()
print(f"process {rank} of {world}, coordinator {distributed.global_state.coordinator_address}, "
      f"cpu collectives {jax.config.jax_cpu_collectives_implementation}", flush=True)
for dp, dtype in ((1, jnp.bfloat16), (2, jnp.float8_e4m3fn)):
    cfg = MoEConfig(num_experts=2 * ep, experts_per_token=3, hidden=128, max_num_tokens=8,
                    world_size=ep, token_replicas=dp, dispatch_dtype=dtype)
    a2a = AllToAll(cfg, backend="reference")
    mesh = T.make_mesh(ep)
    step = T.make_step(a2a, mesh)
    for seed in range(2):
        err = T.run_and_check(a2a, mesh, T.make_inputs(cfg, seed), step=step)
    print(f"EP{ep} dp{dp} {jnp.dtype(dtype).name} ok, max err {err:.3g}", flush=True)
jax.distributed.shutdown()
sys.exit(0)
