"""Oracle and harness shared by the test suite, the GPU worker and the benchmarks.

Every rank builds every rank's inputs from one seed and checks its own outputs locally:
dispatch as a multiset of rows per expert plus exact counts, combine end to end against a
float64 numpy computation of y[t] = sum_j w[t,j] * f_e(x[t]) with f_e(x) = c_e * x.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .api import AllToAll
from .config import SCALE_BLOCK, MoEConfig

ROUTINGS = ("random", "skewed", "duplicates", "empty_ranks", "bad_index")


@dataclasses.dataclass(frozen=True)
class Inputs:
    x: np.ndarray  # [EP, max_m, H] dispatch dtype
    x_scale: np.ndarray | None  # [EP, max_m, S] f32
    indices: np.ndarray  # [EP, max_m, k] int32
    weights: np.ndarray  # [EP, max_m, k] f32
    num_tokens: np.ndarray  # [EP] int32


def expert_factor(cfg: MoEConfig) -> np.ndarray:
    """c_e of the test expert function f_e(x) = c_e * x: distinct per expert, exact in bf16."""
    return 1.0 + (np.arange(cfg.num_experts) % 7) / 8.0


def make_inputs(cfg: MoEConfig, seed: int, routing: str = "random",
                ragged: bool = True) -> Inputs:
    """Inputs of every rank. Ranks of one token group hold the same tokens."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}; expected one of {ROUTINGS}")
    rng = np.random.default_rng(seed)
    G, dp, m, k, H, E = (cfg.num_token_groups, cfg.token_replicas, cfg.max_num_tokens,
                         cfg.experts_per_token, cfg.hidden, cfg.num_experts)
    x = rng.standard_normal((G, m, H)).astype(np.float32)
    x_scale = None
    if cfg.is_fp8:
        x_scale = rng.uniform(0.5, 2.0, (G, m, cfg.num_scales)).astype(np.float32)
        x = x.astype(jnp.float8_e4m3fn)
    else:
        x = x.astype(jnp.bfloat16)
    # k distinct experts per token, then -1 holes.
    indices = np.argsort(rng.random((G, m, E)), axis=-1)[..., :k].astype(np.int32)
    if routing == "skewed":  # every token to expert 0 (plus others to keep k distinct)
        indices[..., 0] = 0
        indices[..., 1:] = (np.arange(1, k) + rng.integers(0, 1, (G, m, 1))) % E
    if routing == "duplicates" and k >= 2:
        indices[..., 1] = indices[..., 0]
    holes = rng.random((G, m, k)) < 0.15
    indices = np.where(holes, -1, indices).astype(np.int32)
    if routing == "bad_index":
        indices[0, 0, 0] = E + 3
    weights = rng.uniform(0.1, 1.0, (G, m, k)).astype(np.float32)
    if ragged:
        num_tokens = rng.integers(0, m + 1, G).astype(np.int32)
        num_tokens[rng.integers(0, G)] = m  # one full group
        if G > 1:
            num_tokens[rng.integers(0, G)] = 0  # and one empty group
    else:
        num_tokens = np.full(G, m, np.int32)
    if routing == "empty_ranks":
        num_tokens[::2] = 0
    if routing == "bad_index":
        num_tokens[0] = m  # the bad token is live
    rep = lambda a: None if a is None else np.repeat(a, dp, axis=0)  # noqa: E731
    return Inputs(rep(x), rep(x_scale), rep(indices), rep(weights), rep(num_tokens))


