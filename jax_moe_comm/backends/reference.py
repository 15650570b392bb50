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
the two differ only when the members of a DP group pass different weights, and autodiff of
this backend then gives each member the weight gradient of its own output (autodiff.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..config import MoEConfig
from ..errors import InvalidRoutingError, ProtocolError
from ..routing import destination, row_key, sent_slots, valid_slots
from . import host_check as hc


class PendingDispatch(NamedTuple):
    recv_x: jax.Array  # [EP(src), max_m, H]
    recv_scale: jax.Array | None  # [EP(src), max_m, S]
    recv_ids: jax.Array  # [EP(src), max_m, k] local expert id or -1
    recv_w: jax.Array | None = None  # [EP(src), max_m, k] router weight of the slot


class Routing(NamedTuple):
    recv_ids: jax.Array  # [EP(src), max_m, k] local expert of each received slot, -1 if none
    recv_pos: jax.Array  # [EP(src), max_m, k] row of that slot in expert_x


class PendingCombine(NamedTuple):
    expert_y: jax.Array  # [L, max_recv, H]
    routing: Routing
    ticket: jax.Array | None = None  # int32 zero from combine_send's protocol visit


class ReferenceBackend:
    name = "reference"

    def __init__(self, cfg: MoEConfig, axis_name, check_routing: bool = True,
                 check_protocol: bool = True):
        self.cfg = cfg
        self.axis_name = axis_name
        self.check_routing = check_routing
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
        """Raise a recorded protocol error (kept: the handle stays unusable, as a CUDA handle
        that refused a launch), else the first bad routing recorded since the last check(),
        then forget those."""
        jax.effects_barrier()
        if self.protocol is not None and self.protocol.error:
            raise ProtocolError(self.protocol.error)
        errors, self._errors = self._errors, []
        if errors:
            raise InvalidRoutingError(errors[0])

    checks_after_close = True  # check() still reports a compiled step run after close()

    def recover(self):
        """As the CUDA handle's recover(): the protocol counts and every recorded error are
        cleared, and the same compiled steps run on."""
        jax.effects_barrier()
        if self.protocol is not None:
            self.protocol.reset()
        self._errors = []

    # -- helpers ---------------------------------------------------------------------------
    def _a2a(self, x):
        return jax.lax.all_to_all(x, self.axis_name, 0, 0, tiled=False)

    def _to_ranks(self, indices, slots):
        """[EP, max_m, k] mask: slot (t, j) is in `slots` and its expert is on rank r."""
        ranks = jnp.arange(self.cfg.world_size)[:, None, None]
        return slots[None] & (destination(self.cfg, indices)[None] == ranks)

    def _outgoing_slots(self, indices, num_tokens):
        """[EP, max_m, k] mask: this rank sends slot (t, j) to rank r (DP groups split it)."""
        rank = jax.lax.axis_index(self.axis_name)
        return self._to_ranks(indices, sent_slots(self.cfg, indices, num_tokens, rank))

    def _from_senders(self, table):
        """table [EP(src), ...] as received by an expert rank -> [EP(dest), ...]: for each
        destination rank, the entry of the member of its DP group that sent to this rank."""
        cfg = self.cfg
        rank = jax.lax.axis_index(self.axis_name)
        dest = jnp.arange(cfg.world_size)
        return table[(dest // cfg.dp_size) * cfg.dp_size + rank % cfg.dp_size]

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
        cfg = self.cfg
        L, R = cfg.num_local_experts, cfg.max_recv_tokens
        recv_ids = pending.recv_ids + self._tick(hc.DISPATCH_RECV, pending.recv_ids)
        pending = pending._replace(recv_ids=recv_ids)
        ids = pending.recv_ids.reshape(-1)  # flat (src, t, j)
        onehot = ids[:, None] == jnp.arange(L)[None, :]
        running = jnp.cumsum(onehot.astype(jnp.int32), axis=0)
        pos = jnp.take_along_axis(running, jnp.clip(ids, 0)[:, None], axis=1)[:, 0] - 1
        expert_num_tokens = running[-1].astype(jnp.int32)
        row_of_slot = jnp.arange(ids.shape[0]) // cfg.experts_per_token
        target = jnp.where(ids >= 0, ids, L)  # L is out of range: dropped

        def scatter(rows, fill_shape, dtype):
            out = jnp.zeros((L, R) + fill_shape, dtype)
            flat = rows.reshape((-1,) + fill_shape)
            return out.at[target, pos].set(flat[row_of_slot], mode="drop")

        expert_x = scatter(pending.recv_x, (cfg.hidden,), pending.recv_x.dtype)
        expert_x_scale = None
        if pending.recv_scale is not None:
            expert_x_scale = scatter(pending.recv_scale, (cfg.num_scales,), jnp.float32)
        expert_weights = None
        if pending.recv_w is not None:  # one weight per slot, not per token row
            expert_weights = jnp.zeros((L, R), jnp.float32).at[target, pos].set(
                pending.recv_w.reshape(-1), mode="drop")
        routing = Routing(pending.recv_ids, pos.reshape(pending.recv_ids.shape))
        return expert_x, expert_x_scale, expert_num_tokens, routing, expert_weights

    def row_keys(self, routing: Routing):
        """[L, R] int32: routing.row_key(source group, token, slot) of each row, -1 past the
        counts."""
        cfg = self.cfg
        ids, pos = routing
        src = jnp.arange(cfg.world_size)[:, None, None]
        token = jnp.arange(cfg.max_num_tokens)[None, :, None]
        slot = jnp.arange(cfg.experts_per_token)[None, None, :]
        keys = jnp.broadcast_to(row_key(cfg, src // cfg.dp_size, token, slot), ids.shape)
        target = jnp.where(ids >= 0, ids, cfg.num_local_experts)  # out of range: dropped
        out = jnp.full((cfg.num_local_experts, cfg.max_recv_tokens), -1, jnp.int32)
        return out.at[target, pos].set(keys.astype(jnp.int32), mode="drop")

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
        # What this rank holds for each destination's tokens: the rows its DP group's
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
            rows = expert_y[jnp.clip(e, 0), jnp.clip(p, 0)].astype(jnp.float32)
            return acc + jnp.where((e >= 0)[..., None], w[..., None] * rows, 0.0)

        shape = (cfg.world_size, cfg.max_num_tokens, cfg.hidden)
        zeros = jnp.zeros_like(recv_w, jnp.float32, shape=shape)  # varying like the data
        partial = jax.lax.fori_loop(0, cfg.experts_per_token, add_slot, zeros)
        y = jnp.sum(self._a2a(partial), axis=0)
        return jnp.where(live, y, 0.0).astype(jnp.bfloat16)

    def _combine_slot_rows(self, expert_y, ids, pos, indices, weights, num_tokens, live):
        """combine_recv(slot_rows=True): the rows themselves travel home ([max_m, k, H] per
        destination, each slot filled by the one rank that holds its expert)."""
        rows = expert_y[jnp.clip(ids, 0), jnp.clip(pos, 0)]  # [EP(dest), m, k, H]
        rows = jnp.where((ids >= 0)[..., None], rows, jnp.zeros((), rows.dtype))
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
