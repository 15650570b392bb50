"""Training the MoE layer of moe.py: loss, jax.grad, an optimizer update, per rank.

The whole step runs inside one `jax.shard_map`: the gradient is taken per rank (each rank
seeds its own loss; the backward all-to-alls of a differentiable AllToAll bring the other
ranks' parts), so an expert's gradient is complete on the rank that holds it. The replicated
parameters (router, shared expert) get one gradient per rank, which must be summed over the
ranks: `psum_over(axis)` (XLA's all-reduce), or any callable that sums a pytree over the ranks.
(Several ranks on one GPU, the launcher's --oversubscribe, have no XLA all-reduce: NCCL refuses
two ranks on one GPU. The test suites use `jax_moe_comm.testing.DispatchSum` there, an
all-reduce built from dispatch; it is a test rig, not part of this module.)

The optimizer is an optax `GradientTransformation` (`optax.adam(1e-3)`: `pip install
'jax_moe_comm[train]'`), or anything with its `init(params)` and `update(grads, state, params)`.

Parameters are kept in f32 (the master copy the optimizer updates) and cast to the layer's
dtypes (bf16 expert and shared weights) in the forward. Every leaf of the training state is a
global array with a leading rank axis, sharded over the EP axis: an expert weight holds the
rank's experts, a replicated one a full copy per rank (equal on every rank: every rank applies
the same summed gradient).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .api import AllToAll
from .moe import MoELayerConfig, moe_forward

EXPERT_PARAMS = ("w_in", "w_out")  # sharded over the EP axis; the others are replicated


def psum_over(axis_name) -> Callable:
    """Sum a pytree over the ranks with XLA's all-reduce (kept varying, like the state)."""
    return lambda tree: jax.lax.pcast(jax.lax.psum(tree, axis_name), axis_name, to="varying")


# -- the training step -----------------------------------------------------------------------
def layer_params(master, like):
    """The f32 master parameters cast to the layer's dtypes (those of init_params)."""
    return jax.tree.map(lambda m, p: m.astype(p.dtype), master, like)


def stacked_state(params: dict, world: int, mesh, axis: str = "ep"):
    """Full numpy parameters -> the f32 training state's parameter leaves: global arrays
    [world, ...] sharded over `axis` (rank r: its experts, or a full copy)."""
    sharding = NamedSharding(mesh, P(axis))
    out = {}
    for name, a in params.items():
        a = np.asarray(a, np.float32)
        if name in EXPERT_PARAMS:
            a = a.reshape((world, a.shape[0] // world) + a.shape[1:])
        else:
            a = np.broadcast_to(a[None], (world,) + a.shape)
        out[name] = jax.make_array_from_callback(a.shape, sharding,
                                                 lambda idx, a=a: a[idx])
    return out


def make_train_step(a2a: AllToAll, cfg: MoELayerConfig, mesh, opt, like_params,
                    rank_sum: Callable, target_fn: Callable):
    """(init, step): init(params_state) -> opt_state; step(params_state, opt_state, x,
    num_tokens) -> (params_state, opt_state, loss [world]) with the loss the global mean
    squared error of moe_forward against target_fn(x) (per rank, no gradient).

    opt: an optax GradientTransformation (init, update); like_params: init_params' output (for
    the layer dtypes); rank_sum: psum_over(axis), or another callable summing a pytree over the
    ranks; the loss and token count travel with the replicated gradients.
    """
    if not a2a.differentiable:
        raise ValueError("training needs AllToAll(..., differentiable=True)")
    axis = mesh.axis_names[0]
    spec = P(axis)
    like = {k: jnp.zeros((), v.dtype) for k, v in like_params.items()}
    unstack = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    stack = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731

    def init_body(params):
        return stack(opt.init(unstack(params)))

    def step_body(params, opt_state, x, num_tokens):
        params, opt_state = unstack(params), unstack(opt_state)
        nt = num_tokens.reshape(())
        live = jnp.arange(cfg.max_num_tokens)[:, None] < nt
        target = jax.lax.stop_gradient(target_fn(x))

        def loss(master):
            y = moe_forward(a2a, cfg, layer_params(master, like), x, nt)
            return jnp.sum(jnp.where(live, y.astype(jnp.float32) - target, 0.0) ** 2)

        sse, grads = jax.value_and_grad(loss)(params)
        # Experts: complete here. Replicated: one part per rank, summed over the ranks.
        shared = {k: g for k, g in grads.items() if k not in EXPERT_PARAMS}
        count = (nt * cfg.hidden).astype(jnp.float32)
        total = rank_sum({"grads": shared, "sse": sse[None], "count": count[None]})
        grads = {**grads, **total["grads"]}
        n = jnp.maximum(total["count"][0], 1.0)
        grads = jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        return stack(params), stack(opt_state), total["sse"] / n

    init = jax.jit(jax.shard_map(init_body, mesh=mesh, in_specs=(spec,), out_specs=spec))
    step = jax.jit(jax.shard_map(step_body, mesh=mesh, in_specs=(spec,) * 4,
                                 out_specs=(spec, spec, spec)), donate_argnums=(0, 1))
    return init, step


def linear_target(hidden: int, seed: int) -> Callable[[Any], Any]:
    """The function the demo trains the layer to fit: a fixed random linear map of x."""
    a = np.random.default_rng(seed).standard_normal((hidden, hidden)).astype(np.float32)
    a /= np.sqrt(hidden)
    return lambda x: jnp.dot(x.astype(jnp.float32), jnp.asarray(a),
                             precision=jax.lax.Precision.HIGHEST)
