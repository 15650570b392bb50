"""Oracle and harness shared by the test suite, the GPU worker and the benchmarks.

Every rank builds every rank's inputs from one seed and checks its own outputs locally:
dispatch as a multiset of rows per expert plus exact counts, combine end to end against a
float64 numpy computation of y[t] = sum_j w[t,j] * f_e(x[t]) with f_e(x) = c_e * x.
"""

from __future__ import annotations

import collections
import dataclasses

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
    """Inputs of every rank. Ranks of one DP group hold the same tokens."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}; expected one of {ROUTINGS}")
    rng = np.random.default_rng(seed)
    G, dp, m, k, H, E = (cfg.num_dp_groups, cfg.dp_size, cfg.max_num_tokens,
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
    L, dp = cfg.num_local_experts, cfg.dp_size
    want = {e: collections.Counter() for e in range(L)}
    for g in range(cfg.num_dp_groups):
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
            src = g * cfg.dp_size
            sc = None if inp.x_scale is None else inp.x_scale[src, t]
            expected[key(inp.x[src, t], sc)] += n
        got = collections.Counter(
            key(ex[e, i], None if exs is None else exs[e, i]) for i in range(counts[e]))
        if got != expected:
            missing = sum((expected - got).values())
            extra = sum((got - expected).values())
            raise AssertionError(f"rank {rank} expert {e}: {missing} expected rows missing, "
                                 f"{extra} unexpected rows (of {counts[e]})")


def unpack(cfg: MoEConfig, expert_x, expert_num_tokens):
    """Packed-layout rows [max_recv_total, ...] -> padded [L, max_recv, ...] (numpy), after
    asserting that rows past sum(group_sizes) are zero."""
    ex, counts = np.asarray(expert_x), np.asarray(expert_num_tokens)
    assert ex.shape[0] == cfg.max_recv_total, ex.shape
    ends = np.cumsum(counts)
    assert ends[-1] <= cfg.max_recv_total, counts
    tail = ex[ends[-1]:]
    assert not np.any(tail.astype(np.float32)), "packed rows past sum(group_sizes) not zero"
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


def expected_y(cfg: MoEConfig, inp: Inputs, rank: int) -> np.ndarray:
    c = expert_factor(cfg)
    xs = None if inp.x_scale is None else inp.x_scale[rank]
    xf = dequantize(inp.x[rank], xs)
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


def make_step(a2a: AllToAll, mesh, split: bool = False):
    """jit(shard_map) of dispatch -> test experts -> combine; returns every output per rank."""
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
        return out.expert_x, scale, out.expert_num_tokens, y

    def step(x, x_scale, indices, weights, num_tokens):
        if x_scale is None:
            fn = lambda x, i, w, n: body(x, None, i, w, n)  # noqa: E731
            args = (x, indices, weights, num_tokens)
        else:
            fn, args = body, (x, x_scale, indices, weights, num_tokens)
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec for _ in args),
                               out_specs=(spec, spec, spec, spec))
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
    """One step on every rank; checks this process's ranks; returns the max combine error."""
    cfg = a2a.config
    step = step or make_step(a2a, mesh, split)
    ex, exs, counts, y = step(*global_inputs(cfg, mesh, inp))
    L, m = cfg.num_local_experts, cfg.max_num_tokens
    rows = cfg.max_recv_total if a2a.layout == "packed" else L
    ex_b, exs_b, c_b, y_b = (local_blocks(ex, rows), local_blocks(exs, rows),
                             local_blocks(counts, L), local_blocks(y, m))
    worst = 0.0
    for rank in sorted(y_b):
        ex_r, scales = ex_b[rank], (exs_b[rank] if cfg.is_fp8 else None)
        if a2a.layout == "packed":
            ex_r = unpack(cfg, ex_r, c_b[rank])
            scales = None if scales is None else unpack(cfg, scales, c_b[rank])
        check_dispatch(cfg, inp, rank, ex_r, scales, c_b[rank])
        worst = max(worst, check_combine(cfg, inp, rank, y_b[rank]))
    return worst
