"""Reference backend: the same ops as the CUDA kernels, in pure JAX.

Dispatch sends every rank's whole padded token block to every rank with one
`jax.lax.all_to_all` (the "standard all-to-all" baseline), together with a [EP, max_m, k]
table of local expert ids (-1 where the slot is not for that rank) and, when given, the
router weights. The receiver scatters rows into `expert_x`. Combine gathers each expert row
on the expert's rank, weights it with the *receiving* rank's weights (every rank's weights
travel to the expert ranks), sums a token's local experts in f32, and sends one f32 partial
row per token back, where the home rank sums over expert ranks; with slot_rows=True it sends
the rows themselves and weights them at home. Rows of one expert come out ordered by
(source group, token, slot).

Weighting with the receiver's weights is what the CUDA combine does (it weights at home);
the two differ only when the members of a token group pass different weights, and autodiff of
this backend then gives each member the weight gradient of its own output (autodiff.py).

layout="packed" scatters the rows straight to their packed position (expert 0's rows, then
expert 1's, ...) in [recv_rows, H]; a slot whose position is >= recv_rows (the capacity) is
not written, and combine treats it as an expert output of zero. layout="padded" with an
expert_capacity P below max_recv_tokens does the same per expert: expert_x is [L, P, H] and
an expert's rows past its first P (in the order above) are not written. How many were dropped
is counted on the host by a visit (host_check.tick), which jax.checkpoint runs once.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..config import MoEConfig
from ..errors import CapacityExceededError, InvalidRoutingError, ProtocolError
from ..routing import destination, row_key, sent_slots, valid_slots
from . import host_check as hc


class PendingDispatch(NamedTuple):
    recv_x: jax.Array  # [EP(src), max_m, H]
    recv_scale: jax.Array | None  # [EP(src), max_m, S]
    recv_ids: jax.Array  # [EP(src), max_m, k] local expert id or -1
    recv_w: jax.Array | None = None  # [EP(src), max_m, k] router weight of the slot


class Routing(NamedTuple):
    recv_ids: jax.Array  # [EP(src), max_m, k] local expert of each received slot, -1 if none
    # [EP(src), max_m, k] row of that slot in expert_x: within its expert (padded; >=
    # expert_capacity: dropped, not held), or in the packed rows (packed; >= recv_rows: dropped)
    recv_pos: jax.Array


class PendingCombine(NamedTuple):
    expert_y: jax.Array  # [L, expert_capacity, H] (padded) or [recv_rows, H] (packed)
    routing: Routing
    ticket: jax.Array | None = None  # int32 zero from combine_send's protocol visit


def capacity_message(rank: int, dropped: int, capacity: int) -> str:
    """The CapacityExceeded record of a packed rank that received capacity + dropped rows."""
    return (f"CapacityExceeded: rank {rank} in dispatch_recv: {capacity + dropped} rows arrived "
            f"for a packed capacity of {capacity} rows (max_recv_rows); the {dropped} rows past "
            "it were not written and add nothing to y. Raise max_recv_rows (or the capacity "
            "factor of MoEConfig.recv_rows_for), or pass overflow='drop' to drop them without "
            "an error (AllToAll.dropped_rows() counts them)")


def expert_capacity_message(rank: int, dropped: int, capacity: int) -> str:
    """The CapacityExceeded record of a padded rank whose experts received `dropped` rows past
    their expert_capacity, summed over its local experts (the nvshmem record's wording)."""
    return (f"CapacityExceeded: rank {rank} in dispatch_recv: {dropped} expert rows arrived "
            f"past expert_capacity={capacity} (per local expert) this cycle; they were not "
            "written and add nothing to y. Raise expert_capacity (or the capacity factor of "
            "MoEConfig.rows_per_expert_for), or pass overflow='drop' to drop them without an "
            "error (AllToAll.dropped_rows() counts them)")


class Overflow:
    """Host record of a capacity below the worst case (packed rows per rank, or padded rows per
    local expert): rows dropped since creation or recover(), and with overflow="fail" the
    first overflow, kept until recover() (as the CUDA handle's error record). Visited once per
    dispatch_recv and device (host_check)."""

    def __init__(self, capacity: int, fail: bool, message=capacity_message):
        self.capacity, self.fail, self.message = capacity, fail, message
        self._lock = threading.Lock()
        self.dropped_total = 0
        self.error = ""

    def visit(self, op: int, rank: int, device: int, dropped) -> None:
        n = int(np.asarray(dropped).reshape(-1)[0])
        if n <= 0:
            return
        with self._lock:
            if not self.fail:  # a "fail" cycle failed: reported by check(), not counted
                self.dropped_total += n  # (the CUDA handle counts drops only with "drop")
            elif not self.error:
                self.error = self.message(rank, n, self.capacity)

    def reset(self) -> None:
        with self._lock:
            self.dropped_total, self.error = 0, ""


class ReferenceBackend:
    name = "reference"

    def __init__(self, cfg: MoEConfig, axis_name, check_routing: bool = True,
                 check_protocol: bool = True, *, layout: str = "padded",
                 recv_rows: int | None = None, expert_capacity: int | None = None,
                 overflow: str = "fail"):
        self.cfg = cfg
        self.axis_name = axis_name
        self.check_routing = check_routing
        self.packed = layout == "packed"
        # Packed rows per rank (None: padded); None for packed means the worst case.
        self.recv_rows = (recv_rows or cfg.max_recv_total) if self.packed else None
        # Padded rows per local expert (None: packed); None for padded means the worst case.
        self.expert_capacity = None if self.packed else (expert_capacity or cfg.max_recv_tokens)
        # Only a capacity below the worst case can drop rows: only then is there a record.
        fail = overflow == "fail"
        if self.packed and self.recv_rows < cfg.max_recv_total:
            self._overflow = Overflow(self.recv_rows, fail)
        elif not self.packed and self.expert_capacity < cfg.max_recv_tokens:
            self._overflow = Overflow(self.expert_capacity, fail, expert_capacity_message)
        else:
            self._overflow = None
        # Bad routing seen at run time, recorded by a host callback (raising inside one would
        # abort XLA:CPU); check() raises the first, like the CUDA path's error record.
        self._errors: list[str] = []
        # The order of each half's send and recv, counted per rank as the kernels count it
        # (host_check.py); an op out of order is recorded and check() raises ProtocolError.
        self.protocol = hc.ProtocolState() if check_protocol else None

    def _tick(self, op: int, *deps):
        """int32 zero from the host visit of `op` (after deps); the op adds it to a value its
        results depend on, so what follows the op runs after the visit."""
        if self.protocol is None:
            return jnp.zeros((), jnp.int32)
        return hc.tick(self.protocol, op, self.axis_name, *deps)

    def _record(self, bad_token, bad_index, num_tokens):
        cfg = self.cfg
        if bad_token >= 0:
            self._errors.append(
                f"in dispatch_send: token {int(bad_token)} has expert index {int(bad_index)} "
                f"outside [-1, num_experts={cfg.num_experts}); that slot was skipped. Use -1 "
                "for a slot that routes nowhere (rows >= num_tokens are not checked)")
        if not 0 <= num_tokens <= cfg.max_num_tokens:
            self._errors.append(
                f"in dispatch_send: num_tokens={int(num_tokens)} outside [0, max_num_tokens="
                f"{cfg.max_num_tokens}] (rows per rank); it was clamped")

    def check(self):
        """Raise a recorded protocol error or capacity overflow (both kept until recover(), as
        a CUDA handle's error record), else the first bad routing recorded since the last
        check(), then forget those."""
        jax.effects_barrier()
        if self.protocol is not None and self.protocol.error:
            raise ProtocolError(self.protocol.error)
        if self._overflow is not None and self._overflow.error:
            raise CapacityExceededError(self._overflow.error)
        errors, self._errors = self._errors, []
        if errors:
            raise InvalidRoutingError(errors[0])

    checks_after_close = True  # check() still reports a compiled step run after close()

    def recover(self):
        """As the CUDA handle's recover(): the protocol counts, the dropped-row count and every
        recorded error are cleared, and the same compiled steps run on."""
        jax.effects_barrier()
        if self.protocol is not None:
            self.protocol.reset()
        if self._overflow is not None:
            self._overflow.reset()
        self._errors = []

    def dropped_rows_total(self) -> int:
        """Rows that the capacity (packed or per expert) dropped on this process's devices
        since creation or recover() (of the dispatches that have run: read it after their
        results)."""
        jax.effects_barrier()
        return 0 if self._overflow is None else self._overflow.dropped_total

    # -- helpers ---------------------------------------------------------------------------
    def _a2a(self, x):
        return jax.lax.all_to_all(x, self.axis_name, 0, 0, tiled=False)

    def _to_ranks(self, indices, slots):
        """[EP, max_m, k] mask: slot (t, j) is in `slots` and its expert is on rank r."""
        ranks = jnp.arange(self.cfg.world_size)[:, None, None]
        return slots[None] & (destination(self.cfg, indices)[None] == ranks)

    def _outgoing_slots(self, indices, num_tokens):
        """[EP, max_m, k] mask: this rank sends slot (t, j) to rank r (token groups split it)."""
        rank = jax.lax.axis_index(self.axis_name)
        return self._to_ranks(indices, sent_slots(self.cfg, indices, num_tokens, rank))

    def _from_senders(self, table):
        """table [EP(src), ...] as received by an expert rank -> [EP(dest), ...]: for each
        destination rank, the entry of the member of its token group that sent to this rank."""
        cfg, r = self.cfg, self.cfg.token_replicas
        rank = jax.lax.axis_index(self.axis_name)
        dest = jnp.arange(cfg.world_size)
        return table[(dest // r) * r + rank % r]

    def _runtime_checks(self, indices, num_tokens):
        if not self.check_routing:
            return
        # Rows >= num_tokens are padding: whatever they hold is ignored, as on the CUDA path.
        live = jnp.arange(self.cfg.max_num_tokens)[:, None] < num_tokens
        bad = live & ((indices < -1) | (indices >= self.cfg.num_experts))
        flat = jnp.argmax(bad.reshape(-1))
        bad_token = jnp.where(jnp.any(bad), flat // self.cfg.experts_per_token, -1)
        jax.debug.callback(self._record, bad_token, indices.reshape(-1)[flat], num_tokens)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_send(self, x, x_scale, indices, num_tokens, weights=None) -> PendingDispatch:
        cfg = self.cfg
        self._runtime_checks(indices, num_tokens)
        # Everything this send computes depends on num_tokens, so on the visit; the visit
        # comes after x and indices (after the previous layer).
        num_tokens = num_tokens + self._tick(hc.DISPATCH_SEND, x, indices, num_tokens)
        num_tokens = jnp.clip(num_tokens, 0, cfg.max_num_tokens)
        to_rank = self._outgoing_slots(indices, num_tokens)
        local_ids = jnp.where(to_rank, (indices % cfg.num_local_experts)[None], -1)
        everyone = (cfg.world_size,) + x.shape
        recv_x = self._a2a(jnp.broadcast_to(x[None], everyone))
        recv_scale = None
        if x_scale is not None:
            scale_everyone = (cfg.world_size,) + x_scale.shape
            recv_scale = self._a2a(jnp.broadcast_to(x_scale[None], scale_everyone))
        recv_w = None
        if weights is not None:
            recv_w = self._a2a(jnp.where(to_rank, weights[None], 0.0))
        return PendingDispatch(recv_x, recv_scale, self._a2a(local_ids.astype(jnp.int32)),
                               recv_w)

    def dispatch_recv(self, pending: PendingDispatch):
        """(expert_x, expert_x_scale | None, expert_num_tokens [L], routing, expert_weights |
        None, dropped (1,) int32) in this handle's layout; rows past the counts are zero."""
        cfg = self.cfg
        L = cfg.num_local_experts
        recv_ids = pending.recv_ids + self._tick(hc.DISPATCH_RECV, pending.recv_ids)
        pending = pending._replace(recv_ids=recv_ids)
        ids = pending.recv_ids.reshape(-1)  # flat (src, t, j)
        onehot = ids[:, None] == jnp.arange(L)[None, :]
        running = jnp.cumsum(onehot.astype(jnp.int32), axis=0)
        pos = jnp.take_along_axis(running, jnp.clip(ids, 0)[:, None], axis=1)[:, 0] - 1
        counts = running[-1].astype(jnp.int32)  # rows arrived per local expert
        if self.packed:
            pos, counts, dropped = self._pack(ids, pos, counts)
        else:  # an expert's rows past its first expert_capacity are not held
            kept = jnp.minimum(counts, self.expert_capacity)
            dropped = self._count_dropped(jnp.sum(counts) - jnp.sum(kept))
            counts = kept
        row_of_slot = jnp.arange(ids.shape[0]) // cfg.experts_per_token
        where = self._row_index(ids, pos)  # out of range where not held: not written

        def scatter(rows, fill_shape, dtype):
            out = jnp.zeros(self._rows_shape + fill_shape, dtype)
            flat = rows.reshape((-1,) + fill_shape)
            return out.at[where].set(flat[row_of_slot], mode="drop")

        expert_x = scatter(pending.recv_x, (cfg.hidden,), pending.recv_x.dtype)
        expert_x_scale = None
        if pending.recv_scale is not None:
            expert_x_scale = scatter(pending.recv_scale, (cfg.num_scales,), jnp.float32)
        expert_weights = None
        if pending.recv_w is not None:  # one weight per slot, not per token row
            expert_weights = jnp.zeros(self._rows_shape, jnp.float32).at[where].set(
                pending.recv_w.reshape(-1), mode="drop")
        routing = Routing(pending.recv_ids, pos.reshape(pending.recv_ids.shape))
        return expert_x, expert_x_scale, counts, routing, expert_weights, dropped

    @property
    def _rows_shape(self) -> tuple:
        """expert_x's row dimensions: [L, expert_capacity] padded, [recv_rows] packed."""
        if self.packed:
            return (self.recv_rows,)
        return (self.cfg.num_local_experts, self.expert_capacity)

    def _count_dropped(self, dropped):
        """dropped as int32 (1,), recorded on the host (when the capacity can drop rows)."""
        dropped = dropped.astype(jnp.int32).reshape(1)
        if self._overflow is not None:
            dropped = dropped + hc.tick(self._overflow, hc.DISPATCH_RECV, self.axis_name,
                                        dropped)
        return dropped

    def _pack(self, ids, pos, counts):
        """Packed positions of the slots (expert order, then arrival order within an expert),
        the rows kept per expert, and how many did not fit (int32 (1,)); records the
        overflow on the host."""
        starts = jnp.cumsum(counts) - counts
        packed_pos = starts[jnp.clip(ids, 0)] + pos
        kept = jnp.clip(self.recv_rows - starts, 0, counts).astype(jnp.int32)
        return packed_pos, kept, self._count_dropped(jnp.sum(counts) - jnp.sum(kept))

    def _held(self, ids, pos):
        """Mask of the slots (ids, pos tables) whose row this rank holds: routed here and not
        dropped (packed position < recv_rows, or row within its expert < expert_capacity)."""
        return (ids >= 0) & (pos < (self.recv_rows if self.packed else self.expert_capacity))

    def _row_index(self, ids, pos):
        """Index of each slot's row into expert_x's row dimensions; out of range where this
        rank holds none (a scatter drops it, a gather fills zero)."""
        held = self._held(ids, pos)
        if self.packed:
            return (jnp.where(held, pos, self.recv_rows),)
        return (jnp.where(held, ids, self.cfg.num_local_experts), pos)

    def _held_rows(self, expert_y, ids, pos):
        """(the expert_y row of each slot, zero where none is held; the held mask)."""
        rows = expert_y.at[self._row_index(ids, pos)].get(mode="fill", fill_value=0)
        return rows, self._held(ids, pos)

    def row_keys(self, routing: Routing, dropped: bool = False):
        """routing.row_key(source group, token, slot) of each row, -1 where none: [L,
        expert_capacity] (padded) or [recv_rows] (packed).

        dropped=True: the keys of the rows that arrived but did not fit this cycle, -1 past
        their number: [max_recv_total - recv_rows] (packed: in packed order past the
        capacity); padded: [max_recv_total] when expert_capacity < max_recv_tokens (expert 0's
        dropped rows, then expert 1's, ...), else [0] (nothing can drop)."""
        cfg = self.cfg
        if dropped and not self.packed and self.expert_capacity >= cfg.max_recv_tokens:
            return jnp.full((0,), -1, jnp.int32)
        ids, pos = routing
        src = jnp.arange(cfg.world_size)[:, None, None]
        token = jnp.arange(cfg.max_num_tokens)[None, :, None]
        slot = jnp.arange(cfg.experts_per_token)[None, None, :]
        keys = jnp.broadcast_to(row_key(cfg, src // cfg.token_replicas, token, slot), ids.shape)
        keys = keys.astype(jnp.int32)
        if not dropped:
            out = jnp.full(self._rows_shape, -1, jnp.int32)
            return out.at[self._row_index(ids, pos)].set(keys, mode="drop")
        if self.packed:
            spill = cfg.max_recv_total - self.recv_rows  # rows that can be dropped
            where = jnp.where((ids >= 0) & (pos >= self.recv_rows), pos - self.recv_rows,
                              spill)
        else:  # per expert, the rows past its capacity; expert after expert
            P, spill = self.expert_capacity, cfg.max_recv_total
            e = jnp.clip(ids, 0)
            arrived = jnp.zeros((cfg.num_local_experts,), jnp.int32).at[e].add(
                (ids >= 0).astype(jnp.int32))
            over = jnp.maximum(arrived - P, 0)
            start = jnp.cumsum(over) - over
            where = jnp.where((ids >= 0) & (pos >= P), start[e] + pos - P, spill)
        return jnp.full((spill,), -1, jnp.int32).at[where].set(keys, mode="drop")

    # -- combine ---------------------------------------------------------------------------
    def combine_send(self, expert_y, routing: Routing) -> PendingCombine:
        # Weights arrive with combine_recv, and the reference weights rows on the expert's
        # rank, so the whole exchange happens there; the split is only functional here.
        return PendingCombine(expert_y, routing, self._tick(hc.COMBINE_SEND, expert_y))

    def combine_recv(self, pending: PendingCombine, indices, weights, num_tokens,
                     slot_rows=False):
        cfg = self.cfg
        num_tokens = jnp.clip(num_tokens, 0, cfg.max_num_tokens)
        expert_y, (ids, pos), ticket = pending
        ids = ids + self._tick(hc.COMBINE_RECV, ticket, expert_y, indices)
        # What this rank holds for each destination's tokens: the rows its token group's
        # sender sent here ([EP(dest), max_m, k] local expert and row, -1 if none).
        ids, pos = self._from_senders(ids), self._from_senders(pos)
        live = jnp.arange(cfg.max_num_tokens)[:, None] < num_tokens
        if slot_rows:
            return self._combine_slot_rows(expert_y, ids, pos, indices, weights, num_tokens,
                                           live)
        # Every destination's own weights of its slots on this rank.
        to_rank = self._to_ranks(indices, valid_slots(cfg, indices, num_tokens))
        recv_w = self._a2a(jnp.where(to_rank, weights[None], 0.0))  # [EP(dest), m, k]

        def add_slot(j, acc):
            e = jax.lax.dynamic_index_in_dim(ids, j, axis=2, keepdims=False)
            p = jax.lax.dynamic_index_in_dim(pos, j, axis=2, keepdims=False)
            w = jax.lax.dynamic_index_in_dim(recv_w, j, axis=2, keepdims=False)
            rows, held = self._held_rows(expert_y, e, p)
            return acc + jnp.where(held[..., None], w[..., None] * rows.astype(jnp.float32),
                                   0.0)

        shape = (cfg.world_size, cfg.max_num_tokens, cfg.hidden)
        zeros = jnp.zeros_like(recv_w, jnp.float32, shape=shape)  # varying like the data
        partial = jax.lax.fori_loop(0, cfg.experts_per_token, add_slot, zeros)
        y = jnp.sum(self._a2a(partial), axis=0)
        return jnp.where(live, y, 0.0).astype(jnp.bfloat16)

    def _combine_slot_rows(self, expert_y, ids, pos, indices, weights, num_tokens, live):
        """combine_recv(slot_rows=True): the rows themselves travel home ([max_m, k, H] per
        destination, each slot filled by the one rank that holds its expert)."""
        rows, _ = self._held_rows(expert_y, ids, pos)  # [EP(dest), m, k, H], zero if none
        got = jnp.sum(self._a2a(rows), axis=0, dtype=rows.dtype)  # one nonzero term per slot
        got = jnp.where(valid_slots(self.cfg, indices, num_tokens)[..., None], got,
                        jnp.zeros((), got.dtype))
        y = jnp.sum(weights[..., None] * got.astype(jnp.float32), axis=1)
        return jnp.where(live, y, 0.0).astype(jnp.bfloat16), got

    def close(self):
        if self.protocol is not None:
            self.protocol.closed = True  # a compiled step run later is recorded, not run past

    @property
    def symmetric_bytes(self) -> int:
        return 0
