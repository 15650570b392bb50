"""Dispatch/combine latency: ours against the dense NVSHMEM all-to-all and the copy floor.

    python -m jax_moe_comm.launch -n 8 --oversubscribe -- \
        python benchmarks/bench_all_to_all.py --out benchmarks/results

Every sample: an on-stream barrier of all ranks, then the fused dispatch and combine (one
launch each; `--split` also times dispatch_send, dispatch_recv, combine_send, combine_recv as
four calls). Samples are enqueued back to back and the host waits once at the end, as
pplx-kernels' harness does (each rank's launches are queued before its barrier ends); the rows
also carry `host_synced_total_us`, the same with the host waiting for every sample (then the
last rank's launch after its barrier is on the critical path). The kernels stamp %globaltimer
at their start and end, and block 0 marks when its waits ended and its work was done
(benchmarks/timeline.py prints where the time goes).
dispatch_us = end of the recv half - start of the send half, combine_us likewise; a sample's
value is the max over ranks; we report the median and p90 over samples. Correctness is checked
against the oracle before timing.

Baselines in the same run: `nvshmem_dense_a2a` (nvshmemx_alltoallmem_on_stream moving every
rank's whole padded token block [max_m, row] to every rank, once for dispatch and once for
combine), and XLA's all_to_all (reference backend) / ragged_all_to_all where XLA's own
collectives can run (one process per GPU; not with several ranks on one GPU, where NCCL
refuses). The floor: bytes that must cross HBM on this GPU (read + write of every sent row, the
copy into expert_x, the combine reduction) over the device-to-device copy bandwidth measured in
the same run with every rank copying at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import jax_moe_comm.distributed as dist

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_moe_comm import (AllToAll, KernelTuning, MoEConfig, native,  # noqa: E402
                          order_after, testing as T)
from jax_moe_comm import _bench  # noqa: E402
from jax_moe_comm._bench import DenseAllToAll  # noqa: E402
from bench_common import CONFIGS, git_commit, kv_gather, measure_host_call_us  # noqa: E402
from timeline import BARRIER_END, format_timeline, phase_timeline  # noqa: E402  (benchmarks/)

@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    tokens: int
    dtype: str  # "fp8" | "bf16"

    def moe(self) -> MoEConfig:
        E, k, H = CONFIGS[self.config]
        dt = jnp.float8_e4m3fn if self.dtype == "fp8" else jnp.bfloat16
        return MoEConfig(num_experts=E, experts_per_token=k, hidden=H,
                         max_num_tokens=self.tokens, world_size=WORLD, dispatch_dtype=dt)


def wire_bytes(cfg: MoEConfig, inp: T.Inputs) -> tuple[int, int, int, int]:
    """(dispatch bytes sent, rows landed in expert_x, combine rows sent, tokens) of rank 0."""
    row = cfg.hidden * cfg.dispatch_dtype.itemsize + 4 * cfg.num_scales
    L = cfg.num_local_experts
    sends = rows = 0
    for t in range(inp.num_tokens[0]):
        experts = {int(e) for e in inp.indices[0, t] if e >= 0}
        sends += len({e // L for e in experts})
        rows += len(experts)
    return sends * row, rows * row, rows * cfg.hidden * cfg.combine_dtype.itemsize, \
        int(inp.num_tokens[0])


def measure_copy_bandwidth(mod) -> float:
    """Bytes/s of one rank's device copy while every rank copies (read + write counted)."""
    x = jnp.ones((64 << 20,), jnp.bfloat16)  # 128 MiB
    copy = jax.jit(lambda a: a * 2)
    jax.block_until_ready(copy(x))
    mod.barrier_all()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        y = copy(x)
    jax.block_until_ready(y)
    dt = (time.perf_counter() - t0) / reps
    rates = kv_gather("copy_bw", 2 * x.nbytes / dt)
    return float(np.median(rates))


def stats(samples_us):
    s = sorted(samples_us)
    return statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))]


