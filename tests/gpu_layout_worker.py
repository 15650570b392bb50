"""GPU checks of issue 12, run on every rank by the launcher (nvshmem backend):

    python -m jax_moe_comm.launch -n N --oversubscribe -- python tests/gpu_layout_worker.py \
        [--quick] [--bench]

- the packed layout against the oracle (fused and split, bf16/fp8/token_replicas=2);
- NaN/inf weights on unused, out-of-range and padding slots never reach y; an out-of-range
  index in a padding row is not reported;
- the MoE layer with ragged_dot on the packed layout against the dense layer and against the
  padded layout's einsum;
- the Flax module decoding with a different token count per rank each step, compiled once;
- dequantize on receive (JMC_RECV_DEQUANTIZE=1): the kernel's bf16 rows against XLA's pass,
  bit for bit, every cycle of a jitted loop, both layouts, fused and split; the fp8 layer's y;
- a packed capacity below the worst case, and a padded per-expert capacity (issue 24):
  overflow="drop" in a jitted fori_loop of cycles that alternate a routing that overflows
  rank 0 with one that fits, every cycle's y checked on the device against the dense sum
  without exactly the dropped slots, the dropped counts exact; overflow="fail" raises
  CapacityExceededError (PeerAborted elsewhere), and after recover() the same compiled step
  runs right;
- --bench: the demo layer's step time, padded einsum vs packed ragged_dot (XLA's default
  lowering, and cuDNN's grouped GEMM through xla_gpu_experimental_use_ragged_dot_fusion).

Prints one `PASS name` / `FAIL name: why` line per case on rank 0 and exits non-zero if any
case failed on any rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from unittest import mock

import jax_moe_comm.distributed as dist

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gpu_harness import Suite, gather_global, run_cycle  # noqa: E402
from jax_moe_comm import (AllToAll, InvalidRoutingError, MoEConfig, PeerAbortedError,  # noqa: E402
                          autodiff, testing as T)
from jax_moe_comm.errors import CapacityExceededError  # noqa: E402
from jax_moe_comm.moe import (MoELayerConfig, dense_forward, init_params,  # noqa: E402
                              moe_forward)

bf16, fp8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
BACKEND = "nvshmem"  # --backend reference: a CPU smoke run of this file itself
suite = Suite(RANK)
log, case = suite.log, suite.case


def configs(quick: bool):
    W = WORLD
    out = [("tiny-bf16", MoEConfig(num_experts=max(8, W), experts_per_token=2, hidden=128,
                                   max_num_tokens=4, world_size=W)),
           ("small-fp8", MoEConfig(num_experts=2 * W, experts_per_token=4, hidden=256,
                                   max_num_tokens=16, world_size=W, dispatch_dtype=fp8))]
    if W % 2 == 0:
        out.append(("replicas2-bf16-f32", MoEConfig(num_experts=4 * W, experts_per_token=3,
                                                    hidden=512, max_num_tokens=8, world_size=W,
                                                    token_replicas=2, combine_dtype=f32)))
    if not quick:
        out.append(("R1-fp8", MoEConfig(num_experts=256, experts_per_token=8, hidden=7168,
                                        max_num_tokens=128, world_size=W, dispatch_dtype=fp8)))
    return out


put = T.put_global  # (mesh, numpy array, spec=P("ep"))


def mine(arr, rows: int) -> dict[int, np.ndarray]:
    return T.local_blocks(arr, rows)


def layer_step(a2a, cfg, mesh, pspecs):
    body = lambda p, x, n: moe_forward(a2a, cfg, p, x, n.reshape(()))  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspecs, P("ep"), P("ep")),
                                 out_specs=P("ep")))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--backend", default="nvshmem", choices=("nvshmem", "reference"))
    args = parser.parse_args()
    global BACKEND
    BACKEND = args.backend
    mesh = T.make_mesh(WORLD)
    log(f"world={WORLD} backend={jax.default_backend()} jax={jax.__version__}")

    for name, cfg in configs(args.quick):
        @case(f"EP{WORLD}-packed-{name}")
        def packed(cfg=cfg):
            with AllToAll(cfg, backend=BACKEND, layout="packed") as a2a:
                fused, split = T.make_step(a2a, mesh), T.make_step(a2a, mesh, split=True)
                worst = 0.0
                for seed, routing in enumerate(("random", "skewed", "duplicates",
                                                "empty_ranks")):
                    for step in (fused, split):
                        inp = T.make_inputs(cfg, 1000 * seed + WORLD, routing)
                        worst = max(worst, T.run_and_check(a2a, mesh, inp, step=step))
                a2a.check()
                return f"max|err|={worst:.3g} max_recv_total={cfg.max_recv_total}"

    tiny = configs(True)[0][1]

    @case(f"EP{WORLD}-nan-weights-and-padding-rows")
    def nan_weights():
        for layout in ("padded", "packed"):
            with AllToAll(tiny, backend=BACKEND, layout=layout) as a2a:
                inp = T.make_inputs(tiny, 17)
                m = tiny.max_num_tokens
                inp.num_tokens[:] = np.arange(WORLD) % (m + 1)
                holes = inp.indices < 0
                inp.weights[holes] = np.nan  # unused slots
                inp.indices[:, 0, -1], inp.weights[:, 0, -1] = -1, np.inf
                for r in range(WORLD):
                    n = inp.num_tokens[r]
                    inp.indices[r, n:] = tiny.num_experts + 5  # padding rows: ignored
                    inp.weights[r, n:] = np.nan
                T.run_and_check(a2a, mesh, inp)  # y is checked finite against the oracle
                a2a.check()  # nothing live was out of range: nothing reported
        with AllToAll(tiny, backend=BACKEND) as a2a:  # an out-of-range slot in a live row
            inp = T.make_inputs(tiny, 5, "bad_index")  # rank 0's token 0 is live and bad
            inp.weights[0, 0, 0] = np.nan
            run_cycle(T.make_step(a2a, mesh), T.global_inputs(tiny, mesh, inp), RANK)
            try:
                a2a.check()
                raised = None
            except (InvalidRoutingError, PeerAbortedError) as e:
                raised = type(e)
            # The holder of the bad token reports it; on the nvshmem backend its abort word
            # stops every other rank with PeerAborted (protocol v2), the reference has none.
            if RANK // tiny.token_replicas == 0:
                want = InvalidRoutingError
            else:
                want = PeerAbortedError if BACKEND == "nvshmem" else None
            assert raised is want, f"rank {RANK}: raised {raised}, expected {want}"

    @case(f"EP{WORLD}-moe-layer-ragged-dot-vs-dense-and-padded-and-row-buckets")
    def layer():
        cfg = MoELayerConfig(num_experts=4 * WORLD, experts_per_token=4, hidden=512, ffn=1024,
                             max_num_tokens=32)
        params = init_params(cfg, 0)
        pspecs = {k: (P("ep") if k in ("w_in", "w_out") else P()) for k in params}
        dev = {k: put(mesh, v, pspecs[k]) for k, v in params.items()}
        rng = np.random.default_rng(3)
        m = cfg.max_num_tokens
        x = rng.standard_normal((WORLD * m, cfg.hidden)).astype(bf16)
        nt = rng.integers(0, m + 1, WORLD).astype(np.int32)  # loads differ: so do buckets
        outs = {}
        # "buckets": the packed layer with gemm_row_buckets (0.5x and 1x the mean load, then
        # the whole buffer), the bucket picked on the device per rank (an XLA conditional);
        # ragged_dot by name: "auto" is the einsum where tokamax does not import (no buckets)
        bucketed = dataclasses.replace(cfg, expert_gemm="ragged_dot",
                                       gemm_row_buckets=(0.5, 1.0))
        for name, layout, lcfg in (("packed", "packed", cfg), ("padded", "padded", cfg),
                                   ("buckets", "packed", bucketed)):
            with AllToAll(cfg.comm_config(WORLD), backend=BACKEND, layout=layout) as a2a:
                y = layer_step(a2a, lcfg, mesh, pspecs)(dev, put(mesh, x), put(mesh, nt))
                outs[name] = mine(y, m)
                a2a.check()
        local = jax.local_devices()[0]
        p_local = {k: jax.device_put(v, local) for k, v in params.items()}
        worst = 0.0
        for r, y in outs["packed"].items():
            ref = dense_forward(cfg, p_local, jax.device_put(x[r * m:(r + 1) * m], local), nt[r])
            err = np.abs(y.astype(np.float32) - np.asarray(ref, np.float32)).max()
            assert err <= 0.05, f"rank {r}: packed vs dense {err}"
            diff = np.abs(y.astype(np.float32) - outs["padded"][r].astype(np.float32)).max()
            assert diff <= 0.05, f"rank {r}: packed vs padded {diff}"
            diff = np.abs(y.astype(np.float32) - outs["buckets"][r].astype(np.float32)).max()
            assert diff <= 0.05, f"rank {r}: packed vs packed with row buckets {diff}"
            worst = max(worst, float(err))
        return f"max|y - dense|={worst:.3g}; row buckets {bucketed.gemm_row_buckets} agree"

    @case(f"EP{WORLD}-flax-decode-varying-tokens")
    def flax_decode():
        try:
            from flax import nnx
        except ImportError:
            return "SKIPPED: flax is not installed"
        from jax_moe_comm.flax import MoE

        fmesh = jax.make_mesh((WORLD,), ("ep",))
        moe = MoE(num_experts=2 * WORLD, experts_per_token=2, hidden=256, ffn=512,
                  max_num_tokens=16, mesh=fmesh, backend=BACKEND, rngs=nnx.Rngs(0))
        traces = []

        @nnx.jit
        def step(m, x, n):
            traces.append(1)
            return m(x, n)

        full = {k: gather_global(f"flax:{k}", v)  # not process_allgather: NCCL
                for k, v in moe._params().items()}  # refuses several ranks on one GPU
        local = jax.local_devices()[0]
        p_local = {k: jax.device_put(v, local) for k, v in full.items()}
        rng = np.random.default_rng(11)
        m, worst = 16, 0.0
        for _ in range(6):
            nt = rng.integers(0, m + 1, WORLD).astype(np.int32)
            x = rng.standard_normal((WORLD * m, 256)).astype(bf16)
            y = step(moe, put(fmesh, x), put(fmesh, nt))
            for r, yr in mine(y, m).items():
                ref = dense_forward(moe.layer, p_local, jax.device_put(x[r * m:(r + 1) * m],
                                                                       local), nt[r])
                worst = max(worst, float(np.abs(yr.astype(np.float32)
                                                - np.asarray(ref, np.float32)).max()))
        moe.a2a.check()
        moe.close()
        assert len(traces) == 1, f"traced {len(traces)} times"
        assert worst <= 0.05, worst
        return f"6 steps, traced once, max|y - dense|={worst:.3g}"

    recv_dequantize_cases(mesh)
    capacity_cases(mesh)
    if args.bench:
        bench(mesh)

    return suite.finish("GPU LAYOUT SUITE")


# -- dequantize on receive (JMC_RECV_DEQUANTIZE) ----------------------------------------------
DEQ_CYCLES = 6


def dequantize_loop(a2a, mesh, split: bool):
    """One jitted fori_loop of DEQ_CYCLES dispatches of bf16 x (the handle quantizes it), no
    host round trip between them, cycle i sending x * (1 + i / 8) from a rank that starts
    it late by a rank-dependent spin; returns per rank [cycles, rows, H] bf16 expert_x and
    [cycles, L] counts, on a handle made under the JMC_RECV_DEQUANTIZE value to test."""
    def body(x, idx, nt):
        nt = nt.reshape(())
        rank = jax.lax.axis_index("ep")

        def cycle(i, carry):
            xs, counts = carry
            # skew: rank-dependent serial work that the send waits for (spin is > 0 always)
            spin = jax.lax.fori_loop(0, 200 * rank, lambda _, v: v * 1.0000001, jnp.float32(1))
            scale = jnp.where(spin > 0, 1 + i / 8, 0.0).astype(f32)
            xi = (x.astype(f32) * scale).astype(bf16)
            if split:
                out = a2a.dispatch_recv(a2a.dispatch_send(xi, idx, nt))
            else:
                out = a2a.dispatch(xi, idx, nt)
            assert out.expert_x.dtype == bf16 and out.expert_x_scale is None
            return (xs.at[i].set(out.expert_x), counts.at[i].set(out.expert_num_tokens))

        rows = ((a2a.max_recv_rows,) if a2a.layout == "packed" else
                (a2a.config.num_local_experts, a2a.expert_capacity))
        shape = (DEQ_CYCLES,) + rows + (a2a.config.hidden,)
        init = (jnp.zeros_like(x, bf16, shape=shape),
                jnp.zeros_like(nt, jnp.int32, shape=(DEQ_CYCLES, a2a.config.num_local_experts)))
        xs, counts = jax.lax.fori_loop(0, DEQ_CYCLES, cycle, init)
        return xs[None], counts[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                 out_specs=(P("ep"), P("ep"))))


def expert_rows(ex, counts, layout) -> list[list[bytes]]:
    """Per local expert, its live rows of one cycle as sorted bytes: which slot takes which row
    comes from atomics on the GPU, so two dispatches agree on the rows, not on their order."""
    if layout == "packed":
        starts = np.concatenate([[0], np.cumsum(counts)])
        groups = [ex[starts[e]:starts[e + 1]] for e in range(len(counts))]
    else:
        groups = [ex[e, :counts[e]] for e in range(len(counts))]
    return [sorted(row.tobytes() for row in g) for g in groups]


def with_knob(value: str, fn):
    """fn() with JMC_RECV_DEQUANTIZE=value (read when a handle is created)."""
    with mock.patch.dict(os.environ, {autodiff.RECV_DEQUANTIZE_ENV: value}):
        return fn()


def asks_kernel(step, args, value: str) -> None:
    """The compiled step's dispatch asks the kernel to dequantize exactly when value is "1"
    (nvshmem only: the reference backend has no kernel)."""
    if BACKEND == "nvshmem":
        asked = "dequantize = true" in step.lower(*args).as_text()
        assert asked == (value == "1"), f"JMC_RECV_DEQUANTIZE={value}: attribute {asked}"


def recv_dequantize_cases(mesh):
    """The receive kernel's bf16 rows (handles made under JMC_RECV_DEQUANTIZE=1) against XLA's
    dequantize pass (=0): every live row of every cycle of a jitted loop, bit for bit, each
    expert's rows as a set (their order comes from atomics), both layouts, fused and split
    dispatch; then the fp8 MoE layer's y with each."""
    cfg = MoEConfig(num_experts=2 * WORLD, experts_per_token=4, hidden=1024, max_num_tokens=16,
                    world_size=WORLD, dispatch_dtype=fp8)
    inp = T.make_inputs(cfg, 77, "duplicates")
    x = put(mesh, T.differentiable_x(cfg, inp).reshape(-1, cfg.hidden))
    idx = put(mesh, inp.indices.reshape(-1, cfg.experts_per_token))
    nt = put(mesh, inp.num_tokens)

    for layout in ("packed", "padded"):
        for split in (False, True):
            @case(f"EP{WORLD}-recv-dequantize-{layout}-{'split' if split else 'fused'}")
            def rows(layout=layout, split=split):
                got = {}
                for value in ("0", "1"):
                    a2a = with_knob(value, lambda: AllToAll(cfg, backend=BACKEND,
                                                            layout=layout))
                    with a2a:
                        step = dequantize_loop(a2a, mesh, split)
                        asks_kernel(step, (x, idx, nt), value)
                        xs, counts = step(x, idx, nt)
                        got[value] = (mine(xs, 1), mine(counts, 1))
                        a2a.check()
                live_rows = 0
                for r, want in got["0"][0].items():
                    want, have = want[0], got["1"][0][r][0]
                    counts = got["0"][1][r][0]
                    np.testing.assert_array_equal(got["1"][1][r][0], counts)
                    assert np.isfinite(want.astype(np.float32)).all()  # XLA's zeroes the rest
                    for i in range(DEQ_CYCLES):
                        w = expert_rows(want[i], counts[i], layout)
                        h = expert_rows(have[i], counts[i], layout)
                        for e, (we, he) in enumerate(zip(w, h)):
                            assert we == he, (f"rank {r} cycle {i} expert {e}: the kernel's "
                                              f"{len(he)} rows differ from XLA's {len(we)}")
                        live_rows += int(counts[i].sum())
                assert live_rows > 0
                return f"{live_rows} live rows over {DEQ_CYCLES} cycles, bit for bit"

    @case(f"EP{WORLD}-recv-dequantize-moe-layer")
    def layer():
        lcfg = MoELayerConfig(num_experts=2 * WORLD, experts_per_token=4, hidden=1024,
                              ffn=512, max_num_tokens=16, fp8_dispatch=True)
        params = init_params(lcfg, 1)
        pspecs = {k: (P("ep") if k in ("w_in", "w_out") else P()) for k in params}
        dev = {k: put(mesh, v, pspecs[k]) for k, v in params.items()}
        rng = np.random.default_rng(5)
        m = lcfg.max_num_tokens
        lx = put(mesh, rng.standard_normal((WORLD * m, lcfg.hidden)).astype(bf16))
        lnt = put(mesh, rng.integers(0, m + 1, WORLD).astype(np.int32))
        ys = {}
        for layout in ("packed", "padded"):
            for value in ("0", "1"):
                a2a = with_knob(value, lambda layout=layout: AllToAll(
                    lcfg.comm_config(WORLD), backend=BACKEND, layout=layout))
                with a2a:
                    step = layer_step(a2a, lcfg, mesh, pspecs)
                    asks_kernel(step, (dev, lx, lnt), value)
                    ys[layout, value] = mine(step(dev, lx, lnt), m)
                    a2a.check()
        worst = 0.0
        for layout in ("packed", "padded"):
            for r, y in ys[layout, "0"].items():
                y = y.astype(np.float32)
                diff = np.abs(y - ys[layout, "1"][r].astype(np.float32)).max()
                # the experts' inputs are equal; only the GEMMs' row order may differ
                assert diff <= 2 ** -7 * max(1.0, float(np.abs(y).max())), (
                    f"rank {r} {layout}: y differs by {diff}")
                worst = max(worst, float(diff))
        return f"y equal on both layouts up to {worst:.3g}"


