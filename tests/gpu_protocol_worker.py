"""GPU protocol suite (issue 9), run on every rank by the launcher:

    python -m jax_moe_comm.launch -n N --oversubscribe -- python tests/gpu_protocol_worker.py
    ... gpu_protocol_worker.py --exit-test   # one rank exits mid-run (run it on its own)

Cycles run inside ONE jitted lax.fori_loop with no host round trip between them, fresh random
routing every cycle, and a random per-rank device-side delay between the send and recv halves
(skew), so races that host-synchronised tests hide show up. Every cycle is checked on the
device against a local oracle; the host only reads the mismatch count at the end.

Prints `PASS name` / `FAIL name: why` on rank 0 (each rank prints its own failures) and exits
non-zero if any case failed on any rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import jax_moe_comm.distributed as dist
from gpu_harness import Suite, clear_runtime_tokens

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_moe_comm import (AllToAll, InvalidRoutingError, MoEConfig,  # noqa: E402
                          PeerAbortedError, PeerTimeoutError, ProtocolError, native,
                          order_after, testing as T)

suite = Suite(RANK)
log = suite.log
SPEC = P("ep")


def small_config(dp: int = 1, **kw) -> MoEConfig:
    args = dict(num_experts=4 * WORLD, experts_per_token=min(4, 4 * WORLD), hidden=256,
                max_num_tokens=16, world_size=WORLD, token_replicas=dp)
    args.update(kw)
    return MoEConfig(**args)


@contextlib.contextmanager
def protocol_env(**settings):
    """Handles created inside take these kernel settings (csrc/handle.cc reads them at creation;
    every rank sets the same, so the creation agreement passes)."""
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def fused_kernels():
    """Handles created inside run AllToAll.dispatch / .combine as the one-block fused kernels
    at any shape (JMC_FUSED=always; by default only shapes with a warp per work item do)."""
    return protocol_env(JMC_FUSED="always")


def assert_options(a2a: AllToAll, options: dict):
    """The handle really took what `options` (JMC_ACKS; else the environment's) asked for (a
    case under release acks that ran the default would pass while testing nothing)."""
    asked = options.get("JMC_ACKS", os.environ.get("JMC_ACKS", ""))
    want = {"relaxed_acks": asked != "release"}  # unset, empty or "relaxed": relaxed
    got = a2a.backend.protocol_options()
    assert got == want, f"rank {RANK}: {got}, expected {want}"


def spin(n, after):
    """A device-side delay of n small matmuls, ordered after `after` (skew between ranks)."""
    a = order_after(jnp.full((64, 64), 1e-3, jnp.float32), after)
    return jax.lax.fori_loop(0, n, lambda _, v: jnp.tanh(v @ v + 1e-3), a)


def random_cycle_inputs(cfg: MoEConfig, key, group):
    """One token group's tokens for one cycle (every member of the group draws the same)."""
    m, H, E, k = cfg.max_num_tokens, cfg.hidden, cfg.num_experts, cfg.experts_per_token
    kx, ke, kh, kw, kn = jax.random.split(jax.random.fold_in(key, group), 5)
    x = jax.random.normal(kx, (m, H), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ke, (m, E)), axis=-1)[:, :k].astype(jnp.int32)
    ids = jnp.where(jax.random.uniform(kh, (m, k)) < 0.15, -1, ids)
    w = jax.random.uniform(kw, (m, k), jnp.float32, 0.1, 1.0)
    nt = jax.random.randint(kn, (), 0, m + 1)
    return x, ids, w, nt


