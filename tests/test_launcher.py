"""The launcher: multi-process CPU runs, rank-prefixed output, failure and timeout handling."""

import inspect
import os
import subprocess
import sys
import tempfile

import pytest

from cpu_env import child_env

# Left out of `scripts/test.sh --quick`: starts 2-8 processes per test.
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(*args, timeout=300):
    env = child_env()
    # Run from a neutral folder so the installed package is the one imported.
    return subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tempfile.gettempdir())


def test_two_processes_reference_backend_match_oracle():
    r = launch("-n", "2", "--platform", "cpu", "--timeout", "240", "--",
               sys.executable, os.path.join(HERE, "cpu_mp_worker.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] process {rank}/2: EP8 dp1 bfloat16 ok" in r.stdout, r.stdout
        assert f"[rank {rank}] process {rank}/2: EP8 dp2 float8_e4m3fn ok" in r.stdout, r.stdout


def test_failing_rank_stops_the_others():
    code = ("import os, sys, time; r = int(os.environ['JAX_MOE_COMM_PROCESS_ID']); "
            "print('up', r, flush=True); sys.exit(3) if r == 1 else time.sleep(120)")
    r = launch("-n", "3", "--platform", "cpu", "--", sys.executable, "-c", code, timeout=60)
    assert r.returncode == 3
    assert "[rank 1] up 1" in r.stdout
    assert "rank 1 exited with 3; stopping the others" in r.stdout


def test_keep_going_lets_the_others_finish():
    # A survivor of a dead rank still reports and exits on its own (serve_decode --kill-at).
    code = ("import os, sys, time; r = int(os.environ['JAX_MOE_COMM_PROCESS_ID']); "
            "sys.exit(3) if r == 1 else (time.sleep(1.5), print('survived', r, flush=True))")
    r = launch("-n", "3", "--platform", "cpu", "--keep-going", "--", sys.executable, "-c",
               code, timeout=60)
    assert r.returncode == 3
    assert "rank 1 exited with 3; the others run on" in r.stdout
    for rank in (0, 2):
        assert f"[rank {rank}] survived {rank}" in r.stdout, r.stdout


def test_timeout_kills_every_rank():
    r = launch("-n", "2", "--platform", "cpu", "--timeout", "2", "--", sys.executable, "-c",
               "import time; time.sleep(120)", timeout=60)
    assert r.returncode == 124
    assert "timeout after 2 s" in r.stdout


def test_environment_for_children():
    code = ("import os; e = os.environ; print(e['JAX_PROCESS_ID'], e['JAX_NUM_PROCESSES'], "
            "e['JAX_COORDINATOR_ADDRESS'] == e['JAX_MOE_COMM_COORDINATOR'], "
            "e['JAX_MOE_COMM_PROCESS_ID'], e['JAX_PLATFORMS'], "
            "e['JAX_CPU_COLLECTIVES_IMPLEMENTATION'], e['NVSHMEM_DISABLE_NVLS'], flush=True)")
    r = launch("-n", "2", "--platform", "cpu", "--", sys.executable, "-c", code, timeout=60)
    assert r.returncode == 0, r.stdout
    assert "[rank 0] 0 2 True 0 cpu gloo 1" in r.stdout, r.stdout
    assert "[rank 1] 1 2 True 1 cpu gloo 1" in r.stdout, r.stdout


def test_plain_jax_distributed_initialize_works_under_the_launcher():
    r = launch("-n", "2", "--platform", "cpu", "--timeout", "240", "--",
               sys.executable, os.path.join(HERE, "plain_init_worker.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] plain init: process {rank} of 2, bfloat16 ok" in r.stdout, r.stdout


def test_launcher_variables_win_over_a_surrounding_slurm_job(monkeypatch):
    """Inside a SLURM allocation the children inherit SLURM_*; the launcher's layout wins."""
    from jax._src import clusters

    import jax_moe_comm  # noqa: F401 - registers the environment

    for k, v in dict(SLURM_JOB_ID="7", SLURM_NTASKS="16", SLURM_PROCID="3", SLURM_LOCALID="3",
                     SLURM_STEP_NODELIST="node1", JAX_COORDINATOR_ADDRESS="127.0.0.1:1",
                     JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="2").items():
        monkeypatch.setenv(k, v)
    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    rest = [None] * (len(inspect.signature(detect).parameters) - 4)  # method[, timeout]
    assert tuple(detect(None, None, None, None, *rest)[:3]) == ("127.0.0.1:1", 4, 2)
    monkeypatch.delenv("JAX_PROCESS_ID")  # not launched by us: SLURM's layout again
    assert detect(None, None, None, None, *rest)[1:3] == (16, 3)


@pytest.mark.parametrize("args, msg", [(["-n", "2"], "usage"),
                                       (["-n", "0", "--", "true"], "at least one process")])
def test_bad_arguments(args, msg):
    r = launch(*args, timeout=60)
    assert r.returncode != 0
    assert msg in r.stdout + r.stderr


def test_gpu_layout_worker_runs_on_cpu_with_the_reference_backend():
    """The GPU worker script itself (harness, gathers, expectations per backend) on 2 CPU
    processes, so a worker bug shows up in CI, not first on the GPU machine."""
    r = launch("-n", "2", "--platform", "cpu", "--timeout", "280", "--", sys.executable,
               os.path.join(HERE, "gpu_layout_worker.py"), "--quick", "--backend", "reference")
    assert r.returncode == 0 and "GPU LAYOUT SUITE PASSED" in r.stdout, \
        (r.stdout + r.stderr)[-5000:]



def test_gpu_soak_worker_runs_on_cpu_with_the_reference_backend():
    """The soak worker (issue 28: hashed inputs, two handles, one counter) on 2 CPU processes,
    a few hundred cycles: its oracle passes, so a zero on the GPU means the kernels agree."""
    r = launch("-n", "2", "--platform", "cpu", "--timeout", "200", "--", sys.executable,
               os.path.join(HERE, "gpu_soak_worker.py"), "--backend", "reference",
               "--cycles", "200", "--per-call", "100")
    assert r.returncode == 0 and "GPU SOAK PASSED" in r.stdout, (r.stdout + r.stderr)[-5000:]
    assert "0 of 200 cycles wrong" in r.stdout, r.stdout[-3000:]


def test_shutdown_grpc_noise_is_dropped_and_counted():
    """The block JAX 0.11 logs at every normal exit (copied from a GPU run), between real
    output: the block goes, the real lines stay."""
    import io

    from jax_moe_comm.launch import ShutdownNoise, _pump

    log = (
        "PASS EP2-train-50-steps\n"
        "W1203 13:36:10.089005    1190 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: "
        "CANCELLED: CANCELLED\n"
        "Additional GRPC error information from remote target coordination_service while "
        "calling /xla.coordination.CoordinationService/WatchTasks:\n"
        ":CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']\n"
        "=== Source Location Trace: ===\n"
        "external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89\n"
        "\n"
        "W1203 13:37:40.240692   11502 pjrt_client.cc:1605] WatchTasksAsync failed for task 5: "
        "UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:127.0.0.1:34373: Failed to connect to remote host: Connection refused\n"
        ":UNAVAILABLE:failed to connect to all addresses; last error: UNKNOWN\n"
        "GPU GRAD SUITE PASSED\n")
    noise, out = ShutdownNoise(), io.StringIO()
    _pump(3, io.StringIO(log), out, noise)
    assert out.getvalue() == "[rank 3] PASS EP2-train-50-steps\n[rank 3] GPU GRAD SUITE PASSED\n"
    assert noise.dropped == 2
    kept = io.StringIO()
    _pump(3, io.StringIO(log), kept)  # --show-grpc
    assert kept.getvalue().count("[rank 3]") == log.count("\n")