# -- capacity (issue 24) ----------------------------------------------------------------------
# L >= k, so the "skewed" routing sends every token's k slots to rank 0's experts: rank 0 gets
# the worst case W * m * k rows, over C = recv_rows_for(1.0) (the mean, m * k here); padded,
# each of experts 0..k-1 gets W * m rows, over P = rows_per_expert_for(1.0) (8: the mean, 4,
# up to a multiple of 8). The spread routing gives every expert 4 rows: it fits either.
CAP_CFG = dict(num_experts=4 * WORLD, experts_per_token=2, hidden=256, max_num_tokens=8,
               world_size=WORLD)


def capacity_loop(a2a, mesh, cycles: int, split: bool = False):
    """A jitted fori_loop of `cycles` dispatch/identity-expert/combine cycles, numbered from the
    call's `start` (an input: one compiled step runs either kind first); even cycles route
    every slot to rank 0 (overflow), odd ones spread the slots. Slot j weighs 2^-j, so each
    token's y is x times the weight sum of exactly one subset of its slots: the subset that
    was not dropped. No collective inside the step (NCCL refuses several ranks on one GPU):
    each rank finds its tokens' subsets from y itself. Returns per rank the worst
    |y - expected| over the cycles, the rows it dropped and its slots that were dropped; the
    host checks that the two totals agree over the ranks. split: the send and recv halves as
    separate ops (separate kernels on nvshmem), else the fused ones."""
    cfg = a2a.config
    m, k, E = cfg.max_num_tokens, cfg.experts_per_token, cfg.num_experts
    w = 2.0 ** -jnp.arange(k, dtype=f32)
    weights = jnp.broadcast_to(w, (m, k))
    kept = (jnp.arange(2 ** k)[:, None] >> jnp.arange(k)[None, :]) & 1  # [subset, slot]
    subset_sum = kept.astype(f32) @ w  # distinct for every subset

    def body(x0, start):
        rank = jax.lax.axis_index("ep")
        tok = jnp.arange(m)[:, None]

        def cycle(i, carry):
            worst, rows_dropped, slots_dropped = carry
            # (+ a zero from the previous cycle XLA cannot fold: on XLA:CPU, cycles whose inputs
            # do not depend on the last one's result get reordered; docs/notes.md)
            c = start.reshape(()) + i + (rows_dropped >> 30)
            x = (x0 * (1.0 + 0.25 * c.astype(f32))).astype(bf16)
            spread = (tok * k + rank * m * k + c + jnp.arange(k)[None, :]) % E
            indices = jnp.where(c % 2 == 0, jnp.arange(k)[None, :], spread).astype(jnp.int32)
            if split:
                out = a2a.dispatch_recv(a2a.dispatch_send(x, indices, m))
            else:
                out = a2a.dispatch(x, indices, m)
            expert_y = out.expert_x.astype(cfg.combine_dtype)  # the identity expert
            if split:
                y = a2a.combine_recv(a2a.combine_send(expert_y, out.routing), indices, weights,
                                     m)
            else:
                y = a2a.combine(expert_y, out.routing, indices, weights, m)
            y = y.astype(f32)
            xf = x.astype(f32)
            ratio = jnp.sum(y * xf, axis=1) / jnp.sum(xf * xf, axis=1)
            subset = jnp.argmin(jnp.abs(ratio[:, None] - subset_sum[None, :]), axis=1)
            want = (subset_sum[subset][:, None] * xf).astype(bf16).astype(f32)
            err = jnp.max(jnp.abs(y - want) / (1.0 + jnp.abs(want)))
            err = jnp.where(jnp.all(jnp.isfinite(y)), err, jnp.inf)
            lost = k * m - jnp.sum(kept[subset])
            return (jnp.maximum(worst, err), rows_dropped + out.dropped_rows.reshape(()),
                    slots_dropped + lost)

        zero = jnp.zeros_like(start.reshape(()))  # varying over "ep", as the carry becomes
        carry = jax.lax.fori_loop(0, cycles, cycle, (zero.astype(f32), zero, zero))
        return tuple(v.reshape(1) for v in carry)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                                 out_specs=(P("ep"),) * 3))


