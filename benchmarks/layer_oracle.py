"""The numpy oracle of one MoE layer (GitHub issue 47): inputs, routing, fp8 round trip, and the
dense reference, shared by the peer layer's harness (layer_pplx.py) and ours (loop_layer.py).

    import layer_oracle as O
    case = O.make_case("V2Lite", tokens_per_rank=2, world=8, seed=0)
    y_ref = O.reference(case)                          # [world, T, H] f32
    err = O.rel_err(y, y_ref)                          # max over rows, see rel_err

The layer, per token t of every rank (what both harnesses compute):
- route: logits = f32(x) @ router [H, E] (f32), the k largest (descending), weights =
  softmax over those k logits (f32); indices int32.
- the routed experts read xq = bf16(fake_quantize_fp8(x)): the 1x128 block fp8 e4m3 round
  trip of the dispatch (scale = amax / 448 per block, f32), then dequantized into bf16 for the
  GEMM, as both dispatches do.
- expert e: a SiLU-gated MLP: pre = xq @ w_in[e] ([H, 2F], columns [0:F] the gate, [F:2F] the
  up projection, f32 accumulation), h = bf16(silu(gate) * up), out = bf16(h @ w_out[e]).
- y[t] = sum_j weights[t, j] * out_{indices[t, j]}[t] (f32) + shared(x[t]), where the S shared
  experts are one gated MLP of width S*F (shared_in [H, 2SF]: every gate column, then every up
  column) on the unquantized bf16 x, h rounded to bf16, its output left in f32.

Inputs (make_case) are deterministic functions of (config, seed) for the weights and of
(config, tokens_per_rank, rank, seed) for x, so every process rebuilds any rank's inputs.
Every bf16 tensor is held as float32 values exactly representable in bf16 (round_bf16).
The expert weights are lazy (ExpertWeights): R1's are 45 G values, so expert e is generated
when it is indexed, from its own seed, and nothing is cached.
"""

from __future__ import annotations

import math

import numpy as np

# name -> (num_experts E, experts_per_token k, hidden H, expert ffn F)
CONFIGS = {
    "V2Lite": (64, 6, 2048, 1408),  # DeepSeek-V2-Lite
    "R1": (256, 8, 7168, 2048),  # DeepSeek-R1 / V3
    "tiny": (16, 4, 256, 128),  # CPU checks
}
BLOCK = 128  # fp8 scale block (1 x 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-12  # amax floor of an all-zero block (its scale, before / FP8_MAX)

# SeedSequence tags: one stream per tensor kind, so no two tensors share random numbers.
_TAG_X, _TAG_ROUTER, _TAG_W_IN, _TAG_W_OUT, _TAG_SHARED_IN, _TAG_SHARED_OUT = range(1, 7)


# -- bf16 and fp8 rounding (exact, numpy only) ------------------------------------------------
def round_bf16(a) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still float32.
    Finite inputs only (the inputs here are)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = u >> np.uint32(16)  # in place from here: R1's expert matrices are 29 M values
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r &= np.uint32(0xFFFF0000)
    return r.view(np.float32)


def bf16_bits(a) -> np.ndarray:
    """uint16 bit patterns of round_bf16(a) (what a bf16 tensor holds)."""
    return (round_bf16(a).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(bits) -> np.ndarray:
    """float32 values of bf16 bit patterns (uint16 or int16 arrays)."""
    b = np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32) << np.uint32(16)
    return b.view(np.float32)


def round_to_e4m3(v) -> np.ndarray:
    """float32 v rounded to the nearest float8_e4m3fn value (ties to even), clipped to
    +-448, still float32. e4m3: 3 mantissa bits, so in [2^(e-1), 2^e) the step is 2^(e-4);
    normals start at 2^-6, below that the subnormal step 2^-9. Every operation is exact (a
    power of two scaling and np.round, which rounds half to even)."""
    v = np.asarray(v, dtype=np.float32)
    _, e = np.frexp(v)  # |v| in [2^(e-1), 2^e); e = 0 for v = 0
    step = np.exp2(np.maximum(e - 4, -9)).astype(np.float32)
    return np.clip(np.round(v / step) * step, -FP8_MAX, FP8_MAX).astype(np.float32)


