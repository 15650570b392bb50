"""The private JAX pieces jax_moe_comm uses, in one place, for every supported jax (0.10 through
0.12): none has a public form there. Every other module takes them from here, so a jax that
moves one breaks one file, and tests/test_jax_compat.py names what moved.

What each is for:
- `core`, `dispatch`, `pe`, `ad`: our two primitives (backends/ffi_call.py: the FFI call that
  keeps jit's C++ dispatch; backends/host_check.py: the reference backend's run-time protocol
  check), their DCE and remat rules, trace-state queries (api.py).
- `ffi_call_abstract_eval`, `ffi_result_avals`, `FfiEffect`, `effects`: jax's own FFI
  abstract eval and result types, and letting
  jax.checkpoint keep our side-effecting calls (autodiff.py).
- `emit_python_callback`, `callback_op_sharding`: the host check's callback.
- `clusters`, `distributed_state()`: the launcher's cluster variables and the key-value store
  that creation, recovery and NVSHMEM's bootstrap exchange through (distributed.py,
  bootstrap.py).
`MISSING` is "" when all are importable, else what failed (the callers then fall back or say so).
"""

from __future__ import annotations

import inspect

MISSING = ""
try:
    from jax._src import clusters, core, dispatch, effects
    from jax._src import distributed as _distributed
    from jax._src.callback import _callback_op_sharding as callback_op_sharding
    from jax._src.callback import emit_python_callback
    from jax._src.ffi import FfiEffect, ffi_call_abstract_eval
    from jax._src.ffi import _result_avals as ffi_result_avals
    from jax._src.interpreters import ad
    from jax._src.interpreters import partial_eval as pe
except (ImportError, AttributeError) as _e:  # pragma: no cover - depends on the jax version
    MISSING = f"{type(_e).__name__}: {_e}"
    clusters = core = dispatch = effects = ad = pe = None  # type: ignore[assignment]
    _distributed = callback_op_sharding = emit_python_callback = None  # type: ignore
    FfiEffect = ffi_call_abstract_eval = ffi_result_avals = None  # type: ignore[assignment]


def distributed_state():
    """jax.distributed's process state (its `client` is the key-value store; None before
    jax.distributed.initialize())."""
    return _distributed.global_state


def under_trace() -> bool:
    """Whether JAX is tracing here (jit, eval_shape, grad, shard_map, ...)."""
    return not core.trace_state_clean()


def current_trace():
    """The innermost trace (an object per jit/shard_map/grad level; identity is what matters)."""
    return core.trace_ctx.trace


def bound_axis_sizes() -> dict:
    """{name: size} of the mesh axes bound here (inside shard_map); {} outside."""
    return dict(core.get_axis_env().axis_sizes)


def _dce_rule_takes_live_inputs() -> bool:
    """jax 0.12 calls DCE rules as (used_outputs, live_inputs, eqn); earlier, (used_outputs,
    eqn). Read from jax's own default rule, so the switch follows jax, not a version number."""
    default = getattr(pe, "_default_dce_rule", None)
    if default is None:  # pragma: no cover - a jax without it: decide by the version
        import jax

        return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
    return len(inspect.signature(default).parameters) == 3


def register_dce_rule(primitive, rule) -> None:
    """Registers rule(used_outputs, eqn) -> (used_inputs, eqn or None) in the form this jax
    calls it."""
    if _dce_rule_takes_live_inputs():
        pe.dce_rules[primitive] = lambda used_outputs, _live_inputs, eqn: rule(used_outputs, eqn)
    else:
        pe.dce_rules[primitive] = rule
