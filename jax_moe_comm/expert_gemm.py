"""The expert MLPs after dispatch, one function per grouped-GEMM option (issue 24).

Every local expert e is a SiLU MLP, y = silu(x @ w_in[e]) @ w_out[e] over its own rows (bf16
inputs, f32 accumulation, the hidden activation rounded to bf16), or with gated=True a
SiLU-gated one (DeepSeek's): w_in[e] [H, 2F], columns [0:F] the gate and [F:2F] the up
projection, y = (silu(x @ gate) * (x @ up)) @ w_out[e] (activation.py). The MoE layer's
`expert_gemm` option (MoELayerConfig(expert_gemm=...)) says how the two GEMMs run:

- "einsum": a batched einsum over the padded layout [L, P, H]: every one of the L*P rows,
  live or not. P is the handle's expert_capacity: by default max_recv, the worst case (at R1
  with 128 tokens per rank, 32x the live rows); with AllToAll(expert_capacity=
  cfg.rows_per_expert_for(1.25)) about 1.25x them (MoELayerConfig(capacity_factor=1.25) on the
  padded layout).
- "ragged_dot": jax.lax.ragged_dot on packed rows [T, H] (group_sizes [L]). XLA lowers it as
  a dense masked matmul over every local expert (on GPU unless a grouped-GEMM lowering is
  switched on, always on CPU): L times the FLOPs of the T packed rows.
- "tokamax": tokamax's ragged_dot on the packed rows (`pip install tokamax`): a grouped GEMM
  over the live rows only (its Pallas Mosaic GPU kernel on Hopper; tokamax falls back to XLA's
  ragged_dot where it has no kernel, e.g. on CPU). SiLU is fused into the first GEMM's
  epilogue where tokamax can; gated, the first GEMM writes its f32 [T, 2F] and XLA forms the
  gated hidden (the gate and up columns of a row lie in different output tiles: no
  elementwise epilogue sees both). Output rows past sum(group_sizes) are not written (undefined);
  combine never reads them. Its backward is grouped_vjp's (tokamax's kernels for d x, XLA's
  batched GEMM over a window of rows per expert for the weights). Which of tokamax's kernels:
  tokamax_mlp(implementation=) or JMC_TOKAMAX_IMPL where either names one (tokamax's names,
  or its Mosaic GPU kernel with a config of ours, "mosaic:<spec>", e.g. "mosaic:m128s4p1":
  TOKAMAX_SPEC_GRAMMAR; TOKAMAX_PERSISTENT is the named spec "p1"); else, given the layer's
  mean rows per expert, the tile measured fastest for them (TOKAMAX_TILE_BY_MEAN_ROWS, on sm90
  GPUs only); else tokamax's own choice (also JMC_TOKAMAX_IMPL=default).
- "masked": the padded layout with rows >= expert_num_tokens[e] skipped. Not a kernel of its
  own: the live rows are gathered into a packed view (layout.pack_rows), run through tokamax's
  grouped GEMM (jax.lax.ragged_dot when tokamax is not installed) and scattered back
  (layout.unpack_rows). Padded in, padded out (zero past the counts): the FLOPs of the live rows
  plus one gather and one scatter of them.
- "auto": the fastest measured option on the platform and layout: GPU_AUTO on a GPU ("tokamax"
  on packed rows, "einsum" on padded ones; "einsum" when tokamax does not import), CPU_AUTO
  elsewhere.

Every option takes either layout: the padded [L, R, H] or the packed [T, H] (its rank tells).
An option run on the other layout converts (a gather of the live rows and a scatter back), so
pair the handle's layout with the option: "packed" for "tokamax"/"ragged_dot", "padded" for
"einsum"/"masked". Gradients flow through every option (jax.grad).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

from . import activation as act
from . import grouped_vjp
from .layout import pack_rows, unpack_rows

OPTIONS = ("auto", "einsum", "ragged_dot", "tokamax", "masked")
# What "auto" runs on a GPU, per layout: the fastest option that benchmarks/bench_layer.py and
# bench_gemm.py measured right on the H200 (change it here). Measured 2026-12-05
# (benchmarks/results/archive/2026-12-05-47804d0-layer/, tokamax 0.0.17, jax 0.11.2): the layer
# step on packed rows with tokamax is 1.3-6x faster than the padded einsum at 128 tokens and
# at 1 token at R1 (it skips experts with no rows); tokamax's forward is right everywhere, its
# own weight gradients were not, so "tokamax" differentiates through grouped_vjp. The padded
# layout keeps the batched einsum (cuBLAS; fastest there with an expert_capacity).
GPU_AUTO = {"packed": "tokamax", "padded": "einsum"}
# XLA:CPU expands ragged_dot densely (L x the FLOPs) and tokamax has no CPU kernel: the padded
# einsum computes min(k, L) x fewer rows there.
CPU_AUTO = "einsum"
NEEDS_TOKAMAX = ("tokamax", "masked")
# The layout each option computes on (the other one is converted to it and back).
NATIVE_LAYOUT = {"einsum": "padded", "masked": "padded", "ragged_dot": "packed",
                 "tokamax": "packed"}

f32, bf16 = jnp.float32, jnp.bfloat16


def check_option(option: str) -> str:
    """option, or a ValueError naming the choices."""
    if option not in OPTIONS:
        raise ValueError(
            f"expert_gemm={option!r}; expected one of {OPTIONS}: 'einsum' (padded batched "
            "einsum over every row), 'ragged_dot' (jax.lax.ragged_dot on packed rows), "
            "'tokamax' (tokamax's grouped GEMM on packed rows: pip install tokamax), 'masked' "
            "(padded layout, only the live rows computed), 'auto' (the fastest measured on "
            "this platform)")
    return option


@functools.cache
def _tokamax():
    """(tokamax module, None), or (None, why it cannot be used)."""
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 -- a missing dependency of tokamax raises anything
        return None, f"import tokamax failed: {type(e).__name__}: {e}"
    if not hasattr(tokamax, "ragged_dot"):
        return None, (f"the installed tokamax {getattr(tokamax, '__version__', '?')} has no "
                      "ragged_dot (tokamax 0.1.0 is an empty placeholder: install 0.0.x)")
    _parse_tokamax_flags()
    return tokamax, None


def _parse_tokamax_flags():
    """tokamax reads its absl flags on first use and, before 0.0.17 (the last release for
    Python 3.11), parses the whole sys.argv to do so: the host program's own arguments (pytest
    -q, --out ...) then raise UnrecognizedFlagError. Parse only its --tokamax_* arguments
    first, as 0.0.17 does itself; a program that parses absl flags later still can."""
    import sys

    from absl import flags

    if not flags.FLAGS.is_parsed():
        ours = [a for a in sys.argv[1:] if a.startswith("--tokamax_")]
        flags.FLAGS(sys.argv[:1] + ours, known_only=True)


def tokamax_problem() -> str | None:
    """None when the "tokamax" option can run, else why not."""
    return _tokamax()[1]


def _require_tokamax():
    tk, why = _tokamax()
    if tk is None:
        raise ImportError(f"expert_gemm='tokamax' (and 'masked') needs tokamax: "
                          f"pip install tokamax ({why}), or pick expert_gemm='einsum' or "
                          "'ragged_dot'")
    return tk


def resolve(option: str = "auto", platform: str | None = None, layout: str = "packed") -> str:
    """The option "auto" stands for on `platform` (default: jax.default_backend()) for a
    handle of `layout` ("packed" or "padded"); any other option unchanged."""
    check_option(option)
    if option != "auto":
        return option
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        choice = GPU_AUTO[layout]
        if choice in NEEDS_TOKAMAX and tokamax_problem() is not None:
            return "einsum"
        return choice
    return CPU_AUTO


# -- one function per option, each on its own layout ------------------------------------------
def einsum_mlp(x, w_in, w_out, out_dtype=f32, gated=False):
    """"einsum": padded x [L, P, H] -> [L, P, H], every row computed (P: the handle's
    expert_capacity). w_in [L, H, F] ([L, H, 2F] gated), w_out [L, F, H]."""
    pre = jnp.einsum("lrh,lhn->lrn", x, w_in, preferred_element_type=f32)
    h = act.hidden(pre, gated).astype(bf16)
    y = jnp.einsum("lrf,lfh->lrh", h, w_out, preferred_element_type=f32)
    return y.astype(out_dtype)


def ragged_dot_mlp(x, group_sizes, w_in, w_out, out_dtype=f32, gated=False):
    """"ragged_dot": packed x [T, H] (group_sizes [L] rows per expert) -> [T, H]; rows past
    sum(group_sizes) are zero. Weights as einsum_mlp's."""
    gs = group_sizes.astype(jnp.int32)
    pre = jax.lax.ragged_dot(x, w_in, gs, preferred_element_type=f32)
    h = act.hidden(pre, gated).astype(bf16)
    y = jax.lax.ragged_dot(h, w_out, gs, preferred_element_type=f32)
    return y.astype(out_dtype)


