"""Instruments of the benchmarks and tests, kept out of the product (`jax_moe_comm._native.bench`
underneath): CUDA events on XLA's stream, the loop benchmark's floor kernels, the kernels'
%globaltimer stamps, the staged-message counter and a dense NVSHMEM all-to-all baseline.

Each function takes an AllToAll on the nvshmem backend (or its NvshmemBackend). The FFI targets
are registered with XLA the first time one of them is traced here; the product never registers
them."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from . import bootstrap, native
from .backends import ffi_call
from .backends.nvshmem import NvshmemBackend, result_type

FLOOR_KINDS = {"empty": 0, "barrier": 1}  # csrc/ffi/bench.cc, FloorKernels


def _module():
    return native.module().bench


@functools.lru_cache(maxsize=None)
def register_targets() -> None:
    """Register the instruments' FFI handlers with XLA for CUDA, once per process."""
    import jax

    native.register_targets()
    for name, capsule in _module().ffi_targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def nvshmem_backend(a2a) -> NvshmemBackend:
    """The NvshmemBackend of an AllToAll (or the backend itself); a ValueError otherwise."""
    backend = getattr(a2a, "_backend", a2a)
    if not isinstance(backend, NvshmemBackend):
        raise ValueError(f"{type(backend).__name__}: the instruments time and count the CUDA "
                         "kernels; they need an AllToAll on backend='nvshmem'")
    return backend


def floor_kernels(a2a, dep, kind: str, count: int):
    """The loop benchmark's floor: `count` kernels in one call, each a dependent launch of the
    one before, "empty" (a kernel boundary alone) or "barrier" (a boundary and one all-rank
    crossing); returns a ticket ordered after dep."""
    if kind not in FLOOR_KINDS or not 1 <= count <= 16:
        raise ValueError(f"floor_kernels: kind from {sorted(FLOOR_KINDS)}, count in [1, 16]; "
                         f"got {kind!r}, {count}")
    backend = nvshmem_backend(a2a)
    if native.available():  # (lowered without a GPU in tests: nothing to register then)
        register_targets()
    return backend._call("jmc_floor_kernels", backend._ticket(dep), dep, side_effect=True,
                         kind=np.int64(FLOOR_KINDS[kind]), count=np.int64(count))


def set_timing(a2a, on: bool) -> None:
    """Bracket every kernel with %globaltimer stamps (read_timings). Each barrier() opens a
    sample; on=True starts counting samples from zero. A call that XLA recorded into a CUDA
    graph (command buffers) keeps the setting of its recording: turn timing on before a
    compiled function's first call."""
    handle = nvshmem_backend(a2a).handle
    _module().set_timing(handle, bool(on))


def read_timings(a2a) -> list[list[int]]:
    """Per sample since set_timing(True), oldest first: ns stamps [start, end] of
    dispatch_send, dispatch_recv, combine_send, combine_recv, then the marks
    (csrc/kernels/kernels.h). Waits for the device."""
    handle = nvshmem_backend(a2a).handle
    return [list(ts) for ts in _module().read_timings(handle)]


def count_staged_messages(a2a, on: bool = True) -> None:
    """Count every message sent to a staged peer (one global atomic each, on the staged path's
    hot path: off unless asked). As set_timing, a call recorded into a CUDA graph keeps the
    setting of its recording."""
    handle = nvshmem_backend(a2a).handle
    _module().set_message_counting(handle, bool(on))


def staged_messages(a2a) -> dict[str, int]:
    """Messages (puts, flag puts) each kernel sent to staged peers while counting was on, since
    creation or recover() (waits for the device): the staged path's cost in network messages."""
    handle = nvshmem_backend(a2a).handle
    counts = _module().staged_messages(handle)
    return dict(zip(("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"),
                    (int(c) for c in counts)))


def record_event(dep, slot: int):
    """cudaEventRecord into event `slot` on XLA's stream once `dep` exists; returns a ticket to
    order later work after it (`order_after`). Kept out of XLA's command buffers, so the event
    is recorded at every execution (csrc/ffi/event.cc). `event_elapsed_us` reads it."""
    bootstrap.init()
    register_targets()
    return ffi_call.call("jmc_record_event", result_type(dep, (1,), jnp.int32), dep,
                         side_effect=True, slot=np.int64(slot))


def event_elapsed_us(start_slot: int, end_slot: int) -> float:
    """Microseconds from event `start_slot` to `end_slot` as last recorded (waits for the end)."""
    return float(_module().event_elapsed_us(int(start_slot), int(end_slot)))


class DenseAllToAll:
    """Baseline: nvshmemx_alltoallmem_on_stream of world x chunk_bytes per rank."""

    def __init__(self, world_size: int, chunk_bytes: int):
        bootstrap.init()
        register_targets()
        self._mod = _module()
        self.world_size, self.chunk_bytes = world_size, chunk_bytes
        self.handle = int(self._mod.create_dense_handle(world_size, chunk_bytes))

    def __call__(self, x, copy: bool = False):
        out = result_type(x, (self.world_size, self.chunk_bytes), jnp.uint8)
        return ffi_call.call("jmc_dense_all_to_all", out, x, side_effect=True,
                             handle=np.int64(self.handle), copy=np.int64(int(copy)))

    def read_timings(self) -> list[int]:
        """ns stamps [start, end] of the last all-to-all on the stream."""
        return list(self._mod.read_dense_timings(self.handle))

    def close(self):
        self._mod.destroy_dense_handle(self.handle)
