"""Trace-time validation and routing normalisation shared by every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import MoEConfig


def _shape_str(x) -> str:
    return f"{tuple(x.shape)} {np.dtype(x.dtype).name}"


def check_array(name: str, x, shape: tuple, dtype, hint: str = "") -> None:
    """Raise a TypeError/ValueError naming `name` unless x has exactly this shape and dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} "
                         f"(per-rank shape inside shard_map{'; ' + hint if hint else ''})")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} has dtype {np.dtype(x.dtype).name}; expected "
                        f"{np.dtype(dtype).name}")


def check_num_tokens(cfg: MoEConfig, num_tokens):
    """num_tokens: this rank's live row count, an int32 array of shape () or (1,), or a Python
    int; a static value is range-checked now.

    The usual way in: a global [EP] int32 array passed to shard_map with in_specs P(axis), so
    each rank sees shape (1,) and the count can change every step with no recompilation.
    """
    if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
        value = int(num_tokens)
    else:
        if not hasattr(num_tokens, "shape") or tuple(num_tokens.shape) not in ((), (1,)):
            got = getattr(num_tokens, "shape", None)
            got = f"shape {tuple(got)}" if got is not None else type(num_tokens).__name__
            raise ValueError(
                f"num_tokens has {got} on this rank; expected one int32 count per rank: shape "
                "() or (1,) inside shard_map. Pass a global [world_size] int32 array with "
                f"in_specs P(axis) (each rank then sees (1,)), or a Python int. Rows >= "
                f"num_tokens of x (max_num_tokens={cfg.max_num_tokens} per rank) are ignored.")
        if not jnp.issubdtype(num_tokens.dtype, jnp.integer):
            raise TypeError(f"num_tokens has dtype {np.dtype(num_tokens.dtype).name}; "
                            "expected int32 (a count of rows)")
        try:
            value = int(np.asarray(num_tokens).reshape(()))  # concrete only
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                TypeError):
            value = None
    if value is not None and not 0 <= value <= cfg.max_num_tokens:
        raise ValueError(f"num_tokens={value} is outside [0, max_num_tokens="
                         f"{cfg.max_num_tokens}] (max_num_tokens counts rows per rank)")
    return jnp.asarray(num_tokens, jnp.int32).reshape(())


def check_routing(cfg: MoEConfig, indices, weights=None) -> None:
    shape = (cfg.max_num_tokens, cfg.experts_per_token)
    if not hasattr(indices, "dtype") or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"indices must be an int32 array, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)}")
    check_array("indices", indices, shape, jnp.int32)
    if weights is not None:
        check_array("weights", weights, shape, jnp.float32)


def check_tokens(cfg: MoEConfig, x, x_scale) -> bool:
    """Checks x (and x_scale); True when an fp8 handle was given bf16 x to quantize itself."""
    if cfg.is_fp8 and x_scale is None and getattr(x, "dtype", None) == jnp.bfloat16:
        check_array("x", x, (cfg.max_num_tokens, cfg.hidden), jnp.bfloat16)
        return True
    check_array("x", x, (cfg.max_num_tokens, cfg.hidden), cfg.dispatch_dtype)
    if cfg.is_fp8:
        if x_scale is None:
            raise ValueError("x_scale is required for float8_e4m3fn dispatch of fp8 x: shape "
                             f"({cfg.max_num_tokens}, {cfg.num_scales}) float32 (or give "
                             "bf16 x without x_scale to have it quantized here)")
        check_array("x_scale", x_scale, (cfg.max_num_tokens, cfg.num_scales), jnp.float32)
    elif x_scale is not None:
        raise ValueError("x_scale is only taken with float8_e4m3fn dispatch; this handle "
                         f"dispatches {cfg.dispatch_dtype.name}")
    return False


def first_occurrence(indices):
    """indices with a repeated expert in one row replaced by -1 after its first slot.

    A token routed twice to one expert is sent once; combine gives that row the sum of
    the repeated slots' weights (see merge_repeats), which is exactly the dense result.
    """
    k = indices.shape[-1]
    same = indices[..., :, None] == indices[..., None, :]  # [m, j, j']
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # j' < j
    repeated = jnp.any(same & earlier, axis=-1)
    return jnp.where(repeated, -1, indices)


def merge_repeats(indices, weights):
    """(first_occurrence(indices), weights summed over the slots naming the same expert and
    kept on the first of them, 0 elsewhere).

    Selects rather than multiplies by a 0/1 mask: a NaN or inf weight on a slot that is not
    used (-1) or names another expert must not reach the live slots (0 * NaN = NaN).
    """
    same = indices[..., :, None] == indices[..., None, :]  # [m, j, l]
    summed = jnp.sum(jnp.where(same, weights[..., None, :], 0.0), axis=-1)
    first = first_occurrence(indices)
    return first, jnp.where(first >= 0, summed, 0.0).astype(weights.dtype)


def valid_slots(cfg: MoEConfig, indices, num_tokens):
    """Mask of (token, slot) pairs that are routed: in-range token, in-range expert."""
    rows = jnp.arange(cfg.max_num_tokens)[:, None] < num_tokens
    return rows & (indices >= 0) & (indices < cfg.num_experts)


def destination(cfg: MoEConfig, indices):
    """Rank holding each slot's expert, -1 for an unused slot."""
    return jnp.where(indices >= 0, indices // cfg.num_local_experts, -1)


def sent_slots(cfg: MoEConfig, indices, num_tokens, rank):
    """Mask of the valid slots that `rank` itself sends: in a token group (token_replicas R > 1)
    the slot to rank d is sent by the member with d % R == rank % R, so each is sent exactly
    once."""
    dst, r = destination(cfg, indices), cfg.token_replicas
    return valid_slots(cfg, indices, num_tokens) & (dst % r == rank % r)


def row_key(cfg: MoEConfig, group, token, slot):
    """Key of the expert row of (source token group, token, slot): (group*max_m + token)*k + slot.

    Every backend's row_keys() uses this packing (the CUDA kernels' pack_source), so the rows of
    two dispatches with the same routing can be matched, even between handles of different
    token_replicas (a token_replicas=1 handle's group is the sending rank).
    """
    return (group * cfg.max_num_tokens + token) * cfg.experts_per_token + slot


def bound_axes() -> dict:
    """{name: size} of the mesh axes bound here (inside shard_map); {} outside, or if this JAX
    version keeps them elsewhere."""
    try:
        from ._jax_compat import bound_axis_sizes

        return bound_axis_sizes()
    except Exception:  # noqa: BLE001 - private API: only used to word an error message
        return {}


def axis_size(axis_name) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        bound = bound_axes()
        if bound:
            names = ", ".join(f"{n!r} ({s} devices)" for n, s in bound.items())
            raise ValueError(
                f"axis_name={axis_name!r} is not a mesh axis of the enclosing shard_map, whose "
                f"axes are {names}. Create the handle with axis_name= set to the "
                "expert-parallel axis, e.g. AllToAll(config, axis_name="
                f"{next(iter(bound))!r}).") from e
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: no shard_map is active here. Call the "
            "all-to-all ops inside jax.shard_map(..., mesh=mesh, in_specs=P("
            f"{axis_name!r}), ...) over a mesh with an axis named {axis_name!r}, on per-rank "
            "shapes.") from e


def check_axis(cfg: MoEConfig, axis_name) -> None:
    size = axis_size(axis_name)
    if size != cfg.world_size:
        raise ValueError(f"mesh axis {axis_name!r} has {size} devices but the handle was made "
                         f"for world_size={cfg.world_size}: make MoEConfig.world_size the size "
                         "of the expert-parallel mesh axis")