def dequantize(x: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    xf = np.asarray(x).astype(np.float64)
    if scale is not None:
        xf = xf * np.repeat(np.asarray(scale, np.float64), SCALE_BLOCK, axis=-1)
    return xf


def expected_rows(cfg: MoEConfig, inp: Inputs, rank: int) -> dict[int, collections.Counter]:
    """Per local expert of `rank`: the multiset of (group, token) it must receive."""
    L, dp = cfg.num_local_experts, cfg.token_replicas
    want = {e: collections.Counter() for e in range(L)}
    for g in range(cfg.num_token_groups):
        src = g * dp  # any member: the group holds the same tokens
        for t in range(inp.num_tokens[src]):
            seen = set()
            for e in inp.indices[src, t]:
                if 0 <= e < cfg.num_experts and e not in seen:
                    seen.add(int(e))
                    if e // L == rank:
                        want[int(e) - rank * L][(g, t)] += 1
    return want


def check_dispatch(cfg: MoEConfig, inp: Inputs, rank: int, expert_x, expert_x_scale,
                   expert_num_tokens) -> None:
    """expert_x rows must be, per expert, exactly the expected multiset of token rows."""
    want = expected_rows(cfg, inp, rank)
    counts = np.asarray(expert_num_tokens)
    expected_counts = np.array([sum(want[e].values()) for e in range(cfg.num_local_experts)])
    np.testing.assert_array_equal(counts, expected_counts,
                                  err_msg=f"rank {rank}: expert_num_tokens")
    ex = np.asarray(expert_x)
    exs = None if expert_x_scale is None else np.asarray(expert_x_scale)
    key = lambda row, sc: row.tobytes() + (b"" if sc is None else sc.tobytes())  # noqa: E731
    for e in range(cfg.num_local_experts):
        expected = collections.Counter()
        for (g, t), n in want[e].items():
            src = g * cfg.token_replicas
            sc = None if inp.x_scale is None else inp.x_scale[src, t]
            expected[key(inp.x[src, t], sc)] += n
        got = collections.Counter(
            key(ex[e, i], None if exs is None else exs[e, i]) for i in range(counts[e]))
        if got != expected:
            missing = sum((expected - got).values())
            extra = sum((got - expected).values())
            raise AssertionError(f"rank {rank} expert {e}: {missing} expected rows missing, "
                                 f"{extra} unexpected rows (of {counts[e]})")


def unpack(cfg: MoEConfig, expert_x, expert_num_tokens, zero_tail: bool = True):
    """Packed-layout rows [max_recv_rows, ...] -> padded [L, max_recv, ...] (numpy), after
    asserting that sum(group_sizes) rows fit and (zero_tail: the reference backend's
    promise) that the rows past them are zero."""
    ex, counts = np.asarray(expert_x), np.asarray(expert_num_tokens)
    assert ex.shape[0] <= cfg.max_recv_total, ex.shape
    ends = np.cumsum(counts)
    assert ends[-1] <= ex.shape[0], (counts, ex.shape)
    tail = ex[ends[-1]:]
    assert not zero_tail or not np.any(tail.astype(np.float32)), \
        "packed rows past sum(group_sizes) not zero"
    out = np.zeros((cfg.num_local_experts, cfg.max_recv_tokens) + ex.shape[1:], ex.dtype)
    for e, (end, n) in enumerate(zip(ends, counts)):
        out[e, :n] = ex[end - n:end]
    return out


def expert_outputs(cfg: MoEConfig, rank, expert_x, expert_x_scale, group_sizes=None):
    """The test experts, in JAX: expert_y = c_e * dequant(row) in combine dtype, for the rows
    of local expert e; packed rows when group_sizes is given."""
    xf = expert_x.astype(jnp.float32)
    if expert_x_scale is not None:
        xf = xf * jnp.repeat(expert_x_scale, SCALE_BLOCK, axis=-1)
    first = rank * cfg.num_local_experts
    c = jnp.asarray(expert_factor(cfg), jnp.float32)
    c = jax.lax.dynamic_slice_in_dim(c, first, cfg.num_local_experts)
    if group_sizes is None:
        return (c[:, None, None] * xf).astype(cfg.combine_dtype)
    c_row = jnp.repeat(c, group_sizes, total_repeat_length=expert_x.shape[0])
    return (c_row[:, None] * xf).astype(cfg.combine_dtype)


def combine_wrong(cfg: MoEConfig, y, x, ids, w, nt) -> jax.Array:
    """In JAX, for checks inside a jitted loop: int32 1 if one rank's y [m, H] differs from
    sum_j w[t, j] * bf16(c_e * x[t]) (the test experts, f32 sum, zero past nt) by more than
    2 % + 0.05 anywhere, else 0."""
    c = jnp.asarray(expert_factor(cfg), jnp.float32)[jnp.clip(ids, 0)]  # [m, k]
    rows = (c[:, :, None] * x.astype(jnp.float32)[:, None, :]).astype(cfg.combine_dtype)
    want = jnp.sum(jnp.where(ids[:, :, None] >= 0, w[:, :, None] * rows.astype(jnp.float32),
                             0.0), axis=1)
    want = jnp.where(jnp.arange(cfg.max_num_tokens)[:, None] < nt, want, 0.0)
    wrong = jnp.abs(y.astype(jnp.float32) - want) > 0.02 * jnp.abs(want) + 0.05
    return jnp.any(wrong).astype(jnp.int32)


def without_slots(cfg: MoEConfig, inp: Inputs, keys) -> Inputs:
    """inp with the slots of `keys` (routing.row_key(group, token, slot); -1 entries ignored)
    routed nowhere on every member of their token group, with the slots of the token that name
    the same expert (they were one row): the oracle's inputs for a dispatch whose capacity
    dropped those rows (backend.row_keys(routing, dropped=True))."""
    m, k, dp = cfg.max_num_tokens, cfg.experts_per_token, cfg.token_replicas
    indices = inp.indices.copy()
    for key in np.asarray(keys).reshape(-1):
        if key < 0:
            continue
        g, t, j = key // (m * k), key // k % m, key % k
        members = indices[g * dp:(g + 1) * dp, t]  # a view: edits land in `indices`
        members[members == members[0, j]] = -1
    return dataclasses.replace(inp, indices=indices)


def capacity_counts(arrived: np.ndarray, capacity: int) -> np.ndarray:
    """Rows a packed capacity keeps per local expert when `arrived` [L] rows arrive: the
    packed positions < capacity in expert order (the highest experts' rows drop first)."""
    starts = np.cumsum(arrived) - arrived
    return np.clip(capacity - starts, 0, arrived)


def kept_counts(a2a: AllToAll, arrived: np.ndarray) -> np.ndarray:
    """Rows the handle's capacity keeps per local expert when `arrived` [L] rows arrive:
    capacity_counts (packed), or min(arrived, expert_capacity) (padded)."""
    if a2a.layout == "packed":
        return capacity_counts(arrived, a2a.max_recv_rows)
    return np.minimum(arrived, a2a.expert_capacity)


def expected_y(cfg: MoEConfig, inp: Inputs, rank: int) -> np.ndarray:
    xs = None if inp.x_scale is None else inp.x_scale[rank]
    return combined_oracle(cfg, inp, rank, dequantize(inp.x[rank], xs))


def combined_oracle(cfg: MoEConfig, inp: Inputs, rank: int, xf: np.ndarray) -> np.ndarray:
    """y [max_m, H] float64 of rank `rank` when the experts see xf [max_m, H]."""
    c = expert_factor(cfg)
    y = np.zeros((cfg.max_num_tokens, cfg.hidden))
    for t in range(inp.num_tokens[rank]):
        for j, e in enumerate(inp.indices[rank, t]):
            if 0 <= e < cfg.num_experts:
                row = (c[e] * xf[t]).astype(np.float32).astype(cfg.combine_dtype)
                y[t] += inp.weights[rank, t, j] * row.astype(np.float64)
    return y


def check_combine(cfg: MoEConfig, inp: Inputs, rank: int, y) -> float:
    """Asserts y against the float64 oracle; returns the max abs error."""
    ref = expected_y(cfg, inp, rank)
    got = np.asarray(y).astype(np.float64)
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * scale,
                               err_msg=f"rank {rank}: combine output y")
    return float(np.abs(got - ref).max())


