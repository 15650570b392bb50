"""Flax NNX module: a MoE layer over the all-to-all (`pip install jax_moe_comm[flax]`).

    mesh = jax.make_mesh((8,), ("ep",))
    moe = jax_moe_comm.flax.MoE(num_experts=32, experts_per_token=4, hidden=256, ffn=512,
                                max_num_tokens=32, mesh=mesh, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x, n: m(x, n))(moe, x, num_tokens)   # x [8*32, 256], num_tokens [8]
    moe.close()

The module holds the AllToAll handle, the router, the experts (sharded over the mesh axis:
rank r holds experts [r*L, (r+1)*L)) and an optional shared expert (replicated), and calls
jax.shard_map itself: its inputs and outputs are global arrays, rows sharded over the axis.
The layer is jax_moe_comm.moe.moe_forward: top-k softmax router, dispatch, the shared expert
while tokens are in flight, SiLU MLP experts (their GEMMs as `expert_gemm` says; default
"auto", the fastest measured on the platform: expert_gemm.py), combine. It trains under
nnx.jit/nnx.grad on both backends (the handle is made differentiable=True unless told
otherwise; gradient rules: autodiff.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from .api import AllToAll
from .moe import MoELayerConfig, moe_forward

EXPERT_PARAMS = ("w_in", "w_out")  # sharded over the mesh axis along experts


class MoE(nnx.Module):
    """A MoE layer on `mesh`'s `axis_name` (the expert-parallel axis).

    Call it on global arrays: x [world_size * max_num_tokens, hidden] bf16 (rank r's tokens in
    rows [r*max_num_tokens, (r+1)*max_num_tokens)) and num_tokens [world_size] int32 (live rows
    of each rank; the rest are padding and give zero rows). Returns y like x. num_tokens can
    change every call without recompiling.

    Parameters (nnx.Param): router [H, E] f32, w_in [E, H, F] and w_out [E, F, H] bf16 sharded
    over the axis, shared_in [H, F] and shared_out [F, H] bf16 when shared_expert.
    differentiable (default True): the handle also holds the backward all-to-alls' buffers,
    so that nnx.grad works (on every backend); pass False for inference only, to save them.
    expert_gemm: how the experts' GEMMs run (jax_moe_comm.expert_gemm.OPTIONS; "auto": the
    fastest measured on the platform).
    Call close() when done (collective): it frees the handle's buffers.
    """

    def __init__(self, *, num_experts: int, experts_per_token: int, hidden: int, ffn: int,
                 max_num_tokens: int, mesh: jax.sharding.Mesh, axis_name: str = "ep",
                 shared_expert: bool = True, fp8_dispatch: bool = False,
                 backend: str = "auto", layout: str = "packed", differentiable: bool = True,
                 expert_gemm: str = "auto", rngs: nnx.Rngs):
        if axis_name not in mesh.shape:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh, whose axes "
                             f"are {tuple(mesh.shape)}: pass axis_name= the expert-parallel one")
        self.layer = MoELayerConfig(num_experts=num_experts, experts_per_token=experts_per_token,
                                    hidden=hidden, ffn=ffn, max_num_tokens=max_num_tokens,
                                    shared_expert=shared_expert, fp8_dispatch=fp8_dispatch,
                                    expert_gemm=expert_gemm)
        self.mesh = mesh
        self.axis_name = axis_name
        self.a2a = AllToAll(self.layer.comm_config(mesh.shape[axis_name]), axis_name=axis_name,
                            backend=backend, layout=layout, differentiable=differentiable)
        H, F, E = hidden, ffn, num_experts
        bf16 = jnp.bfloat16
        self.router = nnx.Param(self._init(rngs, (H, E), H, jnp.float32, P()))
        self.w_in = nnx.Param(self._init(rngs, (E, H, F), H, bf16, P(axis_name)))
        self.w_out = nnx.Param(self._init(rngs, (E, F, H), F, bf16, P(axis_name)))
        if shared_expert:
            self.shared_in = nnx.Param(self._init(rngs, (H, F), H, bf16, P()))
            self.shared_out = nnx.Param(self._init(rngs, (F, H), F, bf16, P()))

    def _init(self, rngs: nnx.Rngs, shape, fan_in: int, dtype, spec):
        """N(0, 1/fan_in) made where it lives: each process computes only its own shards."""
        sharding = NamedSharding(self.mesh, spec)
        make = jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32)
                                    / np.sqrt(fan_in)).astype(dtype), out_shardings=sharding)
        return make(rngs.params())

    @property
    def config(self):
        """The all-to-all's MoEConfig (world_size, per-rank max_num_tokens, ...)."""
        return self.a2a.config

    def _params(self) -> dict:
        names = ["router", "w_in", "w_out"] + (["shared_in", "shared_out"]
                                               if self.layer.shared_expert else [])
        return {n: getattr(self, n)[...] for n in names}

    def __call__(self, x, num_tokens):
        axis = self.axis_name
        params = self._params()
        specs = {n: (P(axis) if n in EXPERT_PARAMS else P()) for n in params}
        rows = P(axis)
        x = _place(x, NamedSharding(self.mesh, rows))
        num_tokens = _place(jnp.asarray(num_tokens, jnp.int32), NamedSharding(self.mesh, rows))

        def body(p, x, n):
            return moe_forward(self.a2a, self.layer, p, x, n.reshape(()))

        return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, rows, rows),
                             out_specs=rows)(params, x, num_tokens)

    def close(self) -> None:
        """Free the all-to-all handle (collective: every process closes its module)."""
        self.a2a.close()


def _place(x, sharding: NamedSharding):
    """x laid out as shard_map's in_specs expect: a no-op when it already is; on a mesh of
    Explicit axes (jax.make_mesh's default) a reshard, else a sharding constraint."""
    current = getattr(jax.typeof(x), "sharding", None)
    if current is not None and getattr(current, "spec", None) == sharding.spec:
        return x
    explicit = any(str(t).endswith("Explicit") for t in getattr(sharding.mesh, "axis_types", ()))
    if explicit and hasattr(jax, "reshard"):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