def totals(tag, results):
    """(this rank's worst error, every rank's dropped rows, every rank's dropped slots)."""
    worst, rows, slots = results
    return (float(mine(worst, 1)[RANK][0]), gather_global(tag + ":rows", rows),
            gather_global(tag + ":slots", slots))


def capacity_cases(mesh):
    for layout in ("packed", "padded"):
        capacity_layout_cases(mesh, layout)


def capacity_layout_cases(mesh, layout):
    cfg = MoEConfig(**CAP_CFG)
    m, k = cfg.max_num_tokens, cfg.experts_per_token
    if layout == "packed":
        C = cfg.recv_rows_for(1.0)
        over = WORLD * m * k - C  # rank 0's overflow in a skewed cycle
        capacity = dict(layout="packed", max_recv_rows=C)
        named = [str(WORLD * m * k), str(C)]  # rows arrived, the capacity
        sized = f"C={C} of {cfg.max_recv_total}"
    else:
        C = cfg.rows_per_expert_for(1.0)
        over = k * max(0, WORLD * m - C)  # experts 0..k-1 of rank 0, W*m rows each
        capacity = dict(layout="padded", expert_capacity=C)
        named = []  # the prefix only: the nvshmem wording is its own (the CPU suite checks ours)
        sized = f"P={C} of {cfg.max_recv_tokens} per expert"
    assert over > 0, "the skewed cycle must overflow rank 0 (WORLD >= 2)"
    rng = np.random.default_rng(5)
    x0 = put(mesh, rng.standard_normal((WORLD * m, cfg.hidden)).astype(bf16))
    skewed_first, spread_first = (put(mesh, np.full(WORLD, v, np.int32)) for v in (0, 1))

    @case(f"EP{WORLD}-{layout}-capacity-drop-in-a-loop")
    def drop():
        cycles = 6
        with AllToAll(cfg, backend=BACKEND, overflow="drop", **capacity) as a2a:
            for split in (False, True):
                results = capacity_loop(a2a, mesh, cycles, split)(x0, skewed_first)
                a2a.check()  # drops are not errors
                worst, rows, slots = totals(f"cap-drop-{layout}-{split}", results)
                want = [over * ((cycles + 1) // 2)] + [0] * (WORLD - 1)
                assert list(rows) == want, f"dropped rows per rank {list(rows)}, want {want}"
                assert slots.sum() == rows.sum(), f"slots lost {list(slots)}, rows {list(rows)}"
                assert worst <= 2e-2, f"rank {RANK}: max rel err {worst} (split={split})"
            total = a2a.dropped_rows()  # since creation: both loops
            assert total == 2 * want[RANK], (total, 2 * want[RANK])
            # Which rows each expert kept and the dropped rows' keys (row_source past the
            # output rows), per rank, against the routing (testing.run_and_check's capacity
            # checks: kept counts per expert, the dropped count, y without those slots).
            T.run_and_check(a2a, mesh, T.make_inputs(cfg, 7, "skewed"))
        return f"{sized}, {over} rows dropped per skewed cycle, err {worst:.3g}"

    @case(f"EP{WORLD}-{layout}-capacity-fail-then-recover")
    def fail():
        with AllToAll(cfg, backend=BACKEND, overflow="fail", timeout_s=10.0,
                      **capacity) as a2a:
            step = capacity_loop(a2a, mesh, 1)
            step(x0, skewed_first)  # one skewed cycle: rank 0 overflows
            raised, message = None, ""
            try:
                a2a.check()
            except Exception as e:  # noqa: BLE001 - asserted after the collective recover()
                raised, message = type(e), str(e)
            a2a.recover()  # every rank, whatever it saw: a rank that skipped it would hang all
            want = CapacityExceededError if RANK == 0 else (
                PeerAbortedError if BACKEND == "nvshmem" else None)
            assert raised is want, f"rank {RANK}: raised {raised}, expected {want}"
            if RANK == 0:
                assert message.startswith("CapacityExceeded:"), message
                assert all(n in message for n in named), (named, message)
            results = step(x0, spread_first)  # the same compiled step: a cycle that fits
            a2a.check()
            worst, rows, slots = totals(f"cap-fail-{layout}", results)
            assert rows.sum() == 0 and slots.sum() == 0, (list(rows), list(slots))
            assert worst <= 2e-2, f"rank {RANK}: err {worst}"
        return f"raised {want.__name__ if want else 'nothing'} here, then recovered: err {worst:.3g}"


def bench(mesh, steps: int = 30):
    """Step time of the demo layer: padded einsum vs packed ragged_dot (two lowerings)."""
    shapes = [("demo", MoELayerConfig()),  # the demo's default layer
              ("V2Lite-like", MoELayerConfig(num_experts=64, experts_per_token=6, hidden=2048,
                                             ffn=1408, max_num_tokens=128))]
    variants = [("padded einsum", "padded", {}),
                ("packed ragged_dot", "packed", {}),
                ("packed ragged_dot cuDNN", "packed",
                 {"xla_gpu_experimental_use_ragged_dot_fusion": True})]
    for shape_name, cfg in shapes:
        params = init_params(cfg, 0)
        pspecs = {k: (P("ep") if k in ("w_in", "w_out") else P()) for k in params}
        dev = {k: put(mesh, v, pspecs[k]) for k, v in params.items()}
        m = cfg.max_num_tokens
        rng = np.random.default_rng(0)
        x = put(mesh, rng.standard_normal((WORLD * m, cfg.hidden)).astype(bf16))
        nt = put(mesh, np.full(WORLD, m, np.int32))
        for label, layout, options in variants:
            try:
                log(timed(cfg, mesh, dev, x, nt, pspecs, layout, options, steps, shape_name,
                          label))
            except Exception as e:  # noqa: BLE001 - a lowering this XLA lacks is no failure
                log(f"BENCH {shape_name} {label}: unavailable: {type(e).__name__}: "
                    f"{str(e)[:300]}")


def timed(cfg, mesh, dev, x, nt, pspecs, layout, options, steps, shape_name, label) -> str:
    with AllToAll(cfg.comm_config(WORLD), backend=BACKEND, layout=layout) as a2a:
        lowered = layer_step(a2a, cfg, mesh, pspecs).lower(dev, x, nt)
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        jax.block_until_ready(compiled(dev, x, nt))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(dev, x, nt))
            times.append(time.perf_counter() - t0)
        a2a.check()
    med = sorted(times)[len(times) // 2] * 1e3
    return (f"BENCH {shape_name} {label}: median step {med:.3f} ms over {steps} steps "
            f"(E={cfg.num_experts} k={cfg.experts_per_token} H={cfg.hidden} F={cfg.ffn} "
            f"tokens/rank={cfg.max_num_tokens}, {WORLD} ranks)")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
