"""Gradients of dispatch and combine: one `jax.custom_vjp` rule set for every backend.

The rules use only backend ops, so the nvshmem backend (whose FFI calls JAX cannot
differentiate) and the reference backend (plain JAX, which it could) run the same backward
and save the same residuals. The ground truth is plain-JAX autodiff of the reference backend;
tests/test_grad.py checks the rules against it.

Per rank, with `first, w = merge_repeats(indices, weights)` (a token's repeated expert is one
slot carrying the summed weight; merge_repeats itself is plain JAX and differentiated as such):

  dispatch   d x[t]        = sum over the slots (t, j) THIS rank sent of d expert_x[row(t, j)]
                             (a combine with weights 1, summed in f32)
  combine    d expert_y[r] = sum over the home ranks h of the row's token of w_h[t, j] * dy_h[t]
                             (a dispatch of dy, each row scaled by its weight on arrival)
             d w[t, j]     = <dy[t], expert_y[row(t, j)]> (f32, from the rows combine brought
                             home: no communication)
  indices, num_tokens, x_scale and the routing get no gradient; rows >= the counts and
  tokens >= num_tokens get zero.

Token groups (token_replicas > 1): the members hold the same tokens, a slot is sent by one
member and combine returns the result to every member. So d expert_y sums the dy of EVERY
member (the fan-out's transpose is a fan-in), d x of a slot lands on the member that sent it,
and each member's d w is that of its own output. Summed over a group, d x is the full gradient
of the group's shared input (the usual reduction for replicated activations). Plain-JAX
autodiff of the reference backend gives exactly this.

Handles. The backward all-to-alls run on handles of their own (created by
`AllToAll(..., differentiable=True)`, eagerly: creation is collective), with bf16 dispatch
and f32 combine:
  * `dispatch_grad`: same token_replicas as the forward; its COMBINE half carries d x, with
    the forward dispatch's routing (the row layout it describes is the forward handle's).
  * `combine_grad`: token_replicas 1, so that every member of a token group sends its own dy
    (the fan-in above; with the forward's token_replicas only one member would); its DISPATCH
    half carries dy. When the forward has token_replicas 1, both are one handle (its two halves
    are independent), unless the forward has a capacity below the worst case (see Layouts).
Why not the forward handle: XLA orders ops by data only, and nothing orders a layer's backward
all-to-alls against forward cycles that do not feed it (a rematerialised forward, or other
work the user puts in the same jit): on one handle XLA could put two cycles in flight. On
separate handles that is harmless. Within the backward, each handle half is used by one layer
at a time: layer i's backward needs layer i+1's d x, which is the recv of layer i+1's last
backward all-to-all; and the forward cycles of a sequential model all precede the loss.

Layouts. Every handle of a plan has the forward's layout. dispatch_grad also has its capacity
(packed rows per rank, `recv_rows`, or padded rows per local expert, `expert_capacity`): its
combine half reads d expert_x in the forward's rows. combine_grad has the worst-case capacity,
so its dispatch of dy drops nothing (which rows a capacity drops may differ from one dispatch
to the next); its rows are matched to the forward's by key, so the result is in the forward's
layout ([recv_rows, H] or [L, expert_capacity, H]). A row the forward dropped is in no
layout: its slot gets no d x, no d expert_y and a zero d weight (its y term was zero).

jax.checkpoint: on the nvshmem backend the all-to-alls run once in the forward pass and their
outputs are saved (the remat rule of backends/ffi_call.py; allow_remat_of_ffi_calls where that
module falls back to effectful jax.ffi calls), so a rematerialised layer recomputes its
experts, not its communication. The reference backend (plain JAX) recomputes them unless a
policy saves the outputs named CHECKPOINT_NAME; it is stateless, so that is only time.

Padding rows of expert_x (rows >= expert_num_tokens) are zeroed by differentiable handles in
every dispatch (primal and forward rule alike, since a jax.grad that does not differentiate x
runs the primal): on the nvshmem backend they hold stale data, and the expert layer's weight
gradient would multiply it by the zero cotangent of those rows (NaN * 0 = NaN). Inference
handles leave them undefined (zeroing them costs L*R*H bytes of writes per call, 235 MB at R1).
The fp8 dequantising path masks them always when XLA dequantizes (it writes every row anyway);
when the receive kernel does (JMC_RECV_DEQUANTIZE when the handle was created), only
differentiable handles mask them.

fp8: bf16 x given to an fp8 handle is quantized inside (1x128 blocks, quant.quantize), sent as
fp8 and dequantised on arrival to bf16 `expert_x`; its gradient is the straight-through one,
with respect to the dequantised input (the rounding is not differentiated, nor the scales). fp8
x with x_scale (the caller's own quantization, for fp8 expert GEMMs) is not differentiable: a
cotangent in e4m3 would underflow; asking for it raises.

vmap: one handle carries one cycle per half at a time, so a batch of cycles has no batch
rule; every op raises a clear error under jax.vmap (use jax.lax.map or scan instead).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from . import quant
from . import routing as rt
from .config import MoEConfig

# The outputs and saved residuals carry this jax.checkpoint name (api.CHECKPOINT_NAME): a remat
# policy that saves it recomputes no all-to-all in the backward pass.
CHECKPOINT_NAME = "jax_moe_comm"

NEEDS_BACKWARD = ("{op} is being differentiated, but this AllToAll has no backward buffers: "
                  "create it with AllToAll(config, ..., differentiable=True) (collective, "
                  "outside jit, on every process)")


@dataclasses.dataclass(frozen=True)
class Rows:
    """How a handle lays out dispatch's rows: `padded` [L, P] (P = expert_capacity, by default
    max_recv_tokens) or packed [recv_rows]."""

    packed: bool
    count: int  # P (padded: rows per local expert) or recv_rows (packed: rows in all)

    @classmethod
    def of(cls, cfg: MoEConfig, layout: str, recv_rows: int | None = None,
           expert_capacity: int | None = None) -> "Rows":
        if layout == "packed":
            return cls(True, recv_rows or cfg.max_recv_total)
        return cls(False, expert_capacity or cfg.max_recv_tokens)

    def live(self, counts):
        """Mask of the rows that hold data: [L, R] r < counts[e], or [recv_rows] i <
        sum(counts) (packed rows are contiguous)."""
        if self.packed:
            return jnp.arange(self.count) < jnp.sum(counts)
        return _live_rows(counts, self.count)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static custom_vjp arg
class Plan:
    """The backends the rules run on (see the module docstring)."""

    cfg: MoEConfig
    axis_name: Any
    rows: Rows  # the forward's layout (and dispatch_grad's)
    fwd: Any
    dispatch_grad: Any | None = None  # combine half carries d x (forward token_replicas, rows)
    combine_grad: Any | None = None  # dispatch half carries dy (token_replicas 1, worst case)
    # fwd dequantizes fp8 rows in its receive kernel (recv_dequantizes, at the handle's birth)
    recv_dequantize: bool = False

    @property
    def differentiable(self) -> bool:
        return self.dispatch_grad is not None


def allow_remat_of_ffi_calls() -> bool:
    """Let jax.checkpoint hold side-effecting jax.ffi calls (the nvshmem ops are, where
    backends/ffi_call.py falls back to them; its own primitive has a remat rule). JAX refuses
    them ("Effects not supported in partial-eval of checkpoint/remat") unless their effect type
    is remat-allowed; allowed, an effectful call always runs in the forward pass and its
    outputs are saved, never recomputed, which is what an all-to-all wants: a recomputed one
    would be a second cycle on the forward handle, not ordered by data against the other
    layers' recomputations. Process-wide, and any other library's side-effecting FFI call gets
    the same treatment (run once, saved) instead of the error. Private JAX API: returns False
    where it moved (remat then raises JAX's error on the nvshmem backend)."""
    try:
        from ._jax_compat import FfiEffect, effects
        effects.remat_allowed_effects.add_type(FfiEffect)
    except (ImportError, AttributeError):
        return False
    return True


# -- vmap guard ------------------------------------------------------------------------------
@functools.cache
def _vmap_guard(op: str):
    @custom_vmap
    def guard(*args):
        return args

    @guard.def_vmap
    def _refuse(axis_size, in_batched, *args):
        raise NotImplementedError(
            f"jax.vmap of AllToAll.{op} is not supported: a handle carries one dispatch/"
            "combine cycle at a time and the kernels take one token block, so a batch of "
            "cycles has no batch rule. Map over the batch with jax.lax.map or jax.lax.scan (one "
            "cycle per step), or fold the batch into max_num_tokens.")

    return guard


def no_vmap(op: str, *trees):
    """The trees unchanged; a clear error if any leaf is batched by jax.vmap (costs nothing)."""
    leaves, treedef = jax.tree.flatten(trees)
    if not leaves:
        return trees
    return jax.tree.unflatten(treedef, list(_vmap_guard(op)(*leaves)))


def _unwrap(tree):
    """(values, perturbed) of a custom_vjp forward-rule argument (symbolic_zeros=True)."""
    is_primal = lambda p: isinstance(p, CustomVJPPrimal)  # noqa: E731
    values = jax.tree.map(lambda p: p.value, tree, is_leaf=is_primal)
    flags = jax.tree.leaves(jax.tree.map(lambda p: p.perturbed, tree, is_leaf=is_primal))
    return values, any(flags)


def _is_zero(ct) -> bool:
    return ct is None or all(isinstance(c, SymbolicZero) for c in jax.tree.leaves(
        ct, is_leaf=lambda c: isinstance(c, SymbolicZero)))


def _named(tree):
    return jax.tree.map(lambda a: checkpoint_name(a, CHECKPOINT_NAME), tree)


def _live_rows(counts, num_rows):
    return jnp.arange(num_rows)[None, :] < counts[:, None]  # [L, R]


def _zero_past(mask, x):
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x,
                     jnp.zeros((), x.dtype))