def _varying_axes(x) -> set:
    """The shard_map manual axes x's type varies over (empty outside shard_map)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.10; older: .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def _vary_like(out, *inputs):
    """out typed as varying over every manual axis its inputs vary over. tokamax's Pallas
    kernels return outputs typed invariant under shard_map (seen on the H200, jax 0.11.2):
    a custom VJP then refuses the varying cotangent of such an output. Its transpose is a psum
    over those axes: use it on a kernel's output or inside a custom VJP, not on a value whose
    cotangent JAX's autodiff already sums (tokamax_mlp's input casts rely on exactly that)."""
    axes = tuple(sorted(set().union(*map(_varying_axes, inputs)) - _varying_axes(out)))
    if not axes:
        return out
    pcast = getattr(jax.lax, "pcast", None)
    return pcast(out, axes, to="varying") if pcast else jax.lax.pvary(out, axes)


# tokamax's Mosaic GPU kernel config for bf16 inputs on sm90 when nothing else is said: its
# heuristic (PallasMosaicGpuRaggedDot._get_heuristics_config; _get_sm90_autotuning_configs
# spans block_m 16-128, num_stages 2/4, persistent or not, grid_minor_dim M/N, tile width 1-8),
# as bench_gemm recorded it (`tokamax_config`) on the H200 run of 2026-12-05, tokamax 0.0.17
# (benchmarks/results/2026-12-05-f97726a-layer3/gemm.json): block_m 64, block_n 64, block_k
# 128, 2 stages, not persistent, M the grid's minor dimension. Letters a kernel spec leaves out
# take these values. (0.0.12's heuristic also sets warp_specialized and async_store, fields
# 0.0.17's Config no longer has; 0.0.12's sm90 kernel for unquantized inputs reads neither.)
TOKAMAX_SM90_DEFAULT = {"block_m": 64, "block_n": 64, "block_k": 128, "num_stages": 2,
                        "split_k": 1, "persistent": False, "grid_minor_dim": "m",
                        "grid_tile_width": 1}
# A kernel spec's letters: each followed by its value, e.g. "m128s4p1" (block_m 128, 4 stages,
# persistent); JMC_TOKAMAX_IMPL and implementation= take it as "mosaic:<spec>".
TOKAMAX_SPEC_LETTERS = {"m": "block_m", "n": "block_n", "k": "block_k", "s": "num_stages",
                        "p": "persistent", "g": "grid_minor_dim", "w": "grid_tile_width"}
TOKAMAX_SPEC_PREFIX = "mosaic:"
TOKAMAX_SPEC_GRAMMAR = (
    "a tokamax kernel spec is letters each followed by its value, each letter at most once, "
    "e.g. 'm128s4p1': m<block_m, a multiple of 8> n<block_n> k<block_k> s<num_stages> "
    "p<persistent: 0 or 1> g<grid_minor_dim: m or n> w<grid_tile_width> (numbers >= 1); "
    "letters left out take tokamax's sm90 heuristic values (expert_gemm.TOKAMAX_SM90_DEFAULT: "
    "m64n64k128s2p0gmw1)")

# Our name for tokamax's Mosaic GPU kernel with its H100/H200 heuristic config but persistent
# (a grid of the device's SM count looping over the output tiles): the spec "p1". tokamax's sm90
# default is one block per tile of a grid over every row tile of the buffer plus the groups:
# with packed rows at the worst case (V2-Lite 128 tokens: 6,144 rows for 768 live) ~90 % of its
# blocks start only to find no rows, which a persistent loop skips in a few loads each. Measured
# against the default by bench_gemm's tokamax_mosaic_persistent and, for the layer, with
# JMC_TOKAMAX_IMPL=mosaic_persistent (docs/notes.md).
TOKAMAX_PERSISTENT = "mosaic_persistent"
# Named kernel specs: implementation names that stand for a "mosaic:<spec>".
TOKAMAX_NAMED_SPECS = {TOKAMAX_PERSISTENT: "p1"}


def tokamax_spec(name) -> str | None:
    """The kernel spec an implementation name stands for ("mosaic:<spec>", or a named one:
    TOKAMAX_NAMED_SPECS), else None (None, or one of tokamax's own names)."""
    if not isinstance(name, str):
        return None
    if name in TOKAMAX_NAMED_SPECS:
        return TOKAMAX_NAMED_SPECS[name]
    return name[len(TOKAMAX_SPEC_PREFIX):] if name.startswith(TOKAMAX_SPEC_PREFIX) else None


def parse_tokamax_spec(spec: str) -> dict:
    """A kernel spec (TOKAMAX_SPEC_GRAMMAR), e.g. "m128s4p1", -> tokamax Config's fields:
    TOKAMAX_SM90_DEFAULT with the spec's letters set (grid_minor_dim "m" or "n"). A ValueError
    names the bad letter or value."""
    fields, seen, i = dict(TOKAMAX_SM90_DEFAULT), set(), 0

    def bad(what):
        return ValueError(f"tokamax kernel spec {spec!r}: {what}; {TOKAMAX_SPEC_GRAMMAR}")

    if not spec:
        raise bad("empty")
    while i < len(spec):
        letter, i = spec[i], i + 1
        if letter not in TOKAMAX_SPEC_LETTERS:
            raise bad(f"unknown letter {letter!r} at position {i - 1}")
        if letter in seen:
            raise bad(f"letter {letter!r} given twice")
        seen.add(letter)
        field = TOKAMAX_SPEC_LETTERS[letter]
        if letter == "g":
            value = spec[i:i + 1]
            if value not in ("m", "n"):
                raise bad(f"g{value}: g takes m or n (the grid's minor dimension)")
            fields[field], i = value, i + 1
            continue
        start = i
        while i < len(spec) and spec[i] in "0123456789":
            i += 1
        if start == i:
            raise bad(f"letter {letter!r} ({field}) has no number after it")
        value = int(spec[start:i])
        if letter == "p":
            if value not in (0, 1):
                raise bad(f"p{value}: p takes 0 or 1 (persistent)")
            fields[field] = bool(value)
        elif value < 1 or (letter == "m" and value % 8):
            raise bad(f"{letter}{value}: {field} must be "
                      + ("a positive multiple of 8" if letter == "m" else ">= 1"))
        else:
            fields[field] = value
    return fields


TOKAMAX_IMPL_ENV = "JMC_TOKAMAX_IMPL"

# tokamax's tile by the layer's mean rows per local expert (MoEConfig.expected_rows_per_expert),
# where nothing names an implementation: (most mean rows, kernel spec), the first that holds.
# Measured 2026-12-06 on an H100, 8 ranks under MPS (16 SMs a rank), the layer step with
# every looped layer routing as the first, runs A B then B A
# (benchmarks/results/2026-12-06-aebd80b-h100-tile/):
# - up to 32 mean rows (V2-Lite 16 tokens: 12; R1 16: 4, R1 128: 32): n128 (64 x 128 tiles),
#   1.08-1.17x the floor, against 1.13-1.23x for tokamax's sm90 choice (m64n64) and
#   1.39-1.47x for m128;
# - 96 mean rows (V2-Lite 128 tokens): m128 (128 x 64 tiles: an expert's rows in one row tile
#   instead of two), 1.37-1.42x on two machines with steady samples, against 1.46-1.51x for
#   n128 and 1.60-1.61x for tokamax's choice. On two other machines, whose m128 samples
#   scattered (t(N)/N 1.3-1.9x the slope), m128 lost by 3-12 %. A fifth machine, A B A B,
#   9 samples a row, all steady (2026-12-06 afternoon, 8aa17b6): m128 621-638 us against
#   721-730 for m64 (benchmarks/results/2026-12-06-8aa17b6-h100-closeout/).
# - 128 mean rows (R1 512 tokens): m128 13,575-13,582 us against 14,790-14,989 for n128 and
#   15,373-15,590 for m64 (2026-12-06 afternoon, 8aa17b6, A B then B A on one machine);
# - 384 mean rows (V2-Lite 512 tokens, prefill): m128 1,772-1,789 us and n128 1,738-1,754
#   against 1,997-2,042 for tokamax's own choice (m64n64) in the same two runs: m128 12 %
#   faster, n128 13-14 %; m128 kept, one tile for the range (n128 lost by 8-9 % at 128 rows).
#   One machine, 5 samples a row; R1's rows by t(N)/N (few layers a sample), not the slope.
# - between (2026-12-06 afternoon, 948f92b, A B then B A, benchmarks/results/
#   2026-12-06-948f92b-h100-tile-gap/): V2-Lite 32 / 64 tokens (24 / 48 mean rows) n128 423 /
#   459-467 us against 511-514 / 543 for m128; R1 256 tokens (64 mean rows) m128 8,379-8,612
#   against 9,552-9,591 for n128 (1.47-1.51x its floor against 1.67-1.68x). One machine, 7
#   samples a row; V2-Lite 64's m128 row ran in one of the two runs (the other's budget ended).
# So the crossover depends on the shapes: R1's lies between 32 and 64 mean rows, V2-Lite's
# between 48 and 96. Any bound from 48 to 63 fits both; 48 it is (R1 at 33-48 mean rows, e.g.
# 192 tokens, gets n128 unmeasured). Past 384 (V2-Lite from 1,024 tokens, R1 from 1,536)
# tokamax keeps its own choice, unmeasured; R1 at 1,024 tokens (256 mean rows) gets m128,
# unmeasured too.
TOKAMAX_TILE_BY_MEAN_ROWS = ((48, "n128"), (384, "m128"))
# The rule applies on the architecture it was measured on (sm90: H100; the H200 is sm90 too,
# unconfirmed there); elsewhere tokamax keeps its own choice.
TOKAMAX_TILE_ARCH = "9."
# JMC_TOKAMAX_IMPL (or implementation=) value for tokamax's own choice, the rule off.
TOKAMAX_OWN_CHOICE = "default"


def tokamax_spec_for_rows(mean_rows: int | None) -> str | None:
    """The implementation the layer gives tokamax for `mean_rows` rows per local expert:
    "mosaic:<spec>" from TOKAMAX_TILE_BY_MEAN_ROWS, or None (tokamax's own choice; also for
    mean_rows None)."""
    if mean_rows is None:
        return None
    for most, spec in TOKAMAX_TILE_BY_MEAN_ROWS:
        if mean_rows <= most:
            return TOKAMAX_SPEC_PREFIX + spec
    return None


@functools.cache
def tile_rule_applies() -> bool:
    """Whether this process's devices are what TOKAMAX_TILE_BY_MEAN_ROWS was measured on: a
    GPU of compute capability TOKAMAX_TILE_ARCH*."""
    try:
        device = jax.local_devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and str(
        getattr(device, "compute_capability", "")).startswith(TOKAMAX_TILE_ARCH)


def layer_tokamax_spec(mean_rows: int | None) -> str | None:
    """The implementation the layer gives tokamax when none is named: tokamax_spec_for_rows on
    the measured architecture (tile_rule_applies), else None (tokamax's own choice)."""
    return tokamax_spec_for_rows(mean_rows) if tile_rule_applies() else None


def _requested_implementation(name):
    """The implementation asked for: `name`, else the environment's JMC_TOKAMAX_IMPL, else
    None (tokamax's own choice)."""
    return name or os.environ.get(TOKAMAX_IMPL_ENV) or None


def tokamax_choice(implementation, mean_rows: int | None) -> str | None:
    """What tokamax_mlp asks tokamax for: `implementation`, else JMC_TOKAMAX_IMPL, else the
    layer's tile for mean_rows (layer_tokamax_spec), else None (tokamax's own choice)."""
    return _requested_implementation(implementation) or layer_tokamax_spec(mean_rows)


def _tokamax_implementation(name):
    """tokamax's `implementation=` for one of ours: None (tokamax's choice; the environment's
    JMC_TOKAMAX_IMPL if set), a tokamax name, or a kernel spec ("mosaic:<spec>" or a named
    one, e.g. TOKAMAX_PERSISTENT): tokamax's Mosaic GPU kernel with that Config first, then
    tokamax's own order ("mosaic" with its own config, "triton" where built, "xla") where it
    refuses a problem (NotImplementedError). TOKAMAX_OWN_CHOICE: None."""
    name = _requested_implementation(name)
    if name == TOKAMAX_OWN_CHOICE:
        return None
    from_env = name is not None and name == os.environ.get(TOKAMAX_IMPL_ENV)
    spec = tokamax_spec(name)
    if spec is None:
        return name
    try:
        fields = parse_tokamax_spec(spec)
    except ValueError as e:
        where = f"JMC_TOKAMAX_IMPL={name!r}" if from_env else f"implementation={name!r}"
        raise ValueError(f"{where}: {e}") from None
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as mgpu  # private: 0.0.17's
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common
    from tokamax._src.ops.ragged_dot import api

    fields["grid_minor_dim"] = common.MatmulDimension[fields["grid_minor_dim"].upper()]
    # then tokamax's own order (triton where its build has it), as with no implementation named
    fallbacks = ("mosaic",) + (("triton",) if "triton" in api.IMPLEMENTATIONS else ()) + ("xla",)
    return (mgpu.PallasMosaicGpuRaggedDot(config=common.Config(**fields)),) + fallbacks


@functools.cache
def _tokamax_dot(implementation=None):
    """tokamax.ragged_dot_general in the signature grouped_vjp takes."""
    tk = _require_tokamax()
    implementation = _tokamax_implementation(implementation)
    kw = {} if implementation is None else {"implementation": implementation}

    def dot(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, preferred_element_type=None):
        out = tk.ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                                    preferred_element_type=preferred_element_type, **kw)
        return _vary_like(out, lhs, rhs)
    return dot