# -- harness ---------------------------------------------------------------------------------
def make_mesh(world: int, axis: str = "ep"):
    devices = jax.devices()
    if len(devices) < world:
        raise ValueError(f"world_size={world} needs {world} devices, {len(devices)} present")
    return jax.sharding.Mesh(np.array(devices[:world]), (axis,))


def global_inputs(cfg: MoEConfig, mesh, inp: Inputs):
    """Inputs as global arrays sharded over the EP axis (rank r holds block r)."""
    axis = mesh.axis_names[0]
    sharding = NamedSharding(mesh, P(axis))

    def put(a):
        a = np.asarray(a)
        flat = a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]) if a.ndim > 1 else a
        return jax.make_array_from_callback(flat.shape, sharding, lambda idx: flat[idx])

    scale = None if inp.x_scale is None else put(inp.x_scale)
    return put(inp.x), scale, put(inp.indices), put(inp.weights), put(inp.num_tokens)


def can_drop(a2a: AllToAll) -> bool:
    """Whether the handle's capacity (packed max_recv_rows, padded expert_capacity) is below
    the worst case (rows can drop)."""
    return not a2a.drops_nothing


def dropped_keys_length(a2a: AllToAll) -> int:
    """Length of backend.row_keys(routing, dropped=True) per rank: max_recv_total -
    max_recv_rows (packed); max_recv_total (padded with expert_capacity below the worst
    case), else 0."""
    cfg = a2a.config
    if a2a.layout == "packed":
        return cfg.max_recv_total - a2a.max_recv_rows
    return 0 if a2a.drops_nothing else cfg.max_recv_total


