"""The MoE layer step against its floor (issue 24): router, dispatch, two expert GEMMs, combine,
jitted, per (config, tokens per rank, layout, expert_gemm option), beside the floor of a layer on
this GPU: the local experts' weights read once plus our dispatch + combine alone.

    python -m jax_moe_comm.launch -n 8 --oversubscribe -- python benchmarks/bench_layer.py \
        --tokens 1,16,128,512,1024,2048,4096 --budget-s 300 --commit abc1234 --out $OUT
    python benchmarks/bench_layer.py --configs tiny --tokens 4 --samples 2   # CPU smoke run (8
                                                          # emulated devices, reference backend)

Per row (all numbers per layer, per rank, the slowest rank of each sample, median of samples):
  loop_us     device time per layer: one jitted lax.fori_loop of n layers (each layer's output,
              RMS-normalised, is the next layer's input, or with --loop-input first the first
              input again, tied to the last output by a zero multiple so the layers stay in
              order; the trip count is an argument, so one program serves every n), timed at
              n = 1 and n = N (N: --target-ms per sample) with a key-value barrier before
              each sample; the slope (t(N) - t(1)) / (N - 1) (host launch and sync cancel
              out) where N >= 5, else (long layers) t(N) / N, as loop_method says;
              loop_slope_us and loop_avg_us = t(N) / N beside it.
  comm_us     the same loop with the expert GEMMs replaced by a cast (expert_x straight to
              combine; moe.experts_forward swapped while tracing): dispatch + combine (and the
              router, the normalisation) alone, same layout, same handle; timed again right
              after each row's loop (compiled once per handle), so a drift in the machine moves
              loop and floor together; comm_first_us is the handle's first row's figure.
  weight_read_us  the local experts' w_in + w_out read once while every rank on this GPU does
              the same: measured in this run (the faster of a reduction over the weights and half
              a copy of them, both in a fori_loop on every rank at once), else nominal
              (ranks sharing the GPU * bytes / --hbm-bps). Both are recorded.
  floor_us    weight_read_us + comm_us; ratio = loop_us / floor_us; ok = ratio <= 1.5.
  step_us     host wall time of one jitted layer call with its result awaited.
  peak_*      XLA's memory analysis of the compiled single-layer step (per rank): temp,
              argument, output, alias, generated code, and peak = argument + output + temp -
              alias (None where the backend reports none).
  err         max |y - y_ref| / max |y_ref| over live rows of one layer against the padded
              einsum layer on the same input (routing is the same; only GEMM numerics differ).

Rows run in priority order (decode rows of the listed options, capacity/skew rows, prefill rows,
then the --defer options) until --budget-s is spent; later rows are recorded as skipped. A row
whose predicted time per layer (FLOPs at --peak-flops, bytes at --hbm-bps, ranks sharing the
GPU) passes --max-layer-s, or whose compiled step needs more memory than a rank's share of the
GPU, is skipped with the reason; every error is recorded in its row (never a crash). Every
decision is taken on values gathered from all ranks, so the ranks stay in step.

Capacity (--capacity-factor, rows of --capacity-configs): packed rows (--capacity-gemm at
--capacity-tokens) need an AllToAll with max_recv_rows/overflow, padded rows (--padded-capacity-
gemm, the batched einsum, at --padded-capacity-tokens: by default --capacity-tokens and the
prefill sizes of --tokens) one with expert_capacity (rows per local expert,
MoEConfig.rows_per_expert_for); both are detected from its signature, else the row says
"capacity: not supported by this build" and runs the worst case. Rows: uniform routing with
overflow="drop"; --skew (that fraction of each rank's tokens biased onto the k experts 0..k-1,
which live on rank 0) with overflow="drop" (dropped rows from a2a.dropped_rows(), output
finite); and overflow="fail", whose check() must raise CapacityExceededError. Order: padded
capacity rows at decode sizes (the einsum over [L, P, H]: issue 24's likely goal figures), the
packed ones, the padded ones at prefill sizes, then the padded skew and fail rows.

Writes --out/<name>.json (meta + rows), <name>.md and <name>.png (matplotlib, if installed;
else `--replot <name>.json` draws it later on another machine), rewritten after every row, so
that a run cut short keeps what it measured. The .md, the .png and the line printed per row are
rendered from the rows by benchmarks/bench_layer_report.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import inspect
import json
import math
import os
import socket
import statistics
import sys
import time
from unittest import mock

import jax_moe_comm.distributed as dist

LAUNCHED = dist.managed()  # our launcher or a cluster manager (srun, mpirun)
if not LAUNCHED:  # a smoke run: 8 emulated CPU devices in one process
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
RANK, WORLD = dist.initialize()
T0 = time.perf_counter()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from bench_common import Attempt, Sync, short  # noqa: E402
from bench_layer_report import line, markdown, plot, replot  # noqa: E402
from jax_moe_comm import AllToAll  # noqa: E402
from jax_moe_comm import errors as jmc_errors  # noqa: E402
from jax_moe_comm import expert_gemm as G  # noqa: E402
from jax_moe_comm import moe as moe_mod  # noqa: E402
from jax_moe_comm.moe import MoELayerConfig, moe_forward, param_shapes  # noqa: E402

# (experts, top-k, hidden, expert ffn): DeepSeek-V2-Lite and DeepSeek-R1 MoE layers.
LAYERS = {"V2Lite": (64, 6, 2048, 1408), "R1": (256, 8, 7168, 2048), "tiny": (16, 4, 256, 512)}
DECODE_MAX_TOKENS = 128  # rows above are prefill rows
# Environment knobs (docs/knobs.md) that change what a row runs: recorded in the results.
KNOBS = ("JMC_RECV_DEQUANTIZE", "JMC_TOKAMAX_IMPL", "JMC_TRANSPORT")
f32, bf16 = jnp.float32, jnp.bfloat16
_A2A_PARAMS = inspect.signature(AllToAll).parameters
CAPACITY = "max_recv_rows" in _A2A_PARAMS  # the packed capacity
EXPERT_CAPACITY = "expert_capacity" in _A2A_PARAMS  # the padded one, per local expert
LAYER_FIELDS = {f.name for f in dataclasses.fields(MoELayerConfig)}
NO_CAPACITY = "capacity: not supported by this build"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="V2Lite,R1")
    p.add_argument("--tokens", default="1,16,128", help=f"per rank; > {DECODE_MAX_TOKENS}: "
                   "prefill rows (run after the decode and capacity rows)")
    p.add_argument("--layouts", default="padded,packed")
    p.add_argument("--expert-gemm", default="einsum,tokamax,masked,ragged_dot",
                   help=f"options (expert_gemm.OPTIONS {G.OPTIONS}) in priority order; "
                   "tokamax@<kernel spec> (e.g. tokamax@m128s2p1) runs tokamax with "
                   "JMC_TOKAMAX_IMPL=mosaic:<spec> for that row; a suffix ~<f>/<f>... "
                   "(e.g. tokamax~1.25/2) runs it with MoELayerConfig(gemm_row_buckets="
                   "(1.25, 2)), packed rows only")
    p.add_argument("--defer", default="masked,ragged_dot",
                   help="options run only after every other row")
    p.add_argument("--all-combos", action="store_true", help="every option on every layout "
                   "(default: einsum on every layout, the others on their native layout)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="0: no capacity rows")
    p.add_argument("--capacity-tokens", default="128,4096")
    p.add_argument("--capacity-configs", default="R1")
    p.add_argument("--capacity-gemm", default="tokamax",
                   help="options of the packed capacity rows, comma-separated (the skew and "
                   "fail rows run the first)")
    p.add_argument("--padded-capacity-tokens", default="auto",
                   help="tokens per rank of the padded capacity rows (auto: --capacity-tokens "
                        "and the prefill sizes of --tokens; '': none)")
    p.add_argument("--padded-capacity-gemm", default="einsum",
                   help="option of the padded capacity rows")
    p.add_argument("--skew", type=float, default=0.9,
                   help="fraction of tokens biased onto experts 0..k-1 in skew rows (0: none)")
    p.add_argument("--bf16", action="store_true", help="bf16 dispatch (default fp8)")
    p.add_argument("--shared-experts", type=int, default=0,
                   help="shared experts of width ffn each (MoELayerConfig.num_shared_experts; "
                        "the issue's layer step has none)")
    p.add_argument("--loop-input", choices=("output", "first"), default="output",
                   help="each looped layer's input: the previous output (its routing drifts: "
                   "busiest rank 1.21-1.33x the mean from the second layer on at V2-Lite, 128 "
                   "tokens, on the CPU) or the first input again (every layer routes as the "
                   "first)")
    p.add_argument("--samples", type=int, default=5, help="timed samples per loop length")
    p.add_argument("--step-calls", type=int, default=10)
    p.add_argument("--target-ms", type=float, default=30.0, help="device time of one sample")
    p.add_argument("--max-loop", type=int, default=50, help="most layers in one sample")
    p.add_argument("--max-layer-s", type=float, default=0.5,
                   help="skip rows predicted slower than this per layer")
    p.add_argument("--mem-per-rank-gb", type=float, default=0.0,
                   help="memory a rank may use (default: the device's limit / ranks on it)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="rows not started by then are recorded as skipped")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
    p.add_argument("--timeout-s", type=float, default=20.0, help="the handles' peer timeout")
    p.add_argument("--tol", type=float, default=5e-2, help="err above it: incorrect")
    p.add_argument("--hbm-bps", type=float, default=4.0e12, help="nominal HBM bytes/s")
    p.add_argument("--peak-flops", type=float, default=700e12, help="for predictions only")
    p.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    p.add_argument("--name", default="", help="file stem (default layer_ep<world>)")
    p.add_argument("--out", default="")
    p.add_argument("--replot", metavar="JSON", help="only rewrite the .md and .png of a run's "
                   "JSON (e.g. here, where the GPU machine had no matplotlib), then exit")
    p.add_argument("--plan", action="store_true", help="print the rows this command would "
                   "run, in order (one JSON object a line), and exit without running any")
    return p.parse_args(argv)


ARGS = parse()
say = print if RANK == 0 else (lambda *a, **kw: None)


# -- collective decisions (bench_common: Sync, every rank's payload under fresh tags; Attempt,
# a row's phases in step on every rank) ---------------------------------------------------------
SYNC = Sync("bench_layer")


# -- data ----------------------------------------------------------------------------------------
def replicated(mesh, value, dtype):
    value = np.asarray(value, dtype)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P()), lambda idx: value)


def per_rank(mesh, value, dtype):
    """A [world * len(value)] array whose every rank's block is `value`."""
    value = np.atleast_1d(np.asarray(value, dtype))
    world = mesh.devices.size
    return jax.make_array_from_callback((world * value.shape[0],) + value.shape[1:],
                                        NamedSharding(mesh, P("ep")), lambda idx: value)


