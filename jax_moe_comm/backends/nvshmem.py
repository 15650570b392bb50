"""NVSHMEM backend: the CUDA kernels as XLA FFI custom calls over a persistent handle."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import bootstrap, native, recovery
from . import ffi_call
from ..config import KernelTuning, MoEConfig
from ..errors import (CapacityExceededError, CorruptDataError, InvalidRoutingError,
                      MoECommError, NativeUnavailableError, PeerAbortedError, PeerTimeoutError,
                      ProtocolError)

DEFAULT_TIMEOUT_S = 30.0
# A peer that has not started the cycle while its process lives (a compile, a checkpoint save)
# is waited for up to this long (csrc/core/protocol.cuh, wait_for_late_start).
DEFAULT_START_TIMEOUT_S = 600.0


class Routing(NamedTuple):
    expert_num_tokens: jax.Array  # [L] int32
    # (group * max_m + token) * k + slot of each row, flat: the output rows ([L, P] padded,
    # [C] packed), then the sources of the rows dropped past a capacity (csrc/core/layout.h,
    # Shape::row_source_entries)
    row_source: jax.Array
    dropped: jax.Array  # (1,) int32: rows dropped past the capacity (0 at the worst case)


def result_type(like, shape, dtype):
    """A result type that carries `like`'s shard_map varying axes (DESIGN section 10)."""
    aval = jax.typeof(like)
    manual = getattr(aval, "manual_axis_type", None)
    sharding = getattr(aval, "sharding", None)
    if manual is None or sharding is None or not getattr(manual, "varying", None):
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = jax.sharding.PartitionSpec(*([None] * len(shape)))
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=jax.sharding.NamedSharding(sharding.mesh, spec),
                                manual_axis_type=manual)


_ERROR_KINDS = {"PeerTimeout": PeerTimeoutError, "InvalidRouting": InvalidRoutingError,
                "PeerAborted": PeerAbortedError, "CorruptData": CorruptDataError,
                "ProtocolError": ProtocolError, "CapacityExceeded": CapacityExceededError}


def raise_recorded(message: str) -> None:
    if not message:
        return
    kind = message.split(":", 1)[0]
    raise _ERROR_KINDS.get(kind, MoECommError)(message)


# Settings read from the environment at creation that every rank must share (csrc/handle.cc
# reads them): a rank that refused one alone would return before the collective allocation and
# leave the others waiting there, so they are agreed first, with the differing rank named.
PROTOCOL_ENV = ("JMC_FUSED", "JMC_PDL", "JMC_NUM_BLOCKS", "JMC_TRANSPORT", "JMC_ACKS")


def forced_node_size(tuning: KernelTuning, world: int) -> int:
    """Ranks per emulated node whose peers outside it are staged (KernelTuning.transport
    "staged", else JMC_TRANSPORT=staged[:<node_size>]); 0: NVSHMEM decides per peer."""
    transport, node_size = tuning.transport, tuning.node_size
    if transport == "auto":
        text = os.environ.get("JMC_TRANSPORT", "").strip()
        name, _, size = text.partition(":")
        if name not in ("", "auto", "staged") or (size and not size.isdigit()):
            raise ValueError(f"JMC_TRANSPORT={text!r}: expected auto, staged or "
                             "staged:<ranks per emulated node>")
        transport, node_size = (name or "auto"), int(size or 1)
    if transport == "auto":
        return 0
    if node_size < 1 or world % node_size:
        raise ValueError(f"transport='staged' with node_size={node_size}: the {world} ranks "
                         "must split into emulated nodes of node_size ranks")
    return node_size

# Tests only (tests/gpu_server_worker.py sets it around a creation): handles start as if this many
# cycles had completed, to run cycles across the epoch values a server reaches after months.
_start_epoch = 0


