"""Main job: a MoE layer through dispatch/combine on 8 ranks, checked against a dense layer.

    python -m jax_moe_comm.demo                      # 8 emulated CPU devices, reference backend
    python -m jax_moe_comm.launch -n 8 [--oversubscribe] -- python -m jax_moe_comm.demo
    python -m jax_moe_comm.demo --train              # training steps (jax.grad + Adam)
    python -m jax_moe_comm.demo --capacity-factor 1.25 --overflow drop   # a packed capacity
    python -m jax_moe_comm.demo --layout padded --capacity-factor 1.25   # per-expert capacity

Prints the config, the max error against the same layer computed densely on one device, the
time per step and tokens/s. With --capacity-factor: the capacity (packed rows per rank, or padded
rows per local expert), its memory against the worst-case padded layout's, and how many rows it
dropped (steps that dropped rows are not compared). With
--train: the layer is trained to fit a fixed random linear map of fresh random tokens each step
(jax.grad through dispatch/combine, an optax Adam update if optax is installed: pip install
'jax_moe_comm[train]'), and the loss must go down.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jax_moe_comm.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (unlaunched)")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32, help="max tokens per rank")
    p.add_argument("--fp8", action="store_true", help="fp8 dispatch with block scales")
    p.add_argument("--shared-experts", type=int, default=1,
                   help="shared experts (of width --ffn each; 0: none)")
    p.add_argument("--gated", action="store_true",
                   help="SiLU-gated experts (DeepSeek's), w_in [E, H, 2F]")
    p.add_argument("--layout", default="packed", choices=("packed", "padded"),
                   help="expert layout: packed rows (default), or padded [L, max_recv, H]")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="the capacity as a multiple of the mean load: packed rows per rank "
                        "(MoEConfig.recv_rows_for) or, with --layout padded, rows per local "
                        "expert (MoEConfig.rows_per_expert_for); default: the worst case, "
                        "nothing drops")
    p.add_argument("--overflow", default="fail", choices=("fail", "drop"),
                   help="rows past the capacity: fail (check() raises) or drop (counted; "
                        "steps that dropped rows are not compared with the dense layer)")
    p.add_argument("--expert-gemm", default="auto",
                   choices=("auto", "einsum", "ragged_dot", "tokamax", "masked"),
                   help="how the experts' GEMMs run (jax_moe_comm.expert_gemm; auto: the "
                        "fastest measured on the platform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", action="store_true", help="training steps instead of inference")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (--train)")
    p.add_argument("--grad-sum", default="auto", choices=("auto", "psum", "dispatch"),
                   help="how replicated gradients are summed over ranks (--train): XLA's "
                        "psum, or the library's dispatch (auto: dispatch on nvshmem, where "
                        "several ranks may share a GPU and NCCL refuses them)")
    return p.parse_args(argv)


def _progress(i, n, width=30):
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} steps")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from . import distributed as dist

    if not dist.managed():  # default: emulated CPU devices in one process
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    rank, _ = dist.initialize()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from . import AllToAll, expert_gemm
    from .moe import MoELayerConfig, dense_forward, init_params, moe_forward

    cfg = MoELayerConfig(num_experts=args.experts, experts_per_token=args.topk,
                         hidden=args.hidden, ffn=args.ffn, max_num_tokens=args.tokens,
                         num_shared_experts=args.shared_experts, gated=args.gated,
                         fp8_dispatch=args.fp8,
                         expert_gemm=args.expert_gemm, capacity_factor=args.capacity_factor,
                         overflow=args.overflow)
    world = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    a2a = AllToAll(cfg.comm_config(world), axis_name="ep", backend=args.backend,
                   differentiable=args.train, **cfg.handle_kwargs(world, args.layout))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"jax_moe_comm demo: backend={a2a.backend_name} ranks={world} "
        f"platform={jax.default_backend()} E={cfg.num_experts} k={cfg.experts_per_token} "
        f"H={cfg.hidden} F={cfg.ffn} max_tokens/rank={cfg.max_num_tokens} "
        f"dispatch={'fp8' if cfg.fp8_dispatch else 'bf16'} "
        f"shared_experts={cfg.num_shared_experts} gated={cfg.gated} "
        f"layout={a2a.layout} "
        f"expert_gemm={expert_gemm.resolve(cfg.expert_gemm, layout=a2a.layout)}")
    comm = a2a.config
    row_bytes = comm.hidden * comm.dispatch_dtype.itemsize
    padded = comm.num_local_experts * comm.max_recv_tokens * row_bytes
    if a2a.layout == "packed":
        say(f"packed capacity: {a2a.max_recv_rows} rows per rank (worst case "
            f"{comm.max_recv_total}, mean load {comm.expected_recv_rows}), overflow="
            f"{a2a.overflow}: expert_x {a2a.max_recv_rows * row_bytes / 2**20:.2f} MiB per "
            f"rank, padded {padded / 2**20:.2f} MiB")
    elif a2a.expert_capacity < comm.max_recv_tokens:
        mine = comm.num_local_experts * a2a.expert_capacity * row_bytes
        say(f"expert capacity: {a2a.expert_capacity} rows per local expert (worst case "
            f"{comm.max_recv_tokens}, mean load {comm.expected_rows_per_expert}), overflow="
            f"{a2a.overflow}: expert_x {mine / 2**20:.2f} MiB per rank, worst case "
            f"{padded / 2**20:.2f} MiB")

    params = init_params(cfg, args.seed)
    if args.train:
        return _train(args, cfg, a2a, mesh, params, say, rank)
    ep, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())

    def put(a, sharding):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    dev_params = {k: put(v, ep if k in ("w_in", "w_out") else rep) for k, v in params.items()}
    pspecs = {k: (P("ep") if k in ("w_in", "w_out") else P()) for k in params}

    def body(p, x, nt):
        return moe_forward(a2a, cfg, p, x, nt.reshape(()))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspecs, P("ep"), P("ep")),
                                 out_specs=P("ep")))
    dense = jax.jit(lambda p, x, nt: dense_forward(cfg, p, x, nt))

    rng = np.random.default_rng(args.seed + 1)
    worst, times, tokens, dropped, compared = 0.0, [], 0, 0, 0
    m, H = cfg.max_num_tokens, cfg.hidden
    for i in range(args.steps):
        x = rng.standard_normal((world * m, H)).astype(jnp.bfloat16)
        nt = rng.integers(m // 2, m + 1, world).astype(np.int32)
        xs, nts = put(x, ep), put(nt, ep)
        t0 = time.perf_counter()
        y = jax.block_until_ready(step(dev_params, xs, nts))
        times.append(time.perf_counter() - t0)
        tokens += int(nt.sum())
        if not _dropped_anywhere(a2a, dropped):
            compared += 1
            # Check this process's ranks against the dense layer on its own device.
            local = jax.local_devices()[0]
            p_local = {k: jax.device_put(v, local) for k, v in params.items()}
            for shard in y.addressable_shards:
                r = (shard.index[0].start or 0) // m
                ref = dense(p_local, jax.device_put(x[r * m:(r + 1) * m], local), nt[r])
                err = np.abs(np.asarray(shard.data, np.float32) - np.asarray(ref, np.float32))
                worst = max(worst, float(err.max()))
        dropped = a2a.dropped_rows()
        if rank == 0:
            _progress(i + 1, args.steps)
    a2a.check()
    a2a.close()
    steady = sorted(times[1:] or times)
    median = steady[len(steady) // 2]
    tol = 0.1 if cfg.fp8_dispatch else 0.05
    ok = worst <= tol
    if compared < args.steps:
        say(f"the capacity dropped {dropped} rows on this process; {compared} of {args.steps} "
            "steps dropped none on any rank and are compared with the dense layer")
    if compared:
        say(f"max |y - dense| = {worst:.4g} (tolerance {tol}) -> {'OK' if ok else 'MISMATCH'}")
    else:
        say("no step ran without dropped rows: y not compared with the dense layer (raise "
            "--capacity-factor to compare)")
    say(f"step time: median {median * 1e3:.2f} ms (first step {times[0] * 1e3:.0f} ms, "
        f"with compile); {tokens / args.steps / median:,.0f} tokens/s over {world} ranks")
    return 0 if ok else 1


def _dropped_anywhere(a2a, before: int) -> bool:
    """Whether the step just run dropped rows on any process (this process's count was
    `before`): its y then lacks those slots' terms, on whichever rank their tokens live."""
    if a2a.drops_nothing:
        return False  # a worst-case capacity drops nothing
    from . import bootstrap

    mine = str(a2a.dropped_rows() - before)
    return any(int(n) for n in bootstrap.all_gather(bootstrap.next_collective_tag("drops"),
                                                    mine))


