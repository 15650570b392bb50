"""Train the Flax NNX MoE layer (jax_moe_comm.flax.MoE) to imitate a fixed target function.

    python examples/flax_train.py                    # 8 emulated CPU devices, reference backend
    python -m jax_moe_comm.launch -n 8 [--oversubscribe] -- python examples/flax_train.py

Each step: ragged token counts per rank, forward through dispatch/combine, loss on the live
rows, gradients with nnx.value_and_grad, an optax Adam update, all in one nnx.jit. Prints the
loss going down. Gradients on the nvshmem backend need the autodiff rules of
jax_moe_comm.autodiff; without them run with --backend reference.
"""

import argparse
import sys

from _setup import put, start

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
p.add_argument("--lr", type=float, default=3e-3)
args = p.parse_args()
RANK, _ = start()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_moe_comm.flax import MoE  # noqa: E402

EP = len(jax.devices())
M, H = 16, 128  # tokens per rank (max), hidden
mesh = jax.make_mesh((EP,), ("ep",))
model = MoE(num_experts=2 * EP, experts_per_token=2, hidden=H, ffn=256, max_num_tokens=M,
            mesh=mesh, backend=args.backend, rngs=nnx.Rngs(0))
tx = optax.adam(args.lr)
opt_state = tx.init(nnx.state(model, nnx.Param))
target_w = jnp.asarray(np.random.default_rng(1).standard_normal((H, H)) / np.sqrt(H))


@nnx.jit
def train_step(model, opt_state, x, num_tokens):
    live = (jnp.arange(EP * M) % M < jnp.repeat(num_tokens, M))[:, None]
    target = jnp.tanh(x.astype(jnp.float32) @ target_w)

    def loss_fn(model):
        err = model(x, num_tokens).astype(jnp.float32) - target
        return jnp.sum(jnp.where(live, err, 0.0) ** 2) / jnp.maximum(jnp.sum(live) * H, 1)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    updates, opt_state = tx.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    return loss, opt_state


rng = np.random.default_rng(0)
x = put(rng.standard_normal((EP * M, H)).astype(jnp.bfloat16), mesh, P("ep"))  # fixed batch
losses = []
for step in range(args.steps):
    num_tokens = put(rng.integers(M // 2, M + 1, EP).astype(np.int32), mesh, P("ep"))
    loss, opt_state = train_step(model, opt_state, x, num_tokens)
    losses.append(float(loss))
    if RANK == 0 and (step % 10 == 0 or step == args.steps - 1):
        print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
model.a2a.check()
model.close()
ok = losses[-1] < 0.8 * losses[0]
if RANK == 0:
    print(f"backend={model.a2a.backend_name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"({'decreasing: OK' if ok else 'NOT decreasing'})")
sys.exit(0 if ok else 1)
