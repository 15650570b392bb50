"""NVSHMEM bootstrap over JAX's coordination service: one PE per process."""

from __future__ import annotations

import itertools

import jax

from . import native
from .errors import NativeUnavailableError

UID_KEY = "jax_moe_comm:nvshmem_uid"
UID_TIMEOUT_MS = 120_000
KV_TIMEOUT_MS = 300_000
_STAGED: bool | None = None  # some peer is not reachable by load/store (decided at init)
_TAGS = itertools.count()  # per-process: the same sequence on every process


def _kv_client():
    from ._jax_compat import distributed_state

    client = distributed_state().client
    if client is None and jax.process_count() > 1:
        raise NativeUnavailableError("jax.distributed is not initialized")
    return client


def process_layout_problem(world_size: int | None = None) -> str:
    """'' when this job has the nvshmem backend's process layout (one GPU per process, one
    rank per process along the expert-parallel axis), else what is wrong and what to do."""
    from . import distributed

    problem = distributed.uninitialized_job_problem()  # a cluster manager's task, alone
    if problem:
        return problem
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
    # Put sources must be symmetric for peers reached over a network transport; every rank
    # must agree, since the staging buffers are part of the collective allocation.
    global _STAGED
    reachable = all_gather("p2p", "1" if mod.probe_peers_p2p() else "0")
    _STAGED = "0" in reachable


def staged() -> bool:
    """Whether puts are staged through symmetric memory (some peer is not load/store)."""
    if _STAGED is None:
        raise RuntimeError("jax_moe_comm.init() has not run")
    return _STAGED


def next_collective_tag(kind: str) -> str:
    """A key-value store tag for the next collective step of this process (same on every
    process as long as they make the same calls in the same order)."""
    return f"{kind}{next(_TAGS)}"


def all_gather(tag: str, value: str) -> list[str]:
    """Every process's `value` for `tag`, in rank order, through JAX's key-value store."""
    client = _kv_client()
    if client is None:
        return [value]
    rank = jax.process_index()
    client.key_value_set(f"jax_moe_comm:{tag}:{rank}", "=" + value)  # "=": never empty
    return [client.blocking_key_value_get(f"jax_moe_comm:{tag}:{r}", KV_TIMEOUT_MS)[1:]
            for r in range(jax.process_count())]


def finalize() -> None:
    """Finalize NVSHMEM (after every handle is closed). No-op when it was never initialized."""
    if native.built() and native._native.initialized():
        native._native.finalize()
