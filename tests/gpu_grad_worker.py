"""GPU gradient suite, run on every rank by the launcher: nvshmem gradients against
computations each rank can do alone, and training steps.

    python -m jax_moe_comm.launch -n N --oversubscribe -- python tests/gpu_grad_worker.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m jax_moe_comm.launch -n N \\
        --oversubscribe -- python tests/gpu_grad_worker.py          # command buffers off
    STAGES=grad scripts/lab/gpu_check.sh     # the same through the GPU check script's generic
                                          # loop over tests/gpu_*_worker.py

The reference backend cannot run here with several ranks on one GPU (NCCL refuses), so each
rank checks its own gradients against the numpy oracle (dispatch/combine with f_e(x) = c_e x)
and against the dense layer computed on its own device. Cases:
  ops     d x, d weights of sum <G, combine(c_e * dispatch(x))>, fused and split, four routings,
          padded and packed layouts (packed: rows the kernels write in place, issue 24); and
          padded with an expert_capacity P below the worst case that these inputs fit (the
          busiest expert's rows): expert_x [L, P], the backward of combine on its own
          worst-case handle, nothing dropped
  layer   every gradient of the MoE layer (router, experts, shared expert, input) within bf16
          tolerance of the dense layer's; stacked layers under jax.checkpoint interleave the
          forward recomputation with other layers' backward all-to-alls (or, with the
          CHECKPOINT_NAME policy, recompute none); on packed rows "auto" is tokamax's grouped
          GEMM where tokamax imports (differentiated through grouped_vjp), and two cases force it
          at ~128 rows per expert
  train   --steps Adam steps (replicated gradients summed by DispatchSum): the loss goes down,
          replicated parameters stay bit-identical on every rank
Prints one `PASS name` / `FAIL name: why` line per case on rank 0 and exits non-zero if any
case failed on any rank. `--backend reference --platform cpu` runs it on CPU processes.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import jax_moe_comm.distributed as dist
from gpu_harness import Suite, small_configs

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_moe_comm import AllToAll, MoEConfig, bootstrap, expert_gemm, train  # noqa: E402
from jax_moe_comm import testing as T  # noqa: E402
from jax_moe_comm.moe import MoELayerConfig, init_params  # noqa: E402

bf16, fp8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
suite = Suite(RANK)
log, case = suite.log, suite.case


def op_configs(quick: bool):
    out = small_configs(WORLD)
    if not quick:
        out.append(("V2Lite-fp8", MoEConfig(num_experts=64, experts_per_token=6, hidden=2048,
                                            max_num_tokens=32, world_size=WORLD,
                                            dispatch_dtype=fp8)))
    return out


def layer_cases():
    base = dict(num_experts=16, experts_per_token=4, hidden=128, ffn=256, max_num_tokens=8)
    out = [("plain", MoELayerConfig(**base), 0.0, 1, False),
           ("dropped-slots", MoELayerConfig(**base), 0.25, 1, False),
           ("dropped-slots-packed", MoELayerConfig(**base), 0.25, 1, False),
           ("3-layers-remat-packed", MoELayerConfig(**base), 0.1, 3, True),
           ("fp8", MoELayerConfig(**{**base, "hidden": 256}, fp8_dispatch=True), 0.1, 1, False),
           ("3-layers", MoELayerConfig(**base), 0.1, 3, False),
           ("3-layers-remat", MoELayerConfig(**base), 0.1, 3, True),
           ("3-layers-remat-saving-a2a", MoELayerConfig(**base), 0.1, 3, "save_a2a")]
    if WORLD % 2 == 0:  # parameter gradients only: d x is split between the replicas
        out.append(("dp2", MoELayerConfig(**base, token_replicas=2), 0.1, 1, False))
    # tokamax's grouped GEMM differentiated through grouped_vjp (its own VJP gave weight
    # gradients 0.5 wrong past 128 rows): groups of ~128 rows per expert, the regime it failed
    big = dict(num_experts=2 * WORLD, experts_per_token=4, hidden=256, ffn=512,
               max_num_tokens=64)
    if expert_gemm.tokamax_problem() is None:
        # 128 mean rows: the tile rule's m128 on sm90 (expert_gemm.TOKAMAX_TILE_BY_MEAN_ROWS);
        # 32 mean rows (max_m 16): its n128, in the forward and the backward's d x
        out += [("tokamax-128-rows-packed", MoELayerConfig(**big, expert_gemm="tokamax"), 0.0,
                 1, False),
                ("tokamax-32-rows-packed",
                 MoELayerConfig(**{**big, "max_num_tokens": 16}, expert_gemm="tokamax"), 0.0, 1,
                 False),
                ("tokamax-dropped-slots-3-layers-remat-packed",
                 MoELayerConfig(**big, expert_gemm="tokamax"), 0.1, 3, True)]
    else:
        log(f"no tokamax cases: {expert_gemm.tokamax_problem()}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=50, help="training steps")
    parser.add_argument("--backend", default="nvshmem", choices=("nvshmem", "reference"))
    parser.add_argument("--only", default="", help="comma list of case-name substrings")
    args = parser.parse_args()
    suite.only.extend(filter(None, args.only.split(",")))
    mesh = T.make_mesh(WORLD)
    log(f"world={WORLD} devices={jax.devices()} backend={args.backend}")

    for (name, cfg), layout in ((c, lay) for c in op_configs(args.quick)
                                for lay in ("padded", "packed")):
        @case(f"EP{WORLD}-ops-{name}-{layout}")
        def run_ops(cfg=cfg, layout=layout):
            with AllToAll(cfg, backend=args.backend, layout=layout,
                          differentiable=True) as a2a:
                steps = (T.make_grad_step(a2a, mesh), T.make_grad_step(a2a, mesh, split=True))
                worst = 0.0
                for seed, routing in enumerate(("random", "skewed", "duplicates",
                                                "empty_ranks")):
                    for kind, step in zip(("fused", "split"), steps):
                        s = 1000 * seed + WORLD
                        inp, G = T.make_inputs(cfg, s, routing), T.loss_cotangent(cfg, s)
                        try:
                            worst = max(worst, T.check_grads_against_oracle(
                                a2a, mesh, inp, G, step=step))
                        except AssertionError as e:
                            raise AssertionError(f"routing {routing}, {kind} step, num_tokens "
                                                 f"{inp.num_tokens.tolist()}: {e}") from None
                a2a.check()
                mib = a2a.symmetric_bytes / 2**20
                return f"max rel err {worst:.3g} symmetric={mib:.1f} MiB/rank (with backward)"

    for name, cfg in op_configs(args.quick):
        @case(f"EP{WORLD}-ops-{name}-padded-capacity")
        def run_capacity(cfg=cfg):
            inputs = []
            for seed, routing in enumerate(("random", "duplicates", "empty_ranks")):
                s = 1000 * seed + WORLD + 7
                inputs.append((routing, T.make_inputs(cfg, s, routing), T.loss_cotangent(cfg, s)))
            P = max(1, max(sum(c.values()) for _, inp, _ in inputs for r in range(WORLD)
                           for c in T.expected_rows(cfg, inp, r).values()))
            if P >= cfg.max_recv_tokens:
                return f"nothing to check: the busiest expert gets the worst case, {P} rows"
            with AllToAll(cfg, backend=args.backend, expert_capacity=P,
                          differentiable=True) as a2a:  # overflow="fail": a drop would raise
                steps = (T.make_grad_step(a2a, mesh), T.make_grad_step(a2a, mesh, split=True))
                worst = 0.0
                for routing, inp, G in inputs:
                    for kind, step in zip(("fused", "split"), steps):
                        try:
                            worst = max(worst, T.check_grads_against_oracle(
                                a2a, mesh, inp, G, step=step))
                        except AssertionError as e:
                            raise AssertionError(f"routing {routing}, {kind} step: {e}") \
                                from None
                a2a.check()
                assert a2a.dropped_rows() == 0, a2a.dropped_rows()
            return f"P={P} of {cfg.max_recv_tokens} rows per expert, max rel err {worst:.3g}"

    for name, cfg, drop_rate, layers, remat in layer_cases():
        @case(f"EP{WORLD}-layer-{name}")
        def run_layer(cfg=cfg, drop_rate=drop_rate, layers=layers, remat=remat):
            L = cfg.num_experts // WORLD
            layout = "packed" if name.endswith("-packed") else "padded"
            with AllToAll(cfg.comm_config(WORLD), backend=args.backend, layout=layout,
                          differentiable=True) as a2a:
                step = T.make_layer_grad_step(a2a, cfg, mesh, layers, remat)
                worst = 0.0
                for seed in range(3):  # one handle, several steps
                    params = [init_params(cfg, 10 * seed + i) for i in range(layers)]
                    x, nt, G, drop = T.layer_grad_inputs(cfg, WORLD, 100 + seed, drop_rate)
                    moe = T.run_layer_grads(a2a, cfg, mesh, params, x, nt, G, drop,
                                            step=step)
                    dense = T.dense_layer_grads(cfg, params, x, nt, G, drop)
                    worst = max(worst, T.compare_layer_grads(*moe, *dense, [RANK], L,
                                                             cfg.token_replicas))
                a2a.check()
            return f"max |moe - dense| / max |dense| = {worst:.3g}"

    @case(f"EP{WORLD}-train-{args.steps}-steps")
    def run_train():
        cfg = MoELayerConfig(num_experts=16, experts_per_token=4, hidden=128, ffn=256,
                             max_num_tokens=16)
        params = init_params(cfg, 0)
        like = {"grads": {k: np.zeros(v.shape, np.float32) for k, v in params.items()
                          if k not in train.EXPERT_PARAMS},
                "sse": np.zeros(1, np.float32), "count": np.zeros(1, np.float32)}
        with AllToAll(cfg.comm_config(WORLD), backend=args.backend,
                      differentiable=True) as a2a:
            summer = T.DispatchSum(like, WORLD, backend=args.backend)
            opt = T.optimizer(1e-2)
            init, step = train.make_train_step(a2a, cfg, mesh, opt, params, summer,
                                               train.linear_target(cfg.hidden, 2))
            state = train.stacked_state(params, WORLD, mesh)
            opt_state = init(state)
            rng = np.random.default_rng(1)
            m, losses = cfg.max_num_tokens, []
            for _ in range(args.steps):
                x = rng.standard_normal((WORLD * m, cfg.hidden)).astype(bf16)
                nt = rng.integers(m // 2, m + 1, WORLD).astype(np.int32)
                state, opt_state, loss = step(state, opt_state, T.put_global(mesh, x),
                                              T.put_global(mesh, nt))
                losses.append(float(np.asarray(loss.addressable_shards[0].data)[0]))
            a2a.check()
            summer.a2a.check()
            summer.close()
        assert np.all(np.isfinite(losses)), losses
        k = max(1, len(losses) // 10)
        first, last = np.mean(losses[:k]), np.mean(losses[-k:])
        assert last < 0.8 * first, f"loss did not go down: {losses}"
        router = np.asarray(state["router"].addressable_shards[0].data)
        digest = hashlib.sha256(router.tobytes()).hexdigest()[:16]
        digests = bootstrap.all_gather("grad_worker:router", digest)
        assert len(set(digests)) == 1, f"replicated router differs between ranks: {digests}"
        return f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({opt.name}); router {digest} on all"

    return suite.finish("GPU GRAD SUITE")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
