"""Loop timing of our dispatch + combine: the steady per-cycle cost, by one clock with pplx.

    python -m jax_moe_comm.launch -n 8 --oversubscribe -- \
        python benchmarks/bench_loop.py --out $OUT/loop_ours.json

What a decode server pays per layer is the cost of one dispatch + combine cycle among many back
to back, not a sample after a barrier. This times it the way `shared/peer/loop_pplx.py` times
pplx-kernels, so the two columns compare (DESIGN section 8, "One clock for both"):
- one jitted call holds an on-stream barrier, a CUDA event (slot 0), K dispatch + combine cycles
  written out, each ordered after the one before, and a second event (slot 1); the events are a
  custom call of ours that XLA keeps out of its command buffers (csrc/ffi/event.cc), so the K
  cycles between them replay as one recorded graph (`graph`, pplx's `torch.cuda.graph`);
- `graph+barrier`: the same with an on-stream barrier before every cycle (what both per-sample
  benchmarks time);
- every cycle combines one precomputed `expert_y` (the test experts over one checked dispatch;
  no cast or expert between the ops, as pplx's loop);
- per rank: event elapsed time; per repetition: max over ranks; then the median over --reps,
  elapsed / K, and the least-squares fit elapsed = a + b * K over --ks (b: the steady cost per
  cycle, a: the fixed cost of the interval);
- `per-call`: the host's cost of a jitted single-cycle call: --calls calls enqueued back to back
  between two event calls; host us per call (enqueue rate) and GPU us per cycle, beside a
  trivial jitted call's host cost measured in the same process; `per-call-donated` the same
  with the previous call's output donated as the next one's (stable buffer addresses);
- `floor-*` (opt-in, --variants): the same loop with kernels that move no data in place of
  each cycle (FLOORS below): what the cycle's shape costs before any byte moves;
- a timeline of one cycle in the recorded `graph+barrier` loop from the kernels' own stamps
  (benchmarks/timeline.py; breakdown only, never the headline).
Correctness is checked before (testing.run_and_check) and after the timed loops.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

# Every program recorded as a graph, however short (XLA outlines >= 5 commands by default), so
# K = 1 is timed as a replay too, as pplx's graph variant is.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_graph_min_graph_size=1").strip()

import jax_moe_comm.distributed as dist  # noqa: E402

RANK, WORLD = dist.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench_common import CONFIGS, fit_line, git_commit, kv_gather, measure_host_call_us  # noqa: E402
from jax_moe_comm import AllToAll, MoEConfig, native, order_after  # noqa: E402
from jax_moe_comm import testing as T  # noqa: E402
from jax_moe_comm import _bench  # noqa: E402
from jax_moe_comm._bench import event_elapsed_us, record_event  # noqa: E402
from timeline import format_timeline, phase_timeline  # noqa: E402

VARIANTS = ("graph", "graph+barrier")
# The floor of a cycle's shape (issue 23): the same loop with each cycle's dispatch and combine
# replaced by kernels that move no data, the calls chained by their tickets and one order_after
# per cycle, as a real cycle's. name: (kind, kernels per call, calls per cycle, order_after
# after every call). "empty" kernels only wait for the one before: 2 calls price two of XLA's
# graph edges between custom calls, 1 call of 2 kernels two dependent launches inside one call,
# "+order" an order_after more after each call (it launches nothing; at no cost, XLA may have
# added no graph node for it). "barrier" kernels add one all-rank crossing each (a release
# store to every peer, a wait for every peer): two per cycle are a dispatch and a combine that
# carry nothing.
FLOORS = {"floor-empty-2calls": ("empty", 1, 2, False), "floor-empty-1call": ("empty", 2, 1, False),
          "floor-empty-2calls+order": ("empty", 1, 2, True),
          "floor-barrier-2calls": ("barrier", 1, 2, False),
          "floor-barrier-1call": ("barrier", 2, 1, False)}
ALL_VARIANTS = VARIANTS + tuple(FLOORS)  # what --variants takes
# the per-call rows: (the name time_case files them under, the row's variant)
CALL_VARIANTS = (("per_call", "per-call"), ("per_call_donated", "per-call-donated"))
CALL_ROWS = tuple(v for _, v in CALL_VARIANTS)


class Case:
    def __init__(self, config: str, tokens: int):
        self.config, self.tokens = config, tokens
        E, k, H = CONFIGS[config]
        self.cfg = MoEConfig(num_experts=E, experts_per_token=k, hidden=H, max_num_tokens=tokens,
                             world_size=WORLD, dispatch_dtype=jnp.float8_e4m3fn)

    def __str__(self):
        return f"{self.config} T={self.tokens}"


def handle_kwargs(cfg: MoEConfig, args) -> dict:
    """The layout and capacity of --layout / --capacity-factor (prefill rows: packed, where the
    padded worst case does not fit)."""
    kw = {"layout": args.layout}
    if args.capacity_factor:
        f = args.capacity_factor
        kw.update({"max_recv_rows": cfg.recv_rows_for(f)} if args.layout == "packed"
                  else {"expert_capacity": cfg.rows_per_expert_for(f)})
    return kw


def time_case(case: Case, mesh, args) -> dict:
    cfg, spec, mod = case.cfg, P("ep"), native.module()
    a2a = AllToAll(cfg, backend="nvshmem", **handle_kwargs(cfg, args))
    backend = a2a.backend
    inp = T.make_inputs(cfg, seed=case.tokens * 31 + len(case.config), ragged=False)
    T.run_and_check(a2a, mesh, inp)  # correct first
    x, xs, idx, w, nt = T.global_inputs(cfg, mesh, inp)

    def experts(x, xs, idx, w, nt):  # expert_y of one dispatch, computed once
        out = a2a.dispatch(x, idx, nt.reshape(()), x_scale=xs)
        groups = out.expert_num_tokens if a2a.layout == "packed" else None
        ey = T.expert_outputs(cfg, jax.lax.axis_index("ep"), out.expert_x, out.expert_x_scale,
                              groups)
        # a whole cycle, as the timed loops run them: a handle whose next dispatch counts
        # acknowledge the last combine (branch implicit-acks) refuses a dispatch alone
        return ey, a2a.combine(ey, out.routing, idx, w, nt.reshape(()))

    ey, _ = jax.jit(jax.shard_map(experts, mesh=mesh, in_specs=(spec,) * 5,
                                  out_specs=(spec, spec)))(x, xs, idx, w, nt)
    operands = (x, xs, idx, w, nt, ey)

    def cycle(x, xs, idx, w, nt, ey):
        out = a2a.dispatch(x, idx, nt, x_scale=xs)
        return a2a.combine(ey, out.routing, idx, w, nt)

    def floor_cycle(nt, variant: str):
        kind, per_call, calls, order_each = FLOORS[variant]
        ticket = nt
        for _ in range(calls):
            ticket = _bench.floor_kernels(backend, ticket, kind, per_call)
            if order_each:
                ticket = order_after(ticket, nt)
        return order_after(nt, ticket)

    def loop_fn(K: int, variant: str):
        def per_rank(x, xs, idx, w, nt, ey):
            nt = nt.reshape(())
            nt = order_after(nt, backend.barrier(nt))  # the ranks start together
            nt = order_after(nt, record_event(nt, 0))
            for _ in range(K):
                if variant in FLOORS:
                    nt = floor_cycle(nt, variant)
                    continue
                if variant == "graph+barrier":
                    nt = order_after(nt, backend.barrier(nt))
                nt = order_after(nt, cycle(x, xs, idx, w, nt, ey))  # the next after this one
            return record_event(nt, 1)

        return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 6,
                                     out_specs=spec))

    def timed(fn) -> tuple[list, list]:
        """Event and wall us per repetition on this rank (after --warmup untimed ones)."""
        jax.block_until_ready(fn(*operands))  # compiled and recorded before any clock
        events, walls = [], []
        for r in range(args.warmup + args.reps):
            mod.barrier_all()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*operands))
            wall = (time.perf_counter() - t0) * 1e6
            if r >= args.warmup:
                events.append(event_elapsed_us(0, 1))
                walls.append(wall)
        return events, walls

    mine = {"runs": {}}
    for variant in args.variants:
        for K in args.ks:
            fn = loop_fn(K, variant)
            if K == args.ks[-1] and variant == "graph" and RANK == 0 and args.show_hlo:
                text = fn.lower(*operands).compile().as_text()
                print(f"  {case} K={K}: compiled program has {text.count('custom-call(')} "
                      f"custom calls, {text.count(' copy(')} copies, "
                      f"{text.count('command_buffer')} command-buffer mentions", flush=True)
            mine["runs"][f"{variant}:{K}"] = timed(fn)

    # The host's cost of one jitted cycle per call, enqueued back to back: each call's output
    # fresh (XLA keys a command-buffer recording by buffer addresses: new ones re-record, our
    # handlers run again), and the previous output donated back as the buffer of the next
    # (what a server loop can do; docs/notes.md, "Command buffers").
    if args.calls:
        def one(*a):  # a[6], where given: the donated previous output (unused but its buffer)
            return cycle(*a[:4], a[4].reshape(()), a[5])

        single = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
        donating = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(spec,) * 7, out_specs=spec),
                           donate_argnums=(6,))
        marks = [jax.jit(jax.shard_map(lambda v, s=s: record_event(v, s), mesh=mesh,
                                       in_specs=spec, out_specs=spec)) for s in (2, 3)]
        for f in marks:
            jax.block_until_ready(f(nt))
        y = jax.block_until_ready(single(*operands))
        y = jax.block_until_ready(donating(*operands, y))
        for name, _ in CALL_VARIANTS:
            host, gpu = [], []
            # our handlers run when XLA records a launch, not when it replays one: runs per
            # call tell a recording replayed (0) from one redone at each call (2: dispatch,
            # combine), the first suspect for the host's cost of a call
            runs_before = backend.handler_calls()
            for _ in range(args.reps):
                mod.barrier_all()
                marks[0](nt)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    y = single(*operands) if name == "per_call" else donating(*operands, y)
                host.append((time.perf_counter() - t0) / args.calls * 1e6)
                jax.block_until_ready(marks[1](nt))
                jax.block_until_ready(y)
                gpu.append(event_elapsed_us(2, 3) / args.calls)
            mine[name] = {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu),
                          "handler_runs": (backend.handler_calls() - runs_before)
                          / (args.reps * args.calls)}

    # Breakdown: the kernels' stamps in a recorded graph+barrier loop (timing is read when a
    # launch is recorded, so a new jit after set_timing).
    if args.timeline:
        _bench.set_timing(backend, True)
        fn = loop_fn(args.timeline, "graph+barrier")
        jax.block_until_ready(fn(*operands))
        jax.block_until_ready(fn(*operands))
        stamps = _bench.read_timings(backend)
        mine["stamps"] = stamps[-args.timeline:]
        _bench.set_timing(backend, False)

    T.run_and_check(a2a, mesh, inp)  # still correct after the loops
    a2a.check()
    a2a.close()
    return mine


def summarize(case: Case, everyone: list[dict], args) -> list[dict]:
    base = dict(method="jax_moe_comm_nvshmem", config=case.config,
                num_experts=case.cfg.num_experts, experts_per_token=case.cfg.experts_per_token,
                hidden=case.cfg.hidden, tokens_per_rank=case.tokens, dispatch_dtype="fp8_e4m3",
                correct=True, layout=args.layout, capacity_factor=args.capacity_factor)
    rows = []
    for variant in args.variants:
        got = {}
        for K in args.ks:
            runs = [p["runs"][f"{variant}:{K}"] for p in everyone]  # [rank] (events, walls)
            ev = statistics.median(max(col) for col in zip(*[r[0] for r in runs]))
            wall = statistics.median(max(col) for col in zip(*[r[1] for r in runs]))
            got[K] = dict(K=K, elapsed_event_us=ev, per_cycle_event_us=ev / K,
                          elapsed_wall_us=wall,
                          per_rank_per_cycle_event_us=[statistics.median(r[0]) / K
                                                       for r in runs])
        a, b = fit_line([(K, g["elapsed_event_us"]) for K, g in got.items()])
        for K in args.ks:
            rows.append(dict(base, variant=variant, **got[K], fit_event_a_us=a,
                             fit_event_b_us=b))
    if args.calls:
        for name, variant in CALL_VARIANTS:
            rows.append(dict(base, variant=variant, K=args.calls,
                             host_us_per_call=max(p[name]["host_us"] for p in everyone),
                             per_cycle_event_us=max(p[name]["gpu_us"] for p in everyone),
                             # 2 per call: recorded again each call, or command buffers off
                             handler_runs_per_call=max(p[name]["handler_runs"]
                                                       for p in everyone),
                             fit_event_b_us=None))
    if args.timeline:
        rows.append(dict(base, variant="timeline", K=args.timeline,
                         phases_us=phase_timeline([p["stamps"] for p in everyone])))
    return rows


def markdown(rows: list[dict], trivial_us: float) -> str:
    out = ["| config | tokens | variant | b µs/cycle (slope) | a µs | per-cycle µs at each K |",
           "|---|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        key = (r["config"], r["tokens_per_rank"], r["variant"])
        if key in seen or r["variant"] == "timeline" or r["variant"] in CALL_ROWS:
            continue
        seen.add(key)
        ks = [q for q in rows if (q["config"], q["tokens_per_rank"], q["variant"]) == key]
        per_k = ", ".join(f"K={q['K']}: {q['per_cycle_event_us']:.1f}" for q in ks)
        out.append(f"| {r['config']} | {r['tokens_per_rank']} | {r['variant']} | "
                   f"{r['fit_event_b_us']:.1f} | {r['fit_event_a_us']:.1f} | {per_k} |")
    calls = [r for r in rows if r["variant"] in CALL_ROWS]
    if calls:
        out += ["", f"Jitted single-cycle calls back to back (a trivial jitted call: "
                f"{trivial_us:.0f} µs of host time; donated: the previous output is the next "
                "call's output buffer):", "",
                ("| config | tokens | variant | host µs per call | GPU µs per cycle | "
                 "handler runs per call |"),
                "|---|---|---|---|---|---|"]
        out += [f"| {r['config']} | {r['tokens_per_rank']} | {r['variant']} | "
                f"{r['host_us_per_call']:.0f} | {r['per_cycle_event_us']:.1f} | "
                f"{r.get('handler_runs_per_call', float('nan')):.2f} |" for r in calls]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="V2Lite,R1")
    p.add_argument("--tokens", default="1,4,16,32,64,128")
    p.add_argument("--ks", default="1,10,50", help="cycles per timed interval, comma list")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--calls", type=int, default=50,
                   help="per-call variant: jitted single-cycle calls per interval (0: off)")
    p.add_argument("--timeline", type=int, default=10,
                   help="cycles of the stamped graph+barrier loop (0: no timeline)")
    p.add_argument("--show-hlo", action="store_true",
                   help="print custom calls and copies of the largest compiled loop")
    p.add_argument("--layout", default="padded", choices=("padded", "packed"),
                   help="the handle's layout (padded: pplx-kernels' own)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="capacity as a multiple of the mean load (recv_rows_for packed, "
                        "rows_per_expert_for padded); default: the worst case")
    p.add_argument("--out", default="loop_ours.json")
    args = p.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    bad_ks = len(set(args.ks)) < 2 or min(args.ks) < 1
    if any(v not in ALL_VARIANTS for v in args.variants) or bad_ks:
        p.error(f"--variants from {ALL_VARIANTS}; --ks: at least two distinct K >= 1")
    if args.timeline > 1000:
        p.error("--timeline: at most 1000 cycles (the stamps a handle keeps)")
    from jax_moe_comm import init

    init()
    mesh = T.make_mesh(WORLD)
    say = print if RANK == 0 else (lambda *a, **k: None)
    trivial_us = measure_host_call_us(mesh, WORLD)
    say(f"bench_loop: {WORLD} ranks, ks={args.ks}, reps={args.reps}, variants={args.variants}; "
        f"host per trivial jitted call {trivial_us:.0f} us", flush=True)
    result = dict(tool="bench_loop", gpu=jax.devices()[0].device_kind, world=WORLD,
                  commit=git_commit(), date=datetime.datetime.now(datetime.UTC).isoformat(),
                  command=" ".join(["python"] + sys.argv), ks=args.ks, reps=args.reps,
                  mps_share=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                  transport=os.environ.get("JMC_TRANSPORT") or "auto",
                  host_us_per_trivial_call=trivial_us, rows=[])
    for config in args.configs.split(","):
        for tokens in map(int, args.tokens.split(",")):
            case = Case(config, tokens)
            t0 = time.time()
            everyone = kv_gather(f"loop:{case}", time_case(case, mesh, args))
            rows = summarize(case, everyone, args)
            result["rows"] += rows
            for r in rows:
                if r["variant"] in ALL_VARIANTS and r["K"] == args.ks[-1]:
                    say(f"{case}: {r['variant']:14s} {r['fit_event_b_us']:7.1f} us/cycle "
                        f"(fit a {r['fit_event_a_us']:.1f} us; K={r['K']}: "
                        f"{r['per_cycle_event_us']:.1f})", flush=True)
                elif r["variant"] in CALL_ROWS:
                    say(f"{case}: {r['variant']} host {r['host_us_per_call']:.0f} us/call, GPU "
                        f"{r['per_cycle_event_us']:.1f} us/cycle, handler runs per call "
                        f"{r['handler_runs_per_call']:.2f}", flush=True)
                elif r["variant"] == "timeline":
                    say(format_timeline(r["phases_us"]), flush=True)
            say(f"{case}: done in {time.time() - t0:.0f} s", flush=True)
            if RANK == 0:
                with open(args.out + ".tmp", "w") as f:
                    json.dump(result, f, indent=1)
                os.replace(args.out + ".tmp", args.out)
    say("\n" + markdown(result["rows"], trivial_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