def device_normal(mesh, shapes, seed, scales):
    """Per-rank random bf16 arrays (each rank its own key), made on the device: the R1 expert
    tensors never pass through a host."""
    def init(s):
        key = jax.random.fold_in(jax.random.key(s[0]), jax.lax.axis_index("ep"))
        keys = jax.random.split(key, len(shapes))
        return tuple((jax.random.normal(k, shp, bf16) * sc).astype(bf16)
                     for k, shp, sc in zip(keys, shapes, scales))

    fn = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=(P("ep"),) * len(shapes)))
    return fn(replicated(mesh, [seed], np.int32))


def make_params(cfg: MoELayerConfig, mesh, seed: int):
    E, H, F = cfg.num_experts, cfg.hidden, cfg.ffn
    L = E // mesh.devices.size
    rng = np.random.default_rng(seed)
    params = {"router": replicated(mesh, rng.standard_normal((H, E)) / np.sqrt(H), np.float32)}
    specs = {"router": P()}
    shapes = param_shapes(cfg)
    for name in ("shared_in", "shared_out") if cfg.num_shared_experts else ():
        shape = shapes[name]
        params[name] = replicated(mesh, rng.standard_normal(shape) / np.sqrt(shape[0]),
                                  jnp.bfloat16)
        specs[name] = P()
    w_in, w_out = device_normal(mesh, [(L, H, F), (L, F, H)], seed,
                                [1 / np.sqrt(H), 1 / np.sqrt(F)])
    params.update(w_in=w_in, w_out=w_out)
    specs.update(w_in=P("ep"), w_out=P("ep"))
    return params, specs


def renorm(y):
    """RMS-normalise each row (zero rows stay zero): the next layer's input keeps the scale of
    the first, so routing stays spread over the experts however many layers the loop runs."""
    yf = y.astype(f32)
    return (yf * jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + 1e-6)).astype(bf16)


def skewed_route_input(x, v, skew_rows: int):
    """What the benchmark's layer routes on: x, its first skew_rows rows pushed toward experts
    0..k-1 by the skew vector v (skew_vector); None (x itself) without skew."""
    if not skew_rows:
        return None
    rows = jnp.arange(x.shape[0])[:, None] < skew_rows
    return x.astype(f32) + jnp.where(rows, v[None, :], 0)


