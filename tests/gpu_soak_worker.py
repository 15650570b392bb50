"""Soak (issue 28): a million dispatch + combine cycles in jitted loops, every cycle checked on
the device, one mismatch counter read at the end. Run on every rank by the launcher:

    python -m jax_moe_comm.launch -n 2 --oversubscribe -- python tests/gpu_soak_worker.py

Two handles take turns, cycle by cycle: one runs the split ops (dispatch_send / _recv,
combine_send / _recv) on the multi-block kernels, the other the fused one-launch ops
(JMC_FUSED=always). Routing, token counts and tokens change every cycle and are drawn on the
device from an integer hash of the cycle number (no host work, no sort per cycle), so a cycle
costs about what the kernels cost. --per-call cycles run in one jitted call (a fori_loop over
--unroll cycles written out); the calls are enqueued back to back with no host sync between
them, the counter passed from one to the next. Printed: cycles per second, the mismatch
count, XLA's and the GPU's free memory and each handle's symmetric bytes before and after, and
`GPU SOAK PASSED` / `FAILED`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax_moe_comm.distributed as dist
from gpu_harness import Suite

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_moe_comm import AllToAll, MoEConfig, native, testing as T  # noqa: E402

suite = Suite(RANK)
SPEC = P("ep")


def hash32(x):
    """A 32-bit integer mix (lowbias32): consecutive inputs give unrelated outputs."""
    x = x.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def cycle_inputs(cfg: MoEConfig, cycle, group):
    """Tokens of one token group for one cycle, from the cycle number: x [m, H] bf16, k distinct
    experts per token spread over the ranks with ~15 % of the slots dropped (-1), weights in
    [0.1, 1), and a token count in [0, m]."""
    m, H, E, k = cfg.max_num_tokens, cfg.hidden, cfg.num_experts, cfg.experts_per_token
    seed = hash32(cycle.astype(jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(group))
    t = jnp.arange(m, dtype=jnp.uint32)[:, None]
    j = jnp.arange(k, dtype=jnp.uint32)[None, :]
    col = jnp.arange(H, dtype=jnp.uint32)[None, :]
    x = ((hash32(seed ^ (t * jnp.uint32(H) + col)) % 2048).astype(jnp.float32) / 1024.0 - 1.0)
    base = hash32(seed + t * jnp.uint32(7919)) % E
    ids = ((base + j * (E // k)) % E).astype(jnp.int32)  # distinct: j * (E // k) < E
    slot = hash32(seed ^ (t * jnp.uint32(k) + j + jnp.uint32(0x9E3779B9)))
    ids = jnp.where(slot % 100 < 15, -1, ids)
    w = 0.1 + (slot >> 8).astype(jnp.float32) % 900 / 1000.0
    nt = (hash32(seed ^ jnp.uint32(0x85EBCA6B)) % (m + 1)).astype(jnp.int32)
    return x.astype(jnp.bfloat16), ids, w, nt


def make_calls(split: AllToAll, fused: AllToAll, mesh, per_call: int, unroll: int):
    """jit(shard_map) of per_call cycles from cycle `first` -> the counter plus the wrong
    cycles; even cycles on the split handle, odd ones on the fused handle."""
    cfg = split.config

    def one_cycle(cycle, rank, a2a, ops_split, after):
        # The inputs would come from the cycle number alone; `after` (this rank's count of
        # wrong cycles, < 2^30) shifted right by 30 adds 0 that XLA cannot fold, so every input
        # depends on the previous cycle's result and its ops run first (XLA orders by data:
        # XLA:CPU ran the next cycles' sends before this one's receive, which the reference
        # backend's protocol check refuses; order_after on x did not keep them in order there).
        cycle = cycle + (after[0] >> 30)
        x, ids, w, nt = cycle_inputs(cfg, cycle, rank // cfg.token_replicas)
        if ops_split:
            out = a2a.dispatch_recv(a2a.dispatch_send(x, ids, nt))
            ey = T.expert_outputs(cfg, rank, out.expert_x, None)
            y = a2a.combine_recv(a2a.combine_send(ey, out.routing), ids, w, nt)
        else:
            out = a2a.dispatch(x, ids, nt)
            ey = T.expert_outputs(cfg, rank, out.expert_x, None)
            y = a2a.combine(ey, out.routing, ids, w, nt)
        return T.combine_wrong(cfg, y, x, ids, w, nt)

    def per_rank(bad, first):
        rank = jax.lax.axis_index("ep")

        def body(i, bad):
            for u in range(unroll):
                cycle = first[0] + i * unroll + u
                a2a = split if u % 2 == 0 else fused
                bad = bad + one_cycle(cycle, rank, a2a, ops_split=u % 2 == 0, after=bad)
            return bad

        return jax.lax.fori_loop(0, per_call // unroll, body, bad)

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(SPEC, SPEC), out_specs=SPEC),
                   donate_argnums=0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=1_000_000)
    parser.add_argument("--per-call", type=int, default=50_000)
    parser.add_argument("--unroll", type=int, default=10, help="cycles written out per loop step")
    parser.add_argument("--backend", default="nvshmem", help="reference: the harness on CPU")
    args = parser.parse_args()
    calls = max(1, args.cycles // args.per_call)
    cycles = calls * args.per_call
    assert args.per_call % args.unroll == 0 and args.unroll % 2 == 0
    mesh = T.make_mesh(WORLD)
    cfg = MoEConfig(num_experts=4 * WORLD, experts_per_token=min(4, 4 * WORLD), hidden=256,
                    max_num_tokens=16, world_size=WORLD)
    suite.log(f"world={WORLD} backend={jax.default_backend()} cycles={cycles} "
              f"({calls} calls of {args.per_call}, {args.unroll} written out per loop step)")
    sharding = NamedSharding(mesh, SPEC)

    def per_rank_array(value: int):
        return jax.make_array_from_callback((WORLD,), sharding,
                                            lambda idx: np.full(WORLD, value, np.int32)[idx])

    def gpu_free() -> int:
        return native.module().device_memory()[0] if args.backend == "nvshmem" else 0

    def symmetric_bytes(*handles) -> list[int]:
        if args.backend != "nvshmem":
            return []
        return [native.module().symmetric_bytes(h._backend.handle) for h in handles]

    @suite.case(f"EP{WORLD}-soak-{cycles}-cycles-two-handles-checked-on-device")
    def soak():
        before = os.environ.get("JMC_FUSED")
        os.environ["JMC_FUSED"] = "always"
        try:
            fused = AllToAll(cfg, backend=args.backend)
        finally:
            if before is None:
                del os.environ["JMC_FUSED"]
            else:
                os.environ["JMC_FUSED"] = before
        with AllToAll(cfg, backend=args.backend) as split, fused:
            step = make_calls(split, fused, mesh, args.per_call, args.unroll)
            bad = jax.block_until_ready(step(per_rank_array(0), per_rank_array(0)))  # compile
            warm = int(T.local_blocks(bad, 1)[RANK][0])
            assert warm == 0, f"rank {RANK}: {warm} of the first {args.per_call} cycles wrong"
            t0 = time.perf_counter()  # one more call, timed, so a log cut short still says why
            jax.block_until_ready(step(per_rank_array(0), per_rank_array(args.per_call)))
            rate = args.per_call / (time.perf_counter() - t0)
            suite.log(f"warm-up: {rate:,.0f} cycles/s, so ~{cycles / rate:.0f} s for the soak")
            # Every input of the soak exists before the first reading: the readings compare
            # what the cycles themselves leave behind.
            firsts = [per_rank_array(2**30 + c * args.per_call) for c in range(calls)]
            bad = per_rank_array(0)
            sym0 = symmetric_bytes(split, fused)
            free0 = gpu_free()
            used0 = (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
            t0 = time.perf_counter()
            for first in firsts:  # enqueued back to back: no host sync between calls
                bad = step(bad, first)
            wrong = int(T.local_blocks(bad, 1)[RANK][0])  # the one read
            seconds = time.perf_counter() - t0
            split.check()
            fused.check()
            free1 = gpu_free()
            used1 = (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
            sym1 = symmetric_bytes(split, fused)
            assert wrong == 0, f"rank {RANK}: {wrong} of {cycles} cycles wrong"
            assert (used1, sym1) == (used0, sym0), (
                f"rank {RANK}: memory grew: XLA {used0} -> {used1}, symmetric {sym0} -> {sym1}")
            assert free1 >= free0 - (64 << 20), f"GPU free {free0 >> 20} -> {free1 >> 20} MiB"
            return (f"0 of {cycles} cycles wrong, {cycles / seconds:,.0f} cycles/s "
                    f"({seconds:.1f} s); rank 0 XLA bytes_in_use {used0} -> {used1}, GPU free "
                    f"{free0 >> 20} -> {free1 >> 20} MiB, symmetric bytes {sym0} -> {sym1}")

    return suite.finish("GPU SOAK")


if __name__ == "__main__":
    sys.exit(main())
