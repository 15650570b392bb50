"""The public all-to-all handle: dispatch and combine, fused or split, on any backend."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import autodiff as ad
from . import quant
from . import routing as rt
from .config import KernelTuning, MoEConfig
from .errors import ProtocolError, ReferenceFallbackWarning

BACKENDS = ("auto", "reference", "nvshmem")
# "padded": expert_x [L, expert_capacity, H], each local expert's rows padded to a capacity
# per expert (at most max_recv_tokens, the worst case and the default), for batched GEMMs
# (a batched einsum, cuBLAS batched GEMM) that take equal-size groups. "packed": expert_x
# [max_recv_rows, H] with the rows of local expert 0, then 1, ... contiguous (group_sizes
# [L] says how many), for jax.lax.ragged_dot; max_recv_rows is a capacity, at most
# max_recv_total (the worst case).
LAYOUTS = ("padded", "packed")
# What a capacity (packed max_recv_rows, padded expert_capacity) does with the rows that arrive
# past it (they are never written): "fail" records a CapacityExceededError that check()
# raises; "drop" only counts them.
OVERFLOWS = ("fail", "drop")

# Every output of dispatch_recv and combine_recv (and what their gradient rules save) carries
# this jax.checkpoint name, so that a remat policy can keep them and never recompute an
# all-to-all in the backward pass:
# jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME))
CHECKPOINT_NAME = ad.CHECKPOINT_NAME
_named = ad._named


class DispatchOutput(NamedTuple):
    """What dispatch gives each rank, in the handle's layout.

    layout="padded" (default; P = AllToAll.expert_capacity, max_recv by default):
      expert_x: [L, P, H] dispatch dtype (bf16 when an fp8 handle was given bf16 x: the
        dequantised rows); row r of local expert e is live for r < expert_num_tokens[e], the
        rest is undefined, except zero on a differentiable handle, on the reference backend
        and when dequantised.
      expert_x_scale: [L, P, H/128] f32 for fp8 dispatch of fp8 x, else None.
      expert_weights: [L, P] f32.
    layout="packed" (C = AllToAll.max_recv_rows, the capacity):
      expert_x: [C, H]: the rows of local expert 0, then of expert 1, ... (group_sizes[e]
        rows each, the ragged_dot layout; sum(group_sizes) <= C); rows >= sum(group_sizes)
        are undefined, except zero on a differentiable handle, on the reference backend and
        when dequantised.
      expert_x_scale: [C, H/128] f32 for fp8 dispatch of fp8 x, packed the same way, else
        None.
      expert_weights: [C] f32, packed the same way.
    expert_num_tokens: [L] int32, rows held per local expert (also `group_sizes`; padded: at
      most P, the rows that arrived past it are not held).
    routing: opaque; hand it to combine unchanged.
    expert_weights: the router weight of the slot that produced each row (repeated experts
      merged; zero past the counts), only when dispatch_send was given weights, else None; it
      carries no gradient (weight in combine to train the router).
    dropped_rows: int32 (1,): rows that arrived at this rank but did not fit the capacity:
      the packed max_recv_rows, or (padded) the sum over local experts of the rows past
      expert_capacity; always 0 at the worst case. They are not in expert_x; combine counts
      their slots as expert outputs of zero.

    L = num_experts / world_size, max_recv = max_num_tokens * num_token_groups,
    max_recv_total = max_recv * min(experts_per_token, L) (MoEConfig properties).
    """

    expert_x: jax.Array
    expert_x_scale: jax.Array | None
    expert_num_tokens: jax.Array
    routing: Any
    expert_weights: jax.Array | None = None
    dropped_rows: jax.Array | None = None

    @property
    def group_sizes(self) -> jax.Array:
        """[L] int32: rows per local expert, the group_sizes of jax.lax.ragged_dot."""
        return self.expert_num_tokens


class Routing(NamedTuple):
    """DispatchOutput.routing: where each expert_x row came from. Opaque to callers."""

    backend: Any  # the backend's own record
    expert_num_tokens: jax.Array  # [L] int32: the counts dispatch returned


class PendingDispatch(NamedTuple):
    """Returned by dispatch_send; hand it to dispatch_recv of the same handle.

    A pytree of arrays (it can be returned from a jitted function and passed to another);
    `owner` (the handle) and `serial` (the send) are static pytree metadata."""

    state: Any
    args: ad.DispatchArgs | None = None  # the inputs, for the gradient rule
    owner: int = 0  # AllToAll serial of the handle that sent
    serial: int = 0  # which dispatch_send made it (per process, trace-time)


class PendingCombine(NamedTuple):
    """Returned by combine_send; hand it to combine_recv of the same handle (a pytree, as
    PendingDispatch)."""

    state: Any
    args: ad.CombineArgs | None = None  # the inputs, for the gradient rule
    owner: int = 0
    serial: int = 0


for _cls in (PendingDispatch, PendingCombine):  # owner and serial: static, not leaves
    jax.tree_util.register_pytree_node(
        _cls, lambda p: ((p.state, p.args), (p.owner, p.serial)),
        lambda aux, children, cls=_cls: cls(*children, *aux))
_HANDLE_SERIALS = itertools.count(1)
_SEND_SERIALS = itertools.count(1)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _under_trace() -> bool:
    """Whether JAX is tracing here (jit, eval_shape, grad, shard_map, ...)."""
    from ._jax_compat import under_trace

    return under_trace()


def _current_trace():
    from ._jax_compat import current_trace

    return current_trace()


def _call_site() -> str:
    """file:line of the first caller outside jax_moe_comm and JAX (for messages)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PACKAGE_DIR) or f"{os.sep}jax{os.sep}" in name
                or f"{os.sep}flax{os.sep}" in name or "<frozen" in name):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _alive(ref) -> Any:
    """The trace behind a weakref while it is still tracing, else None."""
    trace = ref()
    if trace is None or not getattr(trace, "is_valid", lambda: True)():
        return None
    return trace


