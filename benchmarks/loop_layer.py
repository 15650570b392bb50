"""Our MoE layer timed by one clock, as the peer layer is, beside the floor that means something
(GitHub issue 47, points 2 and 3 and the training goal).

    python -m jax_moe_comm.launch -n 8 --oversubscribe -- python benchmarks/loop_layer.py \
        --budget-s 480 --commit abc1234 --out $OUT/layer_ours.json
    python benchmarks/loop_layer.py --configs tiny --tokens 4 --ks 1,2 --reps 1   # CPU smoke
                                        # run: 8 emulated devices, reference backend, wall clock

The layer is the library's, with its default options: moe.moe_forward on a packed handle,
expert_gemm "auto" (tokamax on GPUs), no capacity; fp8 dispatch, SiLU-gated experts
(MoELayerConfig.gated: w_in [E, H, 2F], gate columns [:F], up [F:]) and --shared-experts S
shared experts (MoELayerConfig.num_shared_experts, which the layer overlaps with the flights;
the peer layer has none, so S = 0 by default). A build without those fields gives error rows
that say so ("this build has no gated experts"); --ungated times gated=False rows.

What is measured, per (config, tokens per rank, S, variant):
- per_layer_us, intercept_us: one jitted shard_map call holds an on-stream barrier, a CUDA
  event (record_event slot 0), K layers written out and a second event (slot 1); per rank the
  events' elapsed time, per repetition the max over ranks, the median over --reps, and the
  least-squares fit elapsed = intercept + per_layer * K over --ks. Layers are chained
  (--loop-input output, the default): each layer's output, RMS-normalised, is the next one's
  input, so every router sees a different, realistic input (the busiest rank's load drifts
  to 1.2-1.3x the mean after the first layer; the floor below is computed from those very
  inputs). --loop-input first: every layer reads the first x again, tied to the previous
  layer's output by order_after (every layer routes as the first). Every layer reads the same
  weights (one copy per rank: R1's do not fit K times; larger than L2 where many experts are
  live), each through an optimization barrier of its own (layer_params), so that no op on the
  weights alone is computed once for all K layers. XLA records every program as a graph
  (--xla_gpu_graph_min_graph_size=1, as bench_loop.py); hlo_copy_bytes_by_k: the bytes of the
  compiled program's copy instructions (a weight copied per layer would show there).
- variant "graph": the forward layers. Variant "fwd+bwd": jax.value_and_grad of
  sum(y_K * x) over the same chained layers on a differentiable handle, w.r.t. x and every
  layer's expert weights (w_in, w_out). The layers share one weight copy, so each layer's
  weights pass through a gradient sink (grad_sink below): its dW is computed and written in
  full, as a model with its own weights per layer writes it, but not summed into one
  accumulator over the K layers (an add of the whole [L, H, 3F] per layer that no real step
  pays). Router and shared experts get no gradient. Always chained (an order_after tie passes
  no gradient: "first" would leave K - 1 backward passes dead).
- compiled_programs: XLA executables compiled by the first call of each K's step (jax's
  backend-compile events), per K; compiled_programs_constant says whether it is the same for
  every K, recompiles whether any timed or warm-up call compiled again (it must not).
- the floor: live experts per rank (>= 1 row) from the routing of the timed layers' inputs (a
  jitted scan of the same chained layers counts expert rows per sender; the counts are summed
  on the host through the key-value store, since NCCL refuses 8 ranks on one GPU);
  busiest_rank_live_experts and weight_bytes_busiest = that * (H*2F + F*H) * 2 (bf16; H*F +
  F*H ungated) + the shared experts' weights (every rank reads them once per layer), averaged
  over the layer inputs. hbm_bytes_per_s: one rank's bytes per second reading its local
  experts' weights (a reduction written out --hbm-n times between the events, slope) while
  every rank reads at once; hbm_bytes_per_s_alone: rank 0 alone. weight_floor_busiest_us =
  weight_bytes_busiest / hbm_bytes_per_s (issue 47's formula: below a layer's true floor
  only if ranks are even, above it when they are not, since the others then leave the busiest
  bandwidth: measured on an H100, R1 at 1 token ran at 0.89x it); weight_floor_us, the floor
  used: per layer max(the busiest rank's bytes at the alone rate, the bytes of every rank on
  the busiest GPU at their all-at-once rate) (weight_floors below). comm_floor_us:
  bench_loop's floor-barrier-2calls (two data-free kernels that each cross every rank,
  chained as dispatch and combine are, K cycles, slope) on the row's handle; floor_us =
  max(weight, comm) (the GEMMs and the flights can overlap), floor_sum_us = their sum,
  ratio_floor = per_layer_us / floor_us.
- correct, max_rel_err: before a config's first row, the layer on a small case (4 tokens per
  rank) against benchmarks/layer_oracle.py (numpy; same weights and x), tolerance --tol; a
  config whose case does not fit --check-max-gb of host memory per process (R1) is checked at
  reduced hidden and ffn (check_shape says which), same experts, top-k and handle kind. Where
  layer_oracle is missing or rows are ungated: moe.dense_forward (the layer's own oracle).

Without the launcher (no dist.managed()), a CPU smoke run: 8 emulated devices, the reference
backend, no events: clock "wall" (host time around each call, the fit cancels the fixed part);
no floor kernels there (comm_floor_us None). Rows run graph first (every config, then
fwd+bwd) until --budget-s; later rows and Ks are recorded as skipped; every error is recorded
in its row, never a crash; every decision is taken on values gathered from all ranks.

Writes --out (default $OUT/layer_ours.json) after every row: {meta..., rows: [...]}, meta: gpu,
gpu_count, world, processes, commit, date, command, jax, expert_gemm (expert_gemm.resolve),
tokamax_problem, clock, loop_input; each row: {method: "jax_moe_comm_layer", config,
num_experts, experts_per_token, hidden, ffn, num_shared_experts, gated, tokens_per_rank,
dispatch_dtype: "fp8_e4m3", layout, variant, per_layer_us, intercept_us, ks, elapsed_us,
floor_us, floor_sum_us, weight_floor_us, comm_floor_us, hbm_bytes_per_s,
busiest_rank_live_experts, weight_bytes_busiest, ratio_floor, compiled_programs, correct,
max_rel_err, error} plus clock, status, tokamax_impl, check_shape, oracle, k_errors,
weight_floor_busiest_us, hbm_bytes_per_s_alone, memory_gib_by_k, hlo_copy_bytes_by_k, ...
benchmarks/layer_compare.py joins it with the peer's rows (layer_pplx.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import re
import socket
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bench_common import Attempt, Sync, fit_line, git_commit, short
from jax_moe_comm import AllToAll, _bench, order_after, resolve_backend
from jax_moe_comm import expert_gemm as G
from jax_moe_comm import moe as moe_mod
from jax_moe_comm.moe import MoELayerConfig, moe_forward

# (experts, top-k, hidden, expert ffn): DeepSeek-V2-Lite and R1 MoE layers, and a CPU one.
LAYERS = {"V2Lite": (64, 6, 2048, 1408), "R1": (256, 8, 7168, 2048), "tiny": (16, 4, 256, 128)}
ALIASES = {"V2-Lite": "V2Lite", "v2lite": "V2Lite", "r1": "R1"}
VARIANTS = ("graph", "fwd+bwd")
NO_GATED = "this build has no gated experts (MoELayerConfig.gated)"
NO_SHARED = "this build has no num_shared_experts (MoELayerConfig.num_shared_experts)"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's


# -- arithmetic (pure; tests/test_loop_layer.py) ----------------------------------------------
def slowest_median(per_rank: list[list[float]]) -> float:
    """[rank][rep] -> the median over repetitions of the slowest rank's time."""
    return statistics.median(max(col) for col in zip(*per_rank))