def time_ours(case: Case, mesh, samples: int, warmup: int, matmul: int, num_blocks: int = 0,
              split: bool = False, lead: int = 0, per_call: int = 1):
    """Per-sample kernel times of one case. split=False: the fused ops (AllToAll.dispatch and
    .combine, one launch each); split=True: send and recv as separate calls (two launches per
    op, what a layer that overlaps compute between them pays). The overlap variant (a matmul
    between the halves) is always split. lead > 0: a lead x lead matmul before each sample's
    barrier, GPU work that lets the host's launches get ahead of the GPU (as a model's layers
    before a dispatch do); it is outside the timed kernels. per_call > 1: that many samples in
    one jitted call, each ordered after the one before (as a model's layers are in one decode
    step), so the host pays one call's overhead per per_call samples."""
    cfg = case.moe()
    a2a = AllToAll(cfg, backend="nvshmem", tuning=KernelTuning(num_blocks=num_blocks))
    backend = a2a.backend
    if RANK == 0:
        print(f"{case}: grids (blocks, warps) of the split kernels, then the fused dispatch and "
              f"combine: {backend.launch_shape()}; dependent launch "
              f"{'on' if backend.dependent_launch() else 'off'}", flush=True)
    inp = T.make_inputs(cfg, seed=case.tokens * 31 + len(case.config), ragged=False)
    T.run_and_check(a2a, mesh, inp)  # correctness first
    args = T.global_inputs(cfg, mesh, inp)
    spec = P("ep")

    def body(x, x_scale, idx, w, nt, mm=None, lead_m=None):
        nt = nt.reshape(())
        if lead_m is not None:
            nt = order_after(nt, lead_m @ lead_m)
        ticket = backend.barrier(nt)
        nt = order_after(nt, ticket)  # the dispatch reads nt: it starts after the barrier
        if mm is None and not split:
            out = a2a.dispatch(x, idx, nt, x_scale=x_scale)
            ey = out.expert_x.astype(cfg.combine_dtype)
            return a2a.combine(ey, out.routing, idx, w, nt)
        pending = a2a.dispatch_send(x, idx, nt, x_scale=x_scale)
        if mm is not None:  # overlap: a matmul between the halves
            h = mm @ mm
            pending = order_after(pending, h)
        out = a2a.dispatch_recv(pending)
        ey = out.expert_x.astype(cfg.combine_dtype)
        y = a2a.combine_recv(a2a.combine_send(ey, out.routing), idx, w, nt)
        return y if mm is None else (y, h)

    def compile_step(with_mm):
        x, xs, idx, w, nt = args
        if xs is None:  # bf16: a 0-column stand-in keeps one signature
            xs = jnp.zeros((WORLD * cfg.max_num_tokens, 0), jnp.float32)
        operands = [x, xs, idx, w, nt]
        if with_mm:
            operands.append(jnp.ones((WORLD * matmul, matmul), jnp.bfloat16))
        if lead:
            operands.append(jnp.ones((WORLD * lead, lead), jnp.bfloat16))

        def per_rank(x, xs, idx, w, nt, *extra):
            extra = list(extra)
            mm = extra.pop(0) if with_mm else None
            lead_m = extra.pop(0) if lead else None
            return body(x, xs if cfg.is_fp8 else None, idx, w, nt, mm, lead_m)

        def chained(x, xs, idx, w, nt, *extra):
            for _ in range(per_call - 1):  # each sample's barrier after the last one's output
                nt = order_after(nt, per_rank(x, xs, idx, w, nt, *extra))
            return per_rank(x, xs, idx, w, nt, *extra)

        out_specs = (spec, spec) if with_mm else spec
        fn = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=(spec,) * len(operands),
                                   out_specs=out_specs))
        def step():
            return fn(*operands)

        jax.block_until_ready(step())  # compiled here, before any clock starts
        return step

    # Timing on before the first call: XLA may record the calls into a CUDA graph then and
    # replay them without our handlers, so the stamps' setting is the one of the first call.
    _bench.set_timing(backend, True)

    def timed_samples(step, pipelined: bool) -> tuple[list, float]:
        """Every kernel's stamps of `samples` samples after `warmup`, and the host's time per
        sample (us). Pipelined: the host enqueues sample after sample and waits once at the
        end (pplx's harness does the same), so a sample's launches are queued before its
        barrier ends, if the host enqueues a sample faster than the GPU runs one; else the host
        waits for every sample, and each rank's next launch trails its barrier by the host's
        own launch time."""
        opened = len(_bench.read_timings(backend))  # samples before these (compile, other runs)
        warm_calls = -(-warmup // per_call)
        calls = warm_calls + -(-samples // per_call)
        for i in range(calls):
            if i == warm_calls:
                t0 = time.perf_counter()
            out = step()
            if not pipelined:
                jax.block_until_ready(out)
        # Python's enqueue time per sample; if the runtime launches on another thread or
        # throttles executions in flight, this can understate the launch cost (compare it with
        # the samples' spacing on the GPU, not alone).
        host_us = (time.perf_counter() - t0) / ((calls - warm_calls) * per_call) * 1e6
        jax.block_until_ready(out)
        first = opened + warm_calls * per_call
        stamps = _bench.read_timings(backend)[first:first + samples]
        return stamps, host_us

    def per_kernel_us(ts):  # the four halves, then dispatch and combine end to end
        return [(ts[2 * p + 1] - ts[2 * p]) / 1e3 for p in range(4)] + \
            [(ts[3] - ts[0]) / 1e3, (ts[7] - ts[4]) / 1e3]

    results = {}
    variants = [("plain", False)] + ([("overlap", True)] if matmul > 0 else [])
    for label, with_mm in variants:
        step = compile_step(with_mm)
        stamps, host_us = timed_samples(step, pipelined=True)
        results[label] = [per_kernel_us(ts) for ts in stamps]
        if label == "plain":
            results["stamps"] = stamps
            # Host-bound when the host needs as long per sample as the samples are apart on the
            # GPU: then the queue never fills and the first launches after the barrier wait
            # for the host.
            results["host_us_per_sample"] = host_us
            results["sample_period_us"] = float(np.median(np.diff(
                [ts[BARRIER_END] for ts in stamps]))) / 1e3
            synced, _ = timed_samples(step, pipelined=False)
            results["host_synced"] = [per_kernel_us(ts) for ts in synced]
    if not split:  # the main row's: one custom call of ours alone, beside the trivial call
        results["host_us_per_barrier_call"] = measure_host_call_us(
            mesh, WORLD, backend.barrier, f"barrier:{case}")
    a2a.check()
    a2a.close()
    return cfg, inp, results


def time_split_variant(case: Case, mesh, args, num_blocks: int, tag: str) -> dict:
    """A case again on the split kernels (send and recv as separate calls; a grid size applies
    to them): its row's times, slowest rank per sample, and its timeline."""
    _, _, res = time_ours(case, mesh, args.samples, args.warmup, 0, num_blocks, split=True,
                          lead=args.lead_matmul, per_call=args.samples_per_call)
    each = kv_gather(f"{case}:{tag}", res)
    o = np.max(np.array([g["plain"] for g in each]), axis=0)
    total, p90 = stats(o[:, 4] + o[:, 5])
    return dict(dispatch_us=stats(o[:, 4])[0], combine_us=stats(o[:, 5])[0], total_us=total,
                p90_total_us=p90, phases_us=phase_timeline([g["stamps"] for g in each]))


def time_dense(cfg: MoEConfig, samples: int, warmup: int, mesh, rows_per_pair: int):
    """Two dense all-to-alls of `rows_per_pair` padded rows from every rank to every rank:
    dispatch rows, then combine rows."""
    row_in = cfg.hidden * cfg.dispatch_dtype.itemsize + 4 * cfg.num_scales
    row_out = cfg.hidden * cfg.combine_dtype.itemsize
    out = []
    for row in (row_in, row_out):
        dense = DenseAllToAll(WORLD, rows_per_pair * row)
        spec = P("ep")
        fn = jax.jit(jax.shard_map(lambda v: dense(v), mesh=mesh, in_specs=spec,
                                   out_specs=spec))
        x = jax.make_array_from_callback(
            (WORLD * WORLD, dense.chunk_bytes), jax.sharding.NamedSharding(mesh, spec),
            lambda idx: np.zeros((WORLD, dense.chunk_bytes), np.uint8))
        times = []
        for i in range(warmup + samples):
            native.module().barrier_all()
            jax.block_until_ready(fn(x))
            ts = dense.read_timings()
            if i >= warmup:
                times.append((ts[1] - ts[0]) / 1e3)
        dense.close()
        out.append(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="V2Lite,R1")
    p.add_argument("--tokens", default="1,4,16,32,64,128")
    p.add_argument("--dtypes", default="fp8", help="comma list of fp8,bf16")
    p.add_argument("--bf16-at", default="R1:128",
                   help="extra bf16-dispatch cases CONFIG:T (comma list; 'none': no extra)")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--matmul", type=int, default=2048, help="overlap matmul size (0: off)")
    p.add_argument("--num-blocks", default="0",
                   help="grid of every kernel (0: auto); a comma list sweeps grids: the first "
                        "makes the main rows, each other one an extra 'ours' row")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the split ops (send and recv as separate calls)")
    p.add_argument("--lead-matmul", type=int, default=0,
                   help="N: an N x N bf16 matmul before each sample's barrier (untimed GPU work "
                        "that keeps the host's launches ahead of the GPU; 0: none)")
    p.add_argument("--samples-per-call", type=int, default=1,
                   help="K: K samples in one jitted call, chained like a model's layers (the "
                        "host's per-call cost is paid once per K samples)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    k = args.samples_per_call
    if k < 1:
        p.error("--samples-per-call must be >= 1")
    if (-(-args.warmup // k) + -(-args.samples // k)) * k > 1024:
        p.error("--warmup + --samples (each rounded up to a multiple of --samples-per-call) "
                "must be <= 1024 (the stamps a handle keeps)")
    from jax_moe_comm import init

    init()  # NVSHMEM up before the first host barrier
    mod = native.module()
    mesh = T.make_mesh(WORLD)
    oversubscribed = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in os.environ
    bandwidth = measure_copy_bandwidth(mod)
    say = print if RANK == 0 else (lambda *a, **k: None)
    say(f"copy bandwidth per rank with {WORLD} ranks copying: {bandwidth / 1e12:.3f} TB/s; SMs "
        f"this process sees: {getattr(jax.devices()[0], 'core_count', '?')} "
        f"(MPS share {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', 'none')} %)")

    host_call_us = measure_host_call_us(mesh, WORLD)
    say(f"host time per call of a trivial jitted step: {host_call_us:.0f} us (slowest rank)")

    cases = [Case(c, t, d) for c in args.configs.split(",") for d in args.dtypes.split(",")
             for t in map(int, args.tokens.split(","))]
    for extra in filter(lambda e: e and e != "none", args.bf16_at.split(",")):
        c, t = extra.split(":")
        if c in args.configs.split(",") and Case(c, int(t), "bf16") not in cases:
            cases.append(Case(c, int(t), "bf16"))

    grids = [int(b) for b in args.num_blocks.split(",")]
    rows, overlap_rows = [], []
    for case in cases:
        cfg, inp, ours = time_ours(case, mesh, args.samples, args.warmup, args.matmul
                                   if (case.tokens == 128 and case.dtype == "fp8") else 0,
                                   grids[0], lead=args.lead_matmul,
                                   per_call=args.samples_per_call)
        # Token-padded: each token once per rank ([max_m] rows a pair). Expert-padded: the
        # [L, max_m] block per pair that lands directly in the per-expert layout.
        dense_tok = time_dense(cfg, args.samples, args.warmup, mesh, cfg.max_num_tokens)
        dense_exp = time_dense(cfg, max(20, args.samples // 4), 3, mesh,
                               cfg.max_num_tokens * cfg.num_local_experts)
        gathered = kv_gather(f"{case}", {"ours": ours, "dense": dense_tok, "dense_exp": dense_exp})
        # A sample's time is the slowest rank's.
        plain = np.max(np.array([g["ours"]["plain"] for g in gathered]), axis=0)
        dense = np.max(np.array([np.array(g["dense"]).T for g in gathered]), axis=0)
        dense_e = np.max(np.array([np.array(g["dense_exp"]).T for g in gathered]), axis=0)
        d_sent, d_rows, c_sent, ntok = wire_bytes(cfg, inp)
        # HBM bytes on this GPU per rank: put (read+write), copy into expert_x (read+write),
        # combine put (read+write), reduction (read rows, write y).
        hbm = 2 * d_sent + 2 * d_rows + 3 * c_sent + ntok * cfg.hidden * 2
        floor_us = hbm / bandwidth * 1e6
        d_med, _ = stats(plain[:, 4])
        c_med, _ = stats(plain[:, 5])
        tot = plain[:, 4] + plain[:, 5]
        t_med, t_p90 = stats(tot)
        base = dict(config=case.config, num_experts=cfg.num_experts,
                    experts_per_token=cfg.experts_per_token, hidden=cfg.hidden,
                    tokens_per_rank=case.tokens, dispatch_dtype=case.dtype,
                    bytes_per_rank=d_sent + c_sent, floor_us=floor_us, correct=True)
        halves = {n: stats(plain[:, i])[0] for i, n in enumerate(
            ("dispatch_send_us", "dispatch_recv_us", "combine_send_us", "combine_recv_us"))}
        phases = phase_timeline([g["ours"]["stamps"] for g in gathered])
        synced = np.max(np.array([g["ours"]["host_synced"] for g in gathered]), axis=0)
        synced_med, _ = stats(synced[:, 4] + synced[:, 5])
        ours_row = dict(method="jax_moe_comm_nvshmem", dispatch_us=d_med, combine_us=c_med,
                        total_us=t_med, p90_total_us=t_p90, **halves, **base,
                        host_synced_total_us=synced_med, lead_matmul=args.lead_matmul,
                        samples_per_call=args.samples_per_call,
                        host_us_per_sample=max(g["ours"]["host_us_per_sample"] for g in gathered),
                        host_us_per_barrier_call=gathered[0]["ours"]["host_us_per_barrier_call"],
                        sample_period_us=gathered[0]["ours"]["sample_period_us"],
                        phases_us=phases)
        rows.append(ours_row)
        pair_bytes = (cfg.hidden * cfg.dispatch_dtype.itemsize + 4 * cfg.num_scales +
                      cfg.hidden * 2) * WORLD
        dense_total = {}
        for method, d, rows_pp in (("nvshmem_dense_a2a", dense, cfg.max_num_tokens),
                                   ("nvshmem_dense_a2a_expert_padded", dense_e,
                                    cfg.max_num_tokens * cfg.num_local_experts)):
            m_med, m_p90 = stats(d[:, 0] + d[:, 1])
            dense_total[method] = m_med
            rows.append(dict(method=method, dispatch_us=stats(d[:, 0])[0],
                             combine_us=stats(d[:, 1])[0], total_us=m_med, p90_total_us=m_p90,
                             **{**base, "bytes_per_rank": rows_pp * pair_bytes}))
        dt_med = dense_total["nvshmem_dense_a2a"]
        de_med = dense_total["nvshmem_dense_a2a_expert_padded"]
        say(f"{case.config:7s} T={case.tokens:4d} {case.dtype}: ours {d_med:8.1f} + {c_med:8.1f}"
            f" = {t_med:8.1f} us (p90 {t_p90:.1f}); dense {dt_med:9.1f} us; floor "
            f"{floor_us:7.1f} us; ours/floor {t_med / floor_us:5.1f}x; dense/ours "
            f"{dt_med / t_med:5.1f}x; expert-padded dense {de_med:9.1f} us "
            f"({de_med / t_med:5.1f}x ours); ours with the host waiting for every sample "
            f"{synced_med:8.1f} us; host {ours_row['host_us_per_sample']:.0f} us per sample "
            f"(slowest rank), samples {ours_row['sample_period_us']:.0f} us apart on the GPU; a "
            f"jitted barrier alone {ours_row['host_us_per_barrier_call']:.0f} us per call")
        say(format_timeline(phases))
        head = f"{case.config:7s} T={case.tokens:4d} {case.dtype}: ours"
        if args.split:  # the same case with send and recv as separate calls
            r = time_split_variant(case, mesh, args, grids[0], "split")
            rows.append(dict(method="jax_moe_comm_nvshmem_split", **r, **base))
            say(f"{head}, split ops {r['dispatch_us']:8.1f} + {r['combine_us']:8.1f} = "
                f"{r['total_us']:8.1f} us")
            say(format_timeline(r["phases_us"]))
        for blocks in grids[1:]:  # the same case on other grids: which grid is fastest where
            r = time_split_variant(case, mesh, args, blocks, str(blocks))
            rows.append(dict(method=f"jax_moe_comm_nvshmem_blocks{blocks}", **r, **base))
            say(f"{head} with {blocks} blocks {r['dispatch_us']:8.1f} + {r['combine_us']:8.1f}"
                f" = {r['total_us']:8.1f} us")
        if "overlap" in ours:
            over = np.max(np.array([g["ours"]["overlap"] for g in gathered]), axis=0)
            overlap_rows.append(dict(config=case.config, tokens_per_rank=case.tokens,
                                     matmul=args.matmul, dispatch_alone_us=d_med,
                                     dispatch_with_matmul_between_us=stats(over[:, 4])[0]))
    if not oversubscribed:
        say("note: XLA all_to_all / ragged_all_to_all rows need one process per GPU: "
            "run with real GPUs (issue 5)")
    if RANK == 0:
        write_outputs(args, rows, overlap_rows, bandwidth, oversubscribed, host_call_us)
    return 0


def write_outputs(args, rows, overlap_rows, bandwidth, oversubscribed, host_call_us):
    os.makedirs(args.out, exist_ok=True)
    gpu = jax.devices()[0].device_kind
    run = dict(gpu=gpu, gpu_count=len({d.id for d in jax.local_devices()}) if not
               oversubscribed else 1, world=WORLD, oversubscribed_mps=oversubscribed,
               commit=git_commit(), date=datetime.datetime.now(datetime.UTC).isoformat(),
               command=" ".join(["python"] + sys.argv), copy_bandwidth_per_rank_Bps=bandwidth,
               host_us_per_trivial_call=host_call_us,
               rows=rows, overlap=overlap_rows,
               not_run={"xla_all_to_all": "NCCL refuses several ranks on one GPU",
                        "ragged_all_to_all": "NCCL refuses several ranks on one GPU"}
               if oversubscribed else {})
    stem = os.path.join(args.out, f"bench_ep{WORLD}")
    with open(stem + ".json", "w") as f:
        json.dump(run, f, indent=1)
    lines = [f"# dispatch/combine, {WORLD} ranks on {gpu}" +
             (" (one GPU, MPS)" if oversubscribed else ""),
             "", f"commit {run['commit']}, {run['date']}, `{run['command']}`", "",
             "| config | tokens | dtype | method | dispatch µs | combine µs | total µs | p90 µs |"
             " floor µs | total/floor |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['tokens_per_rank']} | {r['dispatch_dtype']} | "
                     f"{r['method']} | {r['dispatch_us']:.1f} | {r['combine_us']:.1f} | "
                     f"{r['total_us']:.1f} | {r['p90_total_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['total_us'] / r['floor_us']:.1f} |")
    if overlap_rows:
        lines += ["", "| config | tokens | matmul n | dispatch alone µs | send→matmul→recv µs |",
                  "|---|---|---|---|---|"]
        for o in overlap_rows:
            lines.append(f"| {o['config']} | {o['tokens_per_rank']} | {o['matmul']} | "
                         f"{o['dispatch_alone_us']:.1f} | "
                         f"{o['dispatch_with_matmul_between_us']:.1f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, cfgname in zip(axes, CONFIGS):
            for method in ("jax_moe_comm_nvshmem", "nvshmem_dense_a2a",
                           "nvshmem_dense_a2a_expert_padded"):
                pts = sorted((r["tokens_per_rank"], r["total_us"]) for r in rows
                             if r["config"] == cfgname and r["method"] == method
                             and r["dispatch_dtype"] == "fp8")
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=method)
            pts = sorted((r["tokens_per_rank"], r["floor_us"]) for r in rows
                         if r["config"] == cfgname and r["method"] == "jax_moe_comm_nvshmem"
                         and r["dispatch_dtype"] == "fp8")
            if pts:
                ax.plot(*zip(*pts), ls="--", label="floor (HBM copy bw)")
            ax.set(title=f"{cfgname}, EP{WORLD}, fp8 dispatch + bf16 combine",
                   xlabel="tokens per rank", ylabel="dispatch + combine (µs)", xscale="log",
                   yscale="log")
            ax.legend()
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    sys.exit(main())