def make_loop(a2a: AllToAll, mesh, cycles: int, max_spin: int, mode: str = "split"):
    """jit(shard_map(fori_loop over cycles)) -> per-rank count of cycles whose y was wrong.
    mode "split": send, a random per-rank delay, recv (both ops); "fused": the delay, then the
    one-launch op (both ops); "mixed": a split cycle and a fused cycle per iteration, on the
    same handle (their epochs interleave)."""
    cfg = a2a.config

    def one_cycle(key, rank, fused):
        group = rank // cfg.token_replicas
        x, ids, w, nt = random_cycle_inputs(cfg, key, group)
        d1, d2 = jax.random.randint(jax.random.fold_in(key, 7919 + rank), (2,), 0, max_spin)
        if fused:
            x = order_after(x, spin(d1, x))
            out = a2a.dispatch(x, ids, nt)
            expert_y = T.expert_outputs(cfg, rank, out.expert_x, None)
            expert_y = order_after(expert_y, spin(d2, expert_y))
            y = a2a.combine(expert_y, out.routing, ids, w, nt).astype(jnp.float32)
        else:
            pending = a2a.dispatch_send(x, ids, nt)
            pending = order_after(pending, spin(d1, pending))
            out = a2a.dispatch_recv(pending)
            expert_y = T.expert_outputs(cfg, rank, out.expert_x, None)
            sent = a2a.combine_send(expert_y, out.routing)
            sent = order_after(sent, spin(d2, sent))
            y = a2a.combine_recv(sent, ids, w, nt).astype(jnp.float32)
        return T.combine_wrong(cfg, y, x, ids, w, nt)

    def per_rank(seed):
        rank = jax.lax.axis_index("ep")

        def cycle(i, bad):
            key = jax.random.fold_in(jax.random.key(seed[0]), i)
            if mode != "mixed":
                return bad + one_cycle(key, rank, fused=mode == "fused")
            bad = bad + one_cycle(key, rank, fused=False)
            return bad + one_cycle(jax.random.fold_in(key, 1), rank, fused=True)

        return jax.lax.fori_loop(0, cycles, cycle, jnp.zeros_like(seed))

    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
    # One base seed on every rank: the members of a token group must draw the same tokens.
    seeds = jax.make_array_from_callback((WORLD,), jax.sharding.NamedSharding(mesh, SPEC),
                                         lambda idx: np.zeros(WORLD, np.int32)[idx])
    return lambda seed=0: fn(seeds + seed)


def my_value(arr) -> int:
    return int(T.local_blocks(arr, 1)[RANK][0])


