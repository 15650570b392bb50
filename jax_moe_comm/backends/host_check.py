"""The reference backend's protocol state: what the CUDA kernels check on the device, kept on
the host and checked by a host callback as each op runs.

The kernels keep, per handle, rank and half (dispatch, combine), how many sends and receives
completed, and refuse a launch out of order (csrc/core/protocol.cuh, `refused_at_start`): a
send needs sent == received, a recv sent == received + 1. An out-of-order launch is recorded
as a ProtocolError that `check()` raises. The reference backend is plain JAX and would compute
any order; `ProtocolState` counts the same way so that the CPU suite refuses what the GPU
refuses, also across jitted calls (a send in one call, its recv in another), where the API's
trace-time checks (api.py) cannot see the order.

`tick(op, *deps)` is one op's visit: a host callback that gets this rank's index and a value
of each dep, so it runs only once they are computed, and returns an int32 zero that the op
adds to its own results, so that what follows the op runs after the visit. Deps are small
slices of the op's inputs (a layer's send after the previous layer's combine), which orders
the visits as the data orders the ops, as on the GPU stream. The visit is `state.visit(op,
rank, device, *dep_values)` (each dep's first element): any object with that method can be
visited, e.g. the reference backend's count of rows a packed capacity dropped.

Like the ops in ffi_call.py, the callback is a primitive with no JAX effect (an io_callback's
effect is refused by jax.checkpoint and custom_vjp): a DCE rule keeps it, a remat rule saves its
output instead of running it again in the backward pass (a second visit would count a second
send), and its JVP is zero. The callback never raises (that aborts XLA:CPU, and a rank that
stops before an all_to_all leaves the others waiting in it); it records, and check() raises.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

try:  # private pieces (_jax_compat); without them the checks are off (trace-time only)
    from .._jax_compat import MISSING, register_dce_rule
    from .._jax_compat import ad as _ad
    from .._jax_compat import callback_op_sharding as _callback_op_sharding
    from .._jax_compat import core as _core
    from .._jax_compat import dispatch as _dispatch
    from .._jax_compat import emit_python_callback
    from .._jax_compat import pe as _pe
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    if MISSING:
        raise ImportError(MISSING)
except (ImportError, AttributeError):  # pragma: no cover - depends on the jax version
    Primitive = None

# Ops, in the order of the kernels' Phase names (csrc/core/error_record.h).
DISPATCH_SEND, DISPATCH_RECV, COMBINE_SEND, COMBINE_RECV = range(4)
OP_NAMES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
# What an out-of-order launch broke, worded as csrc/handle.cc's out_of_order_reason.
_REASONS = (("a dispatch is already in flight (call dispatch_recv before the next "
             "dispatch_send or dispatch)"), "no dispatch_send before it",
            ("a combine is already in flight (call combine_recv before the next combine_send "
             "or combine)"), "no combine_send before it")


class ProtocolState:
    """Per device and half: sends and receives completed; the first error, kept (a handle that
    broke the protocol stays unusable, as a poisoned CUDA handle does). A device is keyed by
    its index over every mesh axis of the shard_map: with data-parallel axes beside the
    expert axis, several devices share an expert-parallel rank and each counts its own."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[int, np.ndarray] = {}  # device -> [half, (sent, received)]
        self.error = ""
        self.closed = False

    def reset(self) -> None:
        """recover(): every count back to zero and the error forgotten, as the kernels' state."""
        with self._lock:
            self.counts.clear()
            self.error = ""

    def visit(self, op: int, rank: int, device: int, *_deps) -> None:
        half, is_recv = op // 2, op % 2
        with self._lock:
            if self.error:
                return  # a broken handle: the kernels do nothing, and report nothing new
            counts = self.counts.setdefault(device, np.zeros((2, 2), np.int64))
            sent, received = (int(v) for v in counts[half])
            if self.closed:
                self.error = (f"ProtocolError: rank {rank} in {OP_NAMES[op]}: the handle is "
                              "closed (a compiled step ran after close(); the CUDA backend's "
                              "handlers refuse it)")
                return
            in_order = sent == received + 1 if is_recv else sent == received
            if not in_order:
                self.error = (f"ProtocolError: rank {rank} in {OP_NAMES[op]}: "
                              f"{_REASONS[op]} (sends completed {sent}, receives completed "
                              f"{received}); the CUDA kernels refuse this launch and the "
                              "handle: recover() it on every rank, or close it")
                return
            counts[half, is_recv] += 1


