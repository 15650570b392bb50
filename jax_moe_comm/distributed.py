"""jax.distributed from the environment: our launcher's, or a cluster manager's.

The launcher exports JAX's own variables (JAX_COORDINATOR_ADDRESS, JAX_LOCAL_DEVICE_IDS on
GPU, JAX_CPU_COLLECTIVES_IMPLEMENTATION on CPU) and the conventional JAX_NUM_PROCESSES and
JAX_PROCESS_ID, which JAX itself does not read: importing jax_moe_comm registers a JAX cluster
environment that does, so a plain `jax.distributed.initialize()` works under the launcher.

Under a cluster manager (SLURM's srun, Open MPI's mpirun) nothing here parses the manager's
variables: `initialize()` asks JAX's own cluster environments (jax/_src/clusters/) whether one
is present and then calls `jax.distributed.initialize()`, which derives the coordinator, the
process count and id and the local device from them (docs/multinode.md).
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
    from ._jax_compat import clusters
    if clusters is None:  # a JAX without cluster environments: initialize() still works
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


# JAX cluster environments (ClusterEnv.name) whose tasks are the processes of one job, one per
# GPU: initialize() defers to jax.distributed.initialize() when one of them is present. Others
# (Kubernetes, Cloud TPU) are left to the user's own jax.distributed.initialize(): asking
# whether they are present can query a cluster API. "prrte" is Open MPI 5 in JAXes that have it
# (0.11 routes Open MPI 5 through its "ompi" environment and mpi4py).
SCHEDULERS = ("ompi", "prrte", "slurm")


def scheduler():
    """The JAX cluster environment (e.g. jax._src.clusters.SlurmCluster) that a plain
    jax.distributed.initialize() would use here, if it is one of SCHEDULERS; else None (also
    under our launcher, whose variables win, and with JAX_PROCESS_ID etc. set by hand)."""
    if launched():
        return None
    from ._jax_compat import clusters
    if clusters is None:
        return None
    for env in clusters.ClusterEnv._cluster_types:  # JAX's order: the first present wins
        if env.opt_in_only_method or env.name not in SCHEDULERS:
            continue
        try:
            if env.is_env_present():
                return env
        except Exception:  # noqa: BLE001 - a broken environment is JAX's to report
            continue
    return None


def managed() -> bool:
    """Started by our launcher or by a cluster manager of SCHEDULERS: initialize() will set
    jax.distributed up (scripts use it to choose between a real run and a one-process one)."""
    return launched() or scheduler() is not None


def _job(env) -> str:
    """'SLURM task 3 of 16 (local 3)', from JAX's reading of the manager's variables."""
    names = {"slurm": "SLURM", "ompi": "Open MPI", "prrte": "Open MPI (PRRTE)"}
    try:
        local = env.get_local_process_id()
        return (f"{names.get(env.name, env.name)} task {env.get_process_id()} of "
                f"{env.get_process_count()}" + ("" if local is None else f" (local {local})"))
    except Exception:  # noqa: BLE001
        return names.get(env.name, env.name)


def _on_cpu() -> bool:
    return os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu"


def _local_device_ids(env) -> list[int] | None:
    """None (JAX's default under a manager: local rank i drives visible GPU i), or [0] where
    the manager bound one GPU to this task. Raises where the default cannot work."""
    if _on_cpu() or os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None  # CPU: no GPU to pick; JAX_LOCAL_DEVICE_IDS: JAX reads it itself
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    visible = [d for d in cvd.split(",") if d.strip()]
    if len(visible) == 1:
        # srun --gpus-per-task=1 / --gpu-bind=single:1, mpirun with a binding script: this
        # task sees one GPU, ordinal 0, whatever its local rank (JAX would pick ordinal
        # `local rank`, which does not exist; jax-ml/jax#23452, #28194).
        return [0]
    try:
        local = env.get_local_process_id()
    except Exception:  # noqa: BLE001
        return None
    if local is not None and visible and local >= len(visible):
        raise RuntimeError(
            f"jax_moe_comm.distributed.initialize(): this process is {_job(env)} and JAX "
            f"would give it GPU {local} (its local rank), but it sees {len(visible)} GPUs "
            f"(CUDA_VISIBLE_DEVICES={cvd}). Start one task per GPU of each node (srun "
            "--ntasks-per-node=<GPUs per node>), or bind one GPU per task (srun "
            "--gpus-per-task=1), or set JAX_LOCAL_DEVICE_IDS yourself.")
    return None


def uninitialized_job_problem() -> str:
    """'' unless a cluster manager started this process as one of several tasks and
    jax.distributed is not initialized (each task would run as a job of one), else what to
    do. Read at handle creation on GPUs (bootstrap.process_layout_problem)."""
    if is_initialized() or launched():
        return ""
    env = scheduler()
    if env is None:
        return ""
    try:
        count = env.get_process_count()
    except Exception:  # noqa: BLE001
        return ""
    if count <= 1:
        return ""
    return (f"this process is {_job(env)}, but jax.distributed is not initialized, so it "
            "runs as a job of one. Call jax_moe_comm.distributed.initialize() (or "
            "jax.distributed.initialize()) first thing in the script, before anything "
            "touches jax.devices() (docs/multinode.md).")


def is_initialized() -> bool:
    return jax.distributed.is_initialized()


def _cpu_collectives() -> None:
    """gloo for XLA:CPU collectives across processes (the reference backend on CPU), unless
    JAX_CPU_COLLECTIVES_IMPLEMENTATION already names one (JAX reads that itself)."""
    if _on_cpu() and not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(timeout_s: float | None = None) -> tuple[int, int]:
    """jax.distributed.initialize from the environment; returns (rank, world).

    - Started by `python -m jax_moe_comm.launch` (or with JAX_COORDINATOR_ADDRESS,
      JAX_NUM_PROCESSES and JAX_PROCESS_ID set): from those variables.
    - Started by a cluster manager JAX detects (srun under SLURM, mpirun of Open MPI; see
      SCHEDULERS): a plain jax.distributed.initialize(), which reads the manager's variables
      itself. On GPU, JAX gives local task i the node's visible GPU i; where the manager
      bound one GPU to each task (CUDA_VISIBLE_DEVICES lists one), that one is taken.
    - Neither: a single process, nothing to do. Already initialized (by you, by plain
      jax.distributed.initialize()): nothing to do.

    On CPU (JAX_PLATFORMS=cpu) it selects gloo so that XLA's collectives (the reference
    backend) work across processes. `timeout_s` bounds the wait for every process to reach
    the coordinator (JAX's initialization_timeout, 300 s by default); a failure raises a
    RuntimeError that says which job layout JAX read and what to check first.
    Call it before anything touches jax.devices().
    """
    if is_initialized():
        return jax.process_index(), jax.process_count()
    kwargs = {} if timeout_s is None else {"initialization_timeout": max(1, int(timeout_s))}
    if launched():
        rank, world = int(_env(PROCESS_ID)), int(_env(NUM_PROCESSES))
        _cpu_collectives()
        if not _on_cpu() and not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
            kwargs["local_device_ids"] = [0]  # the launcher sets CUDA_VISIBLE_DEVICES
        jax.distributed.initialize(coordinator_address=_env(COORDINATOR),
                                   num_processes=world, process_id=rank, **kwargs)
        return rank, world
    env = scheduler()
    if env is None:
        return 0, 1
    _cpu_collectives()
    local = _local_device_ids(env)
    if local is not None:
        kwargs["local_device_ids"] = local
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:
        from ._jax_compat import distributed_state

        where = getattr(distributed_state(), "coordinator_address", None) or "not derived"
        port = os.environ.get("JAX_COORDINATOR_PORT")
        raise RuntimeError(
            f"jax.distributed.initialize() failed under {_job(env)}, coordinator {where}"
            f"{' (JAX_COORDINATOR_PORT=' + port + ')' if port else ''}: {e}\n"
            "Check first: every task of the step was started (srun / mpirun, not the batch "
            "script alone) and reached this call; the coordinator host resolves on every node "
            "and its port is open between nodes (JAX_COORDINATOR_PORT picks another); no "
            "stale process of an earlier run holds the port (docs/multinode.md).") from e
    return jax.process_index(), jax.process_count()


_register_cluster_env()