# -- fused ops ------------------------------------------------------------------------------
class FusedDispatch(NamedTuple):
    """A dispatch whose send is not issued yet: dispatch_recv's rule runs the backend's fused
    op (send and recv in one launch) on these inputs instead of a recv of a ticket."""

    x: jax.Array
    x_scale: jax.Array | None
    indices: jax.Array
    num_tokens: jax.Array
    weights: jax.Array | None


class FusedCombine(NamedTuple):
    """A combine whose send is not issued yet (see FusedDispatch)."""

    expert_y: jax.Array
    routing: Any


def has_fused_ops(backend) -> bool:
    """Whether the backend's class has one-launch dispatch and combine (nvshmem). Asked of the
    class, so a wrapper that forwards everything else with __getattr__ (the tests' shuffling
    backend) runs send, then recv, through its own overrides."""
    return bool(getattr(type(backend), "fused_ops", False))


# -- dispatch ------------------------------------------------------------------------------
def dispatch_send(plan: Plan, x, x_scale, indices, num_tokens, weights, fused: bool = False):
    """The backend's send on values only: the gradient flows through dispatch_recv's rule
    (an FFI call with a perturbed input cannot even be traced under jax.grad). fused: the
    caller's recv follows at once; a backend with fused ops then sends nothing here and
    dispatch_recv runs both halves in one launch."""
    args = jax.lax.stop_gradient((x, x_scale, indices, num_tokens, weights))
    x, x_scale, indices, num_tokens, weights = no_vmap("dispatch_send", *args)
    if fused and has_fused_ops(plan.fwd):
        return FusedDispatch(x, x_scale, indices, num_tokens, weights)
    return plan.fwd.dispatch_send(x, x_scale, indices, num_tokens, weights=weights)