def _tokamax_forward(x, group_sizes, w_in, w_out, out_dtype, gated=False, implementation=None):
    """The forward on tokamax's kernels. Not gated: SiLU fused into the first GEMM's epilogue
    (in f32 on the accumulator, then bf16: what einsum_mlp does). Gated: the first GEMM's f32
    output [T, 2F], then the gated hidden by XLA (one elementwise fusion over the rows; rows
    past sum(group_sizes) are undefined there too, and the second GEMM reads none of them)."""
    tk = _require_tokamax()
    implementation = _tokamax_implementation(implementation)
    kw = {} if implementation is None else {"implementation": implementation}
    try:
        if gated:
            pre = tk.ragged_dot(x, w_in, group_sizes, preferred_element_type=f32, **kw)
            h = act.hidden(pre, True).astype(bf16)
        else:
            h = tk.ragged_dot(x, w_in, group_sizes, preferred_element_type=bf16,
                              activation=jax.nn.silu, **kw)
        y = tk.ragged_dot(_vary_like(h, x, w_in), w_out, group_sizes,
                          preferred_element_type=out_dtype, **kw)
        return _vary_like(y, x, w_in, w_out)
    except Exception as e:  # NotImplementedError, or an ExceptionGroup of them
        if not isinstance(e, NotImplementedError) and type(e).__name__ != "ExceptionGroup":
            raise
        raise NotImplementedError(
            f"tokamax has no ragged_dot for x {x.dtype}{list(x.shape)}, w "
            f"{w_in.dtype}{list(w_in.shape)} on {jax.default_backend()} ({e}): pick "
            "expert_gemm='einsum' or 'ragged_dot'") from e