def quantize_fp8(x):
    """x [..., H] (H a multiple of 128) -> (q [..., H] f32 on the e4m3 grid, scale
    [..., H/128] f32): per 1x128 block scale = max(amax, 1e-12) / 448, q = x / scale rounded."""
    x = np.asarray(x, dtype=np.float32)
    H = x.shape[-1]
    if H % BLOCK:
        raise ValueError(f"hidden {H} is not a multiple of the fp8 block {BLOCK}")
    blocks = x.reshape(*x.shape[:-1], H // BLOCK, BLOCK)
    scale = (np.maximum(np.abs(blocks).max(axis=-1), np.float32(SCALE_FLOOR))
             / np.float32(FP8_MAX)).astype(np.float32)
    q = round_to_e4m3(blocks / scale[..., None])
    return q.reshape(x.shape), scale


def fake_quantize_fp8(x) -> np.ndarray:
    """The dispatch's fp8 round trip of x [..., H]: q * scale (f32; round it to bf16 for what
    the GEMM reads, as reference does)."""
    q, scale = quantize_fp8(x)
    blocks = q.reshape(*q.shape[:-1], -1, BLOCK) * scale[..., None]
    return blocks.reshape(q.shape).astype(np.float32)


# -- the layer's pieces ------------------------------------------------------------------------
def route(x, router, k: int):
    """x [..., H], router [H, E] f32 -> (indices int32 [..., k], weights f32 [..., k]):
    the k largest f32 logits in descending order (ties: the lower expert first) and the
    softmax over them."""
    x = np.asarray(x, dtype=np.float32)
    logits = (x.reshape(-1, x.shape[-1]) @ np.asarray(router, dtype=np.float32)).astype(np.float32)
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, idx, axis=-1)
    ex = np.exp(top - top[:, :1])  # top[:, 0] is the row's max
    w = (ex / ex.sum(axis=-1, keepdims=True)).astype(np.float32)
    lead = x.shape[:-1]
    return idx.astype(np.int32).reshape(*lead, k), w.reshape(*lead, k)


def silu(z) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-z) = inf for very negative z: silu -> -0
        return (z / (np.float32(1) + np.exp(-z))).astype(np.float32)


def gated_mlp(x, w_in, w_out, round_out: bool = True) -> np.ndarray:
    """x [n, H] @ w_in [H, 2F] (gate [:F], up [F:]) -> h = bf16(silu(gate) * up) -> h @ w_out
    [F, H], f32 accumulation; the output rounded to bf16 where round_out (the routed experts'
    outputs), else left in f32 (the shared experts')."""
    pre = np.asarray(x, np.float32) @ np.asarray(w_in, np.float32)
    F = pre.shape[-1] // 2
    h = round_bf16(silu(pre[:, :F]) * pre[:, F:])
    out = (h @ np.asarray(w_out, np.float32)).astype(np.float32)
    return round_bf16(out) if round_out else out


def expert_contributions(xq, indices, weights, experts, weights_of, out=None) -> np.ndarray:
    """sum over the listed experts e of weights[t, j] * mlp_e(xq[t]) where indices[t, j] == e.

    xq [N, H] (the GEMM's input rows: bf16(fake_quantize_fp8(x))), indices/weights [N, k],
    weights_of(e) -> (w_in[e] [H, 2F], w_out[e] [F, H]); only experts with rows are built.
    Returns (adds into) out [N, H] f32. A harness that holds experts [lo, hi) passes those and
    sums the parts over its processes; reference passes every expert."""
    xq = np.asarray(xq, np.float32)
    indices = np.asarray(indices).reshape(xq.shape[0], -1)
    weights = np.asarray(weights, np.float32).reshape(indices.shape)
    if out is None:
        out = np.zeros(xq.shape, np.float32)
    for e in experts:
        rows, slots = np.nonzero(indices == e)
        if rows.size == 0:
            continue
        w_in, w_out = weights_of(int(e))
        y = gated_mlp(xq[rows], w_in, w_out)
        np.add.at(out, rows, weights[rows, slots][:, None] * y)  # a token picks e at most once
    return out


def shared_output(x, case) -> np.ndarray | None:
    """The shared experts' output (f32) for x [..., H], or None without shared experts."""
    if not case.get("num_shared_experts"):
        return None
    x = np.asarray(x, np.float32)
    y = gated_mlp(x.reshape(-1, x.shape[-1]), case["shared_in"], case["shared_out"],
                  round_out=False)
    return y.reshape(x.shape)


def reference(case, indices=None, weights=None) -> np.ndarray:
    """The dense reference y [world, T, H] f32 of make_case's case. indices/weights [world, T,
    k]: the routing to use (default: route(x, router, k), as the layer computes it; a harness
    may pass the routing its device computed, so that a near-tie flip of the top-k, which
    changes a token's experts, is reported apart from the arithmetic)."""
    x = np.asarray(case["x"], np.float32)
    world, T, H = x.shape
    if indices is None or weights is None:
        indices, weights = route(x, case["router"], case["experts_per_token"])
    xq = round_bf16(fake_quantize_fp8(x)).reshape(world * T, H)
    idx = np.asarray(indices).reshape(world * T, -1)
    used = np.unique(idx)
    w_in, w_out = case["w_in"], case["w_out"]
    y = expert_contributions(xq, idx, weights, used, lambda e: (w_in[e], w_out[e]))
    y = y.reshape(world, T, H)
    shared = shared_output(x, case)
    return y if shared is None else y + shared


def rel_err(y, y_ref) -> float:
    """max over rows (the last axis is H) of max|y - y_ref| / max|y_ref| of that row: every
    element is judged against its own token's scale. inf if y has a non-finite value."""
    y = np.asarray(y, np.float64)
    r = np.asarray(y_ref, np.float64)
    if y.shape != r.shape:
        raise ValueError(f"shapes differ: {y.shape} vs {r.shape}")
    if y.size == 0:
        return 0.0
    if not np.all(np.isfinite(y)):
        return math.inf
    y2, r2 = y.reshape(-1, y.shape[-1]), r.reshape(-1, r.shape[-1])
    num = np.abs(y2 - r2).max(axis=1)
    den = np.maximum(np.abs(r2).max(axis=1), 1e-30)
    return float((num / den).max())