@functools.lru_cache(maxsize=None)  # one compile per layer shape and skew, not one per row
def rank_load(mesh, num_experts: int, k: int, skew_rows: int):
    """(router, x, n, skew vector) -> [world] rows each rank receives: the load a layer with
    input x gives the ranks (routed as the benchmark's layer routes), to tell the busiest
    rank's rows from the mean (the loop's routing drifts when each layer routes on the last
    one's output; docs/notes.md). Each rank counts its own tokens' rows on its device; the
    counts are summed on the host (bootstrap's all-gather): an XLA psum would need NCCL, which
    refuses several ranks on one GPU (the device machine's 8 ranks under MPS)."""
    world = mesh.devices.size
    L = num_experts // world

    def per_rank(router, x, n, v):
        route_x = skewed_route_input(x, v, skew_rows)
        idx, _ = moe_mod.route(router, x if route_x is None else route_x, k)
        live = (jnp.arange(x.shape[0]) < n.reshape(()))[:, None] & (idx >= 0)
        dest = jax.nn.one_hot(jnp.where(live, idx // L, -1), world, dtype=jnp.int32)
        return dest.sum(axis=(0, 1))

    local = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P("ep"), P("ep"), P()),
                                  out_specs=P("ep")))

    def load(router, x, n, v):  # None if any rank failed (a figure, never the row's failure)
        try:
            mine = [np.asarray(s.data).tolist() for s in local(router, x, n, v).addressable_shards]
        except Exception as e:  # noqa: BLE001 -- every rank still reaches the gather below
            print(f"[rank {RANK}] load: {short(e)}", flush=True)
            mine = None
        everyone = SYNC.gather("load", mine)
        if any(m is None for m in everyone):
            return None
        return np.sum([np.sum(m, axis=0) for m in everyone], axis=0)

    return load


def load_ratio(rows) -> float | None:
    """Busiest rank's rows over the mean (1.0: even); None without rows."""
    if rows is None:
        return None
    rows = np.asarray(rows, np.float64)
    return None if rows.sum() <= 0 else round(float(rows.max() / rows.mean()), 3)


def identity_experts(a2a, params, out, *args, **kwargs):
    """moe.experts_forward without the GEMMs: expert_x cast to the combine dtype."""
    ex = out.expert_x
    if out.expert_x_scale is not None:
        ex = moe_mod.dequantize_fp8(ex, out.expert_x_scale)
    return ex.astype(a2a.config.combine_dtype)


def skew_vector(router: np.ndarray, k: int, alpha: float = 10.0) -> np.ndarray:
    """b with (x + b) @ router ~ x @ router + alpha on experts 0..k-1 (router columns are close
    to orthogonal): a token routed on x + b picks those k experts."""
    cols = router[:, :k]
    return (alpha * cols / np.sum(cols * cols, axis=0, keepdims=True)).sum(axis=1)


# -- the cases -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    tokens: int
    layout: str
    gemm: str
    capacity: float = 0.0  # capacity factor, 0: none (worst-case buffers)
    overflow: str = ""  # "drop" / "fail" with capacity
    skew: float = 0.0
    kind: str = "layer"  # "layer", or "fail_check" (overflow="fail" must raise)
    # the capacity factor asked for, where this build has no capacity (runs worst-case buffers)
    wanted: float = dataclasses.field(default=0.0, compare=False)

    @property
    def phase(self):
        return "decode" if self.tokens <= DECODE_MAX_TOKENS else "prefill"

    @property
    def option(self) -> str:  # the layer's expert_gemm: a "tokamax@<spec>~<buckets>" row runs
        return split_gemm(self.gemm)[0]  # "tokamax"

    @property
    def tokamax_impl(self) -> str | None:  # JMC_TOKAMAX_IMPL while a "tokamax@<spec>" row runs
        spec = split_gemm(self.gemm)[1]
        return None if spec is None else G.TOKAMAX_SPEC_PREFIX + spec

    @property
    def row_buckets(self) -> tuple[float, ...]:  # MoELayerConfig.gemm_row_buckets ("~1.25/2")
        return split_gemm(self.gemm)[2]

    @property
    def group(self):  # what shares one handle and one comm-only measurement
        return (self.config, self.tokens, self.layout, self.capacity, self.overflow, self.skew)


def supported(case: Case) -> bool:
    """Whether this build's AllToAll takes the capacity of the case's layout."""
    return EXPERT_CAPACITY if case.layout == "padded" else CAPACITY


def split_gemm(gemm: str) -> tuple[str, str | None, tuple[float, ...]]:
    """An --expert-gemm entry <option>[@<kernel spec>][~<f>/<f>...] -> (option, the spec or
    None, the row buckets' capacity factors or ()): "tokamax@m128~1.25/2" -> ("tokamax",
    "m128", (1.25, 2.0)). Checks only the factors' syntax (check_gemm checks the rest)."""
    head, tilde, factors = gemm.partition("~")
    option, at, spec = head.partition("@")
    try:
        buckets = tuple(float(f) for f in factors.split("/")) if tilde else ()
    except ValueError:
        raise ValueError(f"--expert-gemm {gemm!r}: ~ takes capacity factors joined by '/', "
                         "e.g. tokamax~1.25/2") from None
    return option, spec if at else None, buckets


def check_gemm(gemm: str) -> str:
    """An --expert-gemm entry: an expert_gemm option, or "tokamax@<spec>" (tokamax with that
    kernel spec, expert_gemm.TOKAMAX_SPEC_GRAMMAR), either with "~<f>/<f>..." (row buckets,
    MoELayerConfig.gemm_row_buckets); returns the option."""
    option, spec, buckets = split_gemm(gemm)
    if buckets:
        MoELayerConfig(gemm_row_buckets=buckets)  # (its checks: factors > 0)
        if option == "einsum":
            raise ValueError(f"--expert-gemm {gemm!r}: row buckets need packed rows; the "
                             "einsum runs padded ones")
    G.check_option(option)
    if spec is not None:
        if option != "tokamax":
            raise ValueError(f"--expert-gemm {gemm!r}: only tokamax takes @<kernel spec>")
        G.parse_tokamax_spec(spec)
    return option