def expect_error(fn, kinds, what: str):
    """Runs fn (a step + check); returns the error it raised, which must be one of kinds."""
    try:
        fn()
    except kinds as e:
        return e
    except Exception as e:  # noqa: BLE001 - XLA wraps handler errors in its own type
        if any(k.__name__.replace("Error", "") in str(e) for k in kinds):
            return e
        raise AssertionError(f"{what}: expected {[k.__name__ for k in kinds]}, got "
                             f"{type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: no error raised")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer cycles, no soak")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--soak", type=int, default=1000)
    parser.add_argument("--exit-test", action="store_true")
    args = parser.parse_args()
    mesh = T.make_mesh(WORLD)
    cycles = 20 if args.quick else args.cycles
    log(f"world={WORLD} backend={jax.default_backend()} cycles={cycles}")

    if args.exit_test:
        return exit_test(mesh)

    def checked_loop(a2a, mode):  # `cycles` skewed cycles in one jitted loop, each checked
        bad = my_value(make_loop(a2a, mesh, cycles, max_spin=24, mode=mode)())
        a2a.check()
        assert bad == 0, f"rank {RANK}: {bad} of {cycles} cycles wrong"
        return f"0 of {cycles} cycles wrong"

    for dp in sorted({dp for dp in (1, 2, WORLD) if WORLD % dp == 0}):
        for mode in ("split", "fused"):
            @suite.case(f"EP{WORLD}-dp{dp}-{cycles}-cycles-one-jit-skewed-{mode}")
            def jitted_loop(dp=dp, mode=mode):
                fused = fused_kernels() if mode == "fused" else contextlib.nullcontext()
                with fused, AllToAll(small_config(dp), backend="nvshmem") as a2a:
                    assert_options(a2a, {})  # the default (relaxed) or the environment's
                    return checked_loop(a2a, mode)

    # Acknowledgements are relaxed stores by default (core/protocol.cuh, set_ack): the loops
    # above run them, split and fused; here both interleaved on one handle, then the same
    # loops with release acknowledgements (JMC_ACKS=release, the fallback).
    for mode, acks in (("mixed", "relaxed"), ("split", "release"), ("fused", "release"),
                       ("mixed", "release")):
        @suite.case(f"EP{WORLD}-dp1-{cycles}-cycles-one-jit-skewed-{mode}-{acks}-acks")
        def acks_loop(mode=mode, acks=acks):
            options = dict(JMC_ACKS=acks)
            env = dict(options, JMC_FUSED="always") if mode != "split" else options
            with protocol_env(**env), AllToAll(small_config(1), backend="nvshmem") as a2a:
                assert_options(a2a, options)
                return checked_loop(a2a, mode)

    @suite.case(f"EP{WORLD}-two-handles-interleaved-in-one-jit")
    def two_handles():
        a_cfg, b_cfg = small_config(), small_config(hidden=512, max_num_tokens=8)
        with AllToAll(a_cfg, backend="nvshmem") as a, AllToAll(b_cfg, backend="nvshmem") as b:
            def per_rank(seed):
                rank = jax.lax.axis_index("ep")

                def cycle(i, bad):
                    key = jax.random.fold_in(jax.random.key(seed[0]), i)
                    ins = [random_cycle_inputs(c, jax.random.fold_in(key, n), rank)
                           for n, c in enumerate((a_cfg, b_cfg))]
                    # Both dispatches in flight at once, receives in the other order.
                    pa = a.dispatch_send(ins[0][0], ins[0][1], ins[0][3])
                    pb = b.dispatch_send(ins[1][0], ins[1][1], ins[1][3])
                    ob = b.dispatch_recv(order_after(pb, pa))
                    oa = a.dispatch_recv(order_after(pa, ob))
                    for h, c, o, (x, ids, w, nt) in ((a, a_cfg, oa, ins[0]),
                                                     (b, b_cfg, ob, ins[1])):
                        ey = T.expert_outputs(c, rank, o.expert_x, None)
                        y = h.combine(ey, o.routing, ids, w, nt).astype(jnp.float32)
                        bad = bad + T.combine_wrong(c, y, x, ids, w, nt)
                    return bad

                return jax.lax.fori_loop(0, cycles, cycle, jnp.zeros_like(seed))

            fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
            seeds = jax.make_array_from_callback(
                (WORLD,), jax.sharding.NamedSharding(mesh, SPEC),
                lambda idx: np.arange(WORLD, dtype=np.int32)[idx])
            bad = my_value(fn(seeds))
            a.check()
            b.check()
            assert bad == 0, f"rank {RANK}: {bad} wrong"

    if not args.quick:
        @suite.case(f"EP{WORLD}-soak-{args.soak}-cycles-memory-flat")
        def soak():
            with fused_kernels(), AllToAll(small_config(max_num_tokens=32),
                                           backend="nvshmem") as a2a:
                loop = make_loop(a2a, mesh, args.soak // 2, max_spin=8, mode="mixed")
                jax.block_until_ready(loop(1))  # compile + first run
                free0 = native.module().device_memory()[0]
                used0 = jax.local_devices()[0].memory_stats().get("bytes_in_use", 0)
                bad = my_value(loop(2))  # soak // 2 iterations of a split and a fused cycle
                free1 = native.module().device_memory()[0]
                used1 = jax.local_devices()[0].memory_stats().get("bytes_in_use", 0)
                a2a.check()
                assert bad == 0, f"rank {RANK}: {bad} of {args.soak} cycles wrong"
                return (f"0 of {args.soak} cycles wrong; rank 0 XLA bytes_in_use "
                        f"{used0} -> {used1}, GPU free {free0 >> 20} -> {free1 >> 20} MiB")

    @suite.case(f"EP{WORLD}-bad-runtime-input-reported-then-fresh-handle-correct")
    def bad_input():
        cfg = small_config()
        details = []
        for label, bad_index, bad_count in (("index E", cfg.num_experts, None),
                                            ("index -2", -2, None),
                                            ("num_tokens max+1", None, cfg.max_num_tokens + 1)):
            inp = T.make_inputs(cfg, 11, ragged=False)
            if bad_index is not None:
                inp.indices[WORLD - 1, 0, 0] = bad_index
            if bad_count is not None:
                inp.num_tokens[WORLD - 1] = bad_count
            with AllToAll(cfg, backend="nvshmem", timeout_s=5.0) as a2a:
                step = T.make_step(a2a, mesh)
                culprit = RANK == WORLD - 1
                kinds = (InvalidRoutingError,) if culprit else (InvalidRoutingError,
                                                                PeerAbortedError)

                def run():
                    jax.block_until_ready(step(*T.global_inputs(cfg, mesh, inp)))
                    a2a.check()
                e = expect_error(run, kinds, label)
                details.append(f"{label}: {str(e).splitlines()[0][:160]}")
            clear_runtime_tokens()
            with AllToAll(cfg, backend="nvshmem") as fresh:
                T.run_and_check(fresh, mesh, T.make_inputs(cfg, 12))
                fresh.check()
        if RANK == WORLD - 1:
            print("\n".join(f"rank {RANK} {d}" for d in details), flush=True)

    if WORLD >= 2:
        @suite.case(f"EP{WORLD}-shape-mismatch-refused-at-creation")
        def shape_mismatch():
            cfg = small_config(max_num_tokens=8 if RANK == 0 else 16)
            try:
                AllToAll(cfg, backend="nvshmem")
                raise AssertionError("creation with different shapes was not refused")
            except ValueError as e:
                assert "rank(s)" in str(e), str(e)
                if RANK == 0:
                    print(f"rank 0: {e}", flush=True)
            with AllToAll(small_config(), backend="nvshmem") as a2a:  # still in step afterwards
                T.run_and_check(a2a, mesh, T.make_inputs(a2a.config, 13))

    @suite.case(f"EP{WORLD}-create-close-20-times-no-growth")
    def create_close():
        cfg = MoEConfig(num_experts=8 * WORLD, experts_per_token=8, hidden=7168,
                        max_num_tokens=512, world_size=WORLD)
        sizes = []
        free = []
        for i in range(20):
            with AllToAll(cfg, backend="nvshmem") as a2a:
                sizes.append(a2a.symmetric_bytes)
                if i in (0, 19):
                    T.run_and_check(a2a, mesh, T.make_inputs(cfg, 14 + i))
            native.module().synchronize()
            free.append(native.module().device_memory()[0])
        grew = (free[1] - free[-1]) >> 20
        assert grew < 64, f"rank {RANK}: GPU free memory fell by {grew} MiB over 20 handles"
        return (f"20 x {sizes[0] >> 20} MiB symmetric (more than NVSHMEM_SYMMETRIC_SIZE="
                f"{os.environ.get('NVSHMEM_SYMMETRIC_SIZE', '?')} if leaked); GPU free "
                f"{free[0] >> 20} -> {free[-1] >> 20} MiB")

    @suite.case(f"EP{WORLD}-misuse-recv-without-send-refused")
    def misuse():
        with AllToAll(small_config(), backend="nvshmem") as a2a:
            def combine_recv_alone(idx, w, nt):  # the backend directly: the API refuses a
                ticket = jnp.zeros((1,), jnp.int32) + nt.reshape(())  # made-up pending at trace
                return a2a.backend.combine_recv(ticket, idx, w, nt.reshape(()))
            fn = jax.jit(jax.shard_map(combine_recv_alone, mesh=mesh, in_specs=(SPEC,) * 3,
                                       out_specs=SPEC))
            _, _, idx, w, nt = T.global_inputs(a2a.config, mesh, T.make_inputs(a2a.config, 9))
            # Refused by the kernel (core/protocol.cuh), reported by check().
            e = expect_error(lambda: (jax.block_until_ready(fn(idx, w, nt)), a2a.check()),
                             (ProtocolError, PeerAbortedError), "combine_recv without send")
            assert "ProtocolError" in str(e), str(e)

    if WORLD >= 2:
        @suite.case(f"EP{WORLD}-stalled-rank-one-clear-error-everywhere")
        def stalled():
            timeout = 2.0
            cfg = small_config()
            inp = T.make_inputs(cfg, 21)
            # start_timeout_s = timeout_s: a rank late to start is not waited for longer, so
            # its stall is the error this case is about (the server suite has the late rank
            # that is waited for).
            with AllToAll(cfg, backend="nvshmem", timeout_s=timeout,
                          start_timeout_s=timeout) as a2a:
                step = T.make_step(a2a, mesh)
                args_ = T.global_inputs(cfg, mesh, inp)
                T.run_and_check(a2a, mesh, inp, step=step)  # compiled, and healthy so far
                native.module().barrier_all()
                if RANK == WORLD - 1:
                    time.sleep(timeout + 2.0)  # stalls past the others' deadline, then resumes
                t0 = time.time()

                def run():
                    jax.block_until_ready(step(*args_))
                    a2a.check()
                e = expect_error(run, (PeerTimeoutError, PeerAbortedError), "stalled peer")
                waited = time.time() - t0
                print(f"rank {RANK} after {waited:.1f}s: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
                assert waited < timeout + 10, f"rank {RANK}: took {waited:.1f}s"
                clear_runtime_tokens()
                # The handle is refused from now on, on every rank (never a silent answer).
                def again():
                    jax.block_until_ready(step(*args_))
                    a2a.check()
                expect_error(again, (PeerTimeoutError, PeerAbortedError),
                             "next cycle on the handle")
            clear_runtime_tokens()
            native.module().barrier_all()
            with AllToAll(cfg, backend="nvshmem") as fresh:
                T.run_and_check(fresh, mesh, T.make_inputs(cfg, 22))
                fresh.check()

    return suite.finish("PROTOCOL SUITE")


def exit_test(mesh) -> int:
    """The last rank exits after setup; the others must raise a named error within timeout +
    10 s (it has not started the cycle, but its heartbeat has stopped: not waited for). No
    collective cleanup afterwards (the dead rank would never join it)."""
    timeout = 3.0
    cfg = small_config()
    a2a = AllToAll(cfg, backend="nvshmem", timeout_s=timeout)
    step = T.make_step(a2a, mesh)
    inp = T.make_inputs(cfg, 31)
    args_ = T.global_inputs(cfg, mesh, inp)
    T.run_and_check(a2a, mesh, inp, step=step)  # compiled, and healthy so far
    native.module().barrier_all()
    if RANK == WORLD - 1:
        print(f"rank {RANK} exits now", flush=True)
        os._exit(0)
    t0 = time.time()
    try:
        jax.block_until_ready(step(*args_))
        a2a.check()
        print(f"FAIL rank {RANK}: no error although rank {WORLD - 1} is gone", flush=True)
        code = 1
    except Exception as e:  # noqa: BLE001
        waited = time.time() - t0
        named = isinstance(e, (PeerTimeoutError, PeerAbortedError)) or "Peer" in str(e)
        print(f"rank {RANK} after {waited:.1f}s: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:200]}", flush=True)
        code = 0 if named and waited < timeout + 10 else 1
    log("EXIT TEST " + ("PASSED" if code == 0 else "FAILED"))
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