def make_step(a2a: AllToAll, mesh, split: bool = False, dropped: bool = False):
    """jit(shard_map) of dispatch -> test experts -> combine; returns every output per rank:
    (expert_x, scales, counts, y), and with dropped=True (a handle that can_drop) also the
    keys of the dropped rows ([dropped_keys_length(a2a)] per rank) and their number ((1,) per
    rank)."""
    cfg = a2a.config
    axis = mesh.axis_names[0]
    spec = P(axis)

    def body(x, x_scale, indices, weights, num_tokens):
        nt = num_tokens.reshape(())
        if split:
            pending = a2a.dispatch_send(x, indices, nt, x_scale=x_scale)
            out = a2a.dispatch_recv(pending)
        else:
            out = a2a.dispatch(x, indices, nt, x_scale=x_scale)
        rank = jax.lax.axis_index(axis)
        packed = a2a.layout == "packed"
        expert_y = expert_outputs(cfg, rank, out.expert_x, out.expert_x_scale,
                                  out.group_sizes if packed else None)
        if split:
            y = a2a.combine_recv(a2a.combine_send(expert_y, out.routing), indices, weights, nt)
        else:
            y = a2a.combine(expert_y, out.routing, indices, weights, nt)
        scale = out.expert_x_scale
        if scale is None:
            scale = jnp.zeros(out.expert_x.shape[:-1] + (0,), jnp.float32)
        if dropped:
            keys = a2a.backend.row_keys(out.routing.backend, dropped=True)
            return out.expert_x, scale, out.expert_num_tokens, y, keys, out.dropped_rows
        return out.expert_x, scale, out.expert_num_tokens, y

    def step(x, x_scale, indices, weights, num_tokens):
        if x_scale is None:
            fn = lambda x, i, w, n: body(x, None, i, w, n)  # noqa: E731
            args = (x, indices, weights, num_tokens)
        else:
            fn, args = body, (x, x_scale, indices, weights, num_tokens)
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec for _ in args),
                               out_specs=(spec,) * (6 if dropped else 4))
        return mapped(*args)

    return jax.jit(step)