# -- inputs ------------------------------------------------------------------------------------
def config_dims(config) -> tuple[int, int, int, int]:
    """(E, k, H, F) of a CONFIGS name or of an (E, k, H, F) tuple."""
    dims = CONFIGS[config] if isinstance(config, str) else tuple(int(v) for v in config)
    if len(dims) != 4:
        raise ValueError(f"config {config!r}: expected a name of {sorted(CONFIGS)} or (E, k, H, F)")
    return dims


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(v) for v in key]))


def _normal_bf16(shape, scale: float, *key: int) -> np.ndarray:
    """Standard normal * scale, rounded to bf16 (as f32), from its own seed."""
    return round_bf16(_rng(*key).standard_normal(shape, dtype=np.float32) * np.float32(scale))


class ExpertWeights:
    """A lazy [E, a, b] f32 stack of bf16-representable expert matrices: w[e] (an int, a slice
    or a list of ints) generates those experts from their own seeds, standard normal * scale;
    np.asarray(w) builds all E (small configs only). Nothing is cached."""

    ndim = 3
    dtype = np.dtype(np.float32)

    def __init__(self, num_experts: int, rows: int, cols: int, scale: float, key: tuple) -> None:
        self.shape = (num_experts, rows, cols)
        self.scale = scale
        self.key = tuple(int(v) for v in key)

    def __len__(self) -> int:
        return self.shape[0]

    def expert(self, e: int) -> np.ndarray:
        E = self.shape[0]
        e = int(e)
        if e < 0:
            e += E
        if not 0 <= e < E:
            raise IndexError(f"expert {e} of {E}")
        return _normal_bf16(self.shape[1:], self.scale, *self.key, e)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return self.expert(key)
        if isinstance(key, slice):
            ids = range(*key.indices(self.shape[0]))
        else:
            ids = [int(e) for e in np.asarray(key).reshape(-1)]
        out = np.empty((len(ids),) + self.shape[1:], np.float32)
        for i, e in enumerate(ids):
            out[i] = self.expert(e)
        return out

    def __array__(self, dtype=None, copy=None):
        a = self[:]
        return a if dtype is None else a.astype(dtype)


def make_x(config, tokens_per_rank: int, rank: int, seed: int) -> np.ndarray:
    """One rank's tokens [T, H]: standard normal, bf16-representable f32."""
    E, _, H, F = config_dims(config)
    return _normal_bf16((tokens_per_rank, H), 1.0, seed, _TAG_X, E, H, F, tokens_per_rank, rank)


def make_case(config, tokens_per_rank: int, world: int, seed: int,
              num_shared_experts: int = 0) -> dict:
    """The layer's inputs, deterministic. config: a CONFIGS name or (E, k, H, F).

    Returns {x [world, T, H], router [H, E] f32 (normal / sqrt(H), not rounded), w_in
    ExpertWeights [E, H, 2F] (normal / sqrt(H)), w_out ExpertWeights [E, F, H] (normal /
    sqrt(F)), and with S = num_shared_experts > 0: shared_in [H, 2SF] (normal / sqrt(H)),
    shared_out [SF, H] (normal / sqrt(SF)); plus the ints num_experts, experts_per_token,
    hidden, ffn, num_shared_experts, tokens_per_rank, world, seed}. Every array but the router
    holds bf16-representable f32. The weights depend on (config, seed) only, not on T or world.
    """
    E, k, H, F = config_dims(config)
    S = int(num_shared_experts)
    case = dict(
        num_experts=E, experts_per_token=k, hidden=H, ffn=F, num_shared_experts=S,
        tokens_per_rank=int(tokens_per_rank), world=int(world), seed=int(seed),
        x=np.stack([make_x((E, k, H, F), tokens_per_rank, r, seed) for r in range(world)])
        if world else np.zeros((0, tokens_per_rank, H), np.float32),
        router=(_rng(seed, _TAG_ROUTER, E, H).standard_normal((H, E), dtype=np.float32)
                / np.float32(math.sqrt(H))).astype(np.float32),
        w_in=ExpertWeights(E, H, 2 * F, 1 / math.sqrt(H), (seed, _TAG_W_IN, E, H, F)),
        w_out=ExpertWeights(E, F, H, 1 / math.sqrt(F), (seed, _TAG_W_OUT, E, H, F)),
    )
    if S > 0:
        case["shared_in"] = _normal_bf16((H, 2 * S * F), 1 / math.sqrt(H),
                                         seed, _TAG_SHARED_IN, E, H, F, S)
        case["shared_out"] = _normal_bf16((S * F, H), 1 / math.sqrt(S * F),
                                          seed, _TAG_SHARED_OUT, E, H, F, S)
    return case