def creation_refusal(rank: int, everyone: list[dict]) -> str:
    """The ranks that refused to create the handle ({"refused": why or ""} per rank, in rank
    order), seen from `rank`; "" if none did."""
    refused = [(r, v.get("refused", "")) for r, v in enumerate(everyone) if v.get("refused")]
    if not refused:
        return ""
    me = " (this rank)" if any(r == rank for r, _ in refused) else ""
    return (f"rank(s) {[r for r, _ in refused]} cannot create it{me}: " +
            "; ".join(f"rank {r}: {why}" for r, why in refused))


def creation_mismatch(rank: int, everyone: list[dict]) -> str:
    """What differs between the ranks' creation requests ({"shape": [...], "settings": {...}}
    per rank, in rank order), seen from `rank`; "" if they agree. The same text on every rank
    but for the viewpoint, so every rank raises at once."""
    mine = everyone[rank]
    differ = [r for r, v in enumerate(everyone) if v["shape"] != mine["shape"]]
    if differ:
        return (f"rank(s) {differ} asked for another layer shape than rank {rank} "
                f"{tuple(mine['shape'])}; every process must create the same handles in the "
                "same order")
    for key, value in mine["settings"].items():
        other = {r: v["settings"].get(key) for r, v in enumerate(everyone)
                 if v["settings"].get(key) != value}
        if other:
            return (f"{key} differs between ranks: {value!r} on rank {rank}, " +
                    ", ".join(f"{v!r} on rank {r}" for r, v in other.items()) +
                    "; set it the same way for every process")
    return ""


