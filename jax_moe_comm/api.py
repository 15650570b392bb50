"""The public all-to-all handle: dispatch and combine, fused or split, on any backend."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from . import routing as rt
from .config import KernelTuning, MoEConfig
from .errors import NativeUnavailableError, ProtocolError

BACKENDS = ("auto", "reference", "nvshmem")


class DispatchOutput(NamedTuple):
    """What dispatch lays out per local expert, per rank.

    expert_x: [L, max_recv, H] dispatch dtype; rows >= expert_num_tokens[e] are undefined.
    expert_x_scale: [L, max_recv, H/128] f32 for fp8 dispatch, else None.
    expert_num_tokens: [L] int32.
    routing: opaque pytree that combine needs (where each row came from).
    expert_weights: [L, max_recv] f32 router weight of the slot that made each row (only when
        dispatch_send was given weights), else None.
    """

    expert_x: jax.Array
    expert_x_scale: jax.Array | None
    expert_num_tokens: jax.Array
    routing: Any
    expert_weights: jax.Array | None = None


class PendingDispatch(NamedTuple):
    """Returned by dispatch_send; hand it to dispatch_recv."""

    state: Any


class PendingCombine(NamedTuple):
    """Returned by combine_send; hand it to combine_recv."""

    state: Any


def order_after(value, *deps):
    """`value` (any pytree, e.g. a PendingDispatch), usable only once `deps` are computed.

    XLA orders ops by data dependencies only. To overlap work with the wire time, write
    `pending = dispatch_send(...); h = f(...); out = dispatch_recv(order_after(pending, h))`:
    dispatch_recv then waits on the device only after f ran. No kernel is added
    (lax.optimization_barrier).
    """
    tied, _ = jax.lax.optimization_barrier((value, deps))
    return tied


def _platform() -> str:
    return jax.default_backend()


def native_available() -> bool:
    from . import native

    return native.available()


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if _platform() in ("gpu", "cuda") and native_available():
        return "nvshmem"
    return "reference"


class AllToAll:
    """One expert-parallel all-to-all of a fixed layer shape.

    Create it collectively (same order on every process), outside jit. Call its ops inside
    `jax.shard_map` over `axis_name`, with per-rank shapes:

      x [max_m, H] (bf16 or fp8 e4m3), x_scale [max_m, H/128] f32 (fp8 only),
      indices [max_m, k] int32 (-1 = unused slot), weights [max_m, k] f32,
      num_tokens: scalar int32 (rows >= num_tokens are ignored).

    Every wait for a peer is bounded by `timeout_s`; a peer that never answers surfaces as
    PeerTimeoutError (from check(), or from the next call on the handle).

    One handle serves every layer and step, one dispatch/combine pair at a time: each
    dispatch_send must be followed by its dispatch_recv, combine_send and combine_recv before
    the next dispatch_send on the same handle. Call close() (or use `with`) when done.
    """

    def __init__(self, config: MoEConfig, *, axis_name: str = "ep", backend: str = "auto",
                 tuning: KernelTuning | None = None, timeout_s: float = 30.0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.axis_name = axis_name
        self.backend_name = resolve_backend(backend)
        if self.backend_name == "reference":
            from .backends.reference import ReferenceBackend

            self._backend = ReferenceBackend(config, axis_name)
        else:
            from .backends import nvshmem

            if not native_available():
                from . import native

                raise NativeUnavailableError(native.unavailable_reason())
            self._backend = nvshmem.NvshmemBackend(config, axis_name,
                                                   tuning or KernelTuning.DEFAULT, timeout_s)
        self._closed = False

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the symmetric buffers. Collective: every process closes its handle."""
        if not self._closed:
            self._backend.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def backend(self):
        """The backend object (benchmarks use its barrier and timing hooks)."""
        return self._backend

    @property
    def symmetric_bytes(self) -> int:
        """Bytes of NVSHMEM symmetric memory this handle holds on each rank."""
        return self._backend.symmetric_bytes

    def check(self) -> None:
        """Wait for the device, then raise the first error the kernels recorded, if any."""
        check = getattr(self._backend, "check", None)
        if check is not None:
            check()

    def _live(self):
        if self._closed:
            raise ProtocolError("this AllToAll handle is closed")
        rt.check_axis(self.config, self.axis_name)
        return self._backend

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_send(self, x, indices, num_tokens, *, x_scale=None) -> PendingDispatch:
        """Start sending every token to the ranks of its experts. Returns what recv needs."""
        backend = self._live()
        cfg = self.config
        rt.check_tokens(cfg, x, x_scale)
        rt.check_routing(cfg, indices)
        num_tokens = rt.check_num_tokens(cfg, num_tokens)
        indices = rt.first_occurrence(indices)
        return PendingDispatch(backend.dispatch_send(x, x_scale, indices, num_tokens))

    def dispatch_recv(self, pending: PendingDispatch) -> DispatchOutput:
        """Wait for every peer's tokens and lay them out per local expert."""
        if not isinstance(pending, PendingDispatch):
            raise TypeError("dispatch_recv takes the PendingDispatch that dispatch_send returned")
        return DispatchOutput(*self._live().dispatch_recv(pending.state))

    def dispatch(self, x, indices, num_tokens, *, x_scale=None) -> DispatchOutput:
        return self.dispatch_recv(self.dispatch_send(x, indices, num_tokens, x_scale=x_scale))

    # -- combine ---------------------------------------------------------------------------
    def combine_send(self, expert_y, routing) -> PendingCombine:
        """Start sending every expert output row back to its token's home rank(s)."""
        backend = self._live()
        cfg = self.config
        shape = (cfg.num_local_experts, cfg.max_recv_tokens, cfg.hidden)
        rt.check_array("expert_y", expert_y, shape, cfg.combine_dtype)
        return PendingCombine(backend.combine_send(expert_y, routing))

    def combine_recv(self, pending: PendingCombine, indices, weights, num_tokens) -> jax.Array:
        """Wait for every row of this rank's tokens; y[t] = sum_j weights[t,j] * row(t,j).

        Returns y [max_m, H] bf16, summed in f32; rows >= num_tokens are zero.
        """
        if not isinstance(pending, PendingCombine):
            raise TypeError("combine_recv takes the PendingCombine that combine_send returned")
        backend = self._live()
        cfg = self.config
        rt.check_routing(cfg, indices, weights)
        num_tokens = rt.check_num_tokens(cfg, num_tokens)
        first, merged = rt.merge_repeats(indices, weights)
        return backend.combine_recv(pending.state, first, merged, num_tokens)

    def combine(self, expert_y, routing, indices, weights, num_tokens) -> jax.Array:
        return self.combine_recv(self.combine_send(expert_y, routing), indices, weights,
                                 num_tokens)
