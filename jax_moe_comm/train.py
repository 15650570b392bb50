"""Training the MoE layer of moe.py: loss, jax.grad, an optimizer update, per rank.

The whole step runs inside one `jax.shard_map`: the gradient is taken per rank (each rank
seeds its own loss; the backward all-to-alls of a differentiable AllToAll bring the other
ranks' parts), so an expert's gradient is complete on the rank that holds it. The replicated
parameters (router, shared expert) get one gradient per rank, which must be summed over the
ranks: `jax.lax.psum` where XLA's collectives run, or `DispatchSum`, which moves the values with
the library's own dispatch. Several ranks on one GPU (the launcher's --oversubscribe) need the
latter: NCCL refuses two ranks on one GPU.

Parameters are kept in f32 (the master copy the optimizer updates) and cast to the layer's
dtypes (bf16 expert and shared weights) in the forward. Every leaf of the training state is a
global array with a leading rank axis, sharded over the EP axis: an expert weight holds the
rank's experts, a replicated one a full copy per rank (equal on every rank: every rank applies
the same summed gradient).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .api import AllToAll
from .config import MoEConfig
from .moe import MoELayerConfig, moe_forward

EXPERT_PARAMS = ("w_in", "w_out")  # sharded over the EP axis; the others are replicated


class Optimizer(NamedTuple):
    """optax's GradientTransformation shape: init(params), update(grads, state, params)."""

    init: Callable
    update: Callable
    name: str


def optimizer(learning_rate: float) -> Optimizer:
    """optax.adam (the `train` extra), else the same Adam written out here (the GPU machine
    has no package registry)."""
    try:
        import optax
    except ImportError:
        return _adam(learning_rate)
    opt = optax.adam(learning_rate)
    return Optimizer(opt.init, opt.update, f"optax.adam(lr={learning_rate:g})")


def _adam(lr, b1=0.9, b2=0.999, eps=1e-8) -> Optimizer:
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return (jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params=None):
        count, mu, nu = state
        count = count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        updates = jax.tree.map(lambda m, v: -lr * (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return updates, (count, mu, nu)

    return Optimizer(init, update, f"adam(lr={lr:g}; built in, optax not installed)")


# -- summing over the ranks ------------------------------------------------------------------
def psum_over(axis_name) -> Callable:
    """Sum a pytree over the ranks with XLA's all-reduce (kept varying, like the state)."""
    return lambda tree: jax.lax.pcast(jax.lax.psum(tree, axis_name), axis_name, to="varying")


class DispatchSum:
    """Sum a pytree of f32/bf16 arrays over the EP ranks with the library's own dispatch.

    Every rank bit-casts its values to bf16 lanes (an f32 is two), lays them out as token
    rows and dispatches every row to all `world` experts, one per rank, so each rank receives
    every rank's rows. Rows arrive in no fixed order on the nvshmem backend; their keys
    (row_keys) say whose they are, and each rank adds the ranks' values in rank order in f32:
    the same bits on every rank, so replicated parameters stay equal. Create it (collective)
    outside jit with the tree's shapes; call it inside shard_map.
    """

    ROW = 1024  # lanes per row

    def __init__(self, like, world: int, *, axis_name: str = "ep", backend: str = "auto"):
        self.shapes = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree.leaves(like)]
        for _, dtype in self.shapes:
            if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
                raise TypeError(f"DispatchSum sums f32/bf16 arrays, not {dtype.name}")
        self.treedef = jax.tree.structure(like)
        self.lanes = sum(math.prod(s) * d.itemsize // 2 for s, d in self.shapes)
        self.rows = max(1, -(-self.lanes // self.ROW))
        self.world = world
        cfg = MoEConfig(num_experts=world, experts_per_token=world, hidden=self.ROW,
                        max_num_tokens=self.rows, world_size=world)
        self.a2a = AllToAll(cfg, axis_name=axis_name, backend=backend)

    def close(self):
        self.a2a.close()

    def __call__(self, tree):
        leaves = jax.tree.leaves(tree)
        lanes = [jax.lax.bitcast_convert_type(a.astype(d), jnp.bfloat16).reshape(-1)
                 if d == jnp.float32 else a.astype(d).reshape(-1)
                 for a, (_, d) in zip(leaves, self.shapes)]
        flat = jnp.concatenate(lanes)
        x = jnp.pad(flat, (0, self.rows * self.ROW - self.lanes)).reshape(self.rows, self.ROW)
        every = jnp.broadcast_to(jnp.arange(self.world, dtype=jnp.int32),
                                 (self.rows, self.world))
        out = self.a2a.dispatch(x, every, self.rows)
        # (src * rows + t) * world + my rank
        keys = self.a2a.backend.row_keys(out.routing.backend)[0]
        src, t = keys // (self.rows * self.world), (keys // self.world) % self.rows
        got = jnp.zeros((self.world, self.rows, self.ROW), jnp.bfloat16)
        got = got.at[src, t].set(out.expert_x[0], mode="drop").reshape(self.world, -1)
        out_leaves, at = [], 0
        for shape, dtype in self.shapes:
            n = math.prod(shape) * dtype.itemsize // 2
            part = got[:, at:at + n]
            at += n
            if dtype == jnp.float32:
                part = jax.lax.bitcast_convert_type(part.reshape(self.world, -1, 2),
                                                    jnp.float32)
            part = part.astype(jnp.float32).reshape((self.world,) + shape)
            total = part[0]
            for r in range(1, self.world):  # rank order: identical on every rank
                total = total + part[r]
            out_leaves.append(total.astype(dtype))
        return jax.tree.unflatten(self.treedef, out_leaves)


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


def make_train_step(a2a: AllToAll, cfg: MoELayerConfig, mesh, opt: Optimizer, like_params,
                    rank_sum: Callable, target_fn: Callable):
    """(init, step): init(params_state) -> opt_state; step(params_state, opt_state, x,
    num_tokens) -> (params_state, opt_state, loss [world]) with the loss the global mean
    squared error of moe_forward against target_fn(x) (per rank, no gradient).

    like_params: init_params' output (for the layer dtypes); rank_sum: psum_over(axis) or a
    DispatchSum; the loss and token count travel with the replicated gradients.
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