def fit_per_layer(points) -> tuple[float | None, float | None]:
    """[(K, elapsed us)] -> (intercept_us, per_layer_us): least squares over K."""
    return fit_line(points)


def per_iteration(points) -> float | None:
    """us per iteration of [(n, elapsed)]: the slope, unless noise made it small against
    t(N) / N (then t(N) / N, an upper bound that keeps the fixed cost)."""
    pts = [(n, y) for n, y in points if y is not None]
    if not pts:
        return None
    _, b = fit_line(pts)
    n, y = max(pts)
    avg = y / n
    return b if b is not None and b > 0.5 * avg else avg


def expert_bytes(hidden: int, ffn: int, gated: bool) -> int:
    """bf16 bytes of one expert's w_in and w_out."""
    return (hidden * (2 if gated else 1) * ffn + ffn * hidden) * 2


def live_per_rank(counts, world: int) -> list[list[int]]:
    """counts [layers, E] rows per expert (summed over every sender) -> [layers][rank] local
    experts with >= 1 row (rank r holds experts [r*L, (r+1)*L))."""
    c = np.asarray(counts)
    return (c.reshape(c.shape[0], world, c.shape[1] // world) > 0).sum(axis=-1).tolist()


def weight_floors(live, groups, per_expert: int, shared: int, bps_rank_all, bps_alone) -> dict:
    """The weights' floor of a layer, per layer input then averaged over them.

    live [layers][rank] local experts with rows; groups[rank]: which GPU the rank is on;
    bps_rank_all: one rank's bytes/s while every rank of its GPU reads at once (the GPU's HBM
    split between them); bps_alone: one rank's bytes/s reading alone. A layer ends when its
    busiest rank has read its live experts' (and the shared experts') weights once, and not
    before its GPU has served every rank's such bytes. So per layer
        max(busiest rank's bytes / bps_alone,  busiest GPU's bytes / (its ranks * bps_rank_all)).
    Where every rank is equally busy the second is the busiest rank's bytes / bps_rank_all:
    weight_floor_busiest_us (that figure for the busiest rank whatever the balance, issue 47's
    first formula; above the floor when ranks are unequal: the others leave it bandwidth)."""
    out = dict(busiest_rank_live_experts=None, weight_bytes_busiest=None, weight_floor_us=None,
               weight_floor_busiest_us=None, weight_floor_alone_us=None,
               weight_floor_gpu_us=None)
    if not live:
        return out
    members = {}
    for r, g in enumerate(groups):
        members.setdefault(g, []).append(r)
    busiest = [max(layer) for layer in live]
    bytes_busiest = [b * per_expert + shared for b in busiest]
    # the busiest GPU's bytes per layer, as the time its ranks' share of HBM takes
    gpu_us = ([max(sum(layer[r] * per_expert + shared for r in rs) / (len(rs) * bps_rank_all)
                   for rs in members.values()) * 1e6 for layer in live] if bps_rank_all else None)
    alone_us = [b / bps_alone * 1e6 for b in bytes_busiest] if bps_alone else None
    mean = statistics.fmean
    out.update(busiest_rank_live_experts=mean(busiest), weight_bytes_busiest=mean(bytes_busiest))
    if bps_rank_all:
        out["weight_floor_busiest_us"] = mean(bytes_busiest) / bps_rank_all * 1e6
        out["weight_floor_gpu_us"] = mean(gpu_us)
    if alone_us:
        out["weight_floor_alone_us"] = mean(alone_us)
    parts = [v for v in (gpu_us, alone_us) if v]
    if parts:
        out["weight_floor_us"] = mean(max(vs) for vs in zip(*parts))
    return out


def floors(weight_us: float | None, comm_us: float | None) -> dict:
    """floor_us = max(weights, comm) (the GEMMs and the flights can overlap), floor_sum_us
    their sum; None where a part is missing."""
    both = weight_us is not None and comm_us is not None
    return dict(weight_floor_us=weight_us, comm_floor_us=comm_us,
                floor_us=max(weight_us, comm_us) if both else None,
                floor_sum_us=weight_us + comm_us if both else None)


def rel_err(y, y_ref) -> float:
    """layer_oracle.rel_err's measure: the max over rows (tokens) of max|y - y_ref| / max|y_ref|
    of that row; inf if y is not finite."""
    y, r = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    y2, r2 = y.reshape(-1, y.shape[-1]), r.reshape(-1, r.shape[-1])
    den = np.maximum(np.abs(r2).max(axis=1), 1e-30)
    return float((np.abs(y2 - r2).max(axis=1) / den).max()) if y2.size else 0.0


def ratio(a, b):
    return None if a is None or not b else a / b


def check_dims(dims: tuple, max_gb: float) -> tuple:
    """(E, k, H, F) of a config's correctness case: its own where the oracle's f32 weights
    (E * H * 3F * 4 bytes per process) fit max_gb, else H and F halved (kept multiples of 128,
    the fp8 block) until they fit."""
    E, k, H, F = dims
    while E * H * 3 * F * 4 > max_gb * 2**30 and H % 256 == 0 and F % 256 == 0:
        H, F = H // 2, F // 2
    return E, k, H, F


def param_shapes(dims: tuple, gated: bool, shared: int) -> dict:
    """name -> full shape of the layer's parameters (moe.init_params' names), gated w_in
    [E, H, 2F] (gate [:F], up [F:]); S shared experts as one [H, 2SF] / [SF, H] pair."""
    E, _, H, F = dims
    g = 2 if gated else 1
    out = {"router": (H, E), "w_in": (E, H, g * F), "w_out": (E, F, H)}
    if shared:
        out.update(shared_in=(H, g * shared * F), shared_out=(shared * F, H))
    return out


# -- the run (collective; main() initializes first) --------------------------------------------
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="V2Lite,R1", help=f"from {sorted(LAYERS)}")
    p.add_argument("--tokens", default="1,4,16,128", help="tokens per rank, comma list")
    p.add_argument("--ks", default="1,4,16", help="layers per timed call, comma list")
    p.add_argument("--reps", type=int, default=5, help="timed calls per K (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shared-experts", default="0", help="S values, comma list")
    p.add_argument("--ungated", action="store_true", help="gated=False rows (default gated)")
    p.add_argument("--loop-input", choices=("output", "first"), default="output",
                   help="forward rows: each layer's input is the last output, RMS-normalised, "
                        "or the first x again (fwd+bwd rows are always chained)")
    p.add_argument("--hbm-n", type=int, default=4, help="weight reads of the bandwidth probe")
    p.add_argument("--check-max-gb", type=float, default=3.0,
                   help="host GB per process for the correctness case's f32 weights")
    p.add_argument("--tol", type=float, default=3e-2)
    p.add_argument("--oracle", default="", help="path of layer_oracle.py (default: beside me)")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
    p.add_argument("--timeout-s", type=float, default=20.0, help="the handles' peer timeout")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="rows and Ks not started by then are recorded as skipped")
    p.add_argument("--commit", default=os.environ.get("GIT_COMMIT", ""))
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "layer_ours.json"))
    a = p.parse_args(argv)
    a.configs = [ALIASES.get(c, c) for c in a.configs.split(",") if c]
    a.tokens = [int(t) for t in a.tokens.split(",") if t]
    a.ks = sorted({int(k) for k in a.ks.split(",") if k})
    a.variants = [v for v in a.variants.split(",") if v]
    a.shared_experts = [int(s) for s in a.shared_experts.split(",") if s]
    if len(a.ks) < 2 or a.ks[0] < 1 or any(v not in VARIANTS for v in a.variants) or \
            any(c not in LAYERS for c in a.configs) or a.hbm_n < 2:
        p.error(f"--ks: two distinct K >= 1; --variants from {VARIANTS}; --configs from "
                f"{sorted(LAYERS)}; --hbm-n >= 2")
    return a


