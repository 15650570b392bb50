#!/usr/bin/env python3
"""The peer MoE layer, timed by one clock (GitHub issue 47, point 2): the layer a PyTorch user
writes on pplx-kernels, N ranks on one GPU under CUDA MPS, timed as peer/loop_pplx.py times bare
dispatch + combine.

    PY=python3; $PY -c "import torch" 2>/dev/null || PY=/opt/torch/.venv/bin/python3
    $PY benchmarks/layer_pplx.py --launch 8 --peer .peer --configs V2Lite,R1 \
        --tokens 1,4,16,128 --ks 1,4,16 --out $OUT/layer_pplx.json --timeout 400

Launcher, environment (pplx build by build_pplx.sh, CUDA MPS with 100/N % of the SMs per rank,
the NVSHMEM variables), NVSHMEM over a gloo group, fit_line, median_of_max, all_ranks_true and
gather_json are peer/loop_pplx.py's, imported from --peer DIR (or $PPLX_PEER_DIR; default
.peer): its launcher starts this script as the ranks (loop_pplx.run_ranks runs the file its
module's __file__ names, which launch_main points here).

The layer, per rank (T tokens per rank; E experts, top-k, hidden H, expert ffn F; L = E/world
local experts; P = T*world rows per local expert in pplx's padded buffers):
  1. router: logits = f32(x) @ router [H, E] (f32, no TF32), torch.topk (descending), weights =
     softmax over the k logits (f32), indices int32 (viewed as pplx's uint32);
  2. x quantized to fp8 e4m3 with 1x128 f32 block scales (scale = amax/448), pplx dispatch
     (AllToAll.internode) -> expert_x [L, P, H] fp8, expert_x_scale [L, P, H/128], counts [L];
  3. the expert MLPs over the live rows with torch._grouped_mm (bf16, f32 accumulation): the
     live rows are compacted into a packed [M, H] bf16 buffer (gathered and dequantized), each
     expert's rows contiguous from offs[e-1] (counts rounded up to --group-align rows; the
     padding rows read a zero row), M = packed_rows_bound (the worst case; --capacity-factor f:
     f x the mean, rows past it dropped and the row marked incorrect), the gather index
     computed on the device from cumsum(counts) (compaction_index), rows past the live total
     pointing at the zero row; pre = grouped_mm(x, w_in [L, H, 2F]) (gate [:F], up [F:];
     the weights stored [out, in] as nn.Linear's and read through transposed views, as
     torchtitan calls torch._grouped_mm; --weight-layout n_major: stored as read),
     h = silu(gate) * up (bf16), out = grouped_mm(h, w_out [L, F, H]), scattered back into
     pplx's expert_y [L, P, H] bf16 (padding and idle rows into a sink row combine never reads).
     Without torch._grouped_mm (or if its probe fails): torch.bmm over every padded row,
     named in "grouped_gemm";
  4. pplx combine (bf16) -> y [T, H] bf16; + the --shared-experts S shared gated MLP (width S*F,
     on the bf16 x, computed between dispatch's send and receive halves: do_send/do_recv).
No host sync and no data-dependent shape anywhere, so K layers capture in one CUDA graph.

Timing (as loop_pplx's graph/eager variants): K layers back to back (--loop-input first, the
default: every layer reads the same x; the layers are serialized by the stream order of the
one stream they run on, each layer's first kernel after the previous layer's combine, and every
layer routes alike, so the floor below holds for each. --loop-input output: each layer's
output, RMS-normalised, is the next one's input, as benchmarks/loop_layer.py's default).
Variant "graph": the K layers captured once in a torch.cuda.graph and replayed; "eager": the
host launches every op. Per rank: after a host barrier (gloo) and an on-stream NVSHMEM barrier,
CUDA events around the K layers; per repetition the max over ranks; the median over --reps
(after --warmup); the least-squares fit elapsed = intercept_us + per_layer_us * K over --ks.

The floor (point 3): busiest_rank_live_experts, the most local experts with >= 1 row on any
rank in the timed layers' routing (pplx's counts; the mean over the layers with --loop-input
output); weight_bytes_busiest = that * (H*2F + F*H) * 2 (+ the shared experts' H*2SF + SF*H,
bf16); hbm_bytes_per_s: the bytes per second one rank reads while every rank reads at once
(measured once at the start: the faster of a f32 sum over a bf16 buffer and a device copy,
counted as read + written bytes; per repetition the slowest rank, median); weight_floor_us =
weight_bytes_busiest / hbm_bytes_per_s; floor_us = weight_floor_us; comm_floor_us null (the
comparison script combines it with ours).

Correctness: per (config, S), before timing, the layer on --check-tokens tokens per rank
against benchmarks/layer_oracle.py (numpy; the same x and weights, rebuilt from --seed; the
reference uses the device's routing, every rank computing its own experts' part, summed over
the ranks), max_rel_err (layer_oracle.rel_err, per token row) <= --tol; the device's top-k is
also compared with the oracle's route (route_mismatch_tokens: tokens whose expert set
differs). A timed case is checked the same way too where the oracle's work per rank is below
--check-gflop (its weights then copied back from the device). correct_after: the layer's
output after the timed layers equals the first one's.

Output (--out, default $OUT/layer_pplx.json; rewritten after every case): {tool, gpu,
gpu_count, world, commit (pplx's), date, command, torch, grouped_gemm, hbm_*, mps_share, ks,
reps, warmup, loop_input, group_align, capacity_factor, tol, budget_s, in_progress, error,
rows: [...]}; rows {method: "pplx_torch_layer", config, num_experts, experts_per_token,
hidden, ffn, num_shared_experts, gated: true, tokens_per_rank, dispatch_dtype: "fp8_e4m3",
variant, per_layer_us, intercept_us, ks, elapsed_us (per K, aligned with ks),
elapsed_per_layer_us, per_rank_elapsed_us, floor_us, weight_floor_us, comm_floor_us,
hbm_bytes_per_s, busiest_rank_live_experts, weight_bytes_busiest, live_experts_per_rank,
live_rows_per_rank, packed_rows_bound (M), packed_rows_needed, capacity_factor, group_align,
grouped_gemm, loop_input, correct, max_rel_err, check_tokens, check_source,
route_mismatch_tokens, config_check, correct_after, graph_mismatch_ks (graph rows: the K
whose replays left combine's output unlike the eager layer's; --loop-input first), note}.
Rank 0 prints a markdown table. Cases past --budget-s are recorded as skipped rows
(per_layer_us null, note says so).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import shlex
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import layer_oracle as oracle  # noqa: E402  (numpy only)

METHOD = "pplx_torch_layer"
VARIANTS = ("graph", "eager")
LOOP_INPUTS = ("first", "output")
WEIGHT_LAYOUTS = ("k_major", "n_major")  # how the expert weights are stored (ConfigWeights)
BLOCK = oracle.BLOCK
FP8_MAX = oracle.FP8_MAX
NO_GROUPED_MM = "torch.bmm over every padded row"  # the fallback's name in "grouped_gemm"


# -- pure arithmetic (tests/test_layer_pplx.py) -----------------------------------------------
def packed_rows_bound(num_local_experts: int, k: int, tokens_per_rank: int, num_dp: int,
                      align: int) -> int:
    """M, the packed rows that hold every live row of one rank in the worst case: a token
    sends at most min(L, k) rows to one rank (its k experts are distinct), T * num_dp tokens
    can reach it; each non-empty expert's group is rounded up to `align` rows, which adds at
    most align - 1 rows to each of at most min(L, live) groups."""
    live = min(num_local_experts, k) * tokens_per_rank * num_dp
    return live + min(num_local_experts, live) * (align - 1)


def packed_rows(num_local_experts: int, k: int, tokens_per_rank: int, num_dp: int, world: int,
                align: int, capacity_factor: float | None) -> int:
    """The packed buffer's static rows M: the worst case (capacity_factor None), else
    capacity_factor times the mean live rows per rank under uniform routing (T * num_dp * k
    / world) plus every expert's alignment padding, never past the worst case. Rows past M
    are dropped (the row says so: packed_rows_needed > packed_rows_bound)."""
    worst = packed_rows_bound(num_local_experts, k, tokens_per_rank, num_dp, align)
    if capacity_factor is None:
        return worst
    mean = tokens_per_rank * num_dp * k / world
    return min(worst, math.ceil(capacity_factor * mean) + num_local_experts * (align - 1))


def packed_rows_needed(counts, align: int) -> int:
    """Packed rows one rank's counts fill: every expert's rows rounded up to align."""
    return int(sum((int(c) + align - 1) // align * align for c in counts))


def compaction_index(counts, rows, rows_per_expert: int, align: int):
    """Where each packed row comes from, computed from pplx's counts alone (numpy or torch:
    the same expression runs on both, on the device with no host sync).

    counts [L] (int): live rows of each local expert; rows: arange(M) (int64); rows_per_expert
    P: the padded buffer's rows per expert. Expert e's group is packed rows [start_e,
    end_e), end = cumsum(round_up(counts, align)); its first counts[e] rows come from padded
    row e*P + r, the rest of the group and every row past the last group from the sink
    L*P (a zero row of the gather's source, a never-read row of the scatter's target).
    Returns (src [M] int64 in [0, L*P], ends [L] int64: torch._grouped_mm's offs)."""
    L = counts.shape[0]
    padded = (counts + (align - 1)) // align * align
    ends = padded.cumsum(0)
    starts = ends - padded
    group = (rows[:, None] >= ends[None, :]).sum(1)  # groups ending at or before the row
    g = group.clip(0, L - 1)
    r = rows - starts[g]
    valid = (group < L) & (r < counts[g])
    sink = L * rows_per_expert
    return valid * (g * rows_per_expert + r) + (~valid) * sink, ends


def expert_weight_bytes(hidden: int, ffn: int) -> int:
    """bf16 bytes of one gated expert: w_in [H, 2F] + w_out [F, H]."""
    return (hidden * 2 * ffn + ffn * hidden) * 2


def weight_bytes(live_experts: float, hidden: int, ffn: int, num_shared: int) -> int:
    """Weights one rank reads once per layer: its live experts' and the shared experts'
    (one gated MLP of width S*F)."""
    return int(round(live_experts * expert_weight_bytes(hidden, ffn))) + \
        (expert_weight_bytes(hidden, num_shared * ffn) if num_shared else 0)


def floor_fields(live_per_layer: list[list[int]], hidden: int, ffn: int, num_shared: int,
                 hbm_bps: float | None) -> dict:
    """The row's floor from [layer][rank] live-expert counts: the busiest rank per layer,
    averaged over the layers (one layer with --loop-input first)."""
    busiest = [max(ranks) for ranks in live_per_layer]
    live = busiest[0] if len(set(busiest)) == 1 else statistics.fmean(busiest)
    nbytes = weight_bytes(live, hidden, ffn, num_shared)
    floor = nbytes / hbm_bps * 1e6 if hbm_bps else None
    return dict(busiest_rank_live_experts=live, weight_bytes_busiest=nbytes,
                hbm_bytes_per_s=hbm_bps, weight_floor_us=floor, floor_us=floor,
                comm_floor_us=None)


def oracle_gflop(rows: int, hidden: int, ffn: int) -> float:
    """GFLOP of the numpy oracle for `rows` (token, expert) rows of gated experts."""
    return rows * 2 * (hidden * 2 * ffn + ffn * hidden) / 1e9


def summarize(base: dict, per_rank: list[dict], variants: list[str], ks: list[int],
              loop) -> list[dict]:
    """One row per variant from every rank's raw times ({"runs": {variant: {str(K): [us per
    rep]}}, "unsupported": {variant: why}}): per K the median over repetitions of the max over
    ranks (loop.median_of_max), then loop.fit_line over K."""
    rows = []
    for variant in variants:
        why = next((p["unsupported"][variant] for p in per_rank
                    if variant in p.get("unsupported", {})), "")
        elapsed, per_rank_med = [], []
        for K in ks:
            mat = [p["runs"].get(variant, {}).get(str(K)) for p in per_rank]
            if any(m is None for m in mat):
                elapsed.append(None)
                per_rank_med.append(None)
                continue
            elapsed.append(loop.median_of_max(mat))
            per_rank_med.append([None if None in m else statistics.median(m) for m in mat])
        a, b = loop.fit_line(list(zip(ks, elapsed)))
        rows.append(dict(
            base, variant=variant, per_layer_us=b, intercept_us=a, ks=list(ks),
            elapsed_us=elapsed,
            elapsed_per_layer_us=[None if e is None else e / K for e, K in zip(elapsed, ks)],
            per_rank_elapsed_us=per_rank_med,
            note="; ".join(n for n in (base.get("note", ""),
                                       f"{variant}: unsupported ({why})" if why else "") if n)))
    return rows


def fmt(v, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if math.isfinite(v) else str(v)
    return str(v)


def markdown(rows: list[dict]) -> str:
    out = ["| config | S | tokens | variant | per-layer µs | intercept µs | weight floor µs | "
           "layer / floor | busiest live experts | correct | max rel err | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, w = r.get("per_layer_us"), r.get("weight_floor_us")
        ratio = b / w if b is not None and w else None
        err = r.get("max_rel_err")
        out.append(
            f"| {r['config']} | {r['num_shared_experts']} | {r['tokens_per_rank']} | "
            f"{r['variant']} | {fmt(b)} | {fmt(r.get('intercept_us'))} | {fmt(w)} | "
            f"{fmt(ratio, 2)} | {fmt(r.get('busiest_rank_live_experts'))} | "
            f"{r.get('correct')} | {'-' if err is None else f'{err:.2e}'} | "
            f"{r.get('note', '')} |")
    return "\n".join(out)


LOUD = "!" * 20  # after every incorrect result in the log


def check_line(checked: dict, tol: float) -> str:
    """The log line of a check (check_case's dict)."""
    flag = "correct" if checked["correct"] else "INCORRECT " + LOUD
    err = checked["max_rel_err"]
    return (f"check T={checked['check_tokens']}: {flag}: max_rel_err "
            f"{'-' if err is None else format(err, '.3e')} (tol {tol}), route mismatches "
            f"{checked['route_mismatch_tokens']}, weight diff "
            f"{checked['route_weight_max_diff']:.1e}")


def row_line(r: dict) -> str:
    """The log line of a row."""
    return (f"{r['variant']:6s} per layer {fmt(r['per_layer_us'])} us, intercept "
            f"{fmt(r['intercept_us'])}, elapsed {[fmt(v) for v in r['elapsed_us']]} at "
            f"K={r['ks']}; weight floor {fmt(r['weight_floor_us'])} us "
            f"({fmt(r['busiest_rank_live_experts'])} live experts); correct {r['correct']}"
            f"{'' if r['correct'] else ' ' + LOUD}{'; ' + r['note'] if r.get('note') else ''}")


def default_budget(timeout_s: float) -> float:
    """The ranks' budget for a launcher --timeout: what is left after NVSHMEM init and a
    margin for the case in flight and the teardown."""
    return max(60.0, 0.85 * timeout_s - 30.0)


def with_budget(argv: list[str], timeout_s: float) -> list[str]:
    """argv with --budget-s added where it is absent (the launcher forwards it to the ranks)."""
    if any(a == "--budget-s" or a.startswith("--budget-s=") for a in argv):
        return list(argv)
    return list(argv) + ["--budget-s", f"{default_budget(timeout_s):.0f}"]


def int_list(text: str, name: str, minimum: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: comma list of integers, got {text!r}") from None
    if not vals or min(vals) < minimum:
        raise argparse.ArgumentTypeError(
            f"{name}: comma list of integers >= {minimum}, got {text!r}")
    return vals


# -- the peer module -----------------------------------------------------------------------------
def peer_dir(arg: str | None) -> str:
    """--peer, else $PPLX_PEER_DIR, else .peer (relative to the working directory, else to the
    repository root)."""
    d = arg or os.environ.get("PPLX_PEER_DIR") or ".peer"
    for cand in (d, os.path.join(ROOT, d)):
        if os.path.isfile(os.path.join(cand, "loop_pplx.py")):
            return os.path.abspath(cand)
    raise FileNotFoundError(f"no loop_pplx.py in {d!r} (nor under {ROOT}): pass --peer DIR, "
                            "a copy of shared/peer")


def load_peer(directory: str):
    """peer/loop_pplx.py as a module (stdlib imports only at its top; torch inside functions).
    PPLX_PEER_DIR is set first: loop_pplx takes its build script and source from there."""
    os.environ["PPLX_PEER_DIR"] = directory
    if directory not in sys.path:
        sys.path.insert(0, directory)
    path = os.path.join(directory, "loop_pplx.py")
    spec = importlib.util.spec_from_file_location("loop_pplx", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("launch", "run_ranks", "fit_line", "median_of_max", "all_ranks_true",
                 "gather_json", "pplx_commit"):
        if not hasattr(mod, name):
            raise ImportError(f"{path} has no {name}(): not the expected peer harness")
    return mod


# -- command line -------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launch", type=int, metavar="N", help="start N ranks (launcher mode)")
    p.add_argument("--peer", default=None, help="the peer folder (loop_pplx.py, build_pplx.sh, "
                   "pplx-kernels-src); default $PPLX_PEER_DIR or .peer")
    p.add_argument("--configs", default="V2Lite,R1", help="comma list of V2Lite, R1, tiny")
    p.add_argument("--tokens", default="1,4,16,128", help="tokens per rank, comma list")
    p.add_argument("--ks", default="1,4,16", help="layers per timed interval, comma list")
    p.add_argument("--reps", type=int, default=5, help="timed intervals per (variant, K)")
    p.add_argument("--warmup", type=int, default=2, help="untimed intervals first")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--shared-experts", default="0", help="S shared experts, comma list (rows each)")
    p.add_argument("--loop-input", choices=LOOP_INPUTS, default="first",
                   help="first: every layer reads the same x; output: the last output, "
                        "RMS-normalised")
    # 8: insurance. torch._grouped_mm's setup kernel asserts on the device that group sizes
    # are multiples of 16 bytes / element for its 2D x 2D and 3D x 2D forms (GroupMMCommon.cuh)
    # and on none for ours (2D x 3D, row-major A); a device assert would end the one run, while
    # 8 rows cost at most 7 zero rows per expert inside GEMM tiles of 64-128 rows.
    p.add_argument("--group-align", type=int, default=8,
                   help="rows each expert's packed group is rounded up to (1: none)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="packed rows = this x the mean live rows per rank (default: the worst "
                        "case, nothing dropped); rows past it are dropped and the row says so")
    p.add_argument("--weight-layout", choices=WEIGHT_LAYOUTS, default="k_major",
                   help="k_major: expert weights stored [out, in] as nn.Linear does, read "
                        "through transposed views (torchtitan's grouped_mm call); n_major: "
                        "stored as read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-tokens", type=int, default=2, help="tokens per rank of the check case")
    p.add_argument("--check-gflop", type=float, default=50.0,
                   help="also check a timed case where the oracle's GFLOP per rank is below "
                        "this (0: never)")
    p.add_argument("--tol", type=float, default=3e-2, help="max_rel_err bound of correct")
    p.add_argument("--hbm-mib", type=int, default=256, help="MiB per rank of the bandwidth probe")
    p.add_argument("--hbm-inner", type=int, default=8, help="passes per bandwidth sample")
    p.add_argument("--budget-s", type=float, default=None,
                   help="ranks: seconds for all cases (default from --timeout, else 600)")
    p.add_argument("--out", help="JSON path (default $OUT/layer_pplx.json, else ./layer_pplx.json)")
    p.add_argument("--timeout", type=float, default=900.0, help="launcher: seconds for all ranks")
    p.add_argument("--log-dir", help="launcher: per-rank logs (default: next to --out)")
    p.add_argument("--commit", default=None, help="pplx-kernels commit recorded in the JSON")
    p.add_argument("--no-build", action="store_true", help="launcher: do not build pplx-kernels")
    p.add_argument("--no-mps", action="store_true", help="launcher: do not start CUDA MPS")
    args = p.parse_args(argv)
    try:
        args.ks = int_list(args.ks, "--ks", 1)
        args.tokens = int_list(args.tokens, "--tokens", 1)
        args.shared_experts = int_list(args.shared_experts, "--shared-experts", 0)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.configs if c not in oracle.CONFIGS]
    if bad or not args.configs:
        p.error(f"--configs: comma list of {', '.join(oracle.CONFIGS)} (got {bad or 'none'})")
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants: comma list of {', '.join(VARIANTS)} (got {bad or 'none'})")
    if args.reps < 1 or args.warmup < 0 or args.group_align < 1 or args.check_tokens < 1:
        p.error("--reps >= 1, --warmup >= 0, --group-align >= 1, --check-tokens >= 1")
    if args.capacity_factor is not None and not args.capacity_factor > 0:
        p.error("--capacity-factor > 0")
    return args


def default_out() -> str:
    return os.path.join(os.environ.get("OUT") or ".", "layer_pplx.json")


def launch_main(args: argparse.Namespace, argv: list[str]) -> int:
    """loop_pplx.launch with this script as the ranks: build, MPS, environment, N ranks."""
    try:
        loop = load_peer(peer_dir(args.peer))
    except (OSError, ImportError) as e:
        print(f"layer_pplx: {e}", file=sys.stderr)
        return 2
    args.out = os.path.abspath(args.out or default_out())
    args.log_dir = args.log_dir or os.path.join(os.path.dirname(args.out),
                                                f"layer_pplx_ep{args.launch}_logs")
    cmd = shlex.join(["python3", os.path.relpath(os.path.abspath(__file__))] + argv)
    if os.environ.get("OUT"):
        cmd = cmd.replace(os.environ["OUT"], "$OUT")
    os.environ.setdefault("LAYER_PPLX_COMMAND", cmd)
    os.environ.setdefault("LOOP_PPLX_COMMAND", cmd)
    # run_ranks starts `python -u <loop_pplx.__file__> <forwarded args>`: make that us.
    loop.__file__ = os.path.abspath(__file__)
    print(f"layer_pplx: peer {os.environ['PPLX_PEER_DIR']}, out {args.out}", flush=True)
    return loop.launch(args, with_budget(argv, args.timeout))


# -- the layer (torch; imported inside functions so that the module imports without it) -----
class ConfigWeights:
    """One rank's device weights of a config: its L experts' w_in [L, H, 2F], w_out [L, F, H]
    (bf16), the router [H, E] (f32), built from layer_oracle's generators (so every rank,
    and the oracle, has the same values); shared experts set by set_shared.

    layout "k_major" (the default): stored as nn.Linear stores weights, [out, in] (w_in as
    [L, 2F, H]), and w_in / w_out are their transposed views, as torchtitan passes its expert
    weights to torch._grouped_mm (both GEMM operands K-major). "n_major": stored as the views
    read, [L, H, 2F] and [L, F, H] contiguous."""

    def __init__(self, torch, name: str, world: int, rank: int, seed: int, dev,
                 layout: str = "k_major") -> None:
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight layout {layout!r}; expected one of {WEIGHT_LAYOUTS}")
        self.name = name
        self.E, self.k, self.H, self.F = oracle.CONFIGS[name]
        self.L = self.E // world
        self.rank, self.seed, self.dev, self.layout = rank, seed, dev, layout
        case = oracle.make_case(name, 1, 0, seed)  # weights only (lazy), no tokens
        self.router = torch.from_numpy(case["router"]).to(dev)
        self.w_in = self.stack(torch, (self.H, 2 * self.F))
        self.w_out = self.stack(torch, (self.F, self.H))
        for le in range(self.L):  # one expert at a time: R1's f32 host copies would be 5.6 GB
            e = rank * self.L + le
            self.w_in[le].copy_(host_bf16(torch, case["w_in"][e]))  # copy_ follows the strides
            self.w_out[le].copy_(host_bf16(torch, case["w_out"][e]))
        device_sync(torch)
        self.S = 0
        self.shared_in = self.shared_out = None

    def stack(self, torch, shape):
        """An uninitialized bf16 [L, *shape] stack in this layout (a transposed view if
        k_major)."""
        rows, cols = shape
        if self.layout == "n_major":
            return torch.empty((self.L, rows, cols), dtype=torch.bfloat16, device=self.dev)
        t = torch.empty((self.L, cols, rows), dtype=torch.bfloat16, device=self.dev)
        return t.transpose(1, 2)

    @classmethod
    def dims_only(cls, name: str, world: int) -> "ConfigWeights":
        """The config's sizes without weights (a skipped config's rows)."""
        w = cls.__new__(cls)
        w.name = name
        w.E, w.k, w.H, w.F = oracle.CONFIGS[name]
        w.L, w.S = w.E // world, 0
        return w

    def set_shared(self, torch, S: int, case: dict) -> None:
        self.S = S
        self.shared_in = self.shared_out = None
        if S:
            for name in ("shared_in", "shared_out"):
                host = host_bf16(torch, case[name])
                dev = self.matrix(torch, tuple(host.shape))
                dev.copy_(host)
                setattr(self, name, dev)

    def matrix(self, torch, shape):
        """An uninitialized bf16 2D view of `shape` in this layout."""
        if self.layout == "n_major":
            return torch.empty(shape, dtype=torch.bfloat16, device=self.dev)
        return torch.empty(shape[::-1], dtype=torch.bfloat16, device=self.dev).t()

    def local_expert_host(self, torch, le: int):
        """(w_in[le], w_out[le]) copied back from the device as f32 numpy (a timed case's
        check: the values the layer used; the check case regenerates them from the seed)."""
        def back(w):
            return oracle.from_bf16_bits(w.contiguous().view(torch.int16).cpu().numpy())
        return back(self.w_in[le]), back(self.w_out[le])


def device_sync(torch) -> None:
    """torch.cuda.synchronize() where there is a GPU (the CPU tests run the layer on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def memory_note(torch) -> str:
    """The GPU's free memory (every rank shares it), for the log; "" where unknown."""
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001 - CPU tests, old drivers
        return ""
    return f"GPU memory {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"


def free_cache(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_bf16(torch, a):
    """A CPU bf16 tensor holding round_bf16(a) exactly (bit patterns from numpy)."""
    import numpy as np

    return torch.from_numpy(oracle.bf16_bits(a).view(np.int16)).view(torch.bfloat16)


class PplxLayer:
    """The layer on one pplx handle: buffers sized for T tokens per rank, forward(x) -> y."""

    def __init__(self, torch, ata, w: ConfigWeights, T: int, num_dp: int, dev, align: int,
                 gemm: str, capacity_factor: float | None = None) -> None:
        self.torch, self.ata, self.w = torch, ata, w
        self.T, self.L, self.H, self.F, self.k = T, w.L, w.H, w.F, w.k
        self.S_blocks = w.H // BLOCK
        self.P = T * num_dp  # rows per local expert in pplx's padded buffers
        self.align = align
        self.gemm = gemm  # "grouped" or "bmm"
        self.M = packed_rows(self.L, self.k, T, num_dp, num_dp, align, capacity_factor)
        n = self.L * self.P  # padded rows; row n is the sink (zero for the gather)
        fp8 = torch.float8_e4m3fn
        self.ex_flat = torch.zeros((n + 1, self.H), dtype=torch.uint8, device=dev).view(fp8)
        self.ex = self.ex_flat[:n].view(self.L, self.P, self.H)
        self.ex_words = self.ex_flat.view(torch.uint8).view(torch.int64)  # rows as 8-byte words
        self.exs_flat = torch.zeros((n + 1, self.S_blocks), dtype=torch.float32, device=dev)
        self.exs = self.exs_flat[:n].view(self.L, self.P, self.S_blocks)
        self.ey_flat = torch.zeros((n + 1, self.H), dtype=torch.bfloat16, device=dev)
        self.ey = self.ey_flat[:n].view(self.L, self.P, self.H)
        self.counts = torch.zeros(self.L, dtype=torch.int32, device=dev)
        self.rows = torch.arange(self.M, dtype=torch.int64, device=dev)
        self.bound_m = torch.tensor([T], dtype=torch.uint32, device=dev)
        self.y = torch.zeros((T, self.H), dtype=torch.bfloat16, device=dev)  # combine's output
        try:  # int32 -> uint32 as a view (no kernel); else a cast, as loop_pplx does
            torch.zeros(1, dtype=torch.int32, device=dev).view(torch.uint32)
            self.as_u32 = lambda t: t.view(torch.uint32)
        except (RuntimeError, TypeError):
            self.as_u32 = lambda t: t.to(torch.uint32)
        self.last_routing = None

    # -- the pieces
    def route(self, xf):
        torch = self.torch
        logits = torch.mm(xf, self.w.router)  # [T, E] f32 (TF32 off: rank_main)
        top, idx = torch.topk(logits, self.k, dim=1)  # descending
        return idx.to(torch.int32), torch.softmax(top, dim=1)

    def quantize(self, xf):
        """(q [T, H] fp8, scale [T, H/128] f32): scale = max(amax, 1e-12) / 448 per block."""
        blocks = xf.view(self.T, self.S_blocks, BLOCK)
        scale = blocks.abs().amax(dim=-1).clamp(min=oracle.SCALE_FLOOR) / FP8_MAX
        q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(self.torch.float8_e4m3fn)
        return q.view(self.T, self.H), scale

    def shared_mlp(self, x):
        torch, w = self.torch, self.w
        pre = torch.mm(x, w.shared_in)  # [T, 2SF] bf16 (f32 accumulation)
        SF = pre.shape[1] // 2
        h = (torch.nn.functional.silu(pre[:, :SF]) * pre[:, SF:]).contiguous()
        return torch.mm(h, w.shared_out)

    def experts(self) -> None:
        """expert_y from expert_x and the counts, over the live rows (see the module doc)."""
        torch, w, F = self.torch, self.w, self.F
        if self.gemm == "bmm":  # every padded row (rows past the counts: stale, never combined)
            xb = self.ex.to(torch.bfloat16)
            xb.view(self.L, self.P, self.S_blocks, BLOCK).mul_(self.exs.unsqueeze(-1))
            pre = torch.bmm(xb, w.w_in)
            h = (torch.nn.functional.silu(pre[..., :F]) * pre[..., F:]).contiguous()
            torch.bmm(h, w.w_out, out=self.ey)
            return
        src, ends = compaction_index(self.counts, self.rows, self.P, self.align)
        offs = ends.clamp(max=self.M).to(torch.int32)  # never past the buffer (capacity)
        xq = self.ex_words.index_select(0, src).view(torch.float8_e4m3fn)  # [M, H] fp8
        xb = xq.to(torch.bfloat16)  # exact: every e4m3 value is a bf16 value
        scale = self.exs_flat.index_select(0, src)  # [M, H/128] f32 (the sink's: 0)
        xb.view(self.M, self.S_blocks, BLOCK).mul_(scale.unsqueeze(-1))  # bf16(q * s), in f32
        pre = torch._grouped_mm(xb, w.w_in, offs)  # [M, 2F]; rows past offs[-1] not written
        h = (torch.nn.functional.silu(pre[:, :F]) * pre[:, F:]).contiguous()
        out = torch._grouped_mm(h, w.w_out, offs)  # [M, H]
        self.ey_flat.index_copy_(0, src, out)  # padding and idle rows all land on the sink

    def forward(self, x):
        """x [T, H] bf16 -> y [T, H] bf16 (self.y itself without shared experts)."""
        xf = x.float()
        indices, weights = self.route(xf)
        q, scale = self.quantize(xf)
        idx = self.as_u32(indices)
        kw = dict(out_expert_num_tokens=self.counts, out_expert_x=self.ex,
                  out_expert_x_scale=self.exs, dp_x=q, dp_x_scale=scale, indices=idx,
                  bound_m=self.bound_m)
        shared = None
        if self.w.S:  # the shared experts while the tokens are on the wire
            self.ata.dispatch(**kw, do_send=True, do_recv=False)
            shared = self.shared_mlp(x)
            self.ata.dispatch(**kw, do_send=False, do_recv=True)
        else:
            self.ata.dispatch(**kw)
        self.experts()
        self.ata.combine(out_tokens=self.y, indices=idx, weights=weights, expert_y=self.ey,
                         bound_m=self.bound_m)
        self.last_routing = (indices, weights)
        return self.y if shared is None else self.y + shared


def renorm(torch, y):
    """RMS-normalise each row (benchmarks/bench_layer.py's renorm): the next layer's input."""
    yf = y.float()
    return (yf * torch.rsqrt(yf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).to(torch.bfloat16)


def probe_grouped_mm(torch, dev) -> tuple[bool, str]:
    """(usable, why not): torch._grouped_mm on a small 2D x 3D problem with an empty group and
    rows past offs[-1], against torch.mm per group."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no _grouped_mm"
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(48, 64, generator=gen).to(dev, torch.bfloat16)
        b = torch.randn(3, 64, 48, generator=gen).to(dev, torch.bfloat16)
        offs = torch.tensor([16, 16, 40], dtype=torch.int32, device=dev)
        out = torch._grouped_mm(a, b, offs)
        ref = torch.cat([a[:16] @ b[0], a[16:40] @ b[2]]).float()
        torch.cuda.synchronize()
        if tuple(out.shape) != (48, 48):
            return False, f"torch._grouped_mm gave shape {tuple(out.shape)}, expected (48, 48)"
        err = float((out[:40].float() - ref).abs().max() / ref.abs().max())
        if not err < 2e-2:
            return False, f"torch._grouped_mm differs from torch.mm per group (rel err {err:.3g})"
        return True, ""
    except Exception as e:  # noqa: BLE001 - reported, then the fallback runs
        return False, f"torch._grouped_mm failed: {type(e).__name__}: {str(e).strip()[:200]}"


class Clock:
    """loop_pplx's measurement: host barrier, on-stream NVSHMEM barrier (outside the interval),
    CUDA event, body, CUDA event, sync; microseconds per call."""

    def __init__(self, torch, dist, barrier_on_stream) -> None:
        self.torch, self.dist, self.barrier_on_stream = torch, dist, barrier_on_stream

    def measure(self, body) -> float:
        torch = self.torch
        stream = torch.cuda.current_stream()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        self.dist.barrier()
        self.barrier_on_stream()
        e0.record(stream)
        body()
        e1.record(stream)
        stream.synchronize()
        return e0.elapsed_time(e1) * 1e3

    def timed(self, body, warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            self.measure(body)
        return [self.measure(body) for _ in range(reps)]


def capture(torch, body, stream=None):
    """(graph, "") or (None, why not), captured on `stream` (default: torch's capture stream).
    No rank communicates while capturing."""
    try:
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
            body()
        torch.cuda.synchronize()
        return g, ""
    except Exception as e:  # noqa: BLE001 - reported as unsupported
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return None, f"{type(e).__name__}: {text}"


def measure_hbm(ctx: dict) -> dict:
    """Bytes per second one rank reads while every rank reads at once (collective)."""
    torch, loop, args, clock = ctx["torch"], ctx["loop"], ctx["args"], ctx["clock"]
    n = args.hbm_mib * 2**20 // 2  # bf16 elements
    buf = torch.ones(n, dtype=torch.bfloat16, device=ctx["dev"])
    half = n // 2
    dst = torch.empty(half, dtype=torch.bfloat16, device=ctx["dev"])
    inner = args.hbm_inner

    def read():
        for _ in range(inner):
            buf.sum(dtype=torch.float32)

    def copy():
        for _ in range(inner):
            dst.copy_(buf[:half])

    mine = {"read": clock.timed(read, 1, 5), "copy": clock.timed(copy, 1, 5)}
    everyone = loop.gather_json(mine, ctx["world"])
    t_read = loop.median_of_max([p["read"] for p in everyone])
    t_copy = loop.median_of_max([p["copy"] for p in everyone])
    buf = dst = None  # freed: the closures above are done with them
    torch.cuda.empty_cache()
    read_bps = n * 2 * inner / (t_read * 1e-6)
    copy_bps = 2 * half * 2 * inner / (t_copy * 1e-6)  # read + written bytes
    return dict(hbm_read_bytes_per_s=read_bps, hbm_copy_bytes_per_s=copy_bps,
                hbm_bytes_per_s=max(read_bps, copy_bps), hbm_probe_bytes_per_rank=n * 2)


def check_case(ctx: dict, layer: PplxLayer, w: ConfigWeights, case: dict, y, source: str) -> dict:
    """The layer's y against layer_oracle on this case (collective). source "seed": the oracle
    regenerates this rank's experts from the seed; "device": it copies them back."""
    import numpy as np

    torch, dist, loop = ctx["torch"], ctx["dist"], ctx["loop"]
    rank, world = ctx["rank"], ctx["world"]
    T, H, k, L = layer.T, w.H, w.k, w.L
    indices, weights = layer.last_routing
    mine_idx, mine_w = indices.cpu(), weights.float().cpu()
    all_idx = [torch.empty_like(mine_idx) for _ in range(world)]
    all_w = [torch.empty_like(mine_w) for _ in range(world)]
    dist.all_gather(all_idx, mine_idx)
    dist.all_gather(all_w, mine_w)
    idx = torch.stack(all_idx).numpy().reshape(world * T, k)
    wts = torch.stack(all_w).numpy().reshape(world * T, k)
    x_all = case["x"]
    xq = oracle.round_bf16(oracle.fake_quantize_fp8(x_all)).reshape(world * T, H)
    if source == "seed":
        def weights_of(e):
            return case["w_in"][e], case["w_out"][e]
    else:
        def weights_of(e):
            return w.local_expert_host(torch, e - rank * L)
    part = oracle.expert_contributions(xq, idx, wts, range(rank * L, (rank + 1) * L), weights_of)
    total = torch.from_numpy(np.ascontiguousarray(part))
    dist.all_reduce(total)  # every rank's experts' part (gloo, f32 sum)
    ref = total.numpy().reshape(world, T, H)[rank]
    shared = oracle.shared_output(x_all[rank], case)
    if shared is not None:
        ref = ref + shared
    got = y.float().cpu().numpy()
    err = oracle.rel_err(got, ref)
    np_idx, np_w = oracle.route(x_all[rank], case["router"], k)
    dev_idx, dev_w = mine_idx.numpy(), mine_w.numpy()
    mismatch, wdiff = 0, 0.0
    for t in range(T):
        a, b = np.argsort(dev_idx[t]), np.argsort(np_idx[t])
        if not np.array_equal(dev_idx[t][a], np_idx[t][b]):
            mismatch += 1
            continue
        wdiff = max(wdiff, float(np.abs(dev_w[t][a] - np_w[t][b]).max()))
    everyone = loop.gather_json(dict(err=err if math.isfinite(err) else None, mismatch=mismatch,
                                     wdiff=wdiff, finite=bool(np.isfinite(got).all())), world)
    errs = [p["err"] for p in everyone]
    max_err = None if None in errs else max(errs)  # None: some rank's y was not finite
    mismatches = sum(p["mismatch"] for p in everyone)
    max_wdiff = max(p["wdiff"] for p in everyone)
    ok = (max_err is not None and max_err <= ctx["args"].tol and all(p["finite"] for p in everyone)
          and mismatches <= max(1, world * T // 100) and max_wdiff <= 1e-3)
    return dict(correct=ok, max_rel_err=max_err, check_tokens=T, route_mismatch_tokens=mismatches,
                route_weight_max_diff=max_wdiff, check_source=source)


def run_case(ctx: dict, w: ConfigWeights, T: int, timing: bool, check: str | None) -> dict:
    """One (config, S, T) on its own pplx handle (collective): the first layer eagerly, the
    floor's counts, the check (check: "seed", "device", "auto" = device where cheap, None),
    and with timing every variant and K. Returns what the rows need."""
    from pplx_kernels import AllToAll

    torch, dist, loop, args = ctx["torch"], ctx["dist"], ctx["loop"], ctx["args"]
    rank, world, dev = ctx["rank"], ctx["world"], ctx["dev"]
    case = oracle.make_case(w.name, T, world, args.seed, w.S)
    x = torch.from_numpy(case["x"][rank]).to(dev).to(torch.bfloat16)  # exact
    ata = AllToAll.internode(
        max_num_tokens=T, num_experts=w.E, experts_per_token=w.k, rank=rank, world_size=world,
        dp_size=1, hidden_dim=w.H, hidden_dim_bytes=w.H, hidden_dim_scale_bytes=(w.H // BLOCK) * 4)
    out: dict = {"check": None, "timing": None}
    try:
        layer = PplxLayer(torch, ata, w, T, world, dev, args.group_align, ctx["gemm"],
                          args.capacity_factor)
        y0 = layer.forward(x).clone()
        combined0 = layer.y.clone()  # combine's output, before the shared experts' add
        device_sync(torch)
        counts = [int(v) for v in layer.counts.tolist()]
        per_rank = loop.gather_json(counts, world)
        live_first = [sum(1 for c in cs if c > 0) for cs in per_rank]
        out["live_experts_per_rank"] = live_first
        out["live_rows_per_rank"] = [sum(cs) for cs in per_rank]
        out["packed_rows_bound"] = layer.M
        needed = [max(packed_rows_needed(cs, args.group_align) for cs in per_rank)]
        if check == "auto":
            gflop = oracle_gflop(max(out["live_rows_per_rank"]), w.H, w.F)
            check = "device" if args.check_gflop > 0 and gflop <= args.check_gflop else None
        if check:
            out["check"] = check_case(ctx, layer, w, case, y0, check)
        if args.loop_input == "output" and timing:  # the chained layers' routing, eagerly
            live = [live_first]
            h = renorm(torch, y0)
            for _ in range(max(args.ks) - 1):
                h = renorm(torch, layer.forward(h))
                cs = loop.gather_json([int(v) for v in layer.counts.tolist()], world)
                live.append([sum(1 for c in rc if c > 0) for rc in cs])
                needed.append(max(packed_rows_needed(rc, args.group_align) for rc in cs))
            out["live_per_layer"] = live
        else:
            out["live_per_layer"] = [live_first]
        out["packed_rows_needed"] = max(needed)
        if timing:
            out["timing"] = time_layers(ctx, layer, x,
                                        combined0 if args.loop_input == "first" else None)
            y1 = layer.forward(x).clone()
            device_sync(torch)
            same = oracle.rel_err(y1.float().cpu().numpy(), y0.float().cpu().numpy()) <= 1e-2
            out["correct_after"] = loop.all_ranks_true(same)
        device_sync(torch)
        del layer
    finally:
        dist.barrier()
        ata.destroy()  # collective nvshmem_free, the same order on every rank
    gc.collect()
    free_cache(torch)
    return out


def time_layers(ctx: dict, layer: PplxLayer, x, combined0=None) -> dict:
    """Every variant and K: {"runs": {variant: {str(K): [us per rep]}}, "unsupported": {...},
    "graph_mismatch": [K whose replays left combine's output unlike the eager layer's
    combined0]} for this rank (collective; combined0 None: not compared)."""
    torch, loop, args, clock = ctx["torch"], ctx["loop"], ctx["args"], ctx["clock"]

    def layers(K: int) -> None:
        h = x
        for i in range(K):
            y = layer.forward(h)
            if args.loop_input == "output" and i + 1 < K:
                h = renorm(torch, y)

    result = {"runs": {}, "unsupported": {}, "graph_mismatch": []}
    side = None  # the capture stream, warmed up by one eager layer (torch's advice for graphs:
    # lazily created per-stream state such as cuBLAS workspaces exists before the capture)
    if "graph" in args.variants:
        try:
            side = torch.cuda.Stream()
        except Exception:  # noqa: BLE001 - no CUDA (CPU tests): capture reports why
            side = None
        if loop.all_ranks_true(side is not None):  # the warm-up layer is collective
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                layers(1)
            torch.cuda.current_stream().wait_stream(side)
            device_sync(torch)
        else:
            side = None
    for variant in args.variants:
        result["runs"][variant] = {}
        for K in args.ks:
            if not loop.all_ranks_true(time.time() < ctx["deadline"]):
                result["unsupported"].setdefault(variant, "skipped: --budget-s spent")
                break
            if variant == "eager":
                result["runs"][variant][str(K)] = clock.timed(lambda K=K: layers(K),
                                                              args.warmup, args.reps)
                continue
            if variant in result["unsupported"]:
                break
            g, why = capture(torch, lambda K=K: layers(K), side)
            if not loop.all_ranks_true(g is not None):  # every rank captured
                result["unsupported"][variant] = why or "capture failed on another rank"
                if ctx["rank"] == 0:
                    print(f"    {variant} K={K}: unsupported ({result['unsupported'][variant]})",
                          flush=True)
                del g
                break
            result["runs"][variant][str(K)] = clock.timed(g.replay, args.warmup, args.reps)
            device_sync(torch)
            if combined0 is not None:  # the replayed layers computed what the eager one did
                same = oracle.rel_err(layer.y.float().cpu().numpy(),
                                      combined0.float().cpu().numpy()) <= 1e-2
                if not loop.all_ranks_true(same):
                    result["graph_mismatch"].append(K)
            del g
            free_cache(torch)
    return result


# -- rank main ------------------------------------------------------------------------------------
def base_row(w: ConfigWeights, T: int, ctx: dict) -> dict:
    return dict(method=METHOD, config=w.name, num_experts=w.E, experts_per_token=w.k,
                hidden=w.H, ffn=w.F, num_shared_experts=w.S, gated=True, tokens_per_rank=T,
                dispatch_dtype="fp8_e4m3", grouped_gemm=ctx["gemm_name"],
                weight_layout=ctx["args"].weight_layout,
                group_align=ctx["args"].group_align, loop_input=ctx["args"].loop_input)


def case_rows(ctx: dict, w: ConfigWeights, T: int, got: dict | None, checked: dict,
              everyone: list | None, note: str = "") -> list[dict]:
    """The rows of one case (skipped rows where got is None)."""
    args = ctx["args"]
    base = base_row(w, T, ctx)
    own = (got or {}).get("check")
    chk = own or checked
    base.update(
        correct=bool(checked.get("correct")) and (own is None or bool(own["correct"])),
        max_rel_err=chk.get("max_rel_err"), check_tokens=chk.get("check_tokens"),
        route_mismatch_tokens=chk.get("route_mismatch_tokens"),
        check_source=chk.get("check_source"), config_check=checked, note=note)
    if got is None:
        base.update(floor_fields([[0]], w.H, w.F, w.S, None), busiest_rank_live_experts=None,
                    weight_bytes_busiest=None, hbm_bytes_per_s=ctx["hbm"].get("hbm_bytes_per_s"),
                    correct_after=None)
        return [dict(base, variant=v, per_layer_us=None, intercept_us=None, ks=list(args.ks),
                     elapsed_us=[None] * len(args.ks)) for v in args.variants]
    base.update(floor_fields(got["live_per_layer"], w.H, w.F, w.S,
                             ctx["hbm"].get("hbm_bytes_per_s")))
    base.update(live_experts_per_rank=got["live_experts_per_rank"],
                live_rows_per_rank=got["live_rows_per_rank"],
                packed_rows_bound=got["packed_rows_bound"],
                packed_rows_needed=got["packed_rows_needed"],
                capacity_factor=args.capacity_factor,
                correct_after=got.get("correct_after"))
    if got["packed_rows_needed"] > got["packed_rows_bound"]:  # rows were dropped
        base["correct"] = False
        base["note"] = "; ".join(n for n in (base["note"], (
            f"capacity overflow: {got['packed_rows_needed']} packed rows needed, "
            f"{got['packed_rows_bound']} held")) if n)
    rows = summarize(base, everyone, args.variants, args.ks, ctx["loop"])
    mismatch = sorted({K for p in everyone for K in p.get("graph_mismatch", [])})
    for r in rows:
        if r["variant"] == "graph":
            r["graph_mismatch_ks"] = mismatch
            if mismatch:  # the replayed graph computed something else: its times do not count
                r["correct"] = False
                r["note"] = "; ".join(n for n in (r["note"], (
                    f"graph replays' output differs from the eager layer's at K={mismatch}"))
                    if n)
    return rows


def rank_main(args: argparse.Namespace) -> int:
    loop = load_peer(peer_dir(args.peer))
    import numpy as np  # noqa: F401  (fail here, not mid-run, where numpy is missing)
    import torch
    import torch.distributed as dist
    from pplx_kernels import (
        nvshmem_alloc_empty_unique_id,
        nvshmem_barrier_all_on_current_stream,
        nvshmem_finalize,
        nvshmem_get_unique_id,
        nvshmem_init,
    )

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t_start = time.time()
    budget = args.budget_s
    if budget is None:
        budget = float(os.environ.get("LAYER_PPLX_BUDGET_S", 600))
    if torch.cuda.device_count() == 0:
        print(f"[rank {rank}] no CUDA device visible", flush=True)
        return 1
    dev_index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(dev_index)
    # PPLX_BENCH_DEVICE=cpu only for a dry run without a GPU (tests/test_layer_pplx.py: a
    # stand-in pplx_kernels and torch.cuda stubs), as loop_pplx; real runs always use cuda.
    dev = torch.device(os.environ.get("PPLX_BENCH_DEVICE", "cuda"), dev_index)
    torch.backends.cuda.matmul.allow_tf32 = False  # the router's f32 logits in full f32
    torch.backends.cudnn.allow_tf32 = False
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # NVSHMEM over gloo, as loop_pplx.rank_main does it.
    dist.init_process_group(backend="gloo",
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    uid = nvshmem_get_unique_id() if rank == 0 else nvshmem_alloc_empty_unique_id()
    dist.broadcast(uid, src=0)
    status = nvshmem_init(uid, rank, world)
    if status != 0:
        print(f"[rank {rank}] nvshmem_init returned {status}", flush=True)
        return 1
    props = torch.cuda.get_device_properties(dev)
    gpu_ids = loop.gather_json(str(getattr(props, "uuid", f"{props.name}/{dev_index}")), world)
    out = args.out or default_out()
    clock = Clock(torch, dist, nvshmem_barrier_all_on_current_stream)
    ctx = dict(torch=torch, dist=dist, loop=loop, args=args, rank=rank, world=world, dev=dev,
               clock=clock, deadline=t_start + budget)

    usable, why = probe_grouped_mm(torch, dev)
    usable = loop.all_ranks_true(usable)
    ctx["gemm"] = "grouped" if usable else "bmm"
    ctx["gemm_name"] = "torch._grouped_mm" if usable else \
        f"{NO_GROUPED_MM} ({why or 'torch._grouped_mm failed on another rank'})"
    result = {
        "tool": "layer_pplx", "gpu": props.name, "gpu_count": len(set(gpu_ids)), "world": world,
        "commit": loop.pplx_commit(args), "date": date,
        "command": os.environ.get("LAYER_PPLX_COMMAND", shlex.join(["python3"] + sys.argv)),
        "torch": torch.__version__, "grouped_gemm": ctx["gemm_name"],
        "mps_share": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "ks": args.ks, "reps": args.reps, "warmup": args.warmup, "loop_input": args.loop_input,
        "group_align": args.group_align, "capacity_factor": args.capacity_factor,
        "weight_layout": args.weight_layout,
        "tol": args.tol, "budget_s": budget,
        "in_progress": "bandwidth probe", "error": None, "rows": [],
    }

    def write() -> None:
        if rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, out)

    if rank == 0:
        print(f"layer_pplx: world={world} gpu={props.name} ({result['gpu_count']} GPU(s), "
              f"{props.multi_processor_count} SMs visible per rank) torch={torch.__version__} "
              f"grouped_gemm={ctx['gemm_name']} ks={args.ks} reps={args.reps} "
              f"loop_input={args.loop_input} budget {budget:.0f} s; "
              f"init {time.time() - t_start:.1f} s",
              flush=True)
        if not usable:
            print(f"layer_pplx: WARNING: {ctx['gemm_name']}", flush=True)
        write()
    try:
        ctx["hbm"] = measure_hbm(ctx)
        result.update(ctx["hbm"])
        if rank == 0:
            hbm = ctx["hbm"]
            print(f"  HBM per rank, all ranks at once: read "
                  f"{hbm['hbm_read_bytes_per_s'] / 1e9:.0f} GB/s, copy "
                  f"{hbm['hbm_copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write)", flush=True)
        for name in args.configs:
            E = oracle.CONFIGS[name][0]
            if E % world or world < 2:
                if rank == 0:
                    print(f"skip {name}: E={E} over world={world} not supported", flush=True)
                continue
            if not loop.all_ranks_true(time.time() < ctx["deadline"]):
                w = ConfigWeights.dims_only(name, world)
                for S in args.shared_experts:
                    w.S = S
                    for T in args.tokens:
                        result["rows"] += case_rows(ctx, w, T, None, {}, None,
                                                    note="skipped: --budget-s spent")
                write()
                continue
            result["in_progress"] = f"{name}: weights"
            write()
            t0 = time.time()
            w = ConfigWeights(torch, name, world, rank, args.seed, dev, args.weight_layout)
            if rank == 0:
                print(f"{name}: E={w.E} k={w.k} H={w.H} F={w.F} L={w.L}: weights on the device in "
                      f"{time.time() - t0:.1f} s", flush=True)
            for S in args.shared_experts:
                if S:
                    w.set_shared(torch, S, oracle.make_case(name, 1, 0, args.seed, S))
                else:
                    w.set_shared(torch, 0, {})
                result["in_progress"] = f"{name} S={S}: check at {args.check_tokens} tokens"
                write()
                t0 = time.time()
                checked = run_case(ctx, w, args.check_tokens, timing=False, check="seed")["check"]
                if rank == 0:
                    print(f"  {name} S={S} " + check_line(checked, args.tol)
                          + f" ({time.time() - t0:.1f} s)", flush=True)
                for T in args.tokens:
                    go = loop.all_ranks_true(time.time() < ctx["deadline"])
                    if not go:
                        rows = case_rows(ctx, w, T, None, checked, None,
                                         note="skipped: --budget-s spent")
                    else:
                        result["in_progress"] = f"{name} S={S} T={T}"
                        write()
                        if rank == 0:
                            print(f"  {name} S={S} T={T}: {memory_note(torch)}", flush=True)
                        t0 = time.time()
                        got = run_case(ctx, w, T, timing=True, check="auto")
                        everyone = loop.gather_json(got["timing"], world)
                        rows = case_rows(ctx, w, T, got, checked, everyone)
                        if rank == 0:
                            print(f"  {name} S={S} T={T}: {time.time() - t0:.1f} s", flush=True)
                    result["rows"] += rows
                    if rank == 0:
                        for r in rows:
                            print("    " + row_line(r), flush=True)
                    write()
            del w
            gc.collect()
            torch.cuda.empty_cache()
        result["in_progress"] = None
        write()
    except Exception as e:  # noqa: BLE001 - recorded, then this process ends without teardown
        print(f"[rank {rank}] ERROR: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
        result["error"] = f"rank {rank}: {type(e).__name__}: {str(e)[:500]}"
        try:
            write()
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        # The other ranks may be blocked in a collective or a kernel: no nvshmem_free, no
        # finalize (both collective, they would hang); the launcher stops the others.
        os._exit(1)
    dist.barrier()
    nvshmem_finalize()
    dist.destroy_process_group()
    if rank == 0:
        print()
        print(markdown(result["rows"]))
        bad = [r for r in result["rows"] if r.get("per_layer_us") is not None and not r["correct"]]
        print(f"\nwrote {out} ({len(result['rows'])} rows) in {time.time() - t_start:.1f} s",
              flush=True)
        if bad:
            print(f"INCORRECT: {len(bad)} timed rows failed the check " + LOUD, flush=True)
            return 1
    return 0


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.launch is not None:
        return launch_main(args, argv)
    if "RANK" not in os.environ:
        print("no RANK in the environment: use --launch N", file=sys.stderr)
        return 2
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
