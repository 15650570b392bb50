"""NVSHMEM bootstrap over JAX's coordination service: one PE per process."""

from __future__ import annotations

import jax

from . import native
from .errors import NativeUnavailableError

UID_KEY = "jax_moe_comm:nvshmem_uid"
UID_TIMEOUT_MS = 120_000


def _kv_client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None and jax.process_count() > 1:
        raise NativeUnavailableError("jax.distributed is not initialized")
    return client


def process_layout_problem(world_size: int | None = None) -> str:
    """'' when this job has the nvshmem backend's process layout (one GPU per process, one
    rank per process along the expert-parallel axis), else what is wrong and what to do."""
    local = len(jax.local_devices())
    if local != 1:
        return (f"the nvshmem backend runs one process per GPU (one NVSHMEM PE each), but this "
                f"process drives {local} devices (a single JAX process takes every GPU it sees). "
                f"Launch one process per GPU: `python -m jax_moe_comm.launch -n {local} -- "
                "python your_script.py` (it sets jax.distributed up; on SLURM: srun with one "
                "task per GPU, then jax.distributed.initialize()), or pass backend='reference' "
                "(XLA all_to_all, runs in this process layout).")
    count = jax.process_count()
    if world_size is not None and world_size != count:
        return (f"the nvshmem backend makes one rank of every process: world_size={world_size} "
                f"but jax.process_count()={count}. The expert-parallel axis must span all "
                f"processes, one GPU each (MoEConfig.world_size={count}); or pass "
                "backend='reference'.")
    return ""


def init() -> None:
    """Initialize NVSHMEM for this process (idempotent). Call after jax.distributed.initialize.

    PE = jax.process_index(), n_pes = jax.process_count(); the device is this process's one
    local GPU. Rank 0 makes the unique id and publishes it in the key-value store.
    """
    mod = native.module()
    if mod.initialized():
        return
    problem = process_layout_problem()
    if problem:
        raise NativeUnavailableError(problem)
    local = jax.local_devices()
    rank, nranks = jax.process_index(), jax.process_count()
    if nranks == 1:
        uid = mod.make_unique_id()
    else:
        client = _kv_client()
        if rank == 0:
            uid = mod.make_unique_id()
            client.key_value_set_bytes(UID_KEY, uid)
        else:
            uid = client.blocking_key_value_get_bytes(UID_KEY, UID_TIMEOUT_MS)
    device = getattr(local[0], "local_hardware_id", None)
    device = local[0].id if device is None else device
    mod.init(uid, rank, nranks, int(device))
    native.register_targets()


def finalize() -> None:
    """Finalize NVSHMEM (after every handle is closed). No-op when it was never initialized."""
    if native.built() and native._native.initialized():
        native._native.finalize()