# JMC_RECV_DEQUANTIZE: a backend that can (nvshmem) dequantizes fp8 rows in its receive kernel
# instead of XLA's pass over the whole expert_x afterwards (docs/knobs.md). Unset or 1: on for
# every handle; 0: off. On the GPU: bit for bit against XLA's pass (H200, 2745fad: fused and
# split, both layouts, the layer's y), and the whole gradient suite at 2 ranks passed with it
# (H100, 9448dd0); it took 128 us off V2-Lite's dispatch + combine at 128 tokens per rank and
# 589 us off R1's (the same H100 call, benchmarks/results/archive/2026-12-05-9448dd0-h100).
RECV_DEQUANTIZE_ENV = "JMC_RECV_DEQUANTIZE"


def recv_dequantizes(backend) -> bool:
    """Whether a handle made now on `backend` asks it for bf16 rows (on unless
    JMC_RECV_DEQUANTIZE=0). Read once, when the handle is created (Plan.recv_dequantize):
    dispatch_recv is jitted per plan, so a setting read while tracing would stick to the
    handle's first trace."""
    if not getattr(type(backend), "dequantizes_on_recv", False):
        return False
    setting = os.environ.get(RECV_DEQUANTIZE_ENV, "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"{RECV_DEQUANTIZE_ENV}={setting!r}: use 0 (XLA dequantizes after "
                         "dispatch), 1 or leave it unset (the kernel does, the default)")
    return setting != "0"


def _dispatch_out(plan: Plan, dequantize: bool, has_weights: bool, state):
    state = no_vmap("dispatch_recv", state)[0]
    in_kernel = dequantize and plan.recv_dequantize
    more = dict(dequantize=True) if in_kernel else {}
    if isinstance(state, FusedDispatch):
        ex, scale, counts, routing, ew, dropped = plan.fwd.dispatch(
            state.x, state.x_scale, state.indices, state.num_tokens, weights=state.weights,
            **more)
    else:
        ex, scale, counts, routing, ew, dropped = plan.fwd.dispatch_recv(state, **more)
    live = plan.rows.live(counts)
    if dequantize and not in_kernel:  # writes every row anyway: masking is free
        ex = _zero_past(live, quant.dequantize(ex, scale)).astype(jnp.bfloat16)
        scale = None
    elif plan.differentiable:
        ex = _zero_past(live, ex)
        scale = None if scale is None else _zero_past(live, scale)
    ew = _zero_past(live, ew) if has_weights else None  # undefined past the counts on nvshmem
    return ex, scale, counts, routing, ew, dropped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_recv(plan: Plan, dequantize: bool, state, x, x_scale, indices, num_tokens,
                   weights):
    """(expert_x, expert_x_scale, expert_num_tokens, routing, expert_weights, dropped) of the
    dispatch that `state` is in flight for; x, x_scale, weights are that dispatch's inputs,
    taken here only so that their gradient has a rule (the primal does not read them)."""
    return _dispatch_out(plan, dequantize, weights is not None, state)


@dataclasses.dataclass(frozen=True)
class _DispatchRes:
    routing: Any
    indices: jax.Array
    num_tokens: jax.Array
    counts: jax.Array
    x_dtype: Any = dataclasses.field(metadata=dict(static=True))
    want_dx: bool = dataclasses.field(metadata=dict(static=True))
    check_ew: bool = dataclasses.field(metadata=dict(static=True))


jax.tree_util.register_dataclass(_DispatchRes)


def _dispatch_fwd(plan, dequantize, state, x, x_scale, indices, num_tokens, weights):
    (state, indices, num_tokens), _ = _unwrap((state, indices, num_tokens))
    x, x_perturbed = _unwrap(x)
    x_scale, scale_perturbed = _unwrap(x_scale)
    weights, w_perturbed = _unwrap(weights)
    if x_perturbed or scale_perturbed:
        if not plan.differentiable:
            raise ValueError(NEEDS_BACKWARD.format(op="AllToAll.dispatch"))
        if plan.cfg.is_fp8 and not dequantize:
            raise ValueError(
                "fp8 x with x_scale is not differentiable (its cotangent would be fp8): give "
                "dispatch_send bf16 x and no x_scale; the handle quantizes it (1x128 blocks) "
                "and the gradient is taken with respect to the dequantised input")
    out = _dispatch_out(plan, dequantize, weights is not None, state)
    res = _DispatchRes(*_named((out[3], indices, num_tokens, out[2])), x.dtype, x_perturbed,
                       w_perturbed)
    return out, res


def _dispatch_bwd(plan, dequantize, res: _DispatchRes, cts):
    ct_x, _, _, _, ct_w, _ = cts
    if res.check_ew and not _is_zero(ct_w):
        raise ValueError(
            "DispatchOutput.expert_weights carries no gradient back to the router weights: "
            "weight the expert outputs in combine (its weights are differentiated), or use "
            "jax.lax.stop_gradient(out.expert_weights) to train without that path")
    dx = None
    if res.want_dx and not _is_zero(ct_x):
        dx = dispatch_grad(plan, ct_x, res.routing, res.counts, res.indices,
                           res.num_tokens).astype(res.x_dtype)
    return None, dx, None, None, None, None


_dispatch_recv.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)
# Staged: un-jitted shard_map runs a custom_vjp call op by op and does not implement
# symbolic_zeros there (NotImplementedError even without jax.grad); under jit it is a jaxpr.
dispatch_recv = jax.jit(_dispatch_recv, static_argnums=(0, 1))