def local_blocks(arr, per_rank: int) -> dict[int, np.ndarray]:
    """Rank -> this process's block of a global array sharded in `per_rank` rows per rank."""
    blocks = {}
    for shard in arr.addressable_shards:
        start = shard.index[0].start or 0
        blocks[start // per_rank] = np.asarray(shard.data)
    return blocks


def run_and_check(a2a: AllToAll, mesh, inp: Inputs, split: bool = False, step=None) -> float:
    """One step on every rank; checks this process's ranks; returns the max combine error.

    On a handle whose capacity can drop rows, the step must be make_step(..., dropped=True):
    each rank must keep exactly kept_counts of the rows that arrive and report the rest by
    key; dispatch and combine are then checked against the inputs without the dropped slots
    (combine only when every rank is on this process: it needs every rank's keys)."""
    cfg = a2a.config
    drops = can_drop(a2a)
    step = step or make_step(a2a, mesh, split, dropped=drops)
    ex, exs, counts, y, *dropped = step(*global_inputs(cfg, mesh, inp))
    L, m = cfg.num_local_experts, cfg.max_num_tokens
    rows = a2a.max_recv_rows if a2a.layout == "packed" else L
    ex_b, exs_b, c_b, y_b = (local_blocks(ex, rows), local_blocks(exs, rows),
                             local_blocks(counts, L), local_blocks(y, m))
    expect = inp
    if drops:
        keys_b = local_blocks(dropped[0], dropped_keys_length(a2a))
        n_b = local_blocks(dropped[1], 1)
        for rank in sorted(keys_b):
            arrived = [sum(c.values()) for c in expected_rows(cfg, inp, rank).values()]
            kept = kept_counts(a2a, np.array(arrived))
            np.testing.assert_array_equal(c_b[rank], kept,
                                          err_msg=f"rank {rank}: rows kept per expert")
            n = int(n_b[rank][0])
            assert n == sum(arrived) - kept.sum() == int((keys_b[rank] >= 0).sum()), \
                (rank, n, sum(arrived), kept, keys_b[rank])
        expect = without_slots(cfg, inp, np.concatenate(list(keys_b.values())))
    worst = 0.0
    for rank in sorted(y_b):
        ex_r, scales = ex_b[rank], (exs_b[rank] if cfg.is_fp8 else None)
        if a2a.layout == "packed":  # the tail is undefined on nvshmem inference handles
            zero = a2a.backend_name == "reference" or a2a.differentiable
            ex_r = unpack(cfg, ex_r, c_b[rank], zero)
            scales = None if scales is None else unpack(cfg, scales, c_b[rank], zero)
        check_dispatch(cfg, expect, rank, ex_r, scales, c_b[rank])
        if not drops or len(y_b) == cfg.world_size:
            worst = max(worst, check_combine(cfg, expect, rank, y_b[rank]))
    return worst


# -- gradients -------------------------------------------------------------------------------
# loss = sum over ranks r of <G_r, y_r> for y = combine(f(dispatch(x))), f_e(x) = c_e * x:
# dy_r = G_r, and the gradients have closed forms (expected_grads).
def loss_cotangent(cfg: MoEConfig, seed: int) -> np.ndarray:
    """G [EP, max_m, H] f32: every rank's cotangent of y (different on replicas), bf16
    values (y is bf16, so its cotangent is rounded to bf16 before the rules see it)."""
    rng = np.random.default_rng(seed + 7)
    G = rng.standard_normal((cfg.world_size, cfg.max_num_tokens, cfg.hidden))
    return G.astype(jnp.bfloat16).astype(np.float32)


def differentiable_x(cfg: MoEConfig, inp: Inputs) -> np.ndarray:
    """bf16 x [EP, max_m, H] of the differentiable path (fp8 handles quantize it inside).
    For fp8 the dequantised test values are moved off their fp8 grid (a smooth function of
    the value, so replicas still hold the same x): requantizing grid values on a new
    scale makes many exact rounding ties."""
    x = dequantize(inp.x, inp.x_scale).astype(np.float32)
    if cfg.is_fp8:
        x = x + np.float32(0.03) * np.sin(np.float32(37) * x + np.float32(1.3))
    return x.astype(jnp.bfloat16)


@jax.jit
def _fp8_round_trip(v):
    from . import quant

    return quant.dequantize(*quant.quantize(v)).astype(jnp.bfloat16)


def dispatched_x(cfg: MoEConfig, x_bf16: np.ndarray) -> np.ndarray:
    """What the experts see of bf16 x: itself, or its fp8 round trip on an fp8 handle."""
    if not cfg.is_fp8:
        return np.asarray(x_bf16, np.float64)
    # One jitted function for every call (the oracle calls this per rank): a lambda jitted
    # here would be traced and compiled again at every call.
    deq = _fp8_round_trip(x_bf16.reshape(-1, cfg.hidden))
    return np.asarray(deq, np.float64).reshape(x_bf16.shape)


def expected_grads(cfg: MoEConfig, inp: Inputs, x_bf16: np.ndarray, G: np.ndarray,
                   rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(d x [max_m, H], d weights [max_m, k]) of rank `rank`, float64.

    A repeated expert is one row with the summed weight; d weights of each of its slots is the
    gradient of that sum. In a token group the expert row's cotangent sums every member's
    w * G, and d x of a slot lands on the member that sent it (dst % dp == rank % dp).
    """
    c = expert_factor(cfg)
    dp, L, k = cfg.token_replicas, cfg.num_local_experts, cfg.experts_per_token
    group = range((rank // dp) * dp, (rank // dp + 1) * dp)
    xd = dispatched_x(cfg, x_bf16[rank])
    dx = np.zeros((cfg.max_num_tokens, cfg.hidden))
    dw = np.zeros((cfg.max_num_tokens, k))
    for t in range(inp.num_tokens[rank]):
        idx = inp.indices[rank, t]
        for j, e in enumerate(idx):
            if not 0 <= e < cfg.num_experts:
                continue
            row = (c[e] * xd[t]).astype(np.float32).astype(cfg.combine_dtype)
            dw[t, j] = np.dot(G[rank, t].astype(np.float64), row.astype(np.float64))
            if list(idx).index(e) != j or (e // L) % dp != rank % dp:
                continue  # repeated slot (sent once), or sent by a replica
            same = idx == e
            ct = sum(inp.weights[d, t][same].sum() * G[d, t].astype(np.float64) for d in group)
            dx[t] += c[e] * ct
    return dx, dw


def differentiable_y(cfg: MoEConfig, inp: Inputs, x_bf16: np.ndarray, rank: int) -> np.ndarray:
    """y [max_m, H] of rank `rank` on the differentiable path (bf16 x, quantized inside)."""
    return combined_oracle(cfg, inp, rank, dispatched_x(cfg, x_bf16[rank]))


def make_grad_step(a2a: AllToAll, mesh, split: bool = False, plain: bool = False):
    """jit(shard_map) of (x bf16, indices, weights, num_tokens, G) -> (d x, d weights, y),
    the gradient of sum_r <G_r, y_r> taken inside shard_map (no psum: every rank seeds its own
    <G, y> and the backward all-to-alls bring the other ranks' parts).

    plain=True: plain-JAX autodiff of the reference backend's ops instead of the rules (the
    ground truth); on an fp8 handle, of a bf16 reference backend after quant.fake_quantize.
    Either in the handle's layout and capacity (a capacity drops the same rows on the
    reference backend whatever the dtype: the choice depends on the routing only).
    """
    cfg = a2a.config
    axis = mesh.axis_names[0]
    spec = P(axis)
    packed = a2a.layout == "packed"
    if plain:
        from . import quant, routing as rt
        from .backends.reference import ReferenceBackend

        bf16_cfg = dataclasses.replace(cfg, dispatch_dtype=jnp.bfloat16)
        ref = ReferenceBackend(bf16_cfg, axis, check_routing=False, layout=a2a.layout,
                               recv_rows=a2a.max_recv_rows, expert_capacity=a2a.expert_capacity,
                               overflow="drop")

    def layer(x, indices, weights, nt):
        rank = jax.lax.axis_index(axis)
        if plain:
            first, merged = rt.merge_repeats(indices, weights)
            xq = quant.fake_quantize(x) if cfg.is_fp8 else x
            ex, _, counts, routing, _, _ = ref.dispatch_recv(ref.dispatch_send(xq, None, first,
                                                                               nt))
            ey = expert_outputs(cfg, rank, ex, None, counts if packed else None)
            return ref.combine_recv(ref.combine_send(ey, routing), first, merged, nt)
        if split:
            out = a2a.dispatch_recv(a2a.dispatch_send(x, indices, nt))
        else:
            out = a2a.dispatch(x, indices, nt)
        ey = expert_outputs(cfg, rank, out.expert_x, out.expert_x_scale,
                            out.group_sizes if packed else None)
        if split:
            return a2a.combine_recv(a2a.combine_send(ey, out.routing), indices, weights, nt)
        return a2a.combine(ey, out.routing, indices, weights, nt)

    def body(x, indices, weights, num_tokens, G):
        nt = num_tokens.reshape(())

        def loss(x, weights):
            y = layer(x, indices, weights, nt)
            return jnp.sum(G * y.astype(jnp.float32)), y

        (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights)
        return dx, dw, y

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5,
                                 out_specs=(spec, spec, spec)))


def grad_inputs(cfg: MoEConfig, mesh, inp: Inputs, G: np.ndarray):
    """(x bf16, indices, weights, num_tokens, G) as global arrays for make_grad_step."""
    x = differentiable_x(cfg, inp)
    _, _, idx, w, nt = global_inputs(cfg, mesh, inp)
    put = lambda a: global_inputs(cfg, mesh, dataclasses.replace(  # noqa: E731
        inp, x=a))[0]
    return put(x), idx, w, nt, put(G)


def check_grads_against_oracle(a2a: AllToAll, mesh, inp: Inputs, G: np.ndarray, step=None,
                               split: bool = False, expect: Inputs | None = None) -> float:
    """Runs make_grad_step; asserts this process's ranks' gradients against expected_grads
    of `expect` (default inp; without_slots(inp, ...) when a capacity drops rows); returns
    the max abs error relative to the largest expected value."""
    cfg = a2a.config
    step = step or make_grad_step(a2a, mesh, split)
    dx, dw, y = step(*grad_inputs(cfg, mesh, inp, G))
    expect = inp if expect is None else expect
    m = cfg.max_num_tokens
    dx_b, dw_b, y_b = local_blocks(dx, m), local_blocks(dw, m), local_blocks(y, m)
    x_bf16 = differentiable_x(cfg, inp)
    worst = 0.0
    for rank in sorted(dx_b):
        want_dx, want_dw = expected_grads(cfg, expect, x_bf16, G, rank)
        # The forward first: a wrong y is a dispatch/combine bug, not a gradient rule's.
        for name, got, want in (("forward y", y_b[rank], differentiable_y(cfg, expect, x_bf16,
                                                                          rank)),
                                ("d x", dx_b[rank], want_dx), ("d weights", dw_b[rank],
                                                                 want_dw)):
            got = np.asarray(got, np.float64)
            scale = max(1.0, float(np.abs(want).max()))
            tol = 3e-2 if cfg.is_fp8 else 2e-2  # fp8: a rounding tie may still go either way
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale,
                                       err_msg=f"rank {rank}: {name}")
            worst = max(worst, float(np.abs(got - want).max()) / scale)
    return worst


# -- gradients of the MoE layer of moe.py ----------------------------------------------------
def layer_stack(a2a, cfg, params_list, x, nt, drop, *, dense=False, remat=False):
    """Layers applied in turn (each output the next input), through the all-to-all or dense.
    remat: False, True (jax.checkpoint: the backward recomputes each layer, all-to-alls
    included) or "save_a2a" (a policy keeping the all-to-alls' outputs: none recomputed).

    Every layer routes on the stack's input x, not on its own input: the MoE and the dense
    layer sum in different orders, and a 1-ulp difference in a layer's output can flip a
    near-tie of the next router's top-k (measured on the GPU: 3 bf16 layers, every gradient
    off by 10-40 %). The all-to-alls still interleave as in a real stack."""
    from .api import CHECKPOINT_NAME
    from .moe import dense_forward, moe_forward

    x0 = x

    def one(p, h):
        if dense:
            return dense_forward(cfg, p, h, nt, drop, route_x=x0)
        return moe_forward(a2a, cfg, p, h, nt, drop, route_x=x0)

    fn = one
    if remat == "save_a2a":
        policy = jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME)
        fn = jax.checkpoint(one, policy=policy)
    elif remat:
        fn = jax.checkpoint(one)
    for p in params_list:
        x = fn(p, x)
    return x


def layer_shardings(mesh, params_list):
    """Expert weights sharded over the EP axis, the rest replicated."""
    axis = mesh.axis_names[0]
    return [{k: P(axis) if k in ("w_in", "w_out") else P() for k in p} for p in params_list]


def make_layer_grad_step(a2a: AllToAll, cfg, mesh, num_layers: int = 1, remat=False):
    """jit(shard_map) of (params_list, x, num_tokens, G, drop) -> (grads_list, d x): every
    rank's gradient of sum_r <G_r, layers(x_r)>, taken per rank inside shard_map with the
    replicated parameters made varying (no psum): router and shared-expert gradients come out
    per rank ([EP, ...], from that rank's own output), expert gradients on their rank."""
    axis = mesh.axis_names[0]
    spec = P(axis)

    def body(params_list, x, num_tokens, G, drop):
        nt = num_tokens.reshape(())
        params_list = [{k: (v if k in ("w_in", "w_out") else jax.lax.pcast(v, axis,
                                                                          to="varying"))
                        for k, v in p.items()} for p in params_list]

        def loss(ps, x):
            y = layer_stack(a2a, cfg, ps, x, nt, drop, remat=remat)
            return jnp.sum(G * y.astype(jnp.float32))

        grads, dx = jax.grad(loss, argnums=(0, 1))(params_list, x)
        grads = [{k: (v if k in ("w_in", "w_out") else v[None]) for k, v in g.items()}
                 for g in grads]
        return grads, dx

    def step(params_list, x, num_tokens, G, drop):
        specs = layer_shardings(mesh, params_list)
        out_specs = ([{k: spec for k in p} for p in params_list], spec)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, spec, spec, spec, spec),
                           out_specs=out_specs)
        return fn(params_list, x, num_tokens, G, drop)

    return jax.jit(step)


