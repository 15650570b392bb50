"""The MoE layer under plain `jax.jit`: global arrays in, global arrays out, no `shard_map`
written by the caller.

    y = jax.jit(functools.partial(moe_layer, a2a=a2a, layer_config=cfg, mesh=mesh))(params, x)

x [T, H] is sharded over the token axes (`data_axes` then `expert_axis`, shard i holding rows
[i*m, (i+1)*m), m = T / token shards); the expert weights w_in, w_out are sharded over the
expert axis on their expert dimension (rank r holds experts [r*L, (r+1)*L)); router and shared
experts are replicated. The layer is an internal `jax.shard_map` of moe.moe_forward with those
specs, so on inputs already laid out so it compiles to the program a hand-written shard_map
gives (tests/test_sharded_entry.py compares the compiled HLO): no reshard, no gather. Inputs
laid out otherwise are moved to that layout first (a reshard on Explicit mesh axes, a
sharding constraint on Auto ones), which costs what moving them costs.

Custom partitioning (jax.experimental.custom_partitioning) was the other way to get here; the
shard_map needs no partitioning rule to keep in step with the kernels' per-rank shapes, and
adds nothing to the step, so it is the one used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .api import AllToAll
from .moe import MoELayerConfig, check_params, moe_forward

EXPERT_PARAMS = ("w_in", "w_out")  # sharded over the expert axis on dimension 0


def _axes(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _spec_entry(axes: tuple[str, ...]):
    """One PartitionSpec entry for `axes`: None, a name, or a tuple of names."""
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _size(mesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def _shown(mesh, axes: tuple[str, ...]) -> str:
    return " x ".join(f"{a}={mesh.shape[a]}" for a in axes)


def param_specs(params, expert_axes: tuple[str, ...]) -> dict[str, P]:
    """The partition spec of each parameter: the expert weights over `expert_axes` on their
    expert dimension, everything else replicated."""
    ep = _spec_entry(expert_axes)
    return {name: P(ep) if name in EXPERT_PARAMS else P() for name in params}


def check_layout(params, x, *, mesh, layer_config: MoELayerConfig, a2a: AllToAll,
                 expert_axes: tuple[str, ...], data_axes: tuple[str, ...]) -> int:
    """ValueError (at trace time) unless x's tokens divide over the token shards into at most
    layer_config.max_num_tokens rows each, the expert dimension divides over the expert axis,
    the handle spans that axis, and the parameters fit layer_config. Returns m, the rows per
    token shard."""
    for label, axes in (("expert_axis", expert_axes), ("data_axes", data_axes)):
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(f"{label} names {a!r}, not an axis of the mesh, whose axes are "
                                 f"{tuple(mesh.shape)}")
    if not expert_axes:
        raise ValueError("expert_axis names no mesh axis: give the expert-parallel one")
    if set(expert_axes) & set(data_axes) or len(set(expert_axes + data_axes)) < \
            len(expert_axes + data_axes):
        raise ValueError(f"expert_axis {expert_axes} and data_axes {data_axes} must name "
                         "distinct mesh axes")
    if _axes(a2a.axis_name) != expert_axes:
        raise ValueError(f"the handle runs over axis_name={a2a.axis_name!r} but expert_axis is "
                         f"{_spec_entry(expert_axes)!r}: create the AllToAll with axis_name="
                         f"{_spec_entry(expert_axes)!r}, or pass expert_axis={a2a.axis_name!r}")
    ep = _size(mesh, expert_axes)
    if a2a.config.world_size != ep:
        raise ValueError(f"the handle has world_size={a2a.config.world_size} but the expert "
                         f"axis spans {ep} devices ({_shown(mesh, expert_axes)})")
    for name in EXPERT_PARAMS:
        num = jnp.shape(params[name])[0] if name in params else layer_config.num_experts
        if num % ep:
            raise ValueError(f"params[{name!r}] has {num} experts on its first dimension, not "
                             f"a multiple of the {ep} devices of the expert axis "
                             f"({_shown(mesh, expert_axes)}): each holds the same number")
    if layer_config.num_experts % ep:
        raise ValueError(f"num_experts={layer_config.num_experts} is not a multiple of the {ep} "
                         f"devices of the expert axis ({_shown(mesh, expert_axes)})")
    check_params(layer_config, params)
    H = layer_config.hidden
    shape = tuple(jnp.shape(x))
    if len(shape) != 2 or shape[1] != H:
        raise ValueError(f"x has shape {list(shape)}; expected [T, {H}] (hidden={H}), a global "
                         "array of token rows")
    token_axes = data_axes + expert_axes
    shards = _size(mesh, token_axes)
    T = shape[0]
    if T % shards:
        raise ValueError(f"x has {T} tokens, not a multiple of the {shards} token shards "
                         f"({_shown(mesh, token_axes)}): pad x to a multiple of {shards} rows")
    m, budget = T // shards, layer_config.max_num_tokens
    if m > budget:
        raise ValueError(f"x has {T} tokens, {m} per token shard, more than max_num_tokens="
                         f"{budget} (per rank): the handle holds at most {budget * shards}")
    if a2a.config.max_num_tokens != budget:
        raise ValueError(f"the handle's max_num_tokens={a2a.config.max_num_tokens} is not "
                         f"layer_config's {budget}: make it from layer_config.comm_config(...)")
    return m


def _is_explicit(mesh) -> bool:
    return any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))


def _place(a, sharding: NamedSharding):
    """a laid out as the shard_map's in_specs say: unchanged when its type already says so
    (Explicit axes), else a reshard (Explicit) or a sharding constraint (Auto), which XLA
    drops when the array already has that layout."""
    current = getattr(jax.typeof(a), "sharding", None)
    if current is not None and getattr(current, "mesh", None) is not None and \
            not getattr(current.mesh, "empty", False):
        spec = tuple(current.spec) + (None,) * (a.ndim - len(current.spec))
        want = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
        if spec == want:
            return a
    if _is_explicit(sharding.mesh) and hasattr(jax, "reshard"):
        return jax.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def moe_layer(params, x, num_tokens=None, *, a2a: AllToAll, layer_config: MoELayerConfig,
              mesh, expert_axis=None, data_axes=()):
    """The MoE layer of moe.moe_forward on global arrays, callable under plain jax.jit.

    params: the full parameters (moe.param_shapes(layer_config)) as global arrays: w_in
      [E, H, N] and w_out [E, F, H] sharded over the expert axis on E, the rest replicated
      (moe.init_params makes the values; place them with param_specs).
    x: [T, H] bf16, sharded over the token axes (data_axes, then expert_axis); T must be a
      multiple of their device count, at most layer_config.max_num_tokens rows per shard
      (fewer are padded up to it inside, and cut off again).
    num_tokens: None (every row live) or [token shards] int32, sharded over the token axes:
      the live rows of each shard's block, counted from its start (as moe_forward's per-rank
      num_tokens). Rows past it come back zero.
    a2a: the handle, made with axis_name=expert_axis and layer_config.comm_config(EP size).
    mesh: the mesh x and params live on. Mesh axes outside the token axes replicate x.
    expert_axis: the expert-parallel mesh axis (or a tuple of them); None: a2a.axis_name.
    data_axes: mesh axes that also shard the tokens (each runs its own all-to-all over the
      expert axis), or ().

    Returns y [T, H] bf16, sharded as x's rows are. Differentiable (jax.grad) w.r.t. params and
    x on a differentiable handle. Bad shapes and layouts raise ValueError at trace time
    (check_layout)."""
    expert_axes = _axes(a2a.axis_name if expert_axis is None else expert_axis)
    data_axes = _axes(data_axes)
    m = check_layout(params, x, mesh=mesh, layer_config=layer_config, a2a=a2a,
                     expert_axes=expert_axes, data_axes=data_axes)
    token_axes = data_axes + expert_axes
    shards = _size(mesh, token_axes)
    rows = P(_spec_entry(token_axes))
    if num_tokens is not None and tuple(jnp.shape(num_tokens)) != (shards,):
        raise ValueError(f"num_tokens has shape {list(jnp.shape(num_tokens))}; expected None or "
                         f"[{shards}] int32, the live rows of each token shard "
                         f"({_shown(mesh, token_axes)})")
    specs = param_specs(params, expert_axes)
    params = {k: _place(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    args = [_place(x, NamedSharding(mesh, rows))]
    if num_tokens is not None:
        args.append(_place(jnp.asarray(num_tokens, jnp.int32), NamedSharding(mesh, rows)))
    budget = layer_config.max_num_tokens

    def per_rank(p, x, n=None):
        n = jnp.int32(m) if n is None else n.reshape(())
        if m == budget:
            return moe_forward(a2a, layer_config, p, x, n)
        # moe_forward takes the handle's max_num_tokens rows: pad the block, cut it back (the
        # padding rows stay dead: the count is clamped to the block).
        x = jnp.pad(x, ((0, budget - m), (0, 0)))
        return moe_forward(a2a, layer_config, p, x, jnp.minimum(n, m))[:m]

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(specs,) + (rows,) * len(args),
                         out_specs=rows)(params, *args)