def dispatch_grad(plan: Plan, ct_expert_x, routing, counts, indices, num_tokens):
    """d x: every copy's cotangent summed back to its token, over the combine half of the
    dispatch_grad handle with the forward routing; weights 1 on the slots this rank sent, 0
    elsewhere (its replicas get theirs), so the sum runs in f32 and adds nothing twice."""
    cfg, backend = plan.cfg, plan.dispatch_grad
    ct = _zero_past(plan.rows.live(counts), ct_expert_x.astype(jnp.float32))
    ct, routing, indices, num_tokens = no_vmap("dispatch (backward)", ct, routing, indices,
                                               num_tokens)
    pending = backend.combine_send(ct, routing)
    rank = jax.lax.axis_index(plan.axis_name)
    ones = rt.sent_slots(cfg, indices, num_tokens, rank).astype(jnp.float32)
    return backend.combine_recv(pending, indices, ones, num_tokens)


# -- combine -------------------------------------------------------------------------------
def combine_send(plan: Plan, expert_y, routing, fused: bool = False):
    """The backend's send on values only (the gradient flows through combine_recv's rule);
    fused: as dispatch_send."""
    expert_y, routing = no_vmap("combine_send", *jax.lax.stop_gradient((expert_y, routing)))
    if fused and has_fused_ops(plan.fwd):
        return FusedCombine(expert_y, routing)
    return plan.fwd.combine_send(expert_y, routing)