class _Half:
    """Trace-time order of one half (dispatch or combine) of a handle. What the kernels refuse
    at run time (csrc/core/protocol.cuh: a send while one is in flight, a recv without its
    send) is refused here, on every backend and with the same ProtocolError, when one traced
    function shows it. Sends traced in a trace that has finished (a pending returned by a
    jitted function) are left to the run-time checks: each run of that function sends anew."""

    def __init__(self, name: str):
        self.name = name
        self.sent: dict[int, tuple] = {}  # serial -> (weakref to its trace, call site)
        self.received: dict[int, Any] = {}  # serial -> weakref to the trace that received it

    def _in_flight(self, trace):
        """(serial, call site) of the send traced in `trace` and not received yet, or None."""
        for serial, (ref, site) in list(self.sent.items()):
            alive = _alive(ref)
            if alive is None:  # finished tracing: forget it
                del self.sent[serial]
                self.received.pop(serial, None)
            elif alive is trace and serial not in self.received:
                return serial, site
        return None

    def send(self, fused: bool) -> int:
        trace = _current_trace()
        flying = self._in_flight(trace)
        op = self.name if fused else f"{self.name}_send"
        if flying is not None:
            raise ProtocolError(
                f"{op} while the {self.name}_send at {flying[1]} is still in flight on this "
                f"AllToAll (the CUDA kernels refuse it: one {self.name} per handle at a "
                f"time). Call {self.name}_recv on that pending first, or use another handle "
                "for the second cycle.")
        serial = next(_SEND_SERIALS)
        if not fused:
            self.sent[serial] = (weakref.ref(trace), _call_site())
        return serial

    def recv(self, serial: int) -> None:
        op = f"{self.name}_recv"
        trace = _current_trace()
        known = serial in self.sent and _alive(self.sent[serial][0]) is not None
        # Received before in this same trace (a recv in each branch of a lax.cond is fine).
        if known and serial in self.received and self.received[serial]() is trace:
            raise ProtocolError(
                f"{op} of a Pending{self.name.capitalize()} that was already received: no "
                f"{self.name}_send before it (the CUDA kernels refuse it). Each send is "
                "received once.")
        flying = self._in_flight(trace)
        if flying is not None and flying[0] != serial:
            raise ProtocolError(
                f"{op} was given the pending of another {self.name}_send than the one in "
                f"flight (sent at {flying[1]}): on the device a recv takes the handle's "
                "cycle in flight, so this one would get that send's data. Pass the pending "
                f"that the last {self.name}_send returned.")
        if known:
            self.received[serial] = weakref.ref(trace)


