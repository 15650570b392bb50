"""Shared start-up of the examples: 8 emulated CPU devices in one process unless launched by
`python -m jax_moe_comm.launch` (then one device per process, jax.distributed set up)."""

import os


def start(devices: int = 8) -> tuple[int, int]:
    """Call before importing jax. Returns (process index, process count)."""
    from jax_moe_comm import distributed as dist  # imports jax, but starts no backend

    if not dist.launched():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flag = f"--xla_force_host_platform_device_count={devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    return dist.initialize()


def put(a, mesh, spec):
    """A global array from the full numpy value `a` (the same on every process): each process
    places only its own shards, so this also works across processes."""
    import jax
    import numpy as np

    a = np.asarray(a)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
