"""Shared start-up of the examples: 8 emulated CPU devices in one process unless launched by
`python -m jax_moe_comm.launch` (then one device per process, jax.distributed set up)."""

import os


def start(devices: int = 8) -> tuple[int, int]:
    """Call before importing jax. Returns (process index, process count)."""
    from jax_moe_comm import distributed as dist  # imports jax, but starts no backend

    if not dist.managed():  # neither our launcher nor srun / mpirun: emulated CPU devices
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


def local_copy(arr, tag: str):
    """The whole of a global array on this process's first device: replicated arrays from the
    local copy, arrays sharded on their first axis over one device per process through JAX's
    key-value store (an XLA all-gather would need NCCL, which refuses several ranks on one
    GPU). Single process: every shard is here."""
    import base64
    import io

    import jax
    import numpy as np

    from jax_moe_comm import bootstrap

    local = jax.local_devices()[0]
    if arr.is_fully_addressable:
        return jax.device_put(np.asarray(arr), local)
    if arr.sharding.is_fully_replicated:
        return jax.device_put(np.asarray(arr.addressable_data(0)), local)
    shard = arr.addressable_shards[0]
    data = np.asarray(shard.data)
    buf = io.BytesIO()  # as unsigned ints: np.save cannot name bfloat16
    np.save(buf, data.view(f"u{data.dtype.itemsize}"), allow_pickle=False)
    mine = f"{shard.index[0].start or 0}:{base64.b64encode(buf.getvalue()).decode()}"
    parts = []
    for value in bootstrap.all_gather(f"example:{tag}", mine):
        start, blob = value.split(":", 1)
        parts.append((int(start), np.load(io.BytesIO(base64.b64decode(blob))).view(data.dtype)))
    return jax.device_put(np.concatenate([p for _, p in sorted(parts, key=lambda p: p[0])]),
                          local)