def _combine_y(plan: Plan, state, indices, weights, num_tokens, slot_rows=False):
    """y (and the slot rows) of the combine in flight: a recv of its ticket, or the fused op."""
    state, indices, weights, num_tokens = no_vmap("combine_recv", state, indices, weights,
                                                  num_tokens)
    more = dict(slot_rows=True) if slot_rows else {}
    if isinstance(state, FusedCombine):
        return plan.fwd.combine(state.expert_y, state.routing, indices, weights, num_tokens,
                                **more)
    return plan.fwd.combine_recv(state, indices, weights, num_tokens, **more)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_recv(plan: Plan, state, expert_y, routing, indices, weights, num_tokens):
    """y of the combine that `state` is in flight for; expert_y and routing are that
    combine's inputs, taken here only so that their gradient has a rule."""
    return _combine_y(plan, state, indices, weights, num_tokens)


@dataclasses.dataclass(frozen=True)
class _CombineRes:
    slot_rows: jax.Array | None  # [max_m, k, H] combine dtype, if weights need a gradient
    routing: Any  # None unless expert_y needs a gradient
    indices: jax.Array
    weights: jax.Array
    num_tokens: jax.Array
    y_dtype: Any = dataclasses.field(metadata=dict(static=True))


jax.tree_util.register_dataclass(_CombineRes)


def _combine_fwd(plan, state, expert_y, routing, indices, weights, num_tokens):
    (state, routing, indices, num_tokens), _ = _unwrap((state, routing, indices, num_tokens))
    expert_y, y_perturbed = _unwrap(expert_y)
    weights, w_perturbed = _unwrap(weights)
    if (y_perturbed or w_perturbed) and not plan.differentiable:
        raise ValueError(NEEDS_BACKWARD.format(op="AllToAll.combine"))
    slot_rows = None
    if w_perturbed:
        y, slot_rows = _combine_y(plan, state, indices, weights, num_tokens, slot_rows=True)
    else:
        y = _combine_y(plan, state, indices, weights, num_tokens)
    res = _CombineRes(*_named((slot_rows, routing if y_perturbed else None, indices, weights,
                               num_tokens)), expert_y.dtype)
    return y, res