def _train(args, cfg, a2a, mesh, params, say, rank) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from . import testing, train

    world = mesh.devices.size
    opt = testing.optimizer(args.lr)  # optax.adam, or the same Adam where optax is missing
    grad_sum = args.grad_sum
    if grad_sum == "auto":
        grad_sum = "dispatch" if a2a.backend_name == "nvshmem" else "psum"
    replicated = {k: v for k, v in params.items() if k not in train.EXPERT_PARAMS}
    summer = None
    if grad_sum == "psum":
        rank_sum = train.psum_over("ep")
    else:
        like = {"grads": {k: np.zeros(v.shape, np.float32) for k, v in replicated.items()},
                "sse": np.zeros(1, np.float32), "count": np.zeros(1, np.float32)}
        # Several ranks on one GPU: no XLA all-reduce (NCCL refuses), so the test rig's sum.
        summer = rank_sum = testing.DispatchSum(like, world, axis_name="ep",
                                                backend=a2a.backend_name)
    say(f"training: {opt.name}, replicated gradients summed by {grad_sum}, target: a random "
        "linear map of the tokens")
    init, step = train.make_train_step(a2a, cfg, mesh, opt, params, rank_sum,
                                       train.linear_target(cfg.hidden, args.seed + 2))
    state = train.stacked_state(params, world, mesh)
    opt_state = init(state)
    ep = NamedSharding(mesh, P("ep"))

    def put(a):
        return jax.make_array_from_callback(a.shape, ep, lambda idx: a[idx])

    rng = np.random.default_rng(args.seed + 1)
    m, H = cfg.max_num_tokens, cfg.hidden
    losses, times, tokens = [], [], 0
    for i in range(args.steps):
        x = rng.standard_normal((world * m, H)).astype(jnp.bfloat16)
        nt = rng.integers(m // 2, m + 1, world).astype(np.int32)
        t0 = time.perf_counter()
        state, opt_state, loss = step(state, opt_state, put(x), put(nt))
        loss = float(np.asarray(loss.addressable_shards[0].data)[0])  # the same on every rank
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        tokens += int(nt.sum())
        if rank == 0:
            _progress(i + 1, args.steps)
    a2a.check()
    a2a.close()
    if summer is not None:
        summer.close()
    steady = sorted(times[1:] or times)
    median = steady[len(steady) // 2]
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    ok = len(losses) >= 2 and last < first and all(np.isfinite(losses))
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of first {k}: {first:.4f}, of last "
        f"{k}: {last:.4f}) -> {'OK, going down' if ok else 'NOT GOING DOWN'}")
    say(f"train step time: median {median * 1e3:.2f} ms (first step {times[0] * 1e3:.0f} ms, "
        f"with compile); {tokens / args.steps / median:,.0f} tokens/s over {world} ranks")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