def order_after(value, *deps):
    """`value` (any pytree, e.g. a PendingDispatch), usable only once `deps` are computed.

    XLA orders ops by data dependencies only. To overlap work with the wire time, write
    `pending = dispatch_send(...); h = f(...); out = dispatch_recv(order_after(pending, h))`:
    dispatch_recv then waits on the device only after f ran. No kernel is added. On the GPU
    (the native module loaded, GPU the default backend) the edge is a custom call that launches
    nothing and whose results alias `value`'s arrays, because XLA GPU dropped the edge of a
    lax.optimization_barrier whose `deps` outputs were unused (docs/notes.md); elsewhere it is
    that barrier. XLA copies a tied array that is still read elsewhere, so tie the least that
    the next op needs (moe.py ties `pending.state`).
    """
    from . import native

    gpu = native.available() and jax.default_backend() == "gpu"
    if gpu:
        native.register_targets()  # jmc_order_after
    return _order_after(value, deps, gpu)


def _order_after(value, deps, gpu: bool):
    leaves, tree = jax.tree.flatten(value)
    dep_leaves = jax.tree.leaves(deps)
    if not leaves or not dep_leaves:
        return value
    leaves = [jnp.asarray(v) for v in leaves]
    n = len(leaves)

    def barrier(*args):
        tied, _ = jax.lax.optimization_barrier((args[:n], args[n:]))
        return list(tied)

    @jax.custom_jvp
    def custom_call(*args):
        from .backends import ffi_call
        from .backends.nvshmem import result_type

        results = tuple(result_type(a, a.shape, a.dtype) for a in args[:n])
        return list(ffi_call.call("jmc_order_after", results, *args,
                                  aliases={i: i for i in range(n)}))

    @custom_call.defjvp
    def _(primals, tangents):  # the value's tangents pass through, as through the barrier
        return custom_call(*primals), list(tangents[:n])

    tie = custom_call if gpu else barrier
    return jax.tree.unflatten(tree, tie(*leaves, *dep_leaves))


def _platform() -> str:
    return jax.default_backend()


def native_available() -> bool:
    from . import native

    return native.available()


def _gpu_problem(config: MoEConfig | None) -> str:
    """'' when the nvshmem backend can run in this process, else why not and what to do."""
    from . import bootstrap, native

    reason = native.unavailable_reason()
    if reason:
        return reason
    reason = bootstrap.process_layout_problem(None if config is None else config.world_size)
    if reason:
        return reason
    return native.device_problem(jax.local_devices()[0])


def resolve_backend(backend: str, config: MoEConfig | None = None) -> str:
    """The backend `backend` stands for here: 'auto' is 'nvshmem' on CUDA GPUs where it can
    run, else 'reference' (with a ReferenceFallbackWarning on GPUs, saying why)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if _platform() not in ("gpu", "cuda"):
        return "reference"
    problem = _gpu_problem(config)
    if not problem:
        return "nvshmem"
    warnings.warn(f"jax_moe_comm: backend='auto' is on GPUs but uses the reference backend "
                  f"(XLA all_to_all of padded buffers, far slower than the CUDA kernels) "
                  f"because {problem} Pass backend='reference' to silence this, or "
                  "backend='nvshmem' to make it an error.", ReferenceFallbackWarning,
                  stacklevel=3)
    return "reference"


def _scoped(method):
    """The op under jax.named_scope("jax_moe_comm.<op>"), so that a profile (XProf, Perfetto)
    and the HLO's op metadata name our custom calls and what surrounds them."""
    scope = f"jax_moe_comm.{method.__name__}"

    @functools.wraps(method)
    def scoped(*args, **kwargs):
        with jax.named_scope(scope):
            return method(*args, **kwargs)

    return scoped


