"""End-to-end decode step: the whole MoE layer (router, dispatch, experts, shared expert,
combine) jitted, at decode batch sizes, as an inference server runs it.

    python -m jax_moe_comm.launch -n 8 --oversubscribe -- \
        python benchmarks/bench_decode.py --out benchmarks/results
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m jax_moe_comm.launch -n 8 \
        --oversubscribe -- python benchmarks/bench_decode.py --label cmdbuf-off ...
    python benchmarks/bench_decode.py --configs tiny --steps 5   # CPU smoke run (8 emulated
                                                                 # devices, reference backend)

Two numbers per (config, tokens, layout):
  step_us   host wall time of one jitted call with its result awaited: what a serving loop
            that syncs every token sees (launches, XLA's command buffer, the kernels);
  loop_us   one jitted lax.fori_loop of --loop layer applications (each output the next
            input) over --loop: device time per layer with no host in between.
Each is the median over samples of the slowest rank. Expert and shared-expert weights are
random bf16 made per shard (the full R1 expert tensor is never built on one host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import jax_moe_comm.distributed as dist

LAUNCHED = dist.managed()  # our launcher or a cluster manager (srun, mpirun)
if not LAUNCHED:  # a smoke run: 8 emulated CPU devices in one process
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_moe_comm import AllToAll, bootstrap  # noqa: E402
from jax_moe_comm.moe import MoELayerConfig, moe_forward  # noqa: E402

# (experts, top-k, hidden, expert ffn): DeepSeek-V2-Lite and DeepSeek-R1 MoE layers.
LAYERS = {"V2Lite": (64, 6, 2048, 1408), "R1": (256, 8, 7168, 2048), "tiny": (16, 4, 256, 512)}
EXPERT_PARAMS = ("w_in", "w_out")


def make_params(cfg: MoELayerConfig, mesh, seed: int):
    """Random bf16 parameters built shard by shard (expert weights sharded over 'ep')."""
    E, H, F = cfg.num_experts, cfg.hidden, cfg.ffn
    shapes = {"router": ((H, E), np.float32, H), "w_in": ((E, H, F), jnp.bfloat16, H),
              "w_out": ((E, F, H), jnp.bfloat16, F), "shared_in": ((H, F), jnp.bfloat16, H),
              "shared_out": ((F, H), jnp.bfloat16, F)}
    out, specs = {}, {}
    for i, (name, (shape, dtype, fan_in)) in enumerate(shapes.items()):
        spec = P("ep") if name in EXPERT_PARAMS else P()

        def make(idx, shape=shape, dtype=dtype, fan_in=fan_in, i=i):
            start = (idx[0].start or 0) if idx else 0
            local = tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape)) if idx \
                else shape
            rng = np.random.default_rng((seed, i, start))
            return (rng.standard_normal(local, dtype=np.float32) / np.sqrt(fan_in)).astype(dtype)

        out[name] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), make)
        specs[name] = spec
    return out, specs


def slowest_median(tag: str, samples_s: list[float]) -> float:
    """Median over samples of the slowest rank (each rank's samples are aligned by index)."""
    per_rank = [json.loads(v) for v in bootstrap.all_gather(f"decode:{tag}",
                                                            json.dumps(samples_s))]
    return statistics.median(max(col) for col in zip(*per_rank)) * 1e6


def time_case(name: str, tokens: int, layout: str, fp8: bool, mesh, args) -> dict:
    E, k, H, F = LAYERS[name]
    cfg = MoELayerConfig(num_experts=E, experts_per_token=k, hidden=H, ffn=F,
                         max_num_tokens=tokens, fp8_dispatch=fp8)
    params, pspecs = make_params(cfg, mesh, seed=1)
    rows = NamedSharding(mesh, P("ep"))
    rng = np.random.default_rng(RANK + 7)
    ranks = mesh.devices.size  # EP ranks (one per process when launched)
    x = jax.make_array_from_callback(
        (ranks * tokens, H), rows,
        lambda idx: rng.standard_normal((tokens, H), dtype=np.float32).astype(jnp.bfloat16))
    nt = jax.make_array_from_callback((ranks,), rows,
                                      lambda idx: np.full((1,), tokens, np.int32))
    with AllToAll(cfg.comm_config(ranks), axis_name="ep", layout=layout,
                  backend=args.backend) as a2a:
        def layer(p, x, n):
            return moe_forward(a2a, cfg, p, x, n.reshape(()))

        def loop(p, x, n):
            return jax.lax.fori_loop(0, args.loop, lambda _, h: layer(p, h, n), x)

        specs = dict(mesh=mesh, in_specs=(pspecs, P("ep"), P("ep")), out_specs=P("ep"))
        step = jax.jit(jax.shard_map(layer, **specs))
        looped = jax.jit(jax.shard_map(loop, **specs))
        step_s, loop_s = [], []
        for fn, out, reps in ((step, step_s, args.steps), (looped, loop_s,
                                                           max(3, args.steps // args.loop))):
            for i in range(args.warmup + reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(params, x, nt))
                if i >= args.warmup:
                    out.append(time.perf_counter() - t0)
        a2a.check()
        backend = a2a.backend_name
    tag = f"{name}:{tokens}:{layout}:{fp8}"
    return dict(config=name, num_experts=E, experts_per_token=k, hidden=H, ffn=F,
                tokens_per_rank=tokens, layout=layout,
                dispatch_dtype="fp8" if fp8 else "bf16", backend=backend,
                step_us=slowest_median(tag + ":step", step_s),
                loop_us=slowest_median(tag + ":loop", loop_s) / args.loop)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="V2Lite,R1")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--layouts", default="padded,packed")
    p.add_argument("--bf16", action="store_true", help="bf16 dispatch (default fp8)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--loop", type=int, default=20, help="layers per fori_loop sample")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
    p.add_argument("--label", default="", help="e.g. cmdbuf-on / cmdbuf-off (file name)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    flags = os.environ.get("XLA_FLAGS", "")
    setting = re.search(r"--xla_gpu_enable_command_buffer=(\S*)", flags)
    cmdbuf = "default" if setting is None else (setting.group(1) or "off")
    say = print if RANK == 0 else (lambda *a, **kw: None)
    rows = []
    for name in args.configs.split(","):
        for layout in args.layouts.split(","):
            for tokens in map(int, args.tokens.split(",")):
                r = time_case(name, tokens, layout, not args.bf16, mesh, args)
                r["command_buffers"] = cmdbuf
                rows.append(r)
                say(f"{name:7s} T={tokens:3d} {layout:6s} {r['dispatch_dtype']}: step "
                    f"{r['step_us']:9.1f} us (host sync each step), in-jit loop "
                    f"{r['loop_us']:9.1f} us per layer [{r['backend']}, command buffers "
                    f"{cmdbuf}]", flush=True)
    if RANK == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        label = f"_{args.label}" if args.label else ""
        stem = os.path.join(args.out, f"bench_decode_ep{mesh.devices.size}{label}")
        run = dict(gpu=jax.devices()[0].device_kind, world=mesh.devices.size,
                   oversubscribed_mps="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in os.environ,
                   commit=os.environ.get("GIT_COMMIT", "unknown"),
                   date=datetime.datetime.now(datetime.UTC).isoformat(),
                   command=" ".join(["python"] + sys.argv), xla_flags=flags, rows=rows)
        with open(stem + ".json", "w") as f:
            json.dump(run, f, indent=1)
        say(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