def _combine_bwd(plan, res: _CombineRes, dy):
    if _is_zero(dy):
        return None, None, None, None, None, None
    dw = None
    if res.slot_rows is not None:
        dw = jnp.sum(dy.astype(jnp.float32)[:, None, :] * res.slot_rows.astype(jnp.float32),
                     axis=-1)
        # Zero (not just small) for unused and repeated slots and dead tokens, whatever the
        # backend left in their slot rows: a [max_m, k] select.
        dw = jnp.where(rt.valid_slots(plan.cfg, res.indices, res.num_tokens), dw, 0.0)
    d_expert_y = None
    if res.routing is not None:
        d_expert_y = combine_grad(plan, dy, res.routing, res.indices, res.weights,
                                  res.num_tokens).astype(res.y_dtype)
    return None, d_expert_y, None, None, dw, None


_combine_recv.defvjp(_combine_fwd, _combine_bwd, symbolic_zeros=True)
combine_recv = jax.jit(_combine_recv, static_argnums=(0,))  # staged, as dispatch_recv


def combine_grad(plan: Plan, dy, routing, indices, weights, num_tokens):
    """d expert_y f32 in the forward's layout ([L, P, H] or [recv_rows, H]): dy dispatched
    (bf16, with the forward's routing and weights) on the dispatch half of the combine_grad
    handle (token_replicas 1: every member sends its own dy; worst-case rows: none dropped),
    each arriving row scaled by its weight, then moved to the forward row with the same (group,
    token, slot) key. Row order differs between two dispatches on the nvshmem backend, hence
    the keys; a forward row gets one arriving row per member of its token's group, summed in
    f32. Keys are unique on a rank across its experts, so one flat table matches them."""
    cfg, backend = plan.cfg, plan.combine_grad
    dy, indices, num_tokens, weights = no_vmap("combine (backward)", dy.astype(jnp.bfloat16),
                                               indices, num_tokens, weights)
    pending = backend.dispatch_send(dy, None, indices, num_tokens, weights=weights)
    rows, _, _, routing_b, ew, _ = backend.dispatch_recv(pending)
    keys_b = backend.row_keys(routing_b).reshape(-1)  # groups of the dp-1 handle = ranks
    keys_f = plan.fwd.row_keys(routing)  # forward layout, -1 where no row
    rows, ew = rows.reshape(keys_b.shape + rows.shape[-1:]), ew.reshape(-1)
    dp, span = cfg.token_replicas, cfg.max_num_tokens * cfg.experts_per_token
    space = cfg.world_size * span  # every key of the dp-1 handle
    slot_of = jnp.full((space,), -1, jnp.int32).at[jnp.where(keys_b >= 0, keys_b, space)].set(
        jnp.arange(keys_b.shape[0], dtype=jnp.int32), mode="drop")
    group, rest = keys_f // span, keys_f % span
    out = jnp.zeros(keys_f.shape + (cfg.hidden,), jnp.float32)
    for member in range(dp):  # the forward group's members are ranks group*dp + member
        key_b = (group * dp + member) * span + rest
        i = jnp.where(keys_f >= 0, slot_of[jnp.clip(key_b, 0, space - 1)], -1)
        row = rows[jnp.clip(i, 0)].astype(jnp.float32)
        w = ew[jnp.clip(i, 0)]
        out = out + jnp.where((i >= 0)[..., None], w[..., None] * row, 0.0)
    return out


class DispatchArgs(NamedTuple):
    """The differentiable inputs of a dispatch in flight (carried to dispatch_recv's rule)."""

    x: jax.Array
    x_scale: jax.Array | None
    indices: jax.Array  # first_occurrence'd
    num_tokens: jax.Array
    weights: jax.Array | None  # merged


class CombineArgs(NamedTuple):
    """The differentiable inputs of a combine in flight (carried to combine_recv's rule)."""

    expert_y: jax.Array
    routing: Any
