"""Our custom calls as a JAX primitive: a side effect for XLA, none for JAX.

Why not `jax.ffi.ffi_call(..., has_side_effect=True)`: that gives the jaxpr an effect, and jit
refuses its C++ fast path to any executable with effects, so every call of a jitted step that
holds one of our ops goes through Python dispatch: measured ~400 us of host time per call with 8
ranks on one GPU, against ~50 us for a trivial jitted call (docs/notes.md, "The host's cost per
call"). At decode sizes that host time, not the kernels, set the latency.

What the side effect must still give, and how it is kept:
- XLA must neither drop nor merge our calls, nor hoist one out of a loop, as if they were pure:
  the HLO custom call carries `has_side_effect` (the lowering below). That is all it does. It
  does not order calls: XLA schedules by data dependencies only and may run two side-effecting
  custom calls with no data path between them in either order (StableHLO's spec of
  `has_side_effect`: no DCE, no CSE, no speculation, no ordering; openxla/stablehlo#1365).
  The ops of one cycle are ordered by data: each takes the previous one's result (the send's
  ticket or routing). Two cycles on one handle, e.g. two MoE layers sharing it, must be
  ordered the same way, or the second dispatch_send may run while the first cycle is in
  flight (the kernels refuse it: ProtocolError): feed the first layer's output to the second
  layer (a model's next layer takes the hidden state anyway), or tie the second cycle's
  input to it with `jax_moe_comm.api.order_after(x2, y1)`. On the GPU order_after is a
  custom call that launches nothing and whose results alias x2: a data edge XLA keeps.
  Elsewhere it is an optimization barrier, which XLA:CPU has compiled away (docs/notes.md,
  "The reference backend refuses what XLA:CPU reorders"); there compute something x2 needs
  from y1's values, as the Flax module does (flax.py `_after`: num_tokens from y1).
- JAX must not drop a call whose results are unused (a send without its recv would leave the
  handle in flight): a DCE rule keeps every side-effecting call.
- jax.checkpoint must not run a call again in the backward pass: a remat rule saves its
  outputs instead (GPU run: recomputed sends broke a 3-layer remat step with ProtocolError).
Where jax's private pieces used here are missing (another jax version), `call` falls back to
`jax.ffi.ffi_call(has_side_effect=True)`: correct, only slower to dispatch.
"""

from __future__ import annotations

import functools

import jax

try:  # the private pieces (_jax_compat); see the module docstring for the fallback
    from .._jax_compat import MISSING, register_dce_rule
    from .._jax_compat import core as _core
    from .._jax_compat import dispatch as _dispatch
    from .._jax_compat import ffi_call_abstract_eval
    from .._jax_compat import ffi_result_avals as _result_avals
    from .._jax_compat import pe as _pe
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    if MISSING:
        raise ImportError(MISSING)

    # As jax.ffi.ffi_call does before binding: operands that do not vary over a shard_map axis
    # that others vary over are cast to varying (jax's abstract eval wants them equal).
    _insert_varying = (getattr(_core, "auto_insert_reshard", None) or
                       getattr(_core, "standard_insert_pvary"))
except (ImportError, AttributeError):  # pragma: no cover - depends on the jax version
    Primitive = None


@functools.cache
def _primitive():
    if Primitive is None:
        return None
    p = Primitive("jmc_ffi_call")
    p.multiple_results = True
    p.def_impl(functools.partial(_dispatch.apply_primitive, p))

    def abstract_eval(*avals, result_avals, **_):
        # jax's own rule (shard_map varying axes, shardings), without its effect
        out, _effects = ffi_call_abstract_eval(*avals, result_avals=result_avals,
                                               has_side_effect=False)
        return out

    def lowering(ctx, *operands, target, side_effect, aliases, attributes, **_):
        rule = jax.ffi.ffi_lowering(target, has_side_effect=side_effect,
                                    operand_output_aliases=dict(aliases))
        return rule(ctx, *operands, **dict(attributes))

    def dce(used_outputs, eqn):  # a side-effecting call stays even with no output used
        if eqn.params["side_effect"] or any(used_outputs):
            return [True] * len(eqn.invars), eqn
        return [False] * len(eqn.invars), None

    def remat(saveable, unknown_in, instantiated_in, eqn):
        # jax.checkpoint: never recompute a call in the backward pass (a second dispatch_send
        # there, without its recv, breaks the protocol); its outputs are saved, as jax does
        # for any primitive with an effect.
        if any(unknown_in):
            residuals = [v for v, inst in zip(eqn.invars, instantiated_in)
                         if isinstance(v, _core.Var) and not inst]
            return None, eqn, [True] * len(eqn.outvars), [True] * len(eqn.outvars), residuals
        return eqn, None, [False] * len(eqn.outvars), [False] * len(eqn.outvars), []

    p.def_abstract_eval(abstract_eval)
    mlir.register_lowering(p, lowering)
    register_dce_rule(p, dce)
    _pe.partial_eval_jaxpr_custom_rules[p] = remat
    return p


def fast_dispatch_supported() -> bool:
    """Whether `call` keeps jit's C++ dispatch (False: the slower jax.ffi fallback)."""
    return _primitive() is not None


def call(target: str, results, *args, side_effect: bool = False,
         aliases: dict[int, int] | None = None, **attrs):
    """`jax.ffi.ffi_call(target, results, has_side_effect=side_effect,
    input_output_aliases=aliases)(*args, **attrs)` without a JAX effect. `results` is a
    ShapeDtypeStruct or a tuple of them (then a tuple comes back). Attributes must be hashable
    scalars (numpy integers for the handle)."""
    many = isinstance(results, (tuple, list))
    p = _primitive()
    if p is None:
        fn = jax.ffi.ffi_call(target, results, has_side_effect=side_effect,
                              input_output_aliases=aliases)
        return fn(*args, **attrs)
    out = p.bind(*_insert_varying(*args), target=target,
                 result_avals=_result_avals(tuple(results) if many else (results,)),
                 side_effect=bool(side_effect), aliases=tuple(sorted((aliases or {}).items())),
                 attributes=tuple(sorted(attrs.items())))
    return tuple(out) if many else out[0]