@functools.cache
def _tokamax_primal(implementation=None):
    return functools.partial(_tokamax_forward, implementation=implementation)


# The weight-gradient GEMM writes L*K*N weights whatever its window: up to ~64 rows per expert
# the write, not the FLOPs, bounds it on an H200 (R1: 0.9 GB of d w per weight, 0.23 ms; 64
# rows: 0.09 ms of FLOPs), so a wider window is free and keeps skewed small batches off the
# chunked path (R1, 16 tokens per rank: 4 rows per expert on average, 10 at most).
MIN_GRAD_WINDOW = 64


def grad_window_for(rows: int, num_local_experts: int, mean_rows: int | None = None) -> int:
    """The weight gradients' rows per expert (grouped_vjp): twice the mean rows per expert
    (mean_rows; default: an even share of all `rows`, the packed capacity), a multiple of 8,
    at least MIN_GRAD_WINDOW, at most `rows`."""
    mean = mean_rows if mean_rows is not None else -(-rows // max(num_local_experts, 1))
    return min(rows, max(MIN_GRAD_WINDOW, -(-2 * mean // 8) * 8))


# wgrad options whose weight gradients were measured wrong with tokamax's kernel (its
# ragged-contracting dot, docs/design-decisions.md): kept to measure the kernel again, refused
# unless the caller says it knows.
KNOWN_WRONG_TOKAMAX_WGRAD = ("kernel",)


def tokamax_mlp(x, group_sizes, w_in, w_out, out_dtype=f32, implementation=None,
                grad_window: int | None = None, wgrad: str = "windows",
                mean_rows: int | None = None, gated: bool = False,
                allow_known_wrong: bool = False):
    """"tokamax": packed x [T, H] -> [T, H] through tokamax's grouped GEMM; rows past
    sum(group_sizes) are undefined. Weights as einsum_mlp's (gated: w_in [L, H, 2F]).
    implementation: tokamax's (TOKAMAX_OWN_CHOICE: its own choice); None: JMC_TOKAMAX_IMPL if
    set, else the tile for mean_rows, the expected rows per local expert (layer_tokamax_spec;
    None: tokamax's own choice).
    Differentiable through grouped_vjp (not tokamax's own VJP, whose weight gradients were
    wrong on the H200): grad_window rows per expert in the weight gradients' batched GEMM
    (default grad_window_for), wgrad: grouped_vjp.WGRAD; one of KNOWN_WRONG_TOKAMAX_WGRAD
    only with allow_known_wrong=True (a benchmark measuring it)."""
    if wgrad not in grouped_vjp.WGRAD:
        raise ValueError(f"wgrad={wgrad!r}: one of {grouped_vjp.WGRAD}")
    if wgrad in KNOWN_WRONG_TOKAMAX_WGRAD and not allow_known_wrong:
        raise ValueError(
            f"wgrad={wgrad!r}: tokamax's ragged-contracting kernel gave weight gradients "
            "0.45-0.67 wrong past 128 rows on the H200; the default 'windows' is right. "
            "Pass allow_known_wrong=True only to measure that kernel.")
    window = grad_window or grad_window_for(x.shape[0], w_in.shape[0])
    if window < 1:
        raise ValueError(f"grad_window={grad_window}: rows per expert must be >= 1")
    # Inputs on one varying type (e.g. rows split over ("dp", "ep"), weights over "ep"): a
    # custom VJP must return each cotangent with its primal's type; autodiff of these casts
    # sums the weight gradients over the axes the weights do not vary over.
    x, w_in, w_out = (_vary_like(v, x, w_in, w_out) for v in (x, w_in, w_out))
    # The environment's choice resolved here, not inside the cached builders below: they would
    # keep the first value they saw (a later JMC_TOKAMAX_IMPL would not reach a new trace).
    implementation = tokamax_choice(implementation, mean_rows)
    primal = _tokamax_primal(implementation)
    return grouped_vjp.grouped_mlp(x, group_sizes.astype(jnp.int32), w_in, w_out,
                                   jnp.dtype(out_dtype), _tokamax_dot(implementation), primal,
                                   int(window), wgrad, bool(gated))


def _grouped_mlp(x, group_sizes, w_in, w_out, out_dtype, grad_window=None, mean_rows=None,
                 gated=False):
    """The grouped GEMM under "masked": tokamax's when it imports, else XLA's ragged_dot."""
    if tokamax_problem() is None:
        return tokamax_mlp(x, group_sizes, w_in, w_out, out_dtype, grad_window=grad_window,
                           mean_rows=mean_rows, gated=gated)
    return ragged_dot_mlp(x, group_sizes, w_in, w_out, out_dtype, gated)


def masked_inner() -> str:
    """Which grouped GEMM "masked" runs here: "tokamax" or "ragged_dot"."""
    return "tokamax" if tokamax_problem() is None else "ragged_dot"


def masked_mlp(x, counts, w_in, w_out, out_dtype=f32, total_rows: int | None = None,
               grad_window: int | None = None, mean_rows: int | None = None,
               gated: bool = False):
    """"masked": padded x [L, R, H] -> [L, R, H], only rows r < counts[e] computed (zero past
    them): gathered into a packed view of total_rows rows (default L*R; pass the most that can
    be live, MoEConfig.max_recv_total), one grouped GEMM, scattered back. Weights as
    einsum_mlp's."""
    fn = functools.partial(_grouped_mlp, grad_window=grad_window, mean_rows=mean_rows,
                           gated=gated)
    return _via_packed(fn, x, counts, w_in, w_out, out_dtype, total_rows)


def _via_packed(fn, x, counts, w_in, w_out, out_dtype, total_rows):
    """A packed-rows fn on padded x: pack the live rows, fn, unpack (zero past the counts)."""
    L, R = x.shape[:2]
    packed = pack_rows(x, counts, total_rows or L * R)
    return unpack_rows(fn(packed, counts, w_in, w_out, out_dtype), counts, R)


# -- row buckets: a grouped GEMM over fewer static rows when fewer are live ------------------
# A grouped GEMM's grid is sized by its static rows: tokamax starts a block per row tile of the
# buffer, live or not, and under MPS (16 SMs a rank) a worst-case buffer's idle tiles cost
# waves (V2-Lite, 128 tokens: 6,144 rows for ~768 live, the layer 1.96x its floor on an H100
# against 1.52x with a 1.25 capacity). Buckets run it on the smallest static prefix of the
# rows that holds every live row, picked on the device by a conditional.
BUCKET_ALIGN = 8  # a bucket's rows (recv_rows_for's are multiples of 8 already)


def bucket_rows(rows: int, sizes) -> tuple[int, ...]:
    """The static row counts of a bucketed GEMM on `rows` packed rows: each of `sizes` rounded
    up to BUCKET_ALIGN, those below `rows`, then `rows` itself (the last bucket holds any
    load), ascending and distinct."""
    for b in sizes:
        if not b > 0:
            raise ValueError(f"row bucket {b}: a bucket holds at least one row")
    aligned = {-(-math.ceil(b) // BUCKET_ALIGN) * BUCKET_ALIGN for b in sizes}
    return tuple(sorted(b for b in aligned if b < rows)) + (rows,)


def bucketed_mlp(fn, x, group_sizes, w_in, w_out, out_dtype, buckets):
    """fn (a packed-rows option: (x [T, H], group_sizes, w_in, w_out, out_dtype) -> [T, H]) run
    on x[:b] for the smallest b of `buckets` (bucket_rows) with b >= sum(group_sizes), chosen
    on the device (lax.switch); rows past b come back as zeros (combine never reads them).

    On a GPU the switch is an XLA conditional. Inside a command buffer it is a CUDA graph
    conditional node, but only if CONDITIONAL is among the command types
    (`--xla_gpu_enable_command_buffer=+CONDITIONAL`, docs/knobs.md); otherwise XLA reads the
    branch index on the host, which waits for the GPU there. Differentiable: each branch is
    fn's own rule on its rows; but JAX makes every branch's saved values outputs of the
    conditional (the branch that runs zero-fills the others'), so under jax.grad a step saves
    and writes about the sum of the buckets' residuals (V2-Lite, 128 tokens, worst-case buffer:
    ~77 MB for the whole-buffer branch alone). Buckets are for inference; train with a
    capacity (MoELayerConfig.capacity_factor)."""
    rows = x.shape[0]
    if len(buckets) == 1:
        return fn(x, group_sizes, w_in, w_out, out_dtype)
    live = jnp.sum(group_sizes.astype(jnp.int32))
    # the first bucket that holds every live row (the last always does: rows >= live)
    index = jnp.sum((live > jnp.asarray(buckets[:-1], jnp.int32)).astype(jnp.int32))

    def branch(b):
        def run(x, group_sizes, w_in, w_out):
            y = fn(x[:b], group_sizes, w_in, w_out, out_dtype)
            return y if b == rows else jnp.pad(y, ((0, rows - b), (0, 0)))
        return run

    return jax.lax.switch(index, [branch(b) for b in buckets], x, group_sizes, w_in, w_out)


# -- the layer's entry point -----------------------------------------------------------------
def expert_mlp(x, counts, w_in, w_out, option: str = "auto", *, out_dtype=f32,
               rows_per_expert: int | None = None, total_rows: int | None = None,
               grad_window: int | None = None, row_buckets=None,
               mean_rows: int | None = None, gated: bool = False):
    """This rank's experts on dispatch's rows, in x's layout, through `option` (OPTIONS).

    x: padded [L, P, H] (P rows per expert: the handle's expert_capacity; row r of expert e
    live for r < counts[e]) or packed [T, H] (expert 0's rows, then 1's, ...; counts =
    group_sizes), bf16. w_in [L, H, F] (gated: [L, H, 2F], gate columns [0:F], up [F:2F]),
    w_out [L, F, H] bf16. Returns [L, P, H] or [T, H] in out_dtype; only the live rows are
    defined.
    rows_per_expert (packed x: the most rows one expert can hold, min(T, max_recv_tokens))
    and total_rows (padded x: the most live rows in all, min(L*P, max_recv_total)) size the
    other layout when the option converts (defaults: T, and L*P). grad_window: rows per expert
    of "tokamax"'s weight-gradient GEMM (grouped_vjp; e.g. MoEConfig.rows_per_expert_for(2)).
    row_buckets: packed x only, with an option that runs on packed rows ("tokamax",
    "ragged_dot", "masked"): static row counts (e.g. MoEConfig.recv_rows_for(1.25)) to run the
    GEMMs on the smallest that holds the live rows (bucketed_mlp); None or () runs all T rows.
    "auto" where it means the padded einsum (CPU) runs without them. mean_rows: the expected
    rows per local expert (MoEConfig.expected_rows_per_expert), which picks tokamax's tile on
    sm90 GPUs (layer_tokamax_spec) unless an implementation is named; None: tokamax's own.
    """
    requested = option
    option = resolve(option, layout="padded" if x.ndim == 3 else "packed")
    act.check_weights(w_in, w_out, gated)
    if row_buckets and requested == "auto" and option == "einsum":
        row_buckets = None  # the platform's choice has no packed GEMM to cut
    if row_buckets:
        if x.ndim == 3 or option == "einsum":
            raise ValueError(
                f"row_buckets={tuple(row_buckets)} needs packed rows and an option that runs "
                f"on them (tokamax, ragged_dot, masked); got a {x.ndim}-d x with "
                f"expert_gemm={option!r}")
        buckets = bucket_rows(x.shape[0], row_buckets)

        def on_rows(xb, gs, wi, wo, od):  # the option on a bucket's rows (window <= rows)
            window = min(grad_window, xb.shape[0]) if grad_window else None
            return expert_mlp(xb, gs, wi, wo, option, out_dtype=od, grad_window=window,
                              mean_rows=mean_rows, gated=gated)

        return bucketed_mlp(on_rows, x, counts, w_in, w_out, out_dtype, buckets)
    packed_fn = _grouped_mlp if option == "masked" else _PACKED_FNS.get(option)
    if option in ("masked", "tokamax"):  # the window reaches the backward
        packed_fn = functools.partial(packed_fn, grad_window=grad_window, mean_rows=mean_rows,
                                      gated=gated)
    elif packed_fn is not None:
        packed_fn = functools.partial(packed_fn, gated=gated)
    if x.ndim == 3:  # padded
        if option == "einsum":
            return einsum_mlp(x, w_in, w_out, out_dtype, gated)
        return _via_packed(packed_fn, x, counts, w_in, w_out, out_dtype, total_rows)
    if option == "einsum":  # packed rows through the padded einsum, and back
        padded = unpack_rows(x, counts, rows_per_expert or x.shape[0])
        return pack_rows(einsum_mlp(padded, w_in, w_out, out_dtype, gated), counts,
                         x.shape[0])
    return packed_fn(x, counts, w_in, w_out, out_dtype)  # "masked" on packed rows: no gather


_PACKED_FNS = {"ragged_dot": ragged_dot_mlp, "tokamax": tokamax_mlp}
