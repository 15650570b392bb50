"""The reference backend refuses what the CUDA kernels refuse, with the same error classes
(issue 26): every case of tests/parity_cases.py on 8 CPU devices. tests/gpu_parity_worker.py
runs the same cases on the nvshmem backend (and, in CI, on 2 CPU processes)."""

import os
import sys

import pytest

from cpu_env import child_env

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_cases  # noqa: E402
from jax_moe_comm import testing as T  # noqa: E402

# Left out of `scripts/test.sh --quick`: starts two processes.
pytestmark = pytest.mark.slow

WORLD = 4


# Run in test_gpu_parity_worker_runs_on_two_cpu_processes below (2 processes, through the
# launcher); the rest run here, in one process with 4 of the 8 CPU devices.
RUN_TIME = ("second-send-in-another-call", "recv-again-in-another-call")


@pytest.mark.parametrize("name", sorted(set(parity_cases.CASES) - set(RUN_TIME)))
def test_reference_refuses_what_the_kernels_refuse(name):
    ctx = parity_cases.Ctx(mesh=T.make_mesh(WORLD), backend="reference", world=WORLD)
    parity_cases.CASES[name](ctx)


def test_gpu_parity_worker_runs_on_two_cpu_processes():
    """The GPU worker itself through the launcher (2 CPU processes, reference backend), with
    the run-time cases (a pending crossing jitted calls, counted per process): ~18 s."""
    import subprocess
    import tempfile

    env = child_env()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_parity_worker.py")
    r = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", "2", "--platform",
                        "cpu", "--timeout", "200", "--", sys.executable, worker, "--backend",
                        "reference", "--only", "in-flight,recv-,another,after-close,second-send"],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0 and "GPU PARITY SUITE PASSED" in r.stdout, \
        (r.stdout + r.stderr)[-5000:]
    assert r.stdout.count("[rank 0] PASS") == 7, r.stdout


def test_a_recv_in_each_branch_of_a_cond_is_one_recv():
    """lax.cond traces both branches; only one runs, so each may receive the pending."""
    import jax

    ctx = parity_cases.Ctx(mesh=T.make_mesh(WORLD), backend="reference", world=WORLD)
    with ctx.handle() as a2a:
        _, (x, idx, _, nt) = ctx.inputs()

        def body(x, idx, nt):
            n = nt.reshape(())
            pending = a2a.dispatch_send(x, idx, n)
            recv = lambda p: a2a.dispatch_recv(p).expert_num_tokens  # noqa: E731
            counts = jax.lax.cond(n > 0, recv, recv, pending)
            a2a.dispatch_send(x, idx, n)  # the cycle was received: a new one may start
            return counts

        jax.block_until_ready(ctx.jit(body, 3)(x, idx, nt))


def test_recover_clears_a_broken_protocol_on_the_reference_backend():
    """As recover() on a CUDA handle: the kept ProtocolError is forgotten and the handle runs a
    correct cycle again."""
    import jax

    from jax_moe_comm import AllToAll, MoEConfig, ProtocolError

    cfg = MoEConfig(num_experts=8, experts_per_token=2, hidden=128, max_num_tokens=4,
                    world_size=2)
    mesh = T.make_mesh(2)
    a2a = AllToAll(cfg)
    spec = jax.sharding.PartitionSpec("ep")
    def send(x, i, n):
        return a2a.dispatch_send(x, i, n.reshape(())).state

    send_only = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    x, _, idx, _, nt = T.global_inputs(cfg, mesh, T.make_inputs(cfg, 1))
    jax.block_until_ready(send_only(x, idx, nt))
    jax.block_until_ready(send_only(x, idx, nt))  # a second send in flight: refused
    with pytest.raises(ProtocolError):
        a2a.check()
    a2a.recover()
    a2a.check()  # forgotten
    T.run_and_check(a2a, mesh, T.make_inputs(cfg, 2))
    a2a.check()
