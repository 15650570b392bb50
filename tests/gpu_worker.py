"""GPU suite, run on every rank by the launcher: the CPU suite's oracle on the nvshmem backend.

    python -m jax_moe_comm.launch -n N --oversubscribe -- python tests/gpu_worker.py [--quick]

Prints one `PASS name` / `FAIL name: why` line per case on rank 0 and exits non-zero if any
case failed on any rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax_moe_comm.distributed as dist
from gpu_harness import Suite, clear_runtime_tokens, run_cycle, small_configs

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_moe_comm import (AllToAll, InvalidRoutingError, MoEConfig,  # noqa: E402
                          PeerAbortedError, PeerTimeoutError, ProtocolError, testing as T)

bf16, fp8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
suite = Suite(RANK)
log = suite.log


def configs(quick: bool):
    out = small_configs(WORLD)
    if not quick:
        out.append(("V2Lite-fp8", MoEConfig(num_experts=64, experts_per_token=6, hidden=2048,
                                            max_num_tokens=32, world_size=WORLD,
                                            dispatch_dtype=fp8)))
        out.append(("R1-fp8", MoEConfig(num_experts=256, experts_per_token=8, hidden=7168,
                                        max_num_tokens=128, world_size=WORLD, dispatch_dtype=fp8)))
        out.append(("R1-bf16", MoEConfig(num_experts=256, experts_per_token=8, hidden=7168,
                                         max_num_tokens=128, world_size=WORLD)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--only", default="", help="comma list of case-name substrings")
    args = parser.parse_args()
    suite.only.extend(filter(None, args.only.split(",")))
    mesh = T.make_mesh(WORLD)
    log(f"world={WORLD} devices={jax.devices()} backend={jax.default_backend()}")

    for name, cfg in configs(args.quick):
        @suite.case(f"EP{WORLD}-{name}")
        def run_config(cfg=cfg):
            with AllToAll(cfg, backend="nvshmem") as a2a:
                fused, split = T.make_step(a2a, mesh), T.make_step(a2a, mesh, split=True)
                worst = 0.0
                for seed, routing in enumerate(("random", "skewed", "duplicates",
                                                "empty_ranks")):
                    for step in (fused, split):
                        inp = T.make_inputs(cfg, 1000 * seed + WORLD, routing)
                        worst = max(worst, T.run_and_check(a2a, mesh, inp, step=step))
                a2a.check()
                mib = a2a.symmetric_bytes / 2**20
                return f"max|err|={worst:.3g} symmetric={mib:.1f} MiB/rank"

    tiny = configs(True)[0][1]

    if WORLD >= 2:
        @suite.case(f"EP{WORLD}-staged-transport-messages-per-cycle")
        def staged_messages():
            # Peers outside this rank's emulated node are sent to as over a network (issue 25):
            # correct results, and per staged peer, phase and cycle at most two messages (the
            # records' or rows' one put, the count behind it) and one acknowledgement.
            from jax_moe_comm import KernelTuning, _bench

            cfg = small_configs(WORLD)[1][1]
            seen = []
            for node in sorted({1, max(1, WORLD // 2)}):
                staged_peers = WORLD - node
                if staged_peers == 0:
                    continue
                tuning = KernelTuning(transport="staged", node_size=node)
                with AllToAll(cfg, backend="nvshmem", tuning=tuning) as a2a:
                    _bench.count_staged_messages(a2a)
                    for split in (False, True):
                        before = _bench.staged_messages(a2a)
                        T.run_and_check(a2a, mesh, T.make_inputs(cfg, 41 + node, ragged=False),
                                        split=split)
                        after = _bench.staged_messages(a2a)
                        sent = {k: after[k] - before[k] for k in after}
                        assert sent["dispatch_send"] <= 2 * staged_peers, sent
                        assert sent["dispatch_recv"] == staged_peers, sent
                        assert sent["combine_recv"] == staged_peers, sent
                        assert 0 < sent["combine_send"] <= 2 * staged_peers, sent
                    a2a.check()
                seen.append(f"node_size {node}: {sent} to {staged_peers} staged peers")
            return "; ".join(seen)

    @suite.case(f"EP{WORLD}-{args.steps}-steps-one-handle")
    def many_steps():
        with AllToAll(tiny, backend="nvshmem") as a2a:
            step = T.make_step(a2a, mesh)
            for i in range(args.steps):
                T.run_and_check(a2a, mesh, T.make_inputs(tiny, 7919 * i + 1), step=step)
            a2a.check()

    @suite.case(f"EP{WORLD}-command-buffer-replay")
    def graph_replay():
        # Our handlers carry the command-buffer trait: XLA records their launches into a CUDA
        # graph and replays it, so nothing per call may live on the host. XLA keys a recording
        # by the addresses of the call's buffers (TracedCommandBuffer, a small LRU): a step
        # whose buffers come back at the same addresses, as in a decode loop that drops each
        # step's outputs, replays; one with new addresses re-records (runs the handler). Twenty
        # calls, each checked against the oracle and dropped.
        cmdbuf_off = "--xla_gpu_enable_command_buffer= " in os.environ.get("XLA_FLAGS", "") + " "
        calls = 20
        with AllToAll(tiny, backend="nvshmem") as a2a:
            step, inp = T.make_step(a2a, mesh), T.make_inputs(tiny, 4242, "skewed")
            args = T.global_inputs(tiny, mesh, inp)
            jax.block_until_ready(step(*args))  # compiled (and recorded) here
            before = a2a.backend.handler_calls()
            for _ in range(calls):
                out = step(*args)
                T.run_and_check(a2a, mesh, inp, step=lambda *_, out=out: out)
                del out
            a2a.check()
            ran = a2a.backend.handler_calls() - before
            if cmdbuf_off:
                assert ran == 2 * calls, f"{ran} handler runs for {calls} calls"
            else:
                assert ran < calls, f"{ran} handler runs for {calls} calls: not replayed"
            return f"{ran} handler runs for {calls} calls"

    @suite.case(f"EP{WORLD}-two-handles")
    def two_handles():
        other = configs(True)[1][1]
        with AllToAll(tiny, backend="nvshmem") as a, AllToAll(other, backend="nvshmem") as b:
            sa, sb = T.make_step(a, mesh), T.make_step(b, mesh, split=True)
            for i in range(5):
                T.run_and_check(a, mesh, T.make_inputs(tiny, i), step=sa)
                T.run_and_check(b, mesh, T.make_inputs(other, 100 + i), step=sb)
            a.check()
            b.check()

    @suite.case(f"EP{WORLD}-bad-expert-index-reported")
    def bad_index():
        with AllToAll(tiny, backend="nvshmem") as a2a:
            inp = T.make_inputs(tiny, 5, "bad_index")
            step = T.make_step(a2a, mesh)
            run_cycle(step, T.global_inputs(tiny, mesh, inp), RANK)
            holds_bad_token = RANK // tiny.token_replicas == 0
            # The rank holding the bad token raises InvalidRoutingError; its abort word makes
            # every other rank raise PeerAbortedError naming it.
            try:
                a2a.check()
                raised = None
            except (InvalidRoutingError, PeerAbortedError) as e:
                raised = type(e)
                print(f"rank {RANK} reported: {e}", flush=True)
            want = InvalidRoutingError if holds_bad_token else PeerAbortedError
            assert raised is want, f"rank {RANK}: raised {raised}, expected {want}"

    if WORLD >= 2:
        @suite.case(f"EP{WORLD}-silent-peer-times-out")
        def silent_peer():
            # The last rank never takes part, though its process lives (its heartbeat goes on):
            # to the others it is a rank that has not started the cycle, waited for up to
            # start_timeout_s (not timeout_s), then named as such.
            with AllToAll(tiny, backend="nvshmem", timeout_s=1.0, start_timeout_s=3.0) as a2a:
                # Every rank compiles the step first: XLA's compile of a program over several
                # processes waits for each of them (jax 0.11.2 on the GPU machine: the others
                # hung in backend_compile_and_load while the silent rank, which only lowered
                # it, waited in close()). The silent rank is silent at run time only.
                args = T.global_inputs(tiny, mesh, T.make_inputs(tiny, 3))
                step = T.make_step(a2a, mesh).lower(*args).compile()
                if RANK != WORLD - 1:
                    t0 = time.time()
                    run_cycle(step, args, RANK)
                    waited = time.time() - t0
                    try:
                        a2a.check()
                        raise AssertionError("no PeerTimeoutError / PeerAbortedError")
                    except (PeerTimeoutError, PeerAbortedError) as e:
                        # The first rank to time out reports it; the abort word it sends makes
                        # the others stop at once with PeerAborted naming that rank.
                        print(f"rank {RANK} after {waited:.1f}s: {e}", flush=True)
                        staged = os.environ.get("JMC_TRANSPORT", "").startswith("staged")
                        if isinstance(e, PeerTimeoutError) and not staged:
                            assert "within start_timeout_s" in str(e), str(e)
                            assert waited > 2.5, f"gave up after {waited:.1f} s, before 3 s"
                else:
                    time.sleep(4.0)  # its handle open, its heartbeat beating, past the others' 3 s

    @suite.case(f"EP{WORLD}-protocol-misuse-reported")
    def misuse():
        with AllToAll(tiny, backend="nvshmem") as a2a:
            spec = jax.sharding.PartitionSpec("ep")

            def send_only(x, idx, nt):
                return a2a.dispatch_send(x, idx, nt.reshape(())).state

            fn = jax.jit(jax.shard_map(send_only, mesh=mesh, in_specs=(spec, spec, spec),
                                       out_specs=spec))
            x, _, idx, _, nt = T.global_inputs(tiny, mesh, T.make_inputs(tiny, 9))
            jax.block_until_ready(fn(x, idx, nt))  # one send in flight is fine
            # The kernel refuses the second send (the order lives on the device, where a
            # replayed command buffer is checked too) and check() reports it. A rank whose
            # peer's abort word came first reports PeerAborted naming the ProtocolError, from
            # check() or from the handler refusing the poisoned handle (XLA wraps that one).
            error = None
            try:
                jax.block_until_ready(fn(x, idx, nt))
                a2a.check()
            except Exception as e:  # noqa: BLE001 - check()'s error or XLA's wrap
                error = e
            finally:
                clear_runtime_tokens()
            assert error is not None, "second dispatch_send in flight was not refused"
            assert "ProtocolError" in str(error), str(error)
            assert isinstance(error, (ProtocolError, PeerAbortedError)) or "PeerAborted" in str(
                error), f"{type(error).__name__}: {error}"

    return suite.finish("GPU SUITE")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