def dense_layer_grads(cfg, params_list, x, num_tokens, G, drop):
    """The same gradients from the dense layers on one device, for all ranks at once:
    x, G [EP, m, H], num_tokens [EP], drop [EP, m, k] -> (grads_list with router/shared
    [EP, ...] per rank and experts summed over the ranks' losses, d x [EP, m, H])."""

    grads, dx = _dense_layer_grads_fn(cfg)(params_list, x, num_tokens, G, drop)
    grads = [{k: (jnp.sum(v, axis=0) if k in ("w_in", "w_out") else v) for k, v in g.items()}
             for g in grads]
    return grads, dx


@functools.cache
def _dense_layer_grads_fn(cfg):
    """dense_layer_grads' jitted function, one per layer config (tests compare several
    MoE variants of one config against it)."""

    def per_rank(ps, x, nt, G, drop):
        def loss(ps, x):
            y = layer_stack(None, cfg, ps, x, nt, drop, dense=True)
            return jnp.sum(G * y.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1))(ps, x)

    return jax.jit(jax.vmap(per_rank, in_axes=(None, 0, 0, 0, 0)))


def layer_grad_inputs(cfg, world: int, seed: int, drop_rate: float = 0.0, ragged: bool = True):
    """x bf16, num_tokens, G f32 and drop mask for every rank ([EP, ...]; replicas equal,
    except G: each member has its own output cotangent)."""
    rng = np.random.default_rng(seed)
    dp, m = cfg.token_replicas, cfg.max_num_tokens
    G_ = world // dp
    x = rng.standard_normal((G_, m, cfg.hidden)).astype(jnp.bfloat16)
    nt = (rng.integers(1, m + 1, G_) if ragged else np.full(G_, m)).astype(np.int32)
    drop = rng.random((G_, m, cfg.experts_per_token)) < drop_rate
    rep = lambda a: np.repeat(a, dp, axis=0)  # noqa: E731
    G = rng.standard_normal((world, m, cfg.hidden)).astype(np.float32)
    return rep(x), rep(nt), G, rep(drop)


