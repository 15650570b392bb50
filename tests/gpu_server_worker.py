"""GPU suite for a long-running server (issue 28), run on every rank by the launcher.

    python -m jax_moe_comm.launch -n N --oversubscribe -- python tests/gpu_server_worker.py

Each case is a regime a server meets and the per-call suites do not: months of cycles (epoch
values past the old 32-bit wrap), a compiled step replayed after close(), a poisoned handle
whose step goes on without check(), a rank late by more than the timeout followed by
recover(), ranks that disagree on a setting at creation, and forged expert counts. Prints
`PASS name` / `FAIL name: why` on rank 0 and `GPU SERVER SUITE PASSED` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from unittest import mock

import jax_moe_comm.distributed as dist
from gpu_harness import Suite, kv_allgather, run_cycle, small_configs

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_moe_comm import (AllToAll, CorruptDataError, InvalidRoutingError,  # noqa: E402
                          MoEConfig, PeerAbortedError, PeerTimeoutError, ProtocolError,
                          testing as T)
from jax_moe_comm.backends import nvshmem as nvshmem_backend  # noqa: E402

suite = Suite(RANK)
log = suite.log


@contextlib.contextmanager
def start_epoch(value: int):
    """Handles created inside start as if `value` cycles had completed (every rank alike)."""
    nvshmem_backend._start_epoch = value
    try:
        yield
    finally:
        nvshmem_backend._start_epoch = 0


def local_y(y) -> np.ndarray:
    return np.concatenate([np.asarray(s.data, np.float32) for s in y.addressable_shards])


def live_rows_nan(cfg, inp, y) -> bool:
    """Every live row of this process's y is NaN (rows past num_tokens are not looked at)."""
    rows = local_y(y).reshape(-1, cfg.max_num_tokens, cfg.hidden)
    ranks = sorted(s.index[0].start // cfg.max_num_tokens for s in y.addressable_shards)
    return all(np.isnan(rows[i, :inp.num_tokens[r]]).all() for i, r in enumerate(ranks))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma list: run the cases naming these")
    args = parser.parse_args()
    suite.only = [o for o in args.only.split(",") if o]
    mesh = T.make_mesh(WORLD)
    tiny = small_configs(WORLD)[0][1]
    log(f"world={WORLD} backend={jax.default_backend()}")

    @suite.case(f"EP{WORLD}-epochs-past-old-wrap")
    def epochs():
        # The dispatch count word held a 32-bit epoch: at 2^32 cycles (17 days of a 58-layer
        # model at 50 steps/s) every rank died with CorruptData. Cycles across 2^32 and 2^48.
        for first in (2**32 - 3, 2**48 - 3):
            with start_epoch(first), AllToAll(tiny, backend="nvshmem") as a2a:
                step = T.make_step(a2a, mesh)
                for i in range(6):
                    T.run_and_check(a2a, mesh, T.make_inputs(tiny, 31 * i + 7), step=step)
                a2a.check()
        return "6 checked cycles from 2^32 - 3 and from 2^48 - 3"

    @suite.case(f"EP{WORLD}-poisoned-then-recover")
    def poisoned():
        # A bad expert index poisons the handle on every rank. The same compiled step, called
        # again without check() (a server under command-buffer replay), must give NaN rows,
        # not zeros; poll() reports without a device sync; check() keeps raising; recover()
        # brings the same handle and the same compiled step back.
        with AllToAll(tiny, backend="nvshmem") as a2a:
            step = T.make_step(a2a, mesh)
            bad = T.make_inputs(tiny, 5, "bad_index")
            bad_args = T.global_inputs(tiny, mesh, bad)
            run_cycle(step, bad_args, RANK)  # recorded here; its outputs dropped
            raised = []
            for call in (a2a.poll, a2a.check, a2a.check):
                try:
                    call()
                except (InvalidRoutingError, PeerAbortedError) as e:
                    raised.append(type(e).__name__)
            assert len(raised) == 3, f"poll/check/check raised only {raised}"
            # The same buffers again: XLA replays the recording (command buffers on), and the
            # kernels of the poisoned handle write NaN rows; with them off the handler refuses.
            try:
                _, _, _, y = step(*bad_args)
                refused_or_nan = live_rows_nan(tiny, bad, y)
                del y
            except Exception as e:  # noqa: BLE001 - a handler that runs refuses the handle
                refused_or_nan = "unusable" in str(e)
            assert refused_or_nan, "a cycle on a poisoned handle returned rows that look real"
            # The first cycle failed on every rank: none completed, on every rank alike.
            done = a2a.recover()
            assert done == 0, f"recover() agreed on {done} completed cycles, expected 0"
            for i in range(3):
                T.run_and_check(a2a, mesh, T.make_inputs(tiny, 100 + i), step=step)
            a2a.check()
            return f"raised {raised}; after recover() 3 checked cycles on the same step"

    # A staged peer (JMC_TRANSPORT=staged...) is not read by load/store: its timeouts carry no
    # view of where it stood, and nobody waits longer for it to start (protocol.cuh).
    staged = os.environ.get("JMC_TRANSPORT", "").startswith("staged")

    def timeouts_say(tag: str, a2a: AllToAll, *phrases: str) -> str:
        """check() on every rank: at least one rank timed out, and every timeout names where
        the late rank stood with each of `phrases` (on a staged handle: only that it waited for
        that rank). Returns this rank's first line."""
        err = None
        try:
            a2a.check()
        except (PeerTimeoutError, PeerAbortedError) as e:
            err = e
        mine = str(err).splitlines()[0] if err is not None else ""
        everyone = [bytes(v).decode() for v in
                    kv_allgather(tag, np.frombuffer(mine.encode() or b" ", np.uint8))]
        timeouts = [m for m in everyone if m.startswith("PeerTimeout")]
        assert timeouts, f"no rank timed out: {everyone}"
        if staged:
            phrases = (f"waited for rank {WORLD - 1}",)
        wrong = [m for m in timeouts if not all(p in m for p in phrases)]
        assert not wrong, f"a timeout without {phrases}: {wrong[0]}"
        return mine

    if WORLD >= 2:
        @suite.case(f"EP{WORLD}-late-rank-waited-for")
        def late_waited():
            # The last rank starts its cycle 3 s late (a checkpoint save, a compile) with a 1 s
            # timeout: it has not started the cycle and its process lives (its heartbeat), so
            # the others wait for it (start_timeout_s) and the cycle completes with no error.
            # On a staged handle nobody waits longer: the others time out, and recover().
            with AllToAll(tiny, backend="nvshmem", timeout_s=1.0, start_timeout_s=20.0) as a2a:
                step = T.make_step(a2a, mesh)
                T.run_and_check(a2a, mesh, T.make_inputs(tiny, 31), step=step)
                if RANK == WORLD - 1:
                    time.sleep(3.0)
                t0 = time.time()
                if staged:
                    run_cycle(step, T.global_inputs(tiny, mesh, T.make_inputs(tiny, 32)), RANK)
                    said = timeouts_say("late-staged", a2a)
                    assert a2a.recover() == 1
                    return f"rank {RANK} (staged): {said[:120]}; recovered"
                T.run_and_check(a2a, mesh, T.make_inputs(tiny, 32), step=step)
                waited = time.time() - t0
                a2a.check()
                if RANK != WORLD - 1:
                    assert waited > 1.5, f"the cycle took {waited:.1f} s: nobody waited"
                for i in range(2):
                    T.run_and_check(a2a, mesh, T.make_inputs(tiny, 33 + i), step=step)
                a2a.check()
                return f"rank {RANK}: the late cycle took {waited:.1f} s, no error, 4 cycles"

        @suite.case(f"EP{WORLD}-late-rank-then-recover")
        def late_rank():
            # The last rank starts its cycle 3 s late with a 1 s timeout and a 2 s
            # start_timeout_s: the others wait 2 s for it, then time out, and their records say
            # it had not started the cycle though its process was alive (its started marks and
            # heartbeat, read when the wait gave up). recover() on every rank, and the same
            # compiled step runs on.
            with AllToAll(tiny, backend="nvshmem", timeout_s=1.0, start_timeout_s=2.0) as a2a:
                step = T.make_step(a2a, mesh)
                args = T.global_inputs(tiny, mesh, T.make_inputs(tiny, 21))
                T.run_and_check(a2a, mesh, T.make_inputs(tiny, 21), step=step)
                if RANK == WORLD - 1:
                    time.sleep(3.0)
                run_cycle(step, args, RANK)
                said = timeouts_say("late", a2a, f"rank {WORLD - 1} has not started cycle",
                                    "within start_timeout_s")
                # Cycle 1 completed everywhere, cycle 2 failed everywhere: one agreed cycle;
                # then three more, and a second recover() counts from creation (4).
                done = a2a.recover()
                assert done == 1, f"recover() agreed on {done} completed cycles, expected 1"
                for i in range(3):
                    T.run_and_check(a2a, mesh, T.make_inputs(tiny, 200 + i), step=step)
                a2a.check()
                again = a2a.recover()
                assert again == 4, f"a second recover() agreed on {again}, expected 4"
                return f"rank {RANK}: {said[:150]}; recovered at cycle {done}, then {again}"

        @suite.case(f"EP{WORLD}-rank-held-between-dispatch-and-combine")
        def held_mid_cycle():
            # The last rank's host holds it 3 s between its dispatch and its combine (a host
            # callback in the step, as host work between ops would): the others' combine
            # waits time out, and their records say it is mid-cycle, not that it never came.
            with AllToAll(tiny, backend="nvshmem", timeout_s=1.0) as a2a:
                spec = jax.sharding.PartitionSpec("ep")

                def hold(v):
                    if RANK == WORLD - 1:
                        time.sleep(3.0)
                    return v

                def body(x, idx, w, nt):
                    out = a2a.dispatch(x, idx, nt.reshape(()))
                    ey = out.expert_x.astype(tiny.combine_dtype)
                    ey = jax.pure_callback(hold, jax.ShapeDtypeStruct(ey.shape, ey.dtype), ey)
                    return a2a.combine(ey, out.routing, idx, w, nt.reshape(()))

                fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4,
                                           out_specs=spec))
                x, _, idx, w, nt = T.global_inputs(tiny, mesh, T.make_inputs(tiny, 22))
                run_cycle(fn, (x, idx, w, nt), RANK)
                said = timeouts_say("held", a2a, f"rank {WORLD - 1} is mid-cycle")
                a2a.recover()
                T.run_and_check(a2a, mesh, T.make_inputs(tiny, 23))
                a2a.check()
                return f"rank {RANK}: {said[:160]}; recovered"

    @suite.case(f"EP{WORLD}-stale-step-after-close")
    def stale():
        # A step compiled (and recorded into a command buffer) on handle a, a closed, b created
        # with the same shape (its buffers likely at a's addresses), then a's step called again
        # with the same inputs: it must not run on b's state. Either XLA re-records and the
        # handler refuses, or the replayed launches find a closed and do nothing (NaN rows,
        # ProtocolError from a.check()). b must still be correct afterwards.
        inp = T.make_inputs(tiny, 77)
        args = T.global_inputs(tiny, mesh, inp)
        a = AllToAll(tiny, backend="nvshmem")
        step = T.make_step(a, mesh)
        for _ in range(3):
            out = step(*args)
            jax.block_until_ready(out)
            del out
        a.close()
        a_id, native_mod = a._backend.handle, a._backend._mod
        calls_before = native_mod.handler_calls(a_id)  # a closed handle still counts
        with AllToAll(tiny, backend="nvshmem") as b:
            how = ""
            try:
                _, _, _, y = step(*args)
                jax.block_until_ready(y)
                assert live_rows_nan(tiny, inp, y), "a stale replay returned rows that look real"
                try:
                    a.check()
                    raise AssertionError("a.check() did not report the stale launch")
                except ProtocolError as e:
                    how = f"replayed and refused on the device: {str(e)[:80]}"
                # The replay path: XLA ran the recording, so no handler of a's ran.
                calls = native_mod.handler_calls(a_id)
                assert calls == calls_before, \
                    f"the device refused, but a's handlers ran {calls - calls_before} times"
                del y
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - the handler refused a closed handle
                # The re-record path: a's handler ran, and refused the closed handle.
                calls = native_mod.handler_calls(a_id)
                assert calls > calls_before and "the handle is closed" in str(e), \
                    f"refused without a's handler ({calls - calls_before} calls): {e}"
                how = f"re-recorded and refused by the handler: {str(e).splitlines()[0][:80]}"
            T.run_and_check(b, mesh, T.make_inputs(tiny, 78))
            b.check()
        return how

    @suite.case(f"EP{WORLD}-forged-expert-counts")
    def forged_counts():
        # expert_num_tokens each <= max_recv but adding up to more rows than a rank holds:
        # reported as CorruptData at once, not a timeout later.
        cfg = MoEConfig(num_experts=8 * WORLD, experts_per_token=2, hidden=128,
                        max_num_tokens=4, world_size=WORLD)  # L = 8 > k: rows can overflow
        L, R = cfg.num_local_experts, cfg.max_recv_tokens
        with AllToAll(cfg, backend="nvshmem", timeout_s=5.0) as a2a:
            spec = jax.sharding.PartitionSpec("ep")

            def body(x, idx, w, nt):
                out = a2a.dispatch(x, idx, nt.reshape(()))
                counts = jnp.full_like(out.routing.expert_num_tokens, R)
                forged = out.routing._replace(  # the kernels read the backend's record
                    backend=out.routing.backend._replace(expert_num_tokens=counts),
                    expert_num_tokens=counts)
                ey = out.expert_x.astype(cfg.combine_dtype)
                return a2a.combine(ey, forged, idx, w, nt.reshape(()))

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec))
            x, _, idx, w, nt = T.global_inputs(cfg, mesh, T.make_inputs(cfg, 3))
            t0 = time.time()
            run_cycle(fn, (x, idx, w, nt), RANK)
            try:
                a2a.check()
                raise AssertionError(f"no error for {L} x {R} forged rows")
            except (CorruptDataError, PeerAbortedError) as e:
                took = time.time() - t0
                assert took < 4.0, f"reported after {took:.1f}s: a timeout, not the check"
                return f"{type(e).__name__} after {took:.1f}s"

    @suite.case(f"EP{WORLD}-setting-differs-at-creation")
    def settings_differ():
        # One rank with another JMC_FUSED: every rank raises a ValueError naming it, at once
        # (it used to return before the collective allocation, leaving the others there).
        with mock.patch.dict(os.environ, {"JMC_FUSED": "bogus"} if RANK == 0 else {}):
            try:
                AllToAll(tiny, backend="nvshmem").close()
                raise AssertionError("created a handle with differing JMC_FUSED")
            except ValueError as e:
                msg = str(e)
                assert "JMC_FUSED" in msg and "'bogus' on rank 0" in msg, msg
        with AllToAll(tiny, backend="nvshmem") as a2a:  # the next creation still agrees
            T.run_and_check(a2a, mesh, T.make_inputs(tiny, 9))
        return msg[:100]

    return suite.finish("GPU SERVER SUITE")


if __name__ == "__main__":
    sys.exit(main())