class NvshmemBackend:
    name = "nvshmem"
    checks_after_close = True  # check() reports a launch replayed after close() (kStaleLaunch)
    fused_ops = True  # dispatch() and combine(): both halves in one launch (autodiff.py)
    # dispatch_recv(dequantize=True): the kernel writes fp8 rows out as bf16 (autodiff.py)
    dequantizes_on_recv = True

    def __init__(self, cfg: MoEConfig, axis_name, tuning: KernelTuning,
                 timeout_s: float = DEFAULT_TIMEOUT_S, layout: str = "padded",
                 recv_rows: int | None = None, overflow: str = "fail",
                 expert_capacity: int | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S):
        """layout "padded" or "packed"; recv_rows: the packed capacity C (None: the worst
        case, cfg.max_recv_total); expert_capacity: the padded rows per local expert P (None:
        the worst case, cfg.max_recv_tokens); overflow "fail" or "drop" (api.AllToAll checks
        them); timeout_s and start_timeout_s as api.AllToAll's."""
        self.cfg = cfg
        self.axis_name = axis_name
        self.layout = layout
        self.recv_rows = (recv_rows or cfg.max_recv_total) if layout == "packed" else None
        self.expert_capacity = ((expert_capacity or cfg.max_recv_tokens) if layout == "padded"
                                else None)
        # Creation is collective. Its tag comes first, whatever happens on this rank, and every
        # rank publishes under it its request (shape and settings) or why it refuses: a
        # refusal or a difference on one rank is then a named error on every rank, with the
        # ranks' tag counters still in step, instead of a hang in the collective allocation
        # (or, on a retry, an agreement against another creation's key).
        tag = bootstrap.next_collective_tag("handle")
        from ..api import _gpu_problem

        refusal = _gpu_problem(cfg)
        shape = (cfg.num_experts, cfg.experts_per_token, cfg.hidden, cfg.max_num_tokens,
                 cfg.world_size, cfg.token_replicas, cfg.dispatch_dtype.name,
                 cfg.combine_dtype.name, layout, self.recv_rows or 0, self.expert_capacity or 0,
                 overflow)
        settings = dict({k: os.environ.get(k, "") for k in PROTOCOL_ENV},
                        num_blocks=tuning.num_blocks, warps_per_block=tuning.warps_per_block,
                        transport=tuning.transport, node_size=tuning.node_size,
                        start_epoch=_start_epoch)
        mine = json.dumps({"refused": refusal, "shape": shape, "settings": settings})
        try:
            everyone = [json.loads(v) for v in bootstrap.all_gather(tag + ":shape", mine)]
        except NativeUnavailableError:  # no key-value store to agree through
            if refusal:
                raise NativeUnavailableError(refusal) from None
            raise
        rank = jax.process_index()
        refused = creation_refusal(rank, everyone)
        if refused:  # this rank's own reason first, as it was before any agreement
            kind = NativeUnavailableError if refusal else MoECommError
            raise kind(f"{refusal}\n(AllToAll creation #{tag}: {refused})" if refusal
                       else f"AllToAll creation #{tag}: {refused}")
        problem = creation_mismatch(rank, everyone)
        if problem:
            raise ValueError(f"AllToAll creation #{tag}: {problem}")
        bootstrap.init()  # collective (NVSHMEM's init): every rank gets here or none does
        self._mod = native.module()
        # After the agreement: a JMC_TRANSPORT this refuses is then refused on every rank alike
        # (refused before it, one rank left the others waiting in the all_gather above).
        node_size = forced_node_size(tuning, cfg.world_size)
        handle, error = self._mod.create_handle(
            num_experts=cfg.num_experts, k=cfg.experts_per_token, hidden=cfg.hidden,
            max_m=cfg.max_num_tokens, world=cfg.world_size, dp=cfg.token_replicas,
            in_bytes=cfg.dispatch_dtype.itemsize, num_scales=cfg.num_scales,
            out_bytes=cfg.combine_dtype.itemsize, timeout_ns=int(timeout_s * 1e9),
            start_timeout_ns=int(start_timeout_s * 1e9),
            num_blocks=tuning.num_blocks, warps=tuning.warps_per_block,
            staged=bootstrap.staged() or 0 < node_size < cfg.world_size,
            staged_node_size=node_size, start_epoch=_start_epoch,
            packed_rows=self.recv_rows or 0, drop_overflow=overflow == "drop",
            expert_rows=self.expert_capacity or 0)
        if not handle:  # refused before anything collective happened (same on every rank)
            raise ValueError(f"cannot create the all-to-all handle: {error}")
        # Past the collective allocation: if any rank failed, every rank frees it together.
        errors = bootstrap.all_gather(tag + ":status", error)
        if any(errors):
            self._mod.destroy_handle(handle)
            failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            raise MoECommError(f"creating the all-to-all handle failed on {failed}")
        self.handle = int(handle)
        self._open = True

    def _call(self, name, results, *args, side_effect=False, **attrs):
        return ffi_call.call(name, results, *args, side_effect=side_effect,
                             handle=np.int64(self.handle), **attrs)

    def _ticket(self, like):
        return result_type(like, (1,), jnp.int32)

    # -- ops -------------------------------------------------------------------------------
    def _send_operands(self, x, x_scale, indices, num_tokens, weights):
        cfg = self.cfg
        if x_scale is None:  # 0-column stand-ins keep one signature
            x_scale = jnp.zeros((cfg.max_num_tokens, 0), jnp.float32)
        if weights is None:
            weights = jnp.zeros((cfg.max_num_tokens, 0), jnp.float32)
        return x, x_scale, indices, weights, num_tokens

    def _rows(self) -> tuple[int, ...]:
        """Leading shape of expert_x's rows: (L, P) padded, (C,) packed."""
        if self.layout == "packed":
            return (self.recv_rows,)
        return (self.cfg.num_local_experts, self.expert_capacity)

    def _can_drop(self) -> bool:
        cfg = self.cfg
        if self.layout == "packed":
            return self.recv_rows < cfg.max_recv_total
        return self.expert_capacity < cfg.max_recv_tokens

    def _sources(self) -> int:
        """row_source's length (Shape::row_source_entries in csrc/core/layout.h)."""
        cfg = self.cfg
        if self.layout == "packed":
            return cfg.max_recv_total
        return int(np.prod(self._rows())) + (cfg.max_recv_total if self._can_drop() else 0)

    def _recv_results(self, like, dequantize):
        cfg = self.cfg
        rows, L = self._rows(), cfg.num_local_experts
        sources = (self._sources(),)
        return (result_type(like, rows + (cfg.hidden,),
                            jnp.bfloat16 if dequantize else cfg.dispatch_dtype),
                result_type(like, rows + (0 if dequantize else cfg.num_scales,), jnp.float32),
                result_type(like, (L,), jnp.int32),
                result_type(like, sources, jnp.int32),
                result_type(like, rows, jnp.float32),
                result_type(like, (1,), jnp.int32))

    def _recv_outputs(self, outputs, dequantize):
        expert_x, scale, counts, source, expert_w, dropped = outputs
        return (expert_x, (scale if self.cfg.is_fp8 and not dequantize else None), counts,
                Routing(counts, source, dropped), expert_w, dropped)

    def dispatch_send(self, x, x_scale, indices, num_tokens, weights=None):
        return self._call("jmc_dispatch_send", self._ticket(x),
                          *self._send_operands(x, x_scale, indices, num_tokens, weights),
                          side_effect=True)

    def dispatch_recv(self, ticket, dequantize=False):
        """(expert_x, expert_x_scale | None, expert_num_tokens, routing, expert_weights,
        dropped_rows (1,)), in the handle's layout. dequantize (fp8 handles): the kernel
        writes expert_x as bf16, payload times its block scales, and no scales; rows past the
        counts stay undefined (no XLA pass over the whole buffer)."""
        return self._recv_outputs(self._call(
            "jmc_dispatch_recv", self._recv_results(ticket, dequantize), ticket,
            side_effect=True, dequantize=bool(dequantize)), dequantize)

    def dispatch(self, x, x_scale, indices, num_tokens, weights=None, dequantize=False):
        """dispatch_send + dispatch_recv in one launch; dispatch_recv's results."""
        return self._recv_outputs(self._call(
            "jmc_dispatch", self._recv_results(x, dequantize),
            *self._send_operands(x, x_scale, indices, num_tokens, weights), side_effect=True,
            dequantize=bool(dequantize)), dequantize)

    def combine_send(self, expert_y, routing: Routing):
        return self._call("jmc_combine_send", self._ticket(expert_y), expert_y,
                          routing.expert_num_tokens, routing.row_source, routing.dropped,
                          side_effect=True)

    def _y_results(self, like, slot_rows):
        cfg = self.cfg
        m, k, H = cfg.max_num_tokens, cfg.experts_per_token, cfg.hidden
        return (result_type(like, (m, H), jnp.bfloat16),
                result_type(like, (m, k, H) if slot_rows else (0,), cfg.combine_dtype))

    def combine_recv(self, ticket, indices, weights, num_tokens, slot_rows=False):
        """y [max_m, H] bf16; with slot_rows=True also the row that came back for each valid
        slot, [max_m, k, H] in the combine dtype (zeros elsewhere)."""
        y, slots = self._call("jmc_combine_recv", self._y_results(ticket, slot_rows), ticket,
                              indices, weights, num_tokens, side_effect=True)
        return (y, slots) if slot_rows else y

    def combine(self, expert_y, routing: Routing, indices, weights, num_tokens,
                slot_rows=False):
        """combine_send + combine_recv in one launch; combine_recv's results."""
        y, slots = self._call("jmc_combine", self._y_results(expert_y, slot_rows), expert_y,
                              routing.expert_num_tokens, routing.row_source, routing.dropped,
                              indices, weights, num_tokens, side_effect=True)
        return (y, slots) if slot_rows else y

    def row_keys(self, routing: Routing, dropped: bool = False):
        """(group, token, slot) key of each filled row, -1 past the counts: [L, P] padded,
        [C] packed. dropped=True: the keys of the rows dropped past the capacity this cycle,
        -1 past their number: [max_recv_total - C] packed; padded [max_recv_total] with a
        per-expert capacity below the worst case, else [0]."""
        n = int(np.prod(self._rows()))  # output rows; the dropped rows' sources follow
        if dropped:
            rest = routing.row_source[n:]
            return jnp.where(jnp.arange(rest.shape[0]) < routing.dropped[0], rest, -1)
        if self.layout != "packed":
            L, P = self._rows()
            filled = jnp.arange(P)[None, :] < routing.expert_num_tokens[:, None]
            return jnp.where(filled, routing.row_source[:n].reshape(L, P), -1)
        live = jnp.arange(n) < jnp.sum(routing.expert_num_tokens)
        return jnp.where(live, routing.row_source[:n], -1)

    def dropped_rows_total(self) -> int:
        """Rows this rank dropped past its capacity (packed or per expert) since creation or
        recover(), with overflow "drop" (a "fail" cycle drops nothing: it fails); waits for
        the device."""
        return int(self._mod.dropped_rows(self.handle)) if self._open else 0

    def barrier(self, dep):
        """On-stream barrier of every rank of this handle; returns a ticket ordered after dep."""
        return self._call("jmc_barrier", self._ticket(dep), dep, side_effect=True)

    # -- host side -------------------------------------------------------------------------
    def handler_calls(self) -> int:
        """How many times one of this handle's FFI handlers ran on this process. Calls that XLA
        replays from a command buffer (CUDA graph) run none."""
        return int(self._mod.handler_calls(self.handle))

    def check(self):
        """Waits for the device; raises this rank's recorded error, else a peer's abort. The
        record is kept until recover(): every later check() raises it again. On a closed
        handle: the error a launch replayed after close() recorded (no wait)."""
        raise_recorded(self._recorded(wait=True))

    def poll(self):
        """check() without waiting for the device: raises what this rank's kernels recorded so
        far (a peer's failure is recorded here too once one of our kernels has seen its abort
        word). Reads pinned host memory: cheap enough for every step of a server."""
        raise_recorded(self._recorded(wait=False))

    def _recorded(self, wait: bool) -> str:
        """The error to report ("" if none): a closed handle's stale launch, else this rank's
        record (after waiting for the device, with a peer's abort word as a fallback)."""
        if not self._open:
            return self._mod.closed_handle_error(self.handle)
        if wait:
            return self._mod.check_handle(self.handle)
        return self._mod.handle_error(self.handle)

    def recover(self) -> int:
        """Collective: waits for this rank's kernels (and, staged, its network puts), agrees
        with every rank on the cycles all of them completed with no error since creation
        (jax_moe_comm.recovery), then on every rank clears the handle's flags, launch counts and
        error record, so the same handle (same buffers, so the same compiled steps) runs again.
        Returns the agreed count; RecoveryError (on every rank alike, nothing reset) when the
        ranks are more than one cycle apart."""
        mine = self._mod.quiesce_handle(self.handle)
        agreed = recovery.agree("recover", mine)
        self._mod.recover_handle(self.handle, agreed)
        return agreed

    def launch_shape(self) -> list[tuple[int, int]]:
        """(blocks, warps per block) of dispatch_send, dispatch_recv, combine_send, combine_recv,
        then of the fused dispatch and combine."""
        return [tuple(x) for x in self._mod.launch_shape(self.handle)]

    def dependent_launch(self) -> bool:
        """Whether the kernels start as programmatic dependent launches (Hopper+, JMC_PDL)."""
        return bool(self._mod.dependent_launch(self.handle))

    def protocol_options(self) -> dict:
        """What the handle took from JMC_ACKS at creation: {"relaxed_acks": load/store peers
        acknowledged without a fence (the default; JMC_ACKS=release turns it off)}."""
        return {"relaxed_acks": bool(self._mod.relaxed_acks(self.handle))}

    def close(self):
        if self._open:
            self._mod.destroy_handle(self.handle)
            self._open = False

    @property
    def symmetric_bytes(self) -> int:
        return int(self._mod.symmetric_bytes(self.handle))


__all__ = ["NvshmemBackend", "ProtocolError"]
