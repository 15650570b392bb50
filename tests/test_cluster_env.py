"""Multi-node without our launcher (issue 25): processes started by a cluster manager.

Two CPU processes get the variables srun (SLURM) or mpirun (Open MPI 4, ORTE) sets and run
tests/cluster_env_worker.py: jax_moe_comm.distributed.initialize() must defer to JAX's own
cluster detection (jax/_src/clusters/slurm_cluster.py, ompi_cluster.py), which derives the
coordinator address from the manager's variables, and the reference backend must then run
dispatch + combine across the processes. Every subprocess has a timeout: nothing here can
hang CI.
"""

import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import pytest

# Left out of `scripts/test.sh --quick`: starts cluster-manager tasks as processes.
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cluster_env_worker.py")
EPHEMERAL = 65535 - 2**12 + 1  # JAX's coordinator port: EPHEMERAL + job id % 4096
# Variables of other launchers and managers that would change what JAX detects.
FOREIGN = ("SLURM_", "OMPI_", "PMIX_", "PRTE_", "JAX_MOE_COMM_", "JAX_COORDINATOR_",
           "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "XLA_FLAGS", "KUBERNETES_SERVICE_HOST")


def _port_is_free(port: int) -> bool:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno == 99:  # no IPv6 on this host
                continue
            return False
    return True


def _free_coordinator_port() -> int:
    """A port in JAX's range that nothing listens on now (the manager's job id picks it)."""
    for _ in range(200):
        port = random.randrange(EPHEMERAL, 65536)
        if _port_is_free(port):
            return port
    raise RuntimeError("no free port in JAX's coordinator range")


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    return env


def slurm_env(ntasks: int, port: int) -> list[dict]:
    """What srun -n N on one node sets (the part JAX reads, plus a few neighbours). JAX's
    SlurmCluster takes the first host of SLURM_STEP_NODELIST and port EPHEMERAL +
    SLURM_JOB_ID % 4096: the job id is chosen so that the port is a free one."""
    job_id = (port - EPHEMERAL) + 2**12 * random.randrange(1, 500)
    common = dict(SLURM_JOB_ID=str(job_id), SLURM_JOBID=str(job_id), SLURM_STEP_ID="0",
                  SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks), SLURM_NNODES="1",
                  SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS=str(ntasks),
                  SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
                  SLURM_NODEID="0", SLURM_TASKS_PER_NODE=str(ntasks))
    return [dict(common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(2)]


def ompi_env(ntasks: int, port: int) -> list[dict]:
    """What mpirun -n N of Open MPI 4 (ORTE) sets. JAX's OmpiCluster takes the host of the
    tcp:// URI in OMPI_MCA_orte_hnp_uri and port EPHEMERAL + (job id // 4096) % 4096, the job
    id being the URI's first field."""
    job_id = ((port - EPHEMERAL) + 2**12 * random.randrange(1, 200)) * 2**12
    common = dict(OMPI_MCA_orte_hnp_uri=f"{job_id}.0;tcp://127.0.0.1:{port - 1}",
                  OMPI_COMM_WORLD_SIZE=str(ntasks), OMPI_COMM_WORLD_LOCAL_SIZE=str(ntasks),
                  OMPI_UNIVERSE_SIZE=str(ntasks), OMPI_VERSION="4.1.6")
    return [dict(common, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                 OMPI_COMM_WORLD_NODE_RANK=str(r)) for r in range(2)]


def run_two(task_envs: list[dict], init_timeout_s: int, timeout_s: float):
    """Start one worker per task environment; return [(returncode, output)] in task order.
    Every process is killed at `timeout_s`."""
    procs = []
    for extra in task_envs:
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, str(init_timeout_s)], env={**_base_env(), **extra},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=tempfile.gettempdir()))
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                pytest.fail(f"a task ran past {timeout_s} s (a hang):\n{out[-3000:]}")
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.parametrize("manager, make_env, name", [
    ("slurm", slurm_env, "slurm"), ("openmpi", ompi_env, "ompi")])
def test_two_tasks_of_a_cluster_manager_run_the_reference_backend(manager, make_env, name):
    port = _free_coordinator_port()
    host = "localhost" if name == "slurm" else "127.0.0.1"
    results = run_two(make_env(2, port), init_timeout_s=60, timeout_s=90)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"{manager} task {rank}:\n{out[-4000:]}"
        assert f"detected {name}" in out, out
        assert (f"process {rank} of 2, coordinator {host}:{port}, cpu collectives gloo"
                in out), out
        assert "EP4 dp1 bfloat16 ok" in out and "EP4 dp2 float8_e4m3fn ok" in out, out