@functools.cache
def _primitive():
    if Primitive is None:
        return None
    p = Primitive("jmc_host_check")

    def abstract_eval(*avals, **_):
        vma = frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals))
        try:
            return _core.ShapedArray((), jnp.int32, vma=vma)
        except TypeError:  # pragma: no cover - a jax without varying axes
            return _core.ShapedArray((), jnp.int32)

    def lowering(ctx, *operands, state, op):
        def callback(rank, device, *deps):
            state.visit(op, int(np.asarray(rank).reshape(-1)[0]),
                        int(np.asarray(device).reshape(-1)[0]), *deps)
            return (np.zeros((), np.int32),)

        try:
            axis_context = ctx.module_context.axis_context
            try:
                sharding = _callback_op_sharding(axis_context, None, ctx.avals_out)
            except TypeError:  # older jax: (axis_context, sharding)
                sharding = _callback_op_sharding(axis_context, None)
            result, _, _ = emit_python_callback(ctx, callback, None, list(operands),
                                                ctx.avals_in, ctx.avals_out,
                                                has_side_effect=True, returns_token=False,
                                                sharding=sharding)
            return result
        except (TypeError, ValueError, NotImplementedError) as e:
            # Another jax's private callback API, or a mesh with automatic axes: this op
            # goes unchecked at run time (the trace-time checks of api.py still hold).
            _warn_once(f"jax_moe_comm: the reference backend's run-time protocol check is off "
                       f"in this program ({type(e).__name__}: {e})")
            return [mlir.ir_constant(np.zeros((), np.int32))]

    def dce(used_outputs, eqn):  # a visit stays even when nothing reads its zero
        return [True] * len(eqn.invars), eqn

    def remat(saveable, unknown_in, instantiated_in, eqn):  # run once, output saved
        if any(unknown_in):
            residuals = [v for v, inst in zip(eqn.invars, instantiated_in)
                         if isinstance(v, _core.Var) and not inst]
            return None, eqn, [True], [True], residuals
        return eqn, None, [False], [False], []

    p.def_impl(functools.partial(_dispatch.apply_primitive, p))
    p.def_abstract_eval(abstract_eval)
    mlir.register_lowering(p, lowering)
    _ad.defjvp_zero(p)
    register_dce_rule(p, dce)
    _pe.partial_eval_jaxpr_custom_rules[p] = remat
    return p


@functools.cache
def _warn_once(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=2)


def supported() -> bool:
    return _primitive() is not None


def _scalar(x):
    """One element of x as a small int32/float32 value: enough to order a visit after x."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    v = x.reshape(-1)[:1] if x.size else jnp.zeros((1,), jnp.int32)
    if not (jnp.issubdtype(v.dtype, jnp.integer) or v.dtype == jnp.float32):
        v = v.astype(jnp.float32)
    return v


def tick(state: ProtocolState, op: int, axis_name, *deps):
    """int32 zero, computed by the host visit of `op` on this rank once `deps` exist."""
    p = _primitive()
    if p is None:
        return jnp.zeros((), jnp.int32)
    from ..routing import bound_axes

    rank = jnp.asarray(jax.lax.axis_index(axis_name), jnp.int32).reshape(1)
    axes = tuple(bound_axes()) or axis_name
    device = jnp.asarray(jax.lax.axis_index(axes), jnp.int32).reshape(1)
    return p.bind(rank, device, *(_scalar(d) for d in deps if d is not None), state=state,
                  op=op)