def compare_layer_grads(moe_grads, moe_dx, dense_grads, dense_dx, ranks, experts_per_rank,
                        token_replicas: int = 1, rtol: float = 3e-2) -> float:
    """Asserts the MoE gradients of `ranks` against the dense ones within bf16 tolerance
    (relative to each tensor's largest dense value); returns the worst relative error.
    moe_* map rank -> that rank's block. With token_replicas > 1, d x is compared only when every
    member of a group is in `ranks`, summed over the group (the members split the expert
    path of d x between them: the slot's sender gets it)."""
    worst, bad = 0.0, []

    def close(name, got, want):  # every mismatch is listed: which tensors fail tells why
        nonlocal worst
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(float(np.abs(want).max()), 1e-6)
        err = float(np.abs(got - want).max()) / scale
        if not np.all(np.isfinite(got)):
            bad.append(f"{name}: not finite")
        elif err > rtol:
            bad.append(f"{name}: max |moe - dense| = {err:.3g} of max |dense| {scale:.3g}")
        worst = max(worst, err)

    L = experts_per_rank
    for layer, (mg, dg) in enumerate(zip(moe_grads, dense_grads)):
        for rank in ranks:
            for name, g in mg[rank].items():
                want = dg[name][rank * L:(rank + 1) * L] if name in ("w_in", "w_out") \
                    else dg[name][rank]
                close(f"layer {layer} rank {rank} d {name}", g, want)
    groups = sorted({r // token_replicas for r in ranks})
    for g in groups:
        members = range(g * token_replicas, (g + 1) * token_replicas)
        if all(r in ranks for r in members):
            close(f"group {g} d x", sum(np.asarray(moe_dx[r], np.float64) for r in members),
                  sum(np.asarray(dense_dx[r], np.float64) for r in members))
    assert not bad, "; ".join(bad)
    return worst


def put_global(mesh, a, spec=None):
    """A numpy array as a global array sharded over the EP axis on its first dimension
    (spec None), or with `spec` (P(): replicated); every process passes all of it."""
    a = np.asarray(a)
    spec = P(mesh.axis_names[0]) if spec is None else spec
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


def layer_grad_args(mesh, params_list, x, num_tokens, G, drop):
    """make_layer_grad_step's arguments as global arrays, from numpy ([EP, ...] per rank,
    params full)."""
    flat = lambda a: np.asarray(a).reshape((-1,) + np.asarray(a).shape[2:])  # noqa: E731
    specs = layer_shardings(mesh, params_list)
    gp = [{k: put_global(mesh, v, specs[i][k]) for k, v in p.items()}
          for i, p in enumerate(params_list)]
    return (gp, put_global(mesh, flat(x)), put_global(mesh, num_tokens),
            put_global(mesh, flat(G)), put_global(mesh, flat(drop)))


def run_layer_grads(a2a: AllToAll, cfg, mesh, params_list, x, num_tokens, G, drop,
                    remat=False, step=None):
    """make_layer_grad_step on numpy inputs ([EP, ...] per rank, params full) -> this
    process's blocks, as layer_grad_blocks gives them."""
    step = step or make_layer_grad_step(a2a, cfg, mesh, len(params_list), remat)
    grads, dx = step(*layer_grad_args(mesh, params_list, x, num_tokens, G, drop))
    world = mesh.devices.size
    return layer_grad_blocks(grads, dx, cfg.num_experts // world, cfg.max_num_tokens)


def layer_grad_blocks(grads_list, dx, experts_per_rank: int, max_m: int):
    """make_layer_grad_step's global outputs -> ([{rank: {name: block}}], {rank: d x})."""
    out = []
    for g in grads_list:
        per = collections.defaultdict(dict)
        for name, arr in g.items():
            expert = name in ("w_in", "w_out")
            for rank, block in local_blocks(arr, experts_per_rank if expert else 1).items():
                per[rank][name] = block if expert else block[0]
        out.append(dict(per))
    return out, local_blocks(dx, max_m)


# Workarounds for the test machine (the nvshmem backend under --oversubscribe, no optax there):
# test rigs, not library API.
from ._testing_rigs import DispatchSum, Optimizer, adam, optimizer  # noqa: E402,F401
