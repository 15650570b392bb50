"""Decode with the Flax NNX MoE layer: a different number of live tokens on every rank at
every step, one compilation.

    python examples/flax_decode.py                   # 8 emulated CPU devices, reference backend
    python -m jax_moe_comm.launch -n 8 [--oversubscribe] -- python examples/flax_decode.py

An inference server batches however many sequences are decoding: x is padded to
max_num_tokens rows per rank and num_tokens [world_size] says how many are live. Each step is
checked against the same layer computed densely, and the step function is traced only once.
"""

import argparse
import sys
import time

from _setup import put, start

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
args = p.parse_args()
RANK, _ = start()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_moe_comm.flax import MoE  # noqa: E402
from jax_moe_comm.moe import dense_forward  # noqa: E402

EP = len(jax.devices())
M, H = 32, 256  # max tokens per rank, hidden
mesh = jax.make_mesh((EP,), ("ep",))
moe = MoE(num_experts=4 * EP, experts_per_token=4, hidden=H, ffn=512, max_num_tokens=M,
          mesh=mesh, backend=args.backend, rngs=nnx.Rngs(0))
traces = []


@nnx.jit
def decode_step(moe, x, num_tokens):
    traces.append(1)  # runs only while tracing
    return moe(x, num_tokens)


dense = jax.jit(lambda p, x, n: dense_forward(moe.layer, p, x, n))
local = jax.local_devices()[0]
params = {k: jax.device_put(np.asarray(jax.device_get(v)), local) for k, v in
          moe._params().items()} if jax.process_count() == 1 else None
rng = np.random.default_rng(0)
worst, times = 0.0, []
for step in range(args.steps):
    num_tokens = rng.integers(0, M + 1, EP).astype(np.int32)  # sequences decoding per rank
    x = rng.standard_normal((EP * M, H)).astype(jnp.bfloat16)
    t0 = time.perf_counter()
    y = jax.block_until_ready(decode_step(moe, put(x, mesh, P("ep")),
                                          put(num_tokens, mesh, P("ep"))))
    times.append(time.perf_counter() - t0)
    if params is not None:  # check against the dense layer (single process)
        y = np.asarray(y, np.float32)
        for r in range(EP):
            ref = dense(params, jnp.asarray(x[r * M:(r + 1) * M]), int(num_tokens[r]))
            worst = max(worst, float(np.abs(y[r * M:(r + 1) * M] - np.asarray(ref)).max()))
    if RANK == 0:
        print(f"step {step:2d}: live tokens per rank {num_tokens.tolist()}", flush=True)
moe.a2a.check()
moe.close()
ok = len(traces) == 1 and worst <= 0.05
checked = f"max |y - dense| = {worst:.3g}" if params is not None else "(dense check: 1 process)"
if RANK == 0:
    print(f"backend={moe.a2a.backend_name}: {args.steps} steps, traced {len(traces)}x, "
          f"{checked}, median step {sorted(times)[len(times) // 2] * 1e3:.2f} ms -> "
          f"{'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