class AllToAll:
    """One expert-parallel all-to-all of a fixed layer shape.

    Create it collectively (same order on every process), outside jit. Call its ops inside
    `jax.shard_map` over `axis_name`, with per-rank shapes (the global arrays have world_size
    times the rows, sharded with P(axis_name)):

      x [max_m, H] (bf16 or fp8 e4m3), x_scale [max_m, H/128] f32 (fp8 only),
      indices [max_m, k] int32 (-1 = unused slot), weights [max_m, k] f32,
      num_tokens: int32 of shape (1,) (a global [world_size] array) or () (rows >=
      num_tokens are ignored; it may change every step with no recompilation).

    layout: "padded" gives expert_x [L, expert_capacity, H] (a batched einsum, cuBLAS batched
    GEMM); "packed" gives [max_recv_rows, H] with each local expert's rows contiguous, for
    jax.lax.ragged_dot and grouped GEMMs (see DispatchOutput), written so by the backend (no
    padded intermediate).

    expert_capacity (padded only): P, rows per local expert, in [1, config.max_recv_tokens].
    None: max_recv_tokens, the worst case (nothing can overflow). config.rows_per_expert_for(
    capacity_factor) sizes it from the mean load per expert under uniform routing (GShard's
    expert capacity); expert_x then takes L*P*H, and an einsum over it computes L*P rows
    instead of L*max_recv. An expert's rows past its first P are dropped (which ones is
    unspecified on the CUDA backend).

    max_recv_rows (packed only): the capacity C, packed rows per rank, in [1,
    config.max_recv_total]. None: max_recv_total, the worst case (nothing can overflow).
    config.recv_rows_for(capacity_factor) sizes it from the mean load under uniform routing;
    expert_x then takes C*H instead of L*max_recv*H. The rows past C are dropped: the highest
    local experts' rows go first.

    overflow: what happens to the rows that arrive past either capacity (they are never
    written): "fail" (default) records a CapacityExceededError (check() raises it; it stays
    until recover()), "drop" drops them without an error. Either way a dropped slot adds
    nothing to y (as if its expert's output were zero) and gets a zero weight gradient;
    DispatchOutput.dropped_rows and dropped_rows() count them.

    Every wait for a peer is bounded by `timeout_s`; a peer that never answers surfaces as
    PeerTimeoutError (from check(), or from the next call on the handle). A rank that has not
    started the cycle while its process lives (a compile, a checkpoint save) is late, not
    failed: on the CUDA backend its peers wait for it up to `start_timeout_s` (its process's
    heartbeat tells alive from gone: a killed rank is still reported within about timeout_s
    + 1 s). Only peers reachable by load/store (one node) are waited for so; at most timeout_s
    turns it off. The reference backend has no timeouts.

    One handle serves every layer and step, one dispatch/combine pair at a time: each
    dispatch_send must be followed by its dispatch_recv, combine_send and combine_recv before
    the next dispatch_send on the same handle. Call close() (or use `with`) when done.
    Misuse raises ProtocolError on every backend: at trace time when one traced function
    shows it (a second send while one is in flight, a recv of a pending already received or
    made by another handle, an op on a closed handle, a handle created while tracing), else
    from check() (the CUDA kernels refuse the launch on the device; the reference backend
    counts the same way on the host).

    differentiable=True: also allocate the buffers of the backward all-to-alls (bf16 dispatch,
    f32 combine; a second one with token_replicas 1 when token_replicas > 1), so that jax.grad
    can differentiate dispatch (w.r.t. x) and combine (w.r.t. expert_y and weights); padding
    rows of expert_x are then zero. Without it, differentiating raises at trace time.
    Forward-mode (jax.jvp) and jax.vmap are not supported. Rules and token-group/fp8
    semantics: autodiff.py. Both layouts, with any capacity: the backward handles have the
    forward's layout (the combine backward at the worst-case capacity: it drops nothing).
    """

    def __init__(self, config: MoEConfig, *, axis_name: str = "ep", backend: str = "auto",
                 layout: str = "padded", expert_capacity: int | None = None,
                 max_recv_rows: int | None = None, overflow: str = "fail",
                 tuning: KernelTuning | None = None,
                 timeout_s: float = 30.0, start_timeout_s: float = 600.0,
                 differentiable: bool = False):
        if _under_trace():
            raise ProtocolError(
                "AllToAll was created while JAX is tracing (inside jit, eval_shape, grad, "
                "shard_map or an nnx transform). Creation is collective and allocates "
                "symmetric memory once: create the handle before the jitted function, on "
                "every process in the same order, and use it inside (a Flax module made under "
                "nnx.eval_shape creates its handles later: jax_moe_comm.flax.create_handles).")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s={start_timeout_s!r} must be > 0 (at most timeout_s "
                             "waits for a late rank no longer than for any other)")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}: 'padded' gives "
                             "expert_x [L, expert_capacity, H], 'packed' [max_recv_rows, H] "
                             "for jax.lax.ragged_dot")
        if overflow not in OVERFLOWS:
            raise ValueError(f"overflow={overflow!r}; expected one of {OVERFLOWS}: 'fail' "
                             "(check() raises CapacityExceededError when rows arrive past "
                             "the capacity: expert_capacity or max_recv_rows) or 'drop' (they "
                             "are dropped, counted)")
        self.config = config
        self.axis_name = axis_name
        self.layout = layout
        # Packed rows per rank (None for padded): the backends write no more than this.
        self.max_recv_rows = _check_recv_rows(config, layout, max_recv_rows)
        # Padded rows per local expert (None for packed): likewise.
        self.expert_capacity = _check_expert_capacity(config, layout, expert_capacity)
        self.overflow = overflow
        self.backend_name = resolve_backend(backend, config)
        self._tuning, self._timeout_s = tuning or KernelTuning.DEFAULT, timeout_s
        self._start_timeout_s = start_timeout_s
        self._backends = []  # every handle this object owns, closed together
        try:
            fwd = self._make_backend(config, self.max_recv_rows, self.expert_capacity)
            dispatch_grad = combine_grad = None
            if differentiable:
                # Handle creation is collective: here, eagerly, never while tracing.
                bwd = dataclasses.replace(config, dispatch_dtype=jnp.bfloat16,
                                          combine_dtype=jnp.float32)
                # Its combine half reads d expert_x in the forward's rows: same capacity.
                dispatch_grad = combine_grad = self._make_backend(bwd, self.max_recv_rows,
                                                                  self.expert_capacity)
                # dy is dispatched by every replica (token_replicas 1) and must drop nothing (the
                # worst-case rows): a second handle unless dispatch_grad is that already.
                if config.token_replicas > 1 or not self.drops_nothing:
                    dp1 = dataclasses.replace(bwd, token_replicas=1)
                    packed = layout == "packed"
                    combine_grad = self._make_backend(
                        dp1, dp1.max_recv_total if packed else None,
                        None if packed else dp1.max_recv_tokens)
        except BaseException:
            for b in self._backends:
                b.close()
            raise
        self._backend = fwd
        self._plan = ad.Plan(config, axis_name, ad.Rows.of(config, layout, self.max_recv_rows,
                                                           self.expert_capacity),
                             fwd, dispatch_grad, combine_grad,
                             ad.recv_dequantizes(fwd))
        self._closed = False
        self._serial = next(_HANDLE_SERIALS)
        self._dispatch_order, self._combine_order = _Half("dispatch"), _Half("combine")
        from . import debug

        debug.report(self, backend)  # JMC_DEBUG=1: what was chosen and why

    def _make_backend(self, config: MoEConfig, recv_rows: int | None = None,
                      expert_capacity: int | None = None):
        """A backend of this handle's layout and overflow; recv_rows: its packed capacity
        (None for padded); expert_capacity: its padded rows per local expert (None for
        packed)."""
        layout = dict(layout=self.layout, recv_rows=recv_rows, expert_capacity=expert_capacity,
                      overflow=self.overflow)
        if self.backend_name == "reference":
            from .backends.reference import ReferenceBackend

            backend = ReferenceBackend(config, self.axis_name, **layout)
        else:
            from .backends import nvshmem

            # (It checks _gpu_problem itself, after taking its creation tag: collective.)
            backend = nvshmem.NvshmemBackend(config, self.axis_name, self._tuning,
                                             self._timeout_s,
                                             start_timeout_s=self._start_timeout_s, **layout)
            ad.allow_remat_of_ffi_calls()  # jax.checkpoint saves the all-to-alls' outputs
        self._backends.append(backend)
        return backend

    @property
    def differentiable(self) -> bool:
        return self._plan.differentiable

    @property
    def drops_nothing(self) -> bool:
        """Whether the capacity is the worst case (max_recv_rows == max_recv_total packed,
        expert_capacity == max_recv_tokens padded): then no row can be dropped."""
        if self.layout == "packed":
            return self.max_recv_rows == self.config.max_recv_total
        return self.expert_capacity == self.config.max_recv_tokens

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the symmetric buffers. Collective: every process closes its handle.

        Call no jitted function that uses this handle after close(). If one runs anyway: its
        handlers refuse a closed handle, and launches that XLA replays from a command buffer
        (its default on GPU) without asking the handle find it marked closed in device state
        that close() keeps for that (a few KB per handle, never freed), do nothing, and write
        NaN rows of y; check() on this object then raises ProtocolError. The symmetric buffers
        themselves are freed, and a newer handle may own them."""
        if not self._closed:
            for b in self._backends:
                b.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def backend(self):
        """The backend object (its barrier; the instruments take it: jax_moe_comm._bench)."""
        return self._backend

    @property
    def symmetric_bytes(self) -> int:
        """Bytes of NVSHMEM symmetric memory this handle holds on each rank (with the
        backward buffers of a differentiable handle)."""
        return sum(b.symmetric_bytes for b in self._backends)

    def dropped_rows(self) -> int:
        """Rows that the capacity (packed max_recv_rows, or padded expert_capacity: the rows
        past it summed over the local experts) dropped on this process's ranks since creation
        or recover(), with overflow="drop", over the dispatches that have run (read it after
        their results); 0 when nothing can drop. With overflow="fail" an overflowing cycle
        drops nothing: it fails, and check() raises CapacityExceededError (on the GPU that
        cycle's outputs, DispatchOutput.dropped_rows included, are not data)."""
        return self._backend.dropped_rows_total()

    def check(self) -> None:
        """Wait for the device, then raise the first error recorded on this handle:
        InvalidRoutingError (bad expert index or num_tokens of a live row; the slot was
        skipped), CapacityExceededError (overflow="fail": rows arrived past max_recv_rows or
        expert_capacity; they were not written), PeerTimeoutError, PeerAbortedError (a peer failed first),
        CorruptDataError, or ProtocolError (a half's send and recv out of order, or a compiled
        step replayed after close()); also for the backward handles of a differentiable
        handle. On the GPU the error stays recorded and every later check() raises it again,
        until recover() (every later cycle on the handle does nothing and writes NaN rows of
        y); on the reference backend a CapacityExceededError or ProtocolError stays too. Under
        XLA command buffers a replayed step runs no handler code, so its errors reach the host
        only here or in poll(): a decode loop should poll() every step or check() every few."""
        for b in self._backends:
            check = getattr(b, "check", None)
            if check is not None and (not self._closed or getattr(b, "checks_after_close",
                                                                  False)):
                check()

    def poll(self) -> None:
        """check() without waiting for the device: raises what this rank's kernels have
        recorded so far (on the GPU a pinned-memory read, cheap enough for every step). A
        backend with nothing asynchronous to read (the reference) checks as check() does."""
        for b in self._backends:
            poll = getattr(b, "poll", None) or getattr(b, "check", None)
            if poll is not None:
                poll()

    def recover(self) -> int | None:
        """Collective, after an error: every process calls it (once any rank's poll() or
        check() raised). Waits for this rank's kernels and network puts, agrees with every
        rank on the dispatch + combine cycles all of them completed with no error since
        creation, then brings the handle back to a clean cycle on every rank (flags, launch
        counts and the error record cleared; same buffers), so the compiled steps that use it
        run again without re-jit. Returns that agreed count (a rank that completed one cycle
        more discards it): resume from step count // cycles per step, the same on every rank.
        Raises RecoveryError, resetting nothing, when the ranks' counts are more than one
        cycle apart (they are not on one timeline: restart the job). The reference backend
        counts no cycles: None."""
        if self._closed:
            raise ProtocolError("recover() on a closed AllToAll handle: create a new one")
        agreed = None
        for i, b in enumerate(self._backends):  # the forward handle first
            recover = getattr(b, "recover", None)
            if recover is not None:
                done = recover()
                if i == 0:
                    agreed = done
        return agreed

    def _own(self, pending, kind: str) -> None:
        """Refuse another handle's pending (its recv would take this handle's cycle)."""
        if pending.owner != self._serial:
            raise ProtocolError(
                f"{kind}_recv was given a Pending{kind.capitalize()} made by another AllToAll "
                f"handle (#{pending.owner}, this is #{self._serial}): a recv takes the cycle "
                f"in flight on its own handle. Call {kind}_recv on the handle whose "
                f"{kind}_send returned it.")

    def _live(self):
        if self._closed:
            raise ProtocolError("this AllToAll handle is closed: close() (or the end of its "
                                "`with` block) freed its buffers. Close a handle after the "
                                "last step that uses it; a jitted step traces its ops when it "
                                "first runs, so the handle must be open then too.")
        rt.check_axis(self.config, self.axis_name)
        return self._backend

    # -- dispatch --------------------------------------------------------------------------
    @_scoped
    def dispatch_send(self, x, indices, num_tokens, *, x_scale=None,
                      weights=None) -> PendingDispatch:
        """Start sending every token to the ranks of its experts. Returns what recv needs.

        On an fp8 handle, x is either fp8 with x_scale (your quantization; not
        differentiable) or bf16 without x_scale: then it is quantized here (1x128 blocks),
        travels as fp8, arrives dequantised as bf16 expert_x, and its gradient is taken with
        respect to the dequantised input (straight-through; the scales are not
        differentiated). weights [max_m, k] f32, optional: returned per row as
        DispatchOutput.expert_weights.
        """
        return self._dispatch_send(x, indices, num_tokens, x_scale, weights, fused=False)

    def _dispatch_send(self, x, indices, num_tokens, x_scale, weights, fused: bool):
        self._live()
        cfg = self.config
        quantize = rt.check_tokens(cfg, x, x_scale)
        rt.check_routing(cfg, indices, weights)
        num_tokens = rt.check_num_tokens(cfg, num_tokens)
        serial = self._dispatch_order.send(fused)
        if weights is None:
            first, merged = rt.first_occurrence(indices), None
        else:
            first, merged = rt.merge_repeats(indices, weights)
        sent, sent_scale = (quant.quantize(jax.lax.stop_gradient(x)) if quantize
                            else (x, x_scale))
        state = ad.dispatch_send(self._plan, sent, sent_scale, first, num_tokens, merged, fused)
        return PendingDispatch(state, ad.DispatchArgs(x, x_scale, first, num_tokens, merged),
                               self._serial, serial)

    @_scoped
    def dispatch_recv(self, pending: PendingDispatch) -> DispatchOutput:
        """Wait for every peer's tokens and lay them out per local expert (self.layout)."""
        if not isinstance(pending, PendingDispatch) or pending.args is None:
            what = ("a PendingDispatch that dispatch_send did not make" if
                    isinstance(pending, PendingDispatch) else type(pending).__name__)
            raise TypeError(f"dispatch_recv takes the PendingDispatch that dispatch_send "
                            f"returned, got {what}")
        self._live()
        self._own(pending, "dispatch")
        self._dispatch_order.recv(pending.serial)
        a = pending.args
        dequantize = self.config.is_fp8 and a.x_scale is None
        expert_x, scale, counts, routing, ew, dropped = _named(ad.dispatch_recv(
            self._plan, dequantize, pending.state, a.x, a.x_scale, a.indices, a.num_tokens,
            a.weights))
        return DispatchOutput(expert_x, scale, counts, Routing(routing, counts), ew, dropped)

    @_scoped
    def dispatch(self, x, indices, num_tokens, *, x_scale=None, weights=None) -> DispatchOutput:
        """dispatch_send then dispatch_recv, with nothing between: the nvshmem backend runs
        both halves in one kernel launch."""
        return self.dispatch_recv(self._dispatch_send(x, indices, num_tokens, x_scale, weights,
                                                      fused=True))

    # -- combine ---------------------------------------------------------------------------
    @_scoped
    def combine_send(self, expert_y, routing) -> PendingCombine:
        """Start sending every expert output row back to its token's home rank(s).

        expert_y: combine dtype, in the handle's layout: [L, expert_capacity, H] ("padded")
        or [max_recv_rows, H] ("packed"), row for row as dispatch laid out expert_x.
        routing: the DispatchOutput.routing of that dispatch.
        """
        return self._combine_send(expert_y, routing, fused=False)

    def _combine_send(self, expert_y, routing, fused: bool) -> PendingCombine:
        self._live()
        cfg = self.config
        if not isinstance(routing, Routing):
            raise TypeError(f"routing must be the DispatchOutput.routing that dispatch (or "
                            f"dispatch_recv) returned, passed unchanged; got "
                            f"{type(routing).__name__}")
        rows = self._plan.rows
        shape = (rows.count,) if rows.packed else (cfg.num_local_experts, rows.count)
        rt.check_array("expert_y", expert_y, shape + (cfg.hidden,), cfg.combine_dtype,
                       hint=f"layout={self.layout!r}: one row per expert_x row")
        serial = self._combine_order.send(fused)
        state = ad.combine_send(self._plan, expert_y, routing.backend, fused)
        return PendingCombine(state, ad.CombineArgs(expert_y, routing.backend), self._serial,
                              serial)

    @_scoped
    def combine_recv(self, pending: PendingCombine, indices, weights, num_tokens) -> jax.Array:
        """Wait for every row of this rank's tokens; y[t] = sum_j weights[t,j] * row(t,j).

        Returns y [max_m, H] bf16, summed in f32; rows >= num_tokens are zero.
        """
        if not isinstance(pending, PendingCombine) or pending.args is None:
            what = ("a PendingCombine that combine_send did not make" if
                    isinstance(pending, PendingCombine) else type(pending).__name__)
            raise TypeError(f"combine_recv takes the PendingCombine that combine_send "
                            f"returned, got {what}")
        self._live()
        self._own(pending, "combine")
        self._combine_order.recv(pending.serial)
        cfg = self.config
        rt.check_routing(cfg, indices, weights)
        num_tokens = rt.check_num_tokens(cfg, num_tokens)
        first, merged = rt.merge_repeats(indices, weights)
        a = pending.args
        return _named(ad.combine_recv(self._plan, pending.state, a.expert_y, a.routing, first,
                                      merged, num_tokens))

    @_scoped
    def combine(self, expert_y, routing, indices, weights, num_tokens) -> jax.Array:
        """combine_send then combine_recv, with nothing between (one launch on nvshmem)."""
        return self.combine_recv(self._combine_send(expert_y, routing, fused=True), indices,
                                 weights, num_tokens)


def _check_recv_rows(config: MoEConfig, layout: str, max_recv_rows) -> int | None:
    """The packed capacity AllToAll(max_recv_rows=...) stands for; None for padded."""
    if layout != "packed":
        if max_recv_rows is not None:
            raise ValueError(f"max_recv_rows={max_recv_rows!r} is a capacity of the packed "
                             f"layout (rows per rank); this handle has layout={layout!r}, whose "
                             "capacity is expert_capacity= (rows per local expert, "
                             "config.rows_per_expert_for(capacity_factor)). Pass "
                             "layout='packed' with it, or expert_capacity= instead")
        return None
    if max_recv_rows is None:
        return config.max_recv_total
    if isinstance(max_recv_rows, bool) or not isinstance(max_recv_rows, (int, np.integer)) \
            or not 1 <= max_recv_rows <= config.max_recv_total:
        raise ValueError(
            f"max_recv_rows={max_recv_rows!r} must be an int in [1, max_recv_total="
            f"{config.max_recv_total}] (packed rows per rank; the worst case, max_recv_total, "
            f"is the default). config.recv_rows_for(capacity_factor) sizes it from the mean "
            f"load, expected_recv_rows={config.expected_recv_rows}")
    return int(max_recv_rows)


def _check_expert_capacity(config: MoEConfig, layout: str, expert_capacity) -> int | None:
    """The padded capacity AllToAll(expert_capacity=...) stands for; None for packed."""
    if layout != "padded":
        if expert_capacity is not None:
            raise ValueError(f"expert_capacity={expert_capacity!r} is a capacity of the padded "
                             f"layout (rows per local expert); this handle has layout="
                             f"{layout!r}, whose capacity is max_recv_rows= (rows per rank, "
                             "config.recv_rows_for(capacity_factor)). Pass layout='padded' "
                             "with it, or max_recv_rows= instead")
        return None
    if expert_capacity is None:
        return config.max_recv_tokens
    if isinstance(expert_capacity, bool) or not isinstance(expert_capacity, (int, np.integer)) \
            or not 1 <= expert_capacity <= config.max_recv_tokens:
        raise ValueError(
            f"expert_capacity={expert_capacity!r} must be an int in [1, max_recv_tokens="
            f"{config.max_recv_tokens}] (padded rows per local expert; the worst case, "
            f"max_recv_tokens, is the default). config.rows_per_expert_for(capacity_factor) "
            f"sizes it from the mean load, expected_rows_per_expert="
            f"{config.expected_rows_per_expert}")
    return int(expert_capacity)