def spec_probe(case: Case, world: int, implementation: str) -> dict:
    """For a tokamax@<spec> row, per forward GEMM of the layer (packed rows at the case's
    capacity): "spec" where tokamax's Mosaic GPU kernel takes the spec, else why not (tokamax
    then falls back to its own config, and the row measures that). Traced only."""
    d = shape_of(case, world)
    out = {}
    try:
        tk = G._require_tokamax()
        first = G._tokamax_implementation(implementation)[0]
    except Exception as e:  # noqa: BLE001 -- recorded in the row, the same on every rank
        return {"error": short(e)}
    counts = jax.ShapeDtypeStruct((d["L"],), jnp.int32)
    for gemm, (K, N) in (("w_in", (d["H"], d["F"])), ("w_out", (d["F"], d["H"]))):
        lhs = jax.ShapeDtypeStruct((d["packed"], K), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((d["L"], K, N), jnp.bfloat16)
        try:  # tokamax's own call with our kernel alone: it raises where it would fall back
            jax.eval_shape(lambda a, b, g: tk.ragged_dot(a, b, g, preferred_element_type=bf16,
                                                         implementation=(first,)),
                           lhs, rhs, counts)
            out[gemm] = "spec"
        except Exception as e:  # noqa: BLE001
            out[gemm] = ("refused: " if isinstance(e, NotImplementedError) else "fails: ") \
                + short(e)[:200]
    return out


def combos(args):
    out = []
    for gemm in args.expert_gemm.split(","):
        option = check_gemm(gemm)
        for layout in args.layouts.split(","):
            native = G.NATIVE_LAYOUT.get(G.resolve(option, layout=layout))
            if split_gemm(gemm)[2] and layout != "packed":
                continue  # buckets cut packed rows only
            if args.all_combos or gemm == "einsum" or native == layout:
                out.append((layout, gemm))
    return out


def plan(args) -> list[Case]:
    """Every row, most important first."""
    configs = args.configs.split(",")
    tokens = [int(t) for t in args.tokens.split(",") if t]  # "": capacity rows only
    decode = [t for t in tokens if t <= DECODE_MAX_TOKENS]
    prefill = [t for t in tokens if t > DECODE_MAX_TOKENS]
    defer = set(filter(None, args.defer.split(",")))
    cs = combos(args)
    deferred = [c for c in cs if c[1] in defer or check_gemm(c[1]) in defer]
    first = [c for c in cs if c not in deferred]
    later = deferred

    def rows(toks, which):
        return [Case(c, t, lay, g) for c in configs for t in toks for lay, g in which]

    cases = rows(decode, first)
    cap_tokens = [int(t) for t in args.capacity_tokens.split(",") if t]
    if args.padded_capacity_tokens == "auto":
        padded_tokens = sorted(set(cap_tokens) | set(prefill))
    else:
        padded_tokens = [int(t) for t in args.padded_capacity_tokens.split(",") if t]
    pg = args.padded_capacity_gemm
    cap_gemms = [g for g in args.capacity_gemm.split(",") if g]
    for g in cap_gemms:
        check_gemm(g)
    check_gemm(pg)
    if split_gemm(pg)[2]:
        raise ValueError(f"--padded-capacity-gemm {pg!r}: row buckets cut packed rows only")
    if args.capacity_factor > 0 or args.skew > 0:
        cf = args.capacity_factor
        for c in args.capacity_configs.split(","):
            if c not in LAYERS:
                continue
            if cf > 0:  # the padded einsum over P rows per expert, decode sizes first
                cases += [Case(c, t, "padded", pg, cf, "drop") for t in padded_tokens
                          if t <= DECODE_MAX_TOKENS]
            for t in cap_tokens:
                if cf > 0:
                    cases += [Case(c, t, "packed", g, cf, "drop") for g in cap_gemms]
                if args.skew > 0:
                    cases.append(Case(c, t, "packed", cap_gemms[0], cf, "drop", args.skew))
                    if cf > 0:
                        cases.append(Case(c, t, "packed", cap_gemms[0], cf, "fail",
                                          args.skew, kind="fail_check"))
            if cf > 0:
                cases += [Case(c, t, "padded", pg, cf, "drop") for t in padded_tokens
                          if t > DECODE_MAX_TOKENS]
            if cf > 0 and args.skew > 0 and padded_tokens:
                for t in cap_tokens:
                    cases.append(Case(c, t, "padded", pg, cf, "drop", args.skew))
                    cases.append(Case(c, t, "padded", pg, cf, "fail", args.skew,
                                      kind="fail_check"))
    cases += rows(prefill, first) + rows(decode, later) + rows(prefill, later)
    seen, out = set(), []
    for c in cases:
        if not supported(c) and c.capacity and c.kind == "layer":  # worst-case buffers instead
            c = dataclasses.replace(c, capacity=0.0, overflow="", wanted=c.capacity)
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


# -- predictions ---------------------------------------------------------------------------------
def shape_of(case: Case, world: int):
    E, k, H, F = LAYERS[case.config]
    L = E // world
    R = case.tokens * world  # max_recv rows per local expert
    packed = R * min(k, L)  # max_recv_total
    per_expert = R  # padded rows per local expert (expert_capacity)
    if case.capacity and supported(case):
        if case.layout == "packed":  # ~recv_rows_for
            packed = min(packed, int(math.ceil(case.capacity * case.tokens * k)))
        else:  # rows_per_expert_for
            rows = math.ceil(case.capacity * -(-world * case.tokens * k // E))
            per_expert = min(R, -(-rows // 8) * 8)
    hot = case.skew * world + (1 - case.skew)  # rank 0's load, in units of the uniform load
    live = case.tokens * k * max(1.0, hot)
    return dict(E=E, k=k, H=H, F=F, L=L, R=R, P=per_expert, packed=packed, live=live)


def predict_layer_s(case: Case, world: int, sharing: int, args) -> float:
    """Optimistic seconds per layer on this GPU: GEMM FLOPs at --peak-flops plus weights and
    dispatch buffers at --hbm-bps, times the ranks sharing the GPU."""
    s = shape_of(case, world)
    g = G.resolve(case.option, layout=case.layout)
    if g == "einsum":
        rows = s["L"] * s["P"]  # P = R unless a padded capacity
    elif g == "ragged_dot" or (g == "masked" and G.masked_inner() == "ragged_dot"):
        rows = s["L"] * s["packed"]  # XLA's dense lowering: every expert over every row
    else:
        rows = s["live"]
    flops = 4 * rows * s["H"] * s["F"]
    buf_rows = s["L"] * s["P"] if case.layout == "padded" or not CAPACITY else s["packed"]
    nbytes = 4 * s["L"] * s["H"] * s["F"] + 4 * buf_rows * s["H"] * 2
    return sharing * (flops / args.peak_flops + nbytes / args.hbm_bps)


def min_bytes(case: Case, world: int) -> int:
    """A lower bound of a step's XLA memory per rank: expert_x and expert_y in bf16 over the
    padded rows (L * P: P the expert capacity, else max_recv), or over the packed rows where a
    capacity bounds them. Rows far past a rank's share skip without compiling."""
    s = shape_of(case, world)
    rows = s["packed"] if case.layout == "packed" and case.capacity and CAPACITY else \
        s["L"] * s["P"]
    return 2 * rows * s["H"] * 2


# -- timing --------------------------------------------------------------------------------------
def timed(fn):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def time_loop(att: Attempt, name: str, run, args):
    """run(n) runs a compiled n-iteration loop. Per iteration µs by the slope between n = 1 and
    n = N (N sized to --target-ms from a probe), slowest rank per sample, median of --samples.
    Collective; None when a rank failed."""
    att.do(f"{name}:warm", lambda: [timed(lambda: run(1)) for _ in range(2)])
    _, probe = att.do(f"{name}:probe", lambda: timed(lambda: run(2)) / 2, payload=lambda r: r)
    if att.failed:
        return None
    per = max(probe)
    n_big = int(min(args.max_loop, max(2, round(args.target_ms / 1e3 / max(per, 1e-7)))))
    samples = args.samples if per * n_big < 0.5 else max(2, min(args.samples, 3))
    t1, tn = [], []
    for i in range(samples):
        for n, into in ((1, t1), (n_big, tn)):
            _, got = att.do(f"{name}:{n}:{i}", lambda n=n: timed(lambda: run(n)),
                            payload=lambda r: r)
            if att.failed:
                return None
            into.append(max(got))
    m1, mn = statistics.median(t1), statistics.median(tn)
    slope, avg = (mn - m1) / (n_big - 1), mn / n_big
    # The slope drops the call's fixed cost (launch, sync: ~0.1 ms); with few layers per sample
    # (long layers, where that cost is < 1 %) or a slope lost in noise, t(N)/N is the figure.
    use_slope = n_big >= 5 and slope > 0.5 * avg
    return dict(us=(slope if use_slope else avg) * 1e6, slope_us=slope * 1e6, avg_us=avg * 1e6,
                method="slope" if use_slope else "t(N)/N", n=n_big, samples=samples,
                one_us=m1 * 1e6)


def memory(compiled) -> dict:
    """XLA's memory analysis of a compiled program, per rank (None fields where none)."""
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # noqa: BLE001
        return dict(error=short(e))
    if m is None:
        return dict(error="memory_analysis() returned None on this backend")
    out = {}
    for key in ("temp", "argument", "output", "alias", "generated_code"):
        v = getattr(m, f"{key}_size_in_bytes", None)
        out[key] = None if v is None else int(v)
    if None not in (out["temp"], out["argument"], out["output"], out["alias"]):
        out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    pk = getattr(m, "peak_memory_in_bytes", None)
    if pk:
        out["xla_peak"] = int(pk)
    return out


def custom_calls(hlo_text: str) -> str:
    """Which GEMM kernels the compiled program holds (as benchmarks/bench_gemm.py names them)."""
    markers = (('custom_call_target="mosaic', "mosaic_gpu"),
               ("__gpu$xla.gpu.triton", "pallas_triton"), ("__triton_gemm", "xla_triton_gemm"),
               ("__cublas$lt", "cublasLt"), ("__cublas$gemm", "cublas"), ("__cudnn$", "cudnn"))
    return "+".join(name for key, name in markers if key in hlo_text) or "xla"


# -- the run -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
        self.world = self.mesh.devices.size
        me = jax.local_devices()[0]
        where = [socket.gethostname(), getattr(me, "local_hardware_id", None), me.platform]
        everyone = SYNC.gather("where", where)
        self.sharing = everyone.count(where) if LAUNCHED else 1
        stats = me.memory_stats() or {}
        limit = stats.get("bytes_limit")
        self.mem_per_rank = (args.mem_per_rank_gb * 2**30 if args.mem_per_rank_gb else
                             None if limit is None else limit / self.sharing)
        self.params, self.weights_bw, self.refs = {}, {}, {}
        self.handle, self.handle_key, self.comm, self.handle_rows = None, None, {}, None
        self.comm_runs = {}  # group -> its compiled comm-only loop (on the open handle)
        self.handle_expert_capacity = None
        self.rows = []
        tk = G.tokamax_problem()
        self.meta = dict(
            gpu=getattr(me, "device_kind", me.platform), platform=me.platform,
            world=self.world, processes=WORLD, ranks_per_gpu=self.sharing,
            mps_share=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            commit=self.args.commit, date=datetime.datetime.now(datetime.UTC).isoformat(
                timespec="seconds"),
            command=" ".join(["python"] + sys.argv), jax=jax.__version__,
            xla_flags=os.environ.get("XLA_FLAGS", ""), backend_requested=args.backend,
            loop_input=args.loop_input,
            dispatch_dtype="bf16" if args.bf16 else "fp8", shared_experts=args.shared_experts,
            capacity_support=CAPACITY, expert_capacity_support=EXPERT_CAPACITY,
            tokamax_problem=tk, masked_inner=G.masked_inner(),
            hbm_bps_nominal=args.hbm_bps, mem_per_rank_bytes=self.mem_per_rank,
            budget_s=args.budget_s, weights={}, finished=False,
            # the knobs that change what a row runs (docs/knobs.md), as this run saw them
            knobs={k: os.environ[k] for k in KNOBS if k in os.environ})

    # -- per config ---------------------------------------------------------------------------
    def layer_cfg(self, case: Case) -> MoELayerConfig:
        E, k, H, F = LAYERS[case.config]
        kw = dict(num_experts=E, experts_per_token=k, hidden=H, ffn=F,
                  max_num_tokens=case.tokens, fp8_dispatch=not self.args.bf16,
                  num_shared_experts=self.args.shared_experts, expert_gemm=case.option)
        if case.capacity and "capacity_factor" in LAYER_FIELDS:
            kw["capacity_factor"] = case.capacity
        if case.row_buckets:
            kw["gemm_row_buckets"] = case.row_buckets
        return MoELayerConfig(**kw)

    def config_params(self, case: Case, att: Attempt):
        """The config's parameters (made once), and its weight-read measurement. Collective."""
        if case.config not in self.params:
            cfg = self.layer_cfg(dataclasses.replace(case, capacity=0.0))
            made, _ = att.do("params", lambda: make_params(cfg, self.mesh, seed=1))
            if att.failed:
                return None
            self.params[case.config] = made
            self.weights_bw[case.config] = self.measure_weights(case.config)
        return self.params[case.config]

    def measure_weights(self, config: str) -> dict:
        """The local experts' weights read once (a reduction) and copied once, on every rank at
        once, per iteration; with the bytes and the nominal time."""
        E, _, H, F = LAYERS[config]
        L = E // self.world
        nbytes = 2 * L * H * F * 2
        out = dict(bytes_per_rank=nbytes,
                   nominal_us=1e6 * self.sharing * nbytes / self.args.hbm_bps)
        params, _ = self.params[config]
        spec = P("ep")
        att = Attempt(f"weights:{config}", SYNC)

        def read_body(i, c):
            wi, wo, s, acc = c
            wi, wo = jax.lax.optimization_barrier((wi, wo))
            r = jnp.sum(wi, dtype=f32) * s + jnp.sum(wo, dtype=f32) * s
            return wi, wo, s + 0 * r, acc + r

        def copy_body(i, c):
            wi, wo = jax.lax.optimization_barrier(c)
            return -wi, -wo

        def read(n, wi, wo):
            zero = 0 * wi[0, 0, 0].astype(f32)  # varying over 'ep' like the loop's sums
            acc = jax.lax.fori_loop(0, n, read_body, (wi, wo, zero + 1, zero))[3]
            return acc.reshape(1)

        def copy(n, wi, wo):
            return jax.lax.fori_loop(0, n, copy_body, (wi, wo))

        for name, fn, outs in (("read", read, spec), ("copy", copy, (spec, spec))):
            prog = jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), spec, spec),
                                         out_specs=outs))
            counts = {}

            def run(n, prog=prog, counts=counts):
                if n not in counts:
                    counts[n] = replicated(self.mesh, n, np.int32)
                return prog(counts[n], params["w_in"], params["w_out"])

            t = time_loop(att, f"{name}", run, self.args)
            out[f"{name}_us"] = None if t is None else round(t["us"], 2)
        if att.error:
            out["error"] = att.error
        cands = [v for v in (out.get("read_us"), (out.get("copy_us") or 0) / 2 or None)
                 if v]
        out["measured_us"] = min(cands) if cands else None
        if out["measured_us"]:
            out["hbm_bps_measured"] = self.sharing * nbytes / (out["measured_us"] * 1e-6)
        self.meta["weights"][config] = out
        say(f"{config}: local experts' weights {nbytes / 2**20:.1f} MiB per rank, read "
            f"{out.get('read_us')} us, copy {out.get('copy_us')} us, nominal "
            f"{out['nominal_us']:.1f} us ({self.sharing} ranks on this device) "
            f"{out.get('error', '')}", flush=True)
        return out

    # -- handles ------------------------------------------------------------------------------
    def close_handle(self):
        self.comm_runs.clear()  # their programs call the handle being closed
        if self.handle is not None:
            h, self.handle, self.handle_key = self.handle, None, None
            try:
                h.close()
            except Exception as e:  # noqa: BLE001
                say(f"close: {short(e)}")

    def open_handle(self, case: Case, cfg: MoELayerConfig, att: Attempt):
        key = case.group + (case.kind,)
        if self.handle_key == key and self.handle is not None:
            return self.handle
        self.close_handle()
        kw = dict(axis_name="ep", layout=case.layout, backend=self.args.backend,
                  timeout_s=5.0 if case.kind == "fail_check" else self.args.timeout_s)
        if case.capacity and supported(case):
            comm = cfg.comm_config(self.world)
            if case.layout == "packed":
                kw["max_recv_rows"] = comm.recv_rows_for(case.capacity)
            else:
                kw["expert_capacity"] = comm.rows_per_expert_for(case.capacity)
            kw["overflow"] = case.overflow
        self.handle_rows = kw.get("max_recv_rows")
        self.handle_expert_capacity = kw.get("expert_capacity")
        h, _ = att.do("handle", lambda: AllToAll(cfg.comm_config(self.world), **kw))
        if h is not None:
            self.handle, self.handle_key = h, key
        return h

    # -- one row ------------------------------------------------------------------------------
    def row_base(self, case: Case) -> dict:
        E, k, H, F = LAYERS[case.config]
        resolved = G.resolve(case.option, layout=case.layout)
        return dict(config=case.config, num_experts=E, experts_per_token=k, hidden=H, ffn=F,
                    tokens_per_rank=case.tokens, phase=case.phase, layout=case.layout,
                    expert_gemm=case.gemm,
                    # the kernel spec this row's tokamax ran with, as the layer chooses it
                    # (the row's own is in JMC_TOKAMAX_IMPL while it runs; None: tokamax's)
                    tokamax_impl=case.tokamax_impl or (
                        G.tokamax_choice(None, self.layer_cfg(case).comm_config(
                            self.world).expected_rows_per_expert)
                        if resolved in G.NEEDS_TOKAMAX and G.tokamax_problem() is None
                        else None),
                    expert_gemm_resolved=resolved,
                    # the buckets the layer ran with ("auto" meaning the einsum takes none)
                    gemm_row_buckets=(list(case.row_buckets) or None) if resolved != "einsum"
                    else None,
                    dispatch_dtype="bf16" if self.args.bf16 else "fp8",
                    capacity_factor=case.capacity or None, overflow=case.overflow or None,
                    skew=case.skew, kind=case.kind, wanted_capacity_factor=case.wanted or None,
                    status="", error="", note="")

    def run_case(self, case: Case) -> dict:
        row = self.row_base(case)
        world, args = self.world, self.args
        if G.tokamax_spec(row["tokamax_impl"]):  # did tokamax's kernel take the spec?
            row["tokamax_spec_probe"] = spec_probe(case, world, row["tokamax_impl"])
        if case.kind == "fail_check" and not supported(case):
            row.update(status="skipped", error=NO_CAPACITY)
            return row
        if case.wanted:
            row["note"] = f"{NO_CAPACITY}: asked capacity {case.wanted}, ran worst-case buffers"

        elapsed = max(SYNC.gather(f"elapsed:{len(self.rows)}", time.perf_counter() - T0))
        if elapsed > args.budget_s:
            row.update(status="skipped", error=f"skipped: past the {args.budget_s:.0f} s budget")
            return row
        pred = predict_layer_s(case, world, self.sharing, args)
        row["predicted_layer_us"] = round(pred * 1e6, 1)
        if pred > args.max_layer_s:
            row.update(status="skipped", error=f"skipped: predicted {pred:.2f} s per layer > "
                       f"--max-layer-s {args.max_layer_s}")
            return row
        least = min_bytes(case, world)
        if self.mem_per_rank and least > 0.9 * self.mem_per_rank:
            row.update(status="skipped", error=(
                f"skipped: expert_x and expert_y alone need {least / 2**30:.1f} GiB per rank; "
                f"a rank's share is {self.mem_per_rank / 2**30:.1f} GiB"))
            return row
        att = Attempt(f"row{len(self.rows)}", SYNC)
        cfg = None
        try:
            cfg = self.layer_cfg(case)
        except Exception as e:  # noqa: BLE001 -- the same on every rank
            row.update(status="error", error=short(e))
            return row
        made = self.config_params(case, att)
        params, pspecs = made if made is not None else (None, None)
        wb = self.weights_bw.get(case.config, {})
        a2a = self.open_handle(case, cfg, att) if not att.failed else None
        if att.failed:
            row.update(status="error", error=att.error)
            self.close_handle()
            return row
        comm_cfg = cfg.comm_config(world)
        row.update(max_recv_rows=self.handle_rows, max_recv_total=comm_cfg.max_recv_total,
                   expert_capacity=self.handle_expert_capacity,
                   max_recv_tokens=comm_cfg.max_recv_tokens)
        mesh, T, H = self.mesh, case.tokens, cfg.hidden
        skew_rows = int(math.ceil(case.skew * T))
        x0 = device_normal(mesh, [(T, H)], seed=7, scales=[1.0])[0]
        nt = per_rank(mesh, [T], np.int32)
        sv = replicated(mesh, skew_vector(np.asarray(params["router"].addressable_data(0)),
                                          cfg.experts_per_token) if skew_rows else
                        np.zeros(H), np.float32)

        def layer(p, x, n, v, comm_only=False):
            route_x = skewed_route_input(x, v, skew_rows)
            if comm_only:
                with mock.patch.object(moe_mod, "experts_forward", identity_experts):
                    y = moe_forward(a2a, cfg, p, x, n.reshape(()), route_x=route_x)
            else:
                y = moe_forward(a2a, cfg, p, x, n.reshape(()), route_x=route_x)
            return renorm(y)

        first_input = self.args.loop_input == "first"

        def looped(comm_only):
            def loop(cnt, p, x, n, v):
                def body(_, h):  # "first": x again, ordered after h (XLA keeps x + 0 * h)
                    return layer(p, x + 0 * h if first_input else h, n, v, comm_only)
                return jax.lax.fori_loop(0, cnt, body, x)
            return jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P(), pspecs, P("ep"),
                                                                     P("ep"), P()),
                                         out_specs=P("ep")))

        step = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(pspecs, P("ep"), P("ep"), P()),
                                     out_specs=P("ep")))
        counts = {}

        def count(n):
            if n not in counts:
                counts[n] = replicated(mesh, n, np.int32)
            return counts[n]

        # 1. compile the step: memory, kernels, and whether it fits
        compiled, mems = att.do("compile", lambda: step.lower(params, x0, nt, sv).compile(),
                                payload=lambda c: memory(c))
        if compiled is not None:
            row["impl"] = custom_calls(compiled.as_text())
        if not att.failed:
            mem = mems[0]
            row["peak_bytes"] = mem
            need = [m.get("temp", 0) + m.get("output", 0) for m in mems if "error" not in m]
            if self.mem_per_rank and need:
                stats = jax.local_devices()[0].memory_stats() or {}
                in_use = max(SYNC.gather(f"inuse:{len(self.rows)}", stats.get("bytes_in_use", 0)))
                row["bytes_in_use"] = in_use
                if in_use + max(need) > 0.9 * self.mem_per_rank:
                    row.update(status="skipped", error=(
                        f"skipped: the step needs {max(need) / 2**30:.2f} GiB of XLA memory per "
                        f"rank beside {in_use / 2**30:.2f} GiB in use; a rank's share is "
                        f"{self.mem_per_rank / 2**30:.2f} GiB"))
                    return row
        # 2. one layer: output, correctness against the padded einsum layer, step time
        if case.kind == "fail_check":
            return self.fail_check(case, row, att, compiled, params, x0, nt, sv)
        def first_step():
            t = time.perf_counter()
            y = jax.block_until_ready(compiled(params, x0, nt, sv))
            return y, time.perf_counter() - t

        got, errs = att.do("step", first_step,
                           payload=lambda r: dict(self.local_err(case, r[0]), s=r[1]))
        y = None if got is None else got[0]
        if not att.failed:
            row["finite"] = all(e["finite"] for e in errs)
            ref_key = (case.config, case.tokens, case.skew)
            if case.layout == "padded" and G.resolve(case.option, layout="padded") == "einsum" \
                    and not case.capacity:
                self.refs[ref_key] = [np.asarray(s.data) for s in y.addressable_shards]
                row["err"] = 0.0
            elif all(e.get("err") is not None for e in errs):
                row["err"] = float(f"{max(e['err'] for e in errs):.3g}")
            if row.get("err") is not None:
                row["correct"] = bool(row["err"] <= args.tol) and row["finite"]
            # as many host-synced calls as fit in ~1 s (at least 3)
            n_calls = int(max(3, min(args.step_calls, 1.0 / max(max(e["s"] for e in errs),
                                                                 1e-6))))
            _, st = att.do("step_time", lambda: [timed(lambda: compiled(params, x0, nt, sv))
                                                  for _ in range(n_calls)], payload=lambda r: r)
            if not att.failed:
                row["step_us"] = round(statistics.median(max(c) for c in zip(*st)) * 1e6, 1)
        # 3. the loop of layers, then dispatch + combine alone (once per handle and skew)
        t = None
        if not att.failed:
            loop = looped(False)
            xs = {}

            def run(n):
                xs["last"] = loop(count(n), params, x0, nt, sv)
                return xs["last"]

            t = time_loop(att, "loop", run, args)
        if t is not None:
            # the ranks' load at the loop's first layer and at the input a next layer would get
            load = rank_load(mesh, cfg.num_experts, cfg.experts_per_token, skew_rows)

            def loads():
                first = load(params["router"], x0, nt, sv)
                last = first if first_input else load(params["router"], xs["last"], nt, sv)
                return load_ratio(first), load_ratio(last)

            row["load_first"], row["load_last"] = loads()
            row.update(loop_us=round(t["us"], 2), loop_avg_us=round(t["avg_us"], 2),
                       loop_slope_us=round(t["slope_us"], 2), loop_method=t["method"],
                       loop_n=t["n"], samples=t["samples"])
            _, fin = att.do("loop_finite", lambda: bool(np.all([np.isfinite(
                np.asarray(s.data, np.float32)).all() for s in xs["last"].addressable_shards])),
                payload=lambda r: r)
            if not att.failed:
                row["finite"] = row.get("finite", True) and all(fin)
        # Timed again for every row, right after its loop: the first row of a handle runs
        # while ranks still compile and settle (a comm loop of 682 us there, 203 us in the next
        # run of the same call, 2745fad), and the floor must see what the loop saw.
        comm_key = case.group
        c = None
        if not att.failed:
            run_comm = self.comm_runs.get(comm_key)
            if run_comm is None:
                comm = looped(True)
                run_comm = self.comm_runs[comm_key] = (
                    lambda n, comm=comm, a=(params, x0, nt, sv), count=count:
                    comm(count(n), *a))
            c = time_loop(att, "comm", run_comm, args)
            if c is not None:
                self.comm.setdefault(comm_key, c)
        first = self.comm.get(comm_key)
        c = c or first
        if c is not None:
            row["comm_us"], row["comm_method"] = round(c["us"], 2), c["method"]
            row["comm_first_us"] = round(first["us"], 2)
        # 4. the handle's own report: errors, dropped rows
        _, chk = att.do("check", lambda: self.check_handle(
            lambda: compiled(params, x0, nt, sv)), payload=lambda r: r)
        if not att.failed and chk and chk[0] is not None:
            row["dropped_rows_per_rank"] = [c[0] for c in chk]  # over every layer run
            row["dropped_rows"] = int(sum(c[0] for c in chk))
            row["dropped_rows_one_layer"] = [c[1] for c in chk]  # the first layer, per rank
        # 5. the floor
        row["weight_bytes_per_rank"] = wb.get("bytes_per_rank")
        row["weight_read_nominal_us"] = round(wb["nominal_us"], 2) if wb else None
        row["weight_read_measured_us"] = wb.get("measured_us")
        wr = wb.get("measured_us") or (wb.get("nominal_us") if wb else None)
        row["weight_read_us"] = None if wr is None else round(wr, 2)
        s = shape_of(case, world)
        row["flop_us"] = round(1e6 * self.sharing * 4 * s["live"] * s["H"] * s["F"] /
                               args.peak_flops, 2)
        if row.get("comm_us") is not None and wr is not None:
            floor = wr + row["comm_us"]
            row["floor_us"] = round(floor, 2)
            row["floor_nominal_us"] = round(wb["nominal_us"] + row["comm_us"], 2)
            row["floor_with_flops_us"] = round(max(wr, row["flop_us"]) + row["comm_us"], 2)
            if row.get("loop_us") is not None and floor > 0:
                row["ratio"] = round(row["loop_us"] / floor, 3)
                row["ok"] = bool(row["ratio"] <= 1.5)
        if att.failed:
            row.update(status="error", error=att.error)
            self.close_handle()  # a handle that saw an error is not reused
        else:
            row["status"] = "ok"
        return row

    def local_err(self, case: Case, y) -> dict:
        """This rank's finiteness and error of one layer's output against the reference."""
        shards = [np.asarray(s.data, np.float32) for s in y.addressable_shards]
        out = dict(finite=bool(all(np.isfinite(s).all() for s in shards)), err=None)
        ref = self.refs.get((case.config, case.tokens, case.skew))
        if ref is not None:
            num = max(float(np.max(np.abs(s - r.astype(np.float32)))) for s, r in zip(shards, ref))
            den = max(float(np.max(np.abs(r.astype(np.float32)))) for r in ref)
            out["err"] = num / max(den, 1e-30)
        return out

    def check_handle(self, one_layer):
        """check() (raises what the handle recorded), then this rank's dropped rows: in all
        (cumulative over the handle's life) and in one more layer (None where the build has no
        capacity)."""
        self.handle.check()
        dropped = getattr(self.handle, "dropped_rows", None)
        if dropped is None:
            return None
        before = int(dropped())
        jax.block_until_ready(one_layer())
        self.handle.check()
        after = int(dropped())
        return [after, after - before]

    def fail_check(self, case, row, att, compiled, params, x0, nt, sv):
        """overflow="fail" with the skewed routing: one layer, then check() must raise
        CapacityExceededError on some rank (and no rank another error)."""
        def go():
            jax.block_until_ready(compiled(params, x0, nt, sv))
            try:
                self.handle.check()
            except Exception as e:  # noqa: BLE001 -- the expected outcome, recorded
                return [type(e).__name__, short(e)]
            return ["", ""]

        _, got = att.do("fail_step", go, payload=lambda r: r)
        self.close_handle()
        if att.failed:
            row.update(status="error", error=att.error)
            return row
        cls = getattr(jmc_errors, "CapacityExceededError", None)
        names = [g[0] for g in got]
        row["raised"] = names
        row["raised_messages"] = sorted({g[1] for g in got if g[1]})[:3]
        want = "CapacityExceededError" if cls is None else cls.__name__
        row["fail_raised"] = want in names
        row["status"] = "ok" if row["fail_raised"] else "error"
        if not row["fail_raised"]:
            row["error"] = f"overflow='fail' did not raise {want} (raised: {names})"
        return row

    # -- output -------------------------------------------------------------------------------
    def write(self, final=False):
        if RANK != 0 or not self.args.out:
            return
        os.makedirs(self.args.out, exist_ok=True)
        stem = os.path.join(self.args.out, self.args.name or f"layer_ep{self.world}")
        self.meta["elapsed_s"] = round(time.perf_counter() - T0, 1)
        self.meta["finished"] = final
        with open(stem + ".json", "w") as f:
            json.dump(dict(self.meta, rows=self.rows), f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(self.meta, self.rows))
        if final or len(self.rows) % 8 == 0:
            self.meta["png"] = plot(stem + ".png", self.meta, self.rows)

    def run(self):
        cases = plan(self.args)
        self.meta["planned_rows"] = len(cases)
        say(f"bench_layer: {len(cases)} rows, {self.world} ranks ({self.sharing} per device), "
            f"{self.meta['gpu']}, capacity API {'yes' if CAPACITY else 'no'} (packed), "
            f"{'yes' if EXPERT_CAPACITY else 'no'} (padded), tokamax "
            f"{self.meta['tokamax_problem'] or 'ok'}", flush=True)
        for case in cases:
            # a tokamax@<spec> row: JMC_TOKAMAX_IMPL set for it alone (expert_gemm resolves it
            # at each trace), restored after
            spec = {G.TOKAMAX_IMPL_ENV: case.tokamax_impl} if case.tokamax_impl else {}
            with mock.patch.dict(os.environ, spec):
                row = self.run_case(case)
            row["elapsed_s"] = round(time.perf_counter() - T0, 1)
            self.rows.append(row)
            say(line(row), flush=True)
            self.write()
        self.close_handle()
        self.write(final=True)
        return 0


def main() -> int:
    if ARGS.replot:
        return replot(ARGS.replot)
    if ARGS.plan:
        for case in plan(ARGS):
            say(json.dumps(dict(dataclasses.asdict(case), phase=case.phase)))
        return 0
    bench = Bench(ARGS)
    try:
        return bench.run()
    except BaseException as e:  # a broken run still writes what it has
        if RANK == 0:
            bench.meta["fatal"] = short(e)
            bench.write(final=False)
        raise


if __name__ == "__main__":
    sys.exit(main())
