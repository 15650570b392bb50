"""Child side of the launcher: jax.distributed from the environment it sets.

The launcher exports JAX's own variables (JAX_COORDINATOR_ADDRESS, JAX_LOCAL_DEVICE_IDS on
GPU, JAX_CPU_COLLECTIVES_IMPLEMENTATION on CPU) and the conventional JAX_NUM_PROCESSES and
JAX_PROCESS_ID, which JAX itself does not read: importing jax_moe_comm registers a JAX cluster
environment that does, so a plain `jax.distributed.initialize()` works under the launcher.
"""

from __future__ import annotations

import os

import jax

COORDINATOR, NUM_PROCESSES, PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# The launcher's own names of the same values (kept for scripts written against them).
LEGACY = {COORDINATOR: "JAX_MOE_COMM_COORDINATOR", NUM_PROCESSES: "JAX_MOE_COMM_NUM_PROCESSES",
          PROCESS_ID: "JAX_MOE_COMM_PROCESS_ID"}


def _env(name: str) -> str | None:
    return os.environ.get(name) or os.environ.get(LEGACY[name])


def launched() -> bool:
    """Started by `python -m jax_moe_comm.launch` (or with the three JAX_* variables set)."""
    return all(_env(n) for n in (COORDINATOR, NUM_PROCESSES, PROCESS_ID))


def _register_cluster_env() -> None:
    """Teach jax.distributed.initialize() to read JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
    try:
        from jax._src import clusters
    except ImportError:  # a JAX without cluster environments: initialize() still works
        return

    class LaunchedByEnvironment(clusters.ClusterEnv):
        name = "jax_moe_comm_env"
        opt_in_only_method = False

        @classmethod
        def is_env_present(cls) -> bool:
            return launched()

        @classmethod
        def get_coordinator_address(cls, *args, **kwargs) -> str:
            return _env(COORDINATOR)

        @classmethod
        def get_process_count(cls) -> int:
            return int(_env(NUM_PROCESSES))

        @classmethod
        def get_process_id(cls) -> int:
            return int(_env(PROCESS_ID))

        @classmethod
        def get_local_process_id(cls):
            return None  # JAX_LOCAL_DEVICE_IDS (set by the launcher on GPU) says it

    # Explicitly set variables win over a surrounding scheduler's (a launcher run inside a
    # SLURM allocation inherits SLURM_* variables that describe a different job layout).
    types = clusters.ClusterEnv._cluster_types
    if LaunchedByEnvironment in types:
        types.remove(LaunchedByEnvironment)
        types.insert(0, LaunchedByEnvironment)


def is_initialized() -> bool:
    try:
        from jax._src import distributed

        return distributed.global_state.client is not None
    except (ImportError, AttributeError):
        return False


def initialize() -> tuple[int, int]:
    """jax.distributed.initialize from the launcher's variables; returns (rank, world).

    Without the launcher: a single process, nothing to do. Already initialized (by you, by
    plain jax.distributed.initialize()): nothing to do. On CPU it selects gloo so that XLA's
    collectives (the reference backend) work across processes.
    """
    if is_initialized():
        return jax.process_index(), jax.process_count()
    if not launched():
        return 0, 1
    rank, world = int(_env(PROCESS_ID)), int(_env(NUM_PROCESSES))
    kwargs = {}
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    elif not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        kwargs["local_device_ids"] = [0]  # the launcher sets CUDA_VISIBLE_DEVICES
    jax.distributed.initialize(coordinator_address=_env(COORDINATOR), num_processes=world,
                               process_id=rank, **kwargs)
    return rank, world


_register_cluster_env()
