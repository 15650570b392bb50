"""Child side of the launcher: jax.distributed from the environment it sets."""

from __future__ import annotations

import os

import jax


def launched() -> bool:
    return "JAX_MOE_COMM_COORDINATOR" in os.environ


def initialize() -> tuple[int, int]:
    """jax.distributed.initialize from the launcher's variables; returns (rank, world).

    Without the launcher: a single process, nothing to do. On CPU it selects gloo so that
    XLA's collectives (the reference backend) work across processes.
    """
    if not launched():
        return 0, 1
    rank = int(os.environ["JAX_MOE_COMM_PROCESS_ID"])
    world = int(os.environ["JAX_MOE_COMM_NUM_PROCESSES"])
    kwargs = {}
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
        kwargs["local_device_ids"] = [0]  # the launcher sets CUDA_VISIBLE_DEVICES
    jax.distributed.initialize(coordinator_address=os.environ["JAX_MOE_COMM_COORDINATOR"],
                               num_processes=world, process_id=rank, **kwargs)
    return rank, world
