"""Workarounds for the test machine, kept out of the modules a user imports (reached as
`jax_moe_comm.testing.DispatchSum`, `.optimizer`, `.adam`).

- `DispatchSum`: an all-reduce built from the library's own dispatch. The GPU test machine runs
  several ranks on one GPU (`launch --oversubscribe`), where NCCL, and so `jax.lax.psum`,
  refuses to run; with one process per GPU use `jax_moe_comm.train.psum_over` instead.
- `optimizer` / `adam`: optax's Adam when optax is installed, else the same update written out
  here (the GPU machine has no package registry). Use optax in your own code.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from .api import AllToAll
from .config import MoEConfig


class Optimizer(NamedTuple):
    """optax's GradientTransformation shape: init(params), update(grads, state, params)."""

    init: Callable
    update: Callable
    name: str


def optimizer(learning_rate: float) -> Optimizer:
    """optax.adam (the `train` extra), else `adam` (the GPU machine has no package registry)."""
    try:
        import optax
    except ImportError:
        return adam(learning_rate)
    opt = optax.adam(learning_rate)
    return Optimizer(opt.init, opt.update, f"optax.adam(lr={learning_rate:g})")


def adam(lr, b1=0.9, b2=0.999, eps=1e-8) -> Optimizer:
    """Adam written out, optax.adam's update step for step (tests/test_grad.py checks it)."""
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