def test_a_task_that_never_starts_stops_the_others_at_the_timeout():
    """SLURM_NTASKS says 3, two tasks run (python started in the batch script of a 3-task job,
    a task that died before its import): both must stop at the initialization timeout, not
    wait forever. JAX's coordination client ends the process itself there (a fatal log and
    SIGABRT, not a Python exception), naming the RPC that ran out."""
    port = _free_coordinator_port()
    t0 = time.monotonic()
    results = run_two(slurm_env(3, port), init_timeout_s=3, timeout_s=60)
    assert time.monotonic() - t0 < 45
    for code, out in results:
        assert code != 0 and "detected slurm" in out, out[-4000:]
        assert "DEADLINE_EXCEEDED" in out and "RegisterTask" in out, out[-4000:]


def test_an_inconsistent_layout_is_named():
    """SLURM_PROCID outside SLURM_NTASKS (a variable exported by hand over srun's): JAX
    refuses it at once; the error says which layout JAX read and what to check."""
    port = _free_coordinator_port()
    task = dict(slurm_env(2, port)[1], SLURM_PROCID="2")
    (code, out), = run_two([task], init_timeout_s=10, timeout_s=60)
    assert code == 3, out[-4000:]
    assert ("INIT FAILED: jax.distributed.initialize() failed under SLURM task 2 of 2 (local 1)"
            in out), out[-4000:]
    assert "process_id < num_processes" in out and "every task of the step" in out, out


# -- detection and device choice, in this process (no jax.distributed) ----------------------

def _clear(monkeypatch):
    for k in list(os.environ):
        if k.startswith(FOREIGN):
            monkeypatch.delenv(k)


def _slurm(monkeypatch, ntasks=4, procid=1, localid=1):
    _clear(monkeypatch)
    for k, v in dict(SLURM_JOB_ID="1234", SLURM_NTASKS=str(ntasks), SLURM_PROCID=str(procid),
                     SLURM_LOCALID=str(localid), SLURM_STEP_NODELIST="gpu[007-008]").items():
        monkeypatch.setenv(k, v)


def test_scheduler_is_the_environment_jax_detects(monkeypatch):
    from jax._src import clusters

    import jax_moe_comm.distributed as dist

    _clear(monkeypatch)
    assert dist.scheduler() is None
    _slurm(monkeypatch)
    assert dist.scheduler() is clusters.SlurmCluster
    assert dist.scheduler().get_coordinator_address(None, None) == "gpu007:62674"
    # mpirun inside a SLURM allocation: JAX checks Open MPI first, so do we.
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.0.0.1:34911")
    assert dist.scheduler() is clusters.OmpiCluster
    # our launcher's variables win over both
    for k, v in dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:1", JAX_NUM_PROCESSES="2",
                     JAX_PROCESS_ID="0").items():
        monkeypatch.setenv(k, v)
    assert dist.scheduler() is None


def test_local_device_follows_jax_or_the_managers_binding(monkeypatch):
    from jax._src import clusters

    import jax_moe_comm.distributed as dist

    _slurm(monkeypatch, localid=5)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    env = clusters.SlurmCluster
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert dist._local_device_ids(env) is None  # JAX: local rank 5 -> GPU 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert dist._local_device_ids(env) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # srun --gpus-per-task=1
    assert dist._local_device_ids(env) == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # 2 GPUs for local rank 5: cannot work
    with pytest.raises(RuntimeError, match=r"SLURM task 1 of 4 \(local 5\).*sees 2 GPUs"):
        dist._local_device_ids(env)
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "1")  # the user's choice: JAX reads it
    assert dist._local_device_ids(env) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS")
    assert dist._local_device_ids(env) is None


def test_a_task_that_skipped_initialize_is_told_at_handle_creation(monkeypatch):
    """Without jax.distributed, every task of a 4-task job would run as a job of one."""
    from jax_moe_comm import bootstrap, distributed as dist

    _slurm(monkeypatch)
    problem = bootstrap.process_layout_problem(4)
    assert "SLURM task 1 of 4 (local 1), but jax.distributed is not initialized" in problem
    assert "jax_moe_comm.distributed.initialize()" in problem
    _slurm(monkeypatch, ntasks=1, procid=0, localid=0)  # a job of one task: nothing to say
    assert dist.uninitialized_job_problem() == ""


def test_managed_covers_the_launcher_and_the_managers(monkeypatch):
    """demo.py (and scripts like it) run on emulated CPU devices unless managed()."""
    import jax_moe_comm.distributed as dist

    _clear(monkeypatch)
    assert not dist.managed()
    _slurm(monkeypatch)
    assert dist.managed()