# -- the layer's pieces --------------------------------------------------------------------------
f32, bf16 = jnp.float32, jnp.bfloat16
LAYER_FIELDS = {f.name for f in dataclasses.fields(MoELayerConfig)}
COMPILES = [0]  # XLA executables compiled in this process (jax's backend-compile events)


def _count_compile(event, duration, **kwargs):
    if event == BACKEND_COMPILE_EVENT:
        COMPILES[0] += 1


def layer_config(dims: tuple, tokens: int, shared: int, gated: bool) -> MoELayerConfig:
    """The layer with its default options (expert_gemm "auto", no capacity), fp8 dispatch;
    NotImplementedError where this build lacks the gated / shared-expert fields."""
    E, k, H, F = dims
    kw = dict(num_experts=E, experts_per_token=k, hidden=H, ffn=F, max_num_tokens=tokens,
              fp8_dispatch=True)
    if "gated" in LAYER_FIELDS:
        kw["gated"] = gated
    elif gated:
        raise NotImplementedError(NO_GATED)
    if "num_shared_experts" in LAYER_FIELDS:
        kw["num_shared_experts"] = shared
    elif shared:
        raise NotImplementedError(NO_SHARED)
    elif "shared_expert" in LAYER_FIELDS:
        kw["shared_expert"] = False  # the old boolean's default is True
    return MoELayerConfig(**kw)


def check_param_names(gated: bool, shared: int) -> None:
    """moe.init_params names and shapes the parameters as param_shapes does (probed on a small
    config); a ValueError says how they differ (this script would feed the layer wrong)."""
    dims = (8, 2, 128, 24)
    got = {k: tuple(v.shape) for k, v in
           moe_mod.init_params(layer_config(dims, 4, shared, gated), seed=0).items()}
    want = param_shapes(dims, gated, shared)
    if got != want:
        raise ValueError(f"moe.init_params gives {got} for (E, k, H, F) = {dims}; this script "
                         f"expects {want}")


@jax.custom_vjp
def grad_sink(w, s):
    """w itself; under jax.grad the cotangent dW is computed and written in full (the barrier),
    and flows to the scalar s (one element of it) instead of being summed into w's gradient:
    K layers sharing one weight copy cost what K layers with their own weights cost, without
    an accumulation over [L, H, 3F] per layer that no real step pays."""
    return w


def _sink_fwd(w, s):
    return w, None


def _sink_bwd(_, g):
    g = jax.lax.optimization_barrier(g)
    return None, g.reshape(-1)[0].astype(f32)


grad_sink.defvjp(_sink_fwd, _sink_bwd)


def layer_params(p: dict, n, j: int) -> dict:
    """Layer j's own view of the one weight copy every layer reads: the parameters through an
    optimization barrier with n + j (n: the ticket after event 0). A real model's layers have
    their own weights; here, without it, XLA would compute once per call (and CSE across the
    K layers) any op on the weights alone (a cast, a transpose for a backward GEMM), which a
    model pays per layer. The barrier copies nothing (its outputs alias its inputs) and ties
    such ops after event 0, not to the layer's input."""
    names = sorted(p)
    out = jax.lax.optimization_barrier(tuple(p[k] for k in names) + (n + j,))
    return dict(zip(names, out[:-1]))


_COPY = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* copy\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "f8e4m3fn": 1,
          "pred": 1, "f64": 8, "s64": 8}


def copy_bytes(hlo_text: str) -> int:
    """Bytes written by the copy instructions of a compiled program's text (a weight copied
    per layer would show here: a diagnostic, not a figure)."""
    total = 0
    for dtype, dims in _COPY.findall(hlo_text):
        total += _BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def renorm(y):
    """RMS-normalise each row (zero rows stay zero), as bench_layer's loop does: the next
    layer's input keeps the first one's scale, so routing stays spread however many layers."""
    yf = y.astype(f32)
    return (yf * jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + 1e-6)).astype(bf16)


CONTEXT_BYTES = 512 * 2**20  # a CUDA context under MPS, roughly, beside XLA's allocations


def symmetric_bytes(size: str | None) -> int:
    """NVSHMEM_SYMMETRIC_SIZE ("2G", "512M", "1073741824"; the launcher sets 2G) in bytes;
    NVSHMEM's own default (1 GiB) when unset or unreadable."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        s = (size or "").strip().upper().rstrip("B")
        return int(float(s[:-1]) * units[s[-1]]) if s[-1:] in units else int(s)
    except (ValueError, IndexError):
        return 2**30


def memory_need(compiled) -> int | None:
    """Bytes a call needs beyond its arguments (XLA's temp + output), None where unknown."""
    try:
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 -- no analysis on this backend
        return None


def load_oracle(path: str):
    """benchmarks/layer_oracle.py (or `path`) as a module, or (None, why not)."""
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "layer_oracle.py")
    try:
        spec = importlib.util.spec_from_file_location("layer_oracle", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, ""
    except Exception as e:  # noqa: BLE001 -- e.g. not written yet
        return None, f"{path}: {short(e)}"


def oracle_case(oracle, dims: tuple, tokens: int, world: int, seed: int, shared: int) -> dict:
    """layer_oracle.make_case at (E, k, H, F) = dims (its weights depend on dims and seed, not
    on the config's name, so a reduced case is the oracle's own), its shapes checked. The
    expert weights stay lazy (generated per expert when indexed)."""
    kw = {"num_shared_experts": shared} if shared else {}
    case = oracle.make_case(tuple(dims), tokens, world, seed, **kw)
    want = dict(param_shapes(dims, True, shared), x=(world, tokens, dims[2]))
    got = {k: tuple(np.shape(case[k])) if k in case else None for k in want}
    if got != want:
        raise ValueError(f"layer_oracle.make_case({tuple(dims)}) shapes {got}, expected {want}")
    return case


# -- the run -------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, rank: int, nproc: int, launched: bool):
        self.args, self.rank, self.nproc = args, rank, nproc
        self.sync = Sync("loop_layer")
        self.t0 = time.perf_counter()
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
        self.world = self.mesh.devices.size
        me = jax.local_devices()[0]
        where = [socket.gethostname(), getattr(me, "local_hardware_id", None), me.platform]
        everyone = self.sync.gather("where", where)
        self.sharing = everyone.count(where) if launched else 1  # processes on my device
        limit = (me.memory_stats() or {}).get("bytes_limit")
        self.mem_per_rank = None if limit is None else limit / self.sharing
        first = layer_config_or_none(LAYERS[args.configs[0]], 1)
        self.backend = resolve_backend(args.backend, first.comm_config(self.world)
                                       if first else None)
        # CUDA events where our kernels run (record_event, on-stream barrier, floor kernels)
        self.events = self.backend == "nvshmem"
        if self.events and self.mem_per_rank:
            # what XLA's allocator does not see on a GPU shared by `sharing` processes: each
            # one's NVSHMEM heap and CUDA context (R1's fwd+bwd ran out of memory on an H100
            # with the share limit / sharing alone)
            self.mem_per_rank -= symmetric_bytes(os.environ.get("NVSHMEM_SYMMETRIC_SIZE"))
            self.mem_per_rank -= CONTEXT_BYTES
        if self.events:
            from jax_moe_comm import init
            init()
            self.record_event, self.elapsed = _bench.record_event, _bench.event_elapsed_us
        self.oracle, oracle_problem = load_oracle(args.oracle)
        self.params_key, self.params = None, None
        self.checks, self.counts, self.bandwidths = {}, {}, {}
        # which GPU each mesh rank is on (weight_floors: ranks of a GPU share its HBM)
        self.groups = ([json.dumps(everyone[d.process_index]) for d in jax.devices()]
                       if launched else list(range(self.world)))
        self.rows = []
        self.meta = dict(
            tool="loop_layer", gpu=getattr(me, "device_kind", me.platform), platform=me.platform,
            gpu_count=len({tuple(w) for w in everyone}) if me.platform == "gpu" else 0,
            world=self.world, processes=nproc, ranks_per_gpu=self.sharing,
            mps_share=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            commit=args.commit or git_commit(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(["python"] + sys.argv), jax=jax.__version__,
            xla_flags=os.environ.get("XLA_FLAGS", ""), backend=self.backend,
            clock="event" if self.events else "wall", loop_input=args.loop_input,
            expert_gemm=G.resolve("auto", layout="packed"), tokamax_problem=G.tokamax_problem(),
            has_gated="gated" in LAYER_FIELDS,
            has_num_shared_experts="num_shared_experts" in LAYER_FIELDS,
            oracle=oracle_problem or "layer_oracle", ks=args.ks, reps=args.reps,
            budget_s=args.budget_s, finished=False)

    def say(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def elapsed_all(self) -> float:
        return max(self.sync.gather("elapsed", time.perf_counter() - self.t0))

    # -- device arrays ------------------------------------------------------------------------
    def replicated(self, value, dtype):
        value = np.asarray(value, dtype)
        return jax.make_array_from_callback(value.shape, NamedSharding(self.mesh, P()),
                                            lambda idx: value)

    def sharded(self, full, dtype):
        """An array every process can index in full (numpy, or the oracle's lazy expert
        stacks: indexed on the first axis only), rank r's block on rank r."""
        def block(idx):
            return np.asarray(np.asarray(full[idx[0]], np.float32)[(slice(None),) + idx[1:]],
                              dtype)

        return jax.make_array_from_callback(tuple(full.shape), NamedSharding(self.mesh, P("ep")),
                                            block)

    def per_rank(self, value, dtype=np.int32):
        value = np.atleast_1d(np.asarray(value, dtype))
        return jax.make_array_from_callback((self.world * value.shape[0],) + value.shape[1:],
                                            NamedSharding(self.mesh, P("ep")), lambda idx: value)

    def device_normal(self, seed: int, sharded: list, shared: list):
        """bf16 normal arrays made on the devices (R1's experts never cross a host): `sharded`
        [(shape per rank, scale)] each rank its own, `shared` the same on every rank."""
        def init(s):
            key = jax.random.key(s[0])
            mine = jax.random.fold_in(key, jax.lax.axis_index("ep"))
            out = [(jax.random.normal(k, shp, bf16) * sc).astype(bf16) for k, (shp, sc) in
                   zip(jax.random.split(mine, max(len(sharded), 1)), sharded)]
            out += [(jax.random.normal(k, shp, bf16) * sc).astype(bf16) for k, (shp, sc) in
                    zip(jax.random.split(key, max(len(shared), 1)), shared)]
            return tuple(out)

        specs = (P("ep"),) * len(sharded) + (P(),) * len(shared)
        fn = jax.jit(jax.shard_map(init, mesh=self.mesh, in_specs=P(), out_specs=specs))
        return fn(self.replicated([seed], np.int32))

    def make_params(self, dims, gated: bool, shared: int):
        """The timed layer's parameters (router f32, the rest bf16), scaled 1/sqrt(fan in)."""
        shapes = param_shapes(dims, gated, shared)
        E, _, H, F = dims
        L = E // self.world
        rng = np.random.default_rng(1)
        params = {"router": self.replicated(rng.standard_normal((H, E)) / np.sqrt(H), np.float32)}
        specs = {"router": P()}
        loc = [((L,) + shapes["w_in"][1:], 1 / np.sqrt(H)), ((L,) + shapes["w_out"][1:],
                                                               1 / np.sqrt(F))]
        rep = ([(shapes["shared_in"], 1 / np.sqrt(H)),
                (shapes["shared_out"], 1 / np.sqrt(shared * F))] if shared else [])
        made = self.device_normal(1, loc, rep)
        params.update(w_in=made[0], w_out=made[1])
        specs.update(w_in=P("ep"), w_out=P("ep"))
        if shared:
            params.update(shared_in=made[2], shared_out=made[3])
            specs.update(shared_in=P(), shared_out=P())
        return params, specs

    def params_for(self, key, att):
        """The config's timed parameters, made once (the last config's freed first)."""
        if self.params_key != key:
            if self.params is not None:
                for v in self.params[0].values():
                    v.delete()
            self.params_key, self.params = None, None
            made, _ = att.do("params", lambda: self.make_params(LAYERS[key[0]], key[2], key[1]))
            if made is not None:
                self.params_key, self.params = key, made
        return self.params

    # -- the clock ----------------------------------------------------------------------------
    def start(self, backend, n):
        """n (a per-rank scalar) tied after the ranks' on-stream barrier and event slot 0."""
        if self.events:
            n = order_after(n, backend.barrier(n))  # the ranks start together
            n = order_after(n, self.record_event(n, 0))
        return n

    def stop(self, n, deps):
        """Event slot 1 after deps (a ticket [1]); without events deps tied to n."""
        n = order_after(n, deps)
        return self.record_event(n, 1) if self.events else n.reshape(1)

    def shard_map(self, fn, in_specs, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs,
                                     out_specs=out_specs))

    def time_ks(self, name: str, build, ks, errors: dict) -> tuple[dict, dict, int]:
        """build(K) -> (jitted fn, operands), timed for each K: ({K: elapsed us, slowest rank,
        median of reps}, {K: programs compiled by its first call}, recompiles in later calls).
        A K that fails, or does not fit a rank's share of memory, ends the series (errors[K]
        says why); the handle is then suspect. Collective."""
        att = Attempt(name, self.sync)
        points, compiles, recompiles = {}, {}, 0
        copies = self.copies = {}  # K -> bytes of copy instructions in the compiled program
        self.memory = {}  # K -> GiB [in use, the call's temp + output, a rank's share]
        for K in ks:
            if self.elapsed_all() > self.args.budget_s:
                errors[K] = f"skipped: past the {self.args.budget_s:.0f} s budget"
                break
            fn, ops = build(K)

            def compile_(fn=fn, ops=ops):
                c0 = COMPILES[0]
                compiled = fn.lower(*ops).compile()
                return compiled, COMPILES[0] - c0

            got, info = att.do(f"K{K}:compile", compile_,
                               payload=lambda r: [r[1], memory_need(r[0]),
                                                  copy_bytes(r[0].as_text() or "")])
            if att.failed:
                errors[K] = att.error
                break
            compiled = got[0]
            need = [i[1] for i in info if i[1] is not None]
            if self.mem_per_rank and need:
                stats = jax.local_devices()[0].memory_stats() or {}
                in_use = max(self.sync.gather("inuse", stats.get("bytes_in_use", 0)))
                self.memory[K] = [round(in_use / 2**30, 2), round(max(need) / 2**30, 2),
                                  round(self.mem_per_rank / 2**30, 2)]
                if in_use + max(need) > 0.92 * self.mem_per_rank:
                    errors[K] = (f"skipped: needs {max(need) / 2**30:.2f} GiB beside "
                                 f"{in_use / 2**30:.2f} GiB in use; a rank's share is "
                                 f"{self.mem_per_rank / 2**30:.2f} GiB")
                    break

            def call(compiled=compiled, ops=ops):
                t = time.perf_counter()
                jax.block_until_ready(compiled(*ops))
                wall = (time.perf_counter() - t) * 1e6
                return self.elapsed(0, 1) if self.events else wall

            def warm(call=call):
                c0 = COMPILES[0]
                for _ in range(1 + self.args.warmup):
                    call()
                return COMPILES[0] - c0

            _, first = att.do(f"K{K}:warm", warm, payload=lambda r: r)
            times = []
            c0 = COMPILES[0]
            for i in range(self.args.reps):  # each gather is the host barrier before the next
                _, t = att.do(f"K{K}:rep{i}", call, payload=lambda r: r)
                times.append(t)
            if att.failed:
                errors[K] = att.error
                break
            more = max(self.sync.gather(f"{name}:K{K}:recompiles", COMPILES[0] - c0))
            points[K] = slowest_median([list(col) for col in zip(*times)])
            compiles[K] = max(i[0] for i in info)
            copies[K] = max(i[2] for i in info)
            # a compile in the first call (the AOT program was not the one called), or in a
            # timed or warm-up call after it, is a program the step needs again
            recompiles += max(first) + more
        return points, compiles, recompiles

    # -- programs -----------------------------------------------------------------------------
    def forward(self, a2a, cfg, pspecs, mode):
        """K -> (the K-layer forward between the events, operands)."""
        def build(K):
            def per_rank(p, x, n):
                n = self.start(a2a.backend, n.reshape(()))
                h = x = order_after(x, n)
                for j in range(K):
                    y = moe_forward(a2a, cfg, layer_params(p, n, j), h, n)
                    h = renorm(y) if mode == "output" else order_after(x, y)
                return self.stop(n, y), y

            return (self.shard_map(per_rank, (pspecs, P("ep"), P("ep")), (P("ep"), P("ep"))),
                    self.operands)
        return build

    def backward(self, a2a, cfg, pspecs):
        """K -> (value_and_grad of sum(y_K * x) over K chained layers w.r.t. x and each layer's
        expert weights (through grad_sink), between the events, operands)."""
        def build(K):
            def per_rank(p, x, n, s):
                n = self.start(a2a.backend, n.reshape(()))
                xt = order_after(x, n)

                def loss(s, h):
                    for j in range(K):
                        pj = layer_params(p, n, j)
                        pj.update(w_in=grad_sink(pj["w_in"], s[j]),
                                  w_out=grad_sink(pj["w_out"], s[j]))
                        h = renorm(moe_forward(a2a, cfg, pj, h, n))
                    return jnp.sum(h.astype(f32) * x.astype(f32))

                value, (ds, dx) = jax.value_and_grad(loss, argnums=(0, 1))(s, xt)
                return self.stop(n, (value, ds, dx)), value.reshape(1), ds, dx

            sinks = self.per_rank(np.zeros(K, np.float32), np.float32)
            return (self.shard_map(per_rank, (pspecs, P("ep"), P("ep"), P("ep")),
                                   (P("ep"),) * 4), self.operands + (sinks,))
        return build

    def live_counts(self, a2a, cfg, pspecs, layers: int, mode: str) -> list[list[int]]:
        """Per layer input of the timed loop (the first `layers` of the chain; one: "first"),
        each rank's live experts. A scan of the same layers routes each input as the
        layer does (moe.route) and counts rows per expert on each sender; the host sums the
        senders (the key-value store; no psum: NCCL refuses 8 ranks on one GPU). The scan's
        fusions may round a layer's output otherwise than the written-out loop's (a near-tie
        of top-k can flip): a figure, not an identity."""
        E, k = cfg.num_experts, cfg.experts_per_token

        def count(router, h):  # rows per expert sent by this rank (all T tokens live)
            idx, _ = moe_mod.route(router, h, k)
            return jax.nn.one_hot(idx, E, dtype=jnp.int32).sum(axis=(0, 1))

        def per_rank(p, x, n):
            n = n.reshape(())
            if mode == "first":  # every layer routes on x
                return count(p["router"], x)[None, None]

            def body(h, _):
                return renorm(moe_forward(a2a, cfg, p, h, n)), count(p["router"], h)

            return jax.lax.scan(body, x, None, length=layers)[1][None]

        fn = self.shard_map(per_rank, (pspecs, P("ep"), P("ep")), P("ep"))
        out = fn(*self.operands)
        mine = np.sum([np.asarray(s.data)[0] for s in out.addressable_shards], axis=0)
        total = np.sum([np.asarray(m) for m in self.sync.gather("counts", mine.tolist())],
                       axis=0)
        return live_per_rank(total, self.world)

    def hbm_reader(self, a2a, alone: bool):
        """n -> (n reads of this rank's local expert weights written out between the events,
        by every rank at once, or (alone) by rank 0 while the others wait; operands)."""
        def build(n_reads):
            def reads(c):
                wi, wo, acc = c
                for _ in range(n_reads):
                    # the barrier keeps each read in place: no CSE, no hoisting, after event 0
                    wi, wo, acc = jax.lax.optimization_barrier((wi, wo, acc))
                    acc = acc + jnp.sum(wi, dtype=f32) + jnp.sum(wo, dtype=f32)
                return acc

            def per_rank(wi, wo, n):
                n = self.start(a2a.backend, n.reshape(()))
                c = (wi, wo, n.astype(f32) * 0)
                acc = (jax.lax.cond(jax.lax.axis_index("ep") == 0, reads, lambda c: c[2], c)
                       if alone else reads(c))
                return self.stop(n, acc), acc.reshape(1)

            p = self.params[0]
            return (self.shard_map(per_rank, (P("ep"),) * 3, (P("ep"), P("ep"))),
                    (p["w_in"], p["w_out"], self.operands[2]))
        return build

    def comm_floor(self, a2a):
        """K -> (bench_loop's floor-barrier-2calls: K cycles of two chained barrier kernels,
        each crossing every rank, one order_after per cycle, operands)."""
        backend = a2a.backend

        def build(K):
            def per_rank(n):
                n = self.start(backend, n.reshape(()))
                for _ in range(K):
                    ticket = n
                    for _ in range(2):
                        ticket = _bench.floor_kernels(backend, ticket, "barrier", 1)
                    n = order_after(n, ticket)
                return self.stop(n, n)

            return self.shard_map(per_rank, P("ep"), P("ep")), (self.operands[2],)
        return build

    # -- correctness --------------------------------------------------------------------------
    def correctness(self, config: str, shared: int, gated: bool) -> dict:
        """The layer at 4 tokens per rank against layer_oracle (gated) or moe.dense_forward
        (ungated, or no oracle), on the same weights and x. Collective; once per key."""
        key = (config, shared, gated)
        if key in self.checks:
            return self.checks[key]
        full = LAYERS[config]
        dims = check_dims(full, self.args.check_max_gb)
        T, world = 4, self.world
        use_oracle = gated and self.oracle is not None
        out = dict(correct=None, max_rel_err=None, oracle="layer_oracle" if use_oracle
                   else "moe.dense_forward", check_error="",
                   check_shape=None if dims == full else f"hidden {dims[2]}, ffn {dims[3]}")
        att = Attempt(f"check:{config}:{shared}:{int(gated)}", self.sync)
        cfg, _ = att.do("config", lambda: layer_config(dims, T, shared, gated))
        att.do("param_names", lambda: check_param_names(gated, shared))

        def inputs():
            if use_oracle:
                case = oracle_case(self.oracle, dims, T, world, 11, shared)
                return case, {k: case[k] for k in param_shapes(dims, gated, shared)}, case["x"]
            params = moe_mod.init_params(cfg, seed=11)
            x = np.random.default_rng(12).standard_normal((world, T, dims[2]))
            return None, params, x.astype(np.float32)

        got, _ = att.do("case", inputs)
        case, params_np, x_np = got if got is not None else (None, None, None)
        a2a = None
        pspecs = {k: P("ep") if k in ("w_in", "w_out") else P() for k in params_np or {}}

        def put():
            # expert weights by rank block: the oracle's lazy stacks generate only the
            # experts a block holds (R1's 45 G values never exist at once)
            dev = {k: self.sharded(v, bf16) if pspecs[k] == P("ep") else
                   self.replicated(v, np.float32 if k == "router" else bf16)
                   for k, v in params_np.items()}
            return dev, self.sharded(np.asarray(x_np).reshape(world * T, -1), bf16)

        placed, _ = att.do("put", put)
        a2a, _ = att.do("handle", lambda: AllToAll(
            cfg.comm_config(world), axis_name="ep", backend=self.args.backend,
            timeout_s=self.args.timeout_s, **cfg.handle_kwargs(world, "packed")))

        def ours_and_ref():
            dev, x = placed
            step = self.shard_map(lambda p, x, n: moe_forward(a2a, cfg, p, x, n.reshape(())),
                                  (pspecs, P("ep"), P("ep")), P("ep"))
            y = step(dev, x, self.per_rank([T]))
            ranks = {s.index[0].start // T: np.asarray(s.data, np.float32)
                     for s in y.addressable_shards}
            if case is not None:  # each rank's own tokens: the experts they picked are built
                ref = {r: np.asarray(self.oracle.reference(
                    dict(case, x=case["x"][r:r + 1], world=1))[0], np.float32) for r in ranks}
            else:  # the dense layer (every expert, one device) for every rank's tokens
                dense = jax.jit(jax.vmap(lambda p, x, n: moe_mod.dense_forward(cfg, p, x, n),
                                         in_axes=(None, 0, 0)))
                full = {k: jnp.asarray(v, jnp.float32 if k == "router" else bf16)
                        for k, v in params_np.items()}
                yd = np.asarray(dense(full, jnp.asarray(x_np, bf16),
                                      jnp.full((world,), T, jnp.int32)), np.float32)
                ref = {r: yd[r] for r in ranks}
            a2a.check()
            return [max(rel_err(ranks[r], ref[r]) for r in ranks),
                    all(bool(np.isfinite(v).all()) for v in ranks.values())]

        _, res = att.do("compare", ours_and_ref, payload=lambda r: r)
        if not att.failed:
            err = max(r[0] for r in res)
            out.update(max_rel_err=float(f"{err:.3g}") if math.isfinite(err) else None,
                       correct=bool(err <= self.args.tol and all(r[1] for r in res)))
        if a2a is not None:
            self.close(a2a)
        out["check_error"] = att.error
        self.checks[key] = out
        self.say(f"check {config} S={shared} gated={gated} ({out['oracle']}, "
                 f"{out['check_shape'] or 'full shape'}): correct {out['correct']}, max rel err "
                 f"{out['max_rel_err']} {att.error}")
        return out

    def close(self, a2a):
        try:
            a2a.close()  # collective: every rank reaches it, whatever failed before
        except Exception as e:  # noqa: BLE001
            self.say(f"close: {short(e)}")

    # -- one row ------------------------------------------------------------------------------
    def row_base(self, variant, config, shared, tokens, gated) -> dict:
        E, k, H, F = LAYERS[config]
        return dict(method="jax_moe_comm_layer", config=config, num_experts=E,
                    experts_per_token=k, hidden=H, ffn=F, num_shared_experts=shared,
                    gated=gated, tokens_per_rank=tokens, dispatch_dtype="fp8_e4m3",
                    layout="packed", variant=variant, clock=self.meta["clock"],
                    loop_input="output" if variant == "fwd+bwd" else self.args.loop_input,
                    per_layer_us=None, intercept_us=None, ks=[], elapsed_us=[],
                    floor_us=None, floor_sum_us=None, weight_floor_us=None, comm_floor_us=None,
                    hbm_bytes_per_s=None, busiest_rank_live_experts=None,
                    weight_bytes_busiest=None, ratio_floor=None, compiled_programs=None,
                    correct=None, max_rel_err=None, status="", error="")

    def run_row(self, variant, config, shared, tokens, gated) -> dict:
        row = self.row_base(variant, config, shared, tokens, gated)
        dims, args, world = LAYERS[config], self.args, self.world
        try:
            cfg = layer_config(dims, tokens, shared, gated)
        except (NotImplementedError, ValueError) as e:  # the same on every rank
            row.update(status="error", error=str(e))
            return row
        if self.elapsed_all() > args.budget_s:
            row.update(status="skipped", error=f"skipped: past the {args.budget_s:.0f} s budget")
            return row
        chk = self.correctness(config, shared, gated)
        row.update({k: chk[k] for k in ("correct", "max_rel_err", "oracle", "check_shape",
                                        "check_error")})
        comm = cfg.comm_config(world)
        resolved = G.resolve(cfg.expert_gemm, layout="packed")
        row.update(expert_gemm=resolved, tokamax_impl=G.tokamax_choice(
            None, comm.expected_rows_per_expert) if resolved in G.NEEDS_TOKAMAX
            and G.tokamax_problem() is None else None)
        att = Attempt(f"row{len(self.rows)}", self.sync)
        made = self.params_for((config, shared, gated), att)
        a2a, errors = None, {}
        if made is not None:
            params, pspecs = made
            x0 = self.device_normal(7, [((tokens, cfg.hidden), 1.0)], [])[0]
            self.operands = (params, x0, self.per_rank([tokens]))
            a2a, _ = att.do("handle", lambda: AllToAll(
                comm, axis_name="ep", backend=args.backend, timeout_s=args.timeout_s,
                differentiable=variant == "fwd+bwd", **cfg.handle_kwargs(world, "packed")))
        if a2a is not None and a2a.backend_name != self.backend:
            att.error = f"handle backend {a2a.backend_name}, the run's clock needs {self.backend}"
        if not att.failed:
            build = (self.backward(a2a, cfg, pspecs) if variant == "fwd+bwd" else
                     self.forward(a2a, cfg, pspecs, row["loop_input"]))
            points, compiles, recompiles = self.time_ks(f"{att.tag}:layer", build, args.ks,
                                                        errors)
            ks = sorted(points)
            row.update(ks=ks, elapsed_us=[round(points[K], 2) for K in ks],
                       per_layer_at_k_us=[round(points[K] / K, 2) for K in ks],
                       compiled_programs_by_k=[compiles[K] for K in ks],
                       compiled_programs=compiles[ks[-1]] if ks else None,
                       compiled_programs_constant=len(set(compiles.values())) == 1 if ks
                       else None, recompiles=recompiles,
                       hlo_copy_bytes_by_k=[self.copies.get(K) for K in ks],
                       memory_gib_by_k={str(K): v for K, v in self.memory.items()})
            a, b = fit_per_layer([(K, points[K]) for K in ks])
            row.update(intercept_us=None if a is None else round(a, 2),
                       per_layer_us=None if b is None else round(b, 2))
            self.floor(row, att, a2a, cfg, pspecs, errors)
            _, _ = att.do("check", a2a.check)
        if a2a is not None:
            self.close(a2a)
        row["k_errors"] = {str(k): v for k, v in errors.items()}
        layer_errors = [v for k, v in errors.items() if isinstance(k, int)]
        floor_errors = [f"{k} K={n}: {v}" for k, sub in errors.items() if isinstance(sub, dict)
                        for n, v in sub.items()]
        row["error"] = "; ".join(([att.error] if att.error else []) + layer_errors[:1] +
                                 floor_errors[:1])
        row["status"] = ("error" if row["per_layer_us"] is None else
                         "partial" if row["error"] else "ok")
        return row

    def floor(self, row, att, a2a, cfg, pspecs, errors):
        """The row's floor fields, measured now on the row's handle (collective)."""
        H, F, S, gated = cfg.hidden, cfg.ffn, row["num_shared_experts"], row["gated"]
        key = (row["config"], S, gated, row["tokens_per_rank"], row["loop_input"])
        if key not in self.counts:
            layers = max(self.args.ks)
            got, _ = att.do("live", lambda: self.live_counts(a2a, cfg, pspecs, layers,
                                                              row["loop_input"]))
            if got is not None:
                self.counts[key] = got
        live = self.counts.get(key)
        L = cfg.num_experts // self.world
        local_bytes = L * expert_bytes(H, F, gated)
        bw = self.bandwidth(a2a, local_bytes, errors)
        comm, comm_fit = None, None
        if self.events and a2a.backend_name == "nvshmem":
            cpts, _, _ = self.time_ks(f"{att.tag}:comm", self.comm_floor(a2a), self.args.ks,
                                      errors.setdefault("comm", {}))
            comm_fit = fit_per_layer(sorted(cpts.items()))
            comm = comm_fit[1]
        else:
            row["comm_floor_note"] = "no floor kernels on the reference backend"
        for k in ("hbm", "hbm_alone", "comm"):
            if not errors.get(k):
                errors.pop(k, None)
        per = expert_bytes(H, F, gated)
        wf = weight_floors(live, self.groups, per, S * per, bw.get("rank_all"), bw.get("alone"))
        fl = floors(wf.pop("weight_floor_us"), comm)
        r2 = lambda v: None if v is None else round(v, 2)  # noqa: E731
        g4 = lambda v: None if v is None else float(f"{v:.4g}")  # noqa: E731
        row.update({k: r2(v) for k, v in {**wf, **fl}.items()})
        row.update(busiest_rank_live_experts_per_layer=None if live is None else
                   [max(layer) for layer in live], live_experts_per_rank=live, local_experts=L,
                   hbm_bytes_per_s=g4(bw.get("rank_all")), hbm_bytes_per_s_alone=g4(
                       bw.get("alone")), hbm_bytes_per_s_gpu=g4(bw.get("rank_all") and
                                                                 bw["rank_all"] * self.sharing),
                   hbm_bytes_per_rank=local_bytes, comm_floor_intercept_us=None
                   if comm_fit is None else r2(comm_fit[0]))
        if row["weight_bytes_busiest"] is not None:
            row["weight_bytes_busiest"] = int(row["weight_bytes_busiest"])
        r = ratio(row["per_layer_us"], row["floor_us"])
        row["ratio_floor"] = None if r is None else round(r, 3)

    def bandwidth(self, a2a, local_bytes: int, errors: dict) -> dict:
        """One rank's HBM bytes/s reading its local experts' weights while every rank reads
        (rank_all) and alone (alone), measured once per parameter set on the first row's
        handle (their spread over a run's rows was 3 % on an H100). Collective."""
        if self.params_key in self.bandwidths:
            return self.bandwidths[self.params_key]
        bw = {}
        for name, alone in (("rank_all", False), ("alone", True)):
            pts, _, _ = self.time_ks(f"hbm:{len(self.rows)}:{name}",
                                     self.hbm_reader(a2a, alone), [1, self.args.hbm_n],
                                     errors.setdefault("hbm_alone" if alone else "hbm", {}))
            us = per_iteration(sorted(pts.items()))
            bw[name] = local_bytes / (us * 1e-6) if us else None
        if bw["rank_all"]:  # a failed measurement is tried again on the next row
            self.bandwidths[self.params_key] = bw
        return bw

    # -- output -------------------------------------------------------------------------------
    def write(self, final: bool = False):
        if self.rank != 0:
            return
        self.meta.update(elapsed_s=round(time.perf_counter() - self.t0, 1), finished=final)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out + ".tmp", "w") as f:
            json.dump(dict(self.meta, rows=self.rows), f, indent=1)
        os.replace(self.args.out + ".tmp", self.args.out)

    def run(self) -> int:
        a, gated = self.args, not self.args.ungated
        plan = [(v, c, s, t) for v in a.variants for c in a.configs for s in a.shared_experts
                for t in a.tokens]
        self.meta["planned_rows"] = len(plan)
        self.say(f"loop_layer: {len(plan)} rows, {self.world} ranks ({self.sharing} per "
                 f"device), {self.meta['gpu']}, clock {self.meta['clock']}, expert_gemm "
                 f"{self.meta['expert_gemm']}, tokamax {self.meta['tokamax_problem'] or 'ok'}, "
                 f"oracle {self.meta['oracle']}")
        for variant, config, shared, tokens in plan:
            row = self.run_row(variant, config, shared, tokens, gated)
            row["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
            self.rows.append(row)
            self.say(line(row))
            self.write()
        self.write(final=True)
        return 0


def layer_config_or_none(dims, tokens):
    try:
        return layer_config(dims, tokens, 0, "gated" in LAYER_FIELDS)
    except (NotImplementedError, ValueError):
        return None


def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def line(r) -> str:
    return (f"{r['config']:6s} T={r['tokens_per_rank']:4d} S={r['num_shared_experts']} "
            f"{r['variant']:8s} {fmt(r['per_layer_us']):>8s} us/layer (a {fmt(r['intercept_us'])})"
            f" floor {fmt(r['floor_us'])} (weights {fmt(r['weight_floor_us'])}, comm "
            f"{fmt(r['comm_floor_us'])}, live {fmt(r['busiest_rank_live_experts'], 2)}) ratio "
            f"{fmt(r['ratio_floor'], 2)} programs {r['compiled_programs']} correct "
            f"{r['correct']} ({r['max_rel_err']}) {r['status']} {r['error'][:200]}")


def main(argv=None) -> int:
    args = parse(argv)
    import jax_moe_comm.distributed as dist

    launched = dist.managed()
    if not launched:  # a smoke run: 8 emulated CPU devices in one process
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8").strip()
    # Every program recorded as a graph, however short (XLA outlines >= 5 commands by default),
    # so that K = 1 replays as one too, as the peer's torch.cuda.graph does (bench_loop.py).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_graph_min_graph_size=1").strip()
    rank, nproc = dist.initialize()  # before anything touches jax.devices()
    bench = Bench(args, rank, nproc, launched)
    try:
        return bench.run()
    except BaseException as e:  # a broken run still writes what it has
        bench.meta["fatal"] = f"{type(e).__name__}: {e}"[:500]
        bench.write()
        raise


if __name__ == "__main__":
    sys.exit(main())
