"""A decode server that runs for many steps, polls its handle every step, and survives faults
by the agreed recovery of docs/serving.md ("The server loop: agreed recovery").

    python examples/serve_decode.py --bad-index-at 5        # 8 emulated CPU devices, reference
    python -m jax_moe_comm.launch -n 8 --oversubscribe --keep-going -- \\
        python examples/serve_decode.py --bad-index-at 5 --late-at 12 --kill-at 30
    python -m jax_moe_comm.launch -n 8 --oversubscribe -- \\
        python examples/serve_decode.py --bad-index-at 5 --late-at 12   # the restart: passes

The model is tiny: an embedding, --layers MoE layers (router, top-k, dispatch, expert MLPs,
combine) that all run on ONE AllToAll handle, and a greedy head; each rank decodes its own
--batch-per-rank sequences. So one step runs cycles_per_step = --layers dispatch + combine
cycles on the handle. The step is jitted and compiled once, ahead of the first step, and
never traced again: faults reach it through its inputs (a per-rank int32 poison flag), not by
re-jitting. After each step the loop reads the step's tokens on the host (then its kernels
have ended), calls poll(), and on a MoECommError every rank calls recover(): it returns the
agreed count of completed cycles, and every rank resumes from done // cycles_per_step with the
inputs it kept of that step.

Faults, each fired once (the re-run of its step after recovery is clean):
  --bad-index-at S --bad-rank R   rank R's token 0 of the first MoE layer gets an expert index
                                  out of range at step S (InvalidRoutingError on rank R; on the
                                  CUDA backend the others see PeerAbortedError)
  --late-at S --late-rank R       rank R sleeps 3 x --timeout-s before step S. It has not
                                  started the step and its process lives, so the others wait
                                  for it (--start-timeout-s): no error, no step lost. With
                                  --start-timeout-s below the sleep (or staged peers, which
                                  are not waited for) they time out instead (PeerTimeoutError:
                                  R has not started the cycle), R finds the handle aborted,
                                  and the step is lost and re-run after recover()
  --kill-at S --kill-rank R       rank R ends itself with os._exit before step S, as a crashed
                                  process: the survivors get PeerTimeoutError / PeerAbortedError
                                  within about --timeout-s and exit with code 3, not recovering
                                  (recover() needs every process: there is no recovery from a
                                  dead one). Restart the job. Under the launcher pass
                                  --keep-going, or it stops the survivors as soon as R exits
                                  (as `srun --kill-on-bad-exit=1` would), before they report.
The late and kill faults need the CUDA backend (--timeout-s is its bound on every wait; the
reference backend's exchange is XLA's all_to_all, which has no timeout: a late rank only
delays the others, a dead one leaves them waiting inside XLA). Elsewhere they are skipped,
with a line that says so. The reference backend does raise InvalidRoutingError for a bad
index, from poll() (which is its check()): it skipped that one slot, its message names no
rank, and the check() that raised it forgets it (a CUDA handle keeps its record until
recover()). Its recover() counts no cycles and returns None, so the loop resumes from its own
step there. Across processes (the launcher on CPU) only the bad rank's process sees the error,
and its step holds XLA collectives, so there the ranks agree on every step's poll() outcome
through the key-value store.

What is printed, one line per event, each "[serve] rank R ..." (one process driving every
rank, as on CPU: "[serve] ranks 0-7 ..."; under the launcher each line also gets its
"[rank R]" prefix):
  step S: injecting ... / sleeping ... / ending this process ...   a fault fires (that rank)
  step S: <ErrorType>: <first line of its message>     this rank's poll() raised after step S
  step S: clean here, but rank R reported ...          (reference backend, several processes)
  recovered: agreed C cycles -> resume at step S       recover() returned C (CUDA backend)
  recovered: recover() returned None ... -> resume at step S       (reference backend)
  peer dead (<ErrorType>: ...) after X.X s: restart the job        a survivor of --kill-at,
                                               then its steps lost so far, and exit code 3
  steps lost: [..] (re-run after recovery)     every rank, at the end: the step each recovery
                                               resumed from (the steps the faults hit)
  replay: ...      the emitted tokens of every step against a fault-free run of the same
                   compiled step on the same handle (recovery changed no output)
  traced 1x ...    the step was traced and compiled once for every run of it
and on rank 0 `SERVE PASSED lost steps [..] the same on every rank` (every rank lost exactly
the steps the faults that fired hit, the replay matched, one trace), else `SERVE FAILED ...`.
Exit codes: 0 passed, 1 SERVE FAILED, 2 bad arguments, 3 a survivor of a dead peer, 4 the
killed rank itself (the launcher exits with the first failing rank's: 4 for a --kill-at run).
"""

import argparse
import itertools
import json
import os
import sys
import time

from _setup import put, start

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
p.add_argument("--steps", type=int, default=40)
p.add_argument("--layers", type=int, default=2, help="MoE layers, all on one handle")
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--experts-per-rank", type=int, default=2)
p.add_argument("--k", type=int, default=2, help="experts per token")
p.add_argument("--ffn", type=int, default=128, help="per expert")
p.add_argument("--vocab", type=int, default=256)
p.add_argument("--batch-per-rank", type=int, default=4, help="sequences per rank")
p.add_argument("--timeout-s", type=float, default=2.0, help="the handle's bound on every wait")
p.add_argument("--start-timeout-s", type=float, default=600.0,
               help="how long the others wait for a rank that has not started a step while its "
               "process lives (the handle's start_timeout_s)")
p.add_argument("--bad-index-at", type=int, default=None, metavar="STEP")
p.add_argument("--bad-rank", type=int, default=None, help="default: rank 1 (0 with one rank)")
p.add_argument("--late-at", type=int, default=None, metavar="STEP")
p.add_argument("--late-rank", type=int, default=None, help="default: the last rank")
p.add_argument("--kill-at", type=int, default=None, metavar="STEP")
p.add_argument("--kill-rank", type=int, default=None, help="default: the last rank")
args = p.parse_args()
RANK, NPROC = start()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_moe_comm import AllToAll, bootstrap, resolve_backend  # noqa: E402
from jax_moe_comm.errors import MoECommError, PeerAbortedError, PeerTimeoutError  # noqa: E402
from jax_moe_comm.moe import MoELayerConfig, experts_and_shared, init_params, route  # noqa: E402

EP = len(jax.devices())
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))  # rank r on process r (launcher)
B, H, E, K = args.batch_per_rank, args.hidden, args.experts_per_rank * EP, args.k
BAD_EXPERT = E + 3  # the out-of-range expert index a poisoned token gets (as testing.py's)
CYCLES_PER_STEP = args.layers  # one dispatch + combine per MoE layer, all on one handle
HISTORY = 4  # steps of inputs kept for a rewind: a rank resumes at most one step back
RETRIES = 3  # recoveries in a row that resume at one step: a fault that stays, not a transient
EXIT_FAILED, EXIT_USAGE, EXIT_PEER_DEAD, EXIT_KILLED = 1, 2, 3, 4
bf16, f32 = jnp.bfloat16, jnp.float32
# Who a line speaks for: this process's rank, or every rank where one process drives them all.
WHO = f"rank {RANK}" if NPROC > 1 or EP == 1 else f"ranks 0-{EP - 1}"


def say(msg: str) -> None:
    print(f"[serve] {WHO} {msg}", flush=True)


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def fault_plan(backend: str) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """({fault: (step, rank)} of the faults that can fire here, a line for each one asked for
    that cannot); exits with EXIT_USAGE on arguments that cannot be honoured."""
    def refuse(msg):
        if RANK == 0:
            print(f"[serve] error: {msg}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)

    asked = {}  # fault -> (step, rank), with its flags' names
    for name, at, rank, flag in (
            ("bad_index", args.bad_index_at, args.bad_rank, "bad"),
            ("late", args.late_at, args.late_rank, "late"),
            ("kill", args.kill_at, args.kill_rank, "kill")):
        if at is None:
            continue
        if rank is None:
            rank = min(1, EP - 1) if name == "bad_index" else EP - 1
        step_flag = "--bad-index-at" if name == "bad_index" else f"--{flag}-at"
        if not 0 <= at < args.steps:
            refuse(f"{step_flag} {at}: the steps are 0 .. {args.steps - 1} (--steps)")
        if not 0 <= rank < EP:
            refuse(f"--{flag}-rank {rank}: the ranks are 0 .. {EP - 1}")
        asked[name] = (at, rank)
    plan, notes = dict(asked), []
    if backend != "nvshmem" or EP < 2:
        for name in ("late", "kill"):
            if name in plan:
                notes.append(
                    f"--{name}-at {plan.pop(name)[0]} skipped (backend={backend}, {EP} ranks on "
                    f"{NPROC} process(es)): a late or dead rank needs the CUDA backend over "
                    "several processes, whose kernels bound every wait by timeout_s; the "
                    "reference backend's exchange is XLA's all_to_all, which has no timeout (a "
                    "late rank would only delay the others, a dead one leave them waiting)")
    if "kill" in plan:
        at, rank = plan["kill"]
        if rank == 0:
            refuse("--kill-rank 0: process 0 runs jax.distributed's coordination service (the "
                   "key-value store of recover() and of this example's exchanges); its end "
                   "takes that down on every process. Kill another rank")
        later = [n for n, (s, _) in plan.items() if n != "kill" and s >= at]
        if later:
            refuse(f"the {', '.join(later)} fault at or after --kill-at {at}: nothing runs "
                   "after the kill")
    steps = sorted({s for s, _ in plan.values()})
    if any(b - a < 2 for a, b in itertools.pairwise(steps)):
        # A rank whose poll came back clean may run one step past a failed one before its own
        # poll raises; a fault in that step would fire in a step that is then discarded.
        refuse(f"fault steps {steps}: keep distinct faults at least 2 steps apart")
    return plan, notes


def mine(arr) -> np.ndarray:
    """This process's rows of a global array sharded over the ranks on its first axis."""
    shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def rms_norm(x):
    xf = x.astype(f32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(bf16)


def make_model(a2a: AllToAll, layer: MoELayerConfig):
    """(params as global arrays, the jitted step, a list whose length counts its traces)."""
    rng = np.random.default_rng(0)
    expert_spec = {"w_in": P("ep"), "w_out": P("ep")}  # experts sharded on E, the rest copied
    layers = [init_params(layer, seed=1 + i) for i in range(args.layers)]
    specs = {"embed": P(), "head": P(),
             "layers": [{n: expert_spec.get(n, P()) for n in lp} for lp in layers]}
    params = {"embed": rng.standard_normal((args.vocab, H)).astype(bf16),
              "head": (rng.standard_normal((H, args.vocab)) / np.sqrt(H)).astype(bf16),
              "layers": layers}
    params = jax.tree.map(lambda a, s: put(a, MESH, s), params, specs)
    traces = []

    def body(params, tokens, pos, poison):
        """One rank's step: tokens [B] -> the next tokens [B]. poison [1] int32: where set,
        token 0 of the first MoE layer routes to BAD_EXPERT (an injected fault)."""
        traces.append(1)  # runs only while tracing: counts the traces
        half = H // 2
        angle = pos.astype(f32) / 10000.0 ** (jnp.arange(half, dtype=f32) / half)
        x = params["embed"][tokens] + jnp.concatenate([jnp.sin(angle), jnp.cos(angle)]
                                                      ).astype(bf16)
        for i, lp in enumerate(params["layers"]):
            h = rms_norm(x)
            indices, weights = route(lp["router"], h, K)
            if i == 0:
                indices = indices.at[0, 0].set(jnp.where(poison[0] != 0, BAD_EXPERT,
                                                         indices[0, 0]))
            y = experts_and_shared(a2a, layer, lp, h, indices, weights, jnp.int32(B))
            x = x + y.astype(bf16)  # every row is live: num_tokens = B
        logits = jnp.dot(rms_norm(x), params["head"], preferred_element_type=f32)
        return jnp.argmax(logits, -1).astype(jnp.int32)

    step = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(specs, P("ep"), P(), P("ep")),
                                 out_specs=P("ep")))
    return params, step, traces


def main() -> int:
    layer = MoELayerConfig(num_experts=E, experts_per_token=K, hidden=H, ffn=args.ffn,
                           max_num_tokens=B, num_shared_experts=0)
    backend = resolve_backend(args.backend, layer.comm_config(EP))  # "auto" -> what runs
    plan, notes = fault_plan(backend)  # before the handle: its creation is collective
    a2a = AllToAll(layer.comm_config(EP), axis_name="ep", backend=backend,
                   timeout_s=args.timeout_s, start_timeout_s=args.start_timeout_s,
                   **layer.handle_kwargs(EP, "padded"))
    params, step_fn, traces = make_model(a2a, layer)
    clean = put(np.zeros(EP, np.int32), MESH, P("ep"))
    poisoned = clean
    if "bad_index" in plan:
        poisoned = put(np.eye(EP, dtype=np.int32)[plan["bad_index"][1]], MESH, P("ep"))
    first = np.random.default_rng(1).integers(0, args.vocab, EP * B).astype(np.int32)
    tokens0 = put(first, MESH, P("ep"))
    # Compile ahead of the first step, then line the processes up (docs/serving.md, "Late
    # ranks"): otherwise a rank whose compile took longer than timeout_s fails step 0. The
    # line-up goes through the key-value store: an XLA collective would need NCCL, which
    # refuses several ranks on one GPU (--oversubscribe).
    compiled = step_fn.lower(params, tokens0, np.int32(0), clean).compile()
    bootstrap.all_gather("example:serve-warm", "1")
    # The reference backend across processes: its step holds XLA collectives, and its check()
    # sees only this process's ranks, so the ranks agree on every step's poll() outcome
    # through the key-value store before the next step, or one would re-run a step that the
    # others' collectives have left (docs/serving.md, "What the loop relies on"). The CUDA
    # step holds no collective: nothing to agree on per step.
    agree_each_step = backend != "nvshmem" and NPROC > 1
    if RANK == 0:
        say(f"backend={backend}, {EP} ranks on {NPROC} process(es): {args.layers} MoE layers on "
            f"one handle (cycles_per_step {CYCLES_PER_STEP}), {B} sequences per rank, "
            f"{args.steps} steps, timeout_s {args.timeout_s}, faults "
            f"{ {n: s for n, (s, _) in plan.items()} or 'none'}")
        for note in notes:
            say(note)

    fired = {name: False for name in plan}  # each fault fires once: a re-run step is clean
    history = {0: tokens0}  # step -> its input tokens (what a rewind needs), the last few
    outputs = {}  # step -> this process's emitted tokens of it (a re-run writes them again)
    lost = []  # the step each recovery resumed from
    runs = 0  # calls of the compiled step
    step = 0
    while step < args.steps:
        for old in [s for s in history if s <= step - HISTORY]:
            del history[old]
        poison = clean
        for name, (at, rank) in plan.items():
            if step != at or fired[name]:
                continue
            fired[name] = True  # on every rank: the step it fired in is then re-run clean
            here = rank == RANK or NPROC == 1
            if name == "kill" and rank == RANK:
                say(f"step {step}: ending this process with os._exit({EXIT_KILLED}) before the "
                    "step, as a crashed process would")
                os._exit(EXIT_KILLED)  # no atexit, no finalize, no close: the process is gone
            if name == "late" and rank == RANK:
                say(f"step {step}: sleeping {3 * args.timeout_s:.1f} s (3 x timeout_s) before "
                    "the step: a late rank")
                time.sleep(3 * args.timeout_s)
            if name == "bad_index":
                poison = poisoned
                if here:
                    say(f"step {step}: injecting expert index {BAD_EXPERT} (of {E}) into token 0 "
                        f"of the first MoE layer on rank {rank}")
        started = time.perf_counter()
        nxt = compiled(params, history[step], np.int32(step), poison)
        runs += 1
        emitted = mine(nxt)  # on the host: this step's kernels have ended, poll() covers them
        try:
            a2a.poll()  # a pinned-memory read on the CUDA backend, no device sync
            error = None
        except MoECommError as e:
            error = e
        others = []
        if agree_each_step:
            said = bootstrap.all_gather(bootstrap.next_collective_tag("serve-poll"),
                                        "" if error is None else first_line(error))
            others = [(r, m) for r, m in enumerate(said) if m and r != RANK]
        if error is None and not others:
            took = time.perf_counter() - started
            if took > args.timeout_s:  # the late fault, survived: a late peer was waited for
                say(f"step {step}: clean after {took:.1f} s (more than timeout_s: a rank that "
                    "had not started the step was waited for)")
            outputs[step] = emitted
            history[step + 1] = nxt  # (again after a rewind: the fresh run's tokens)
            step += 1
            continue
        if error is not None:
            say(f"step {step}: {first_line(error)}")
        else:
            r, m = others[0]
            say(f"step {step}: clean here, but rank {r} reported {m}")
        # Dead or late? A late rank whose process lives was waited for (start_timeout_s); a
        # killed one stopped its heartbeat and the error says so. The rule of this example:
        # once the injected kill's step has come, any error is fatal; before it, recover. A real server learns of a dead process from its job
        # scheduler (srun ends the job; a pod is restarted) or a health check of its own, and
        # must not call recover() then: recover() needs every process (on the survivors it
        # waits in its key-value exchange for the dead one, 300 s, and fails).
        if "kill" in plan and step >= plan["kill"][0]:
            named = isinstance(error, (PeerTimeoutError, PeerAbortedError))
            say(f"peer dead ({first_line(error)}{'' if named else ', not the expected peer error'}"
                f") after {time.perf_counter() - started:.1f} s: restart the job")
            say(f"steps lost: {lost} (re-run after recovery), then the dead peer at step {step}")
            # os._exit, not sys.exit: a clean exit would close the handle and finalize NVSHMEM
            # and jax.distributed, and each of those waits for every process, the dead one too.
            os._exit(EXIT_PEER_DEAD)
        done = a2a.recover()  # collective: every rank gets here, at this step or the next
        if done is None:  # the reference backend counts no cycles: resume from our own step
            resume = step
            say(f"recovered: recover() returned None (the reference backend counts no cycles) "
                f"-> resume at step {resume}, this loop's own")
        else:
            resume = done // CYCLES_PER_STEP  # the first step some rank did not finish
            say(f"recovered: agreed {done} cycles -> resume at step {resume}")
        if resume not in history:
            raise RuntimeError(f"recover() resumes at step {resume}, but this rank kept the "
                               f"inputs of steps {sorted(history)} only")
        if lost[-RETRIES:] == [resume] * RETRIES:
            say(f"step {resume} failed again after {RETRIES} recoveries: the fault stays "
                "(bad data, not a transient); giving up")
            a2a.close()  # every rank gets here alike (the resume step is agreed)
            if RANK == 0:
                print(f"SERVE FAILED step {resume} fails after every recovery", flush=True)
            return EXIT_FAILED
        lost.append(resume)
        step = resume  # that step's inputs are in history; its tokens were not emitted here

    say(f"steps lost: {lost} (re-run after recovery)")
    # Recovery must change no output: the same compiled step, fault-free, from step 0.
    tokens, differ = tokens0, []
    for s in range(args.steps):
        tokens = compiled(params, tokens, np.int32(s), clean)
        runs += 1
        if s not in outputs or not np.array_equal(mine(tokens), outputs[s]):
            differ.append(s)
    try:
        a2a.poll()
        replay_error = ""
    except MoECommError as e:  # reported below, with every rank's outcome
        replay_error = first_line(e)
    replay_ok = not differ and not replay_error
    say(f"replay: the emitted tokens of all {args.steps} steps "
        + ("equal a fault-free run of the same compiled step" if replay_ok
           else f"differ from a fault-free run at steps {differ}" if differ
           else f"match, but the replay raised {replay_error}"))
    say(f"traced {len(traces)}x: the step was compiled once, for {runs} runs of it (the "
        "re-runs and the replay too)")
    a2a.close()  # collective: every process, after the last step that uses the handle

    # The late rank costs a step only where nobody waits for it long enough (its sleep is
    # 3 x timeout_s; staged peers are never waited for past timeout_s).
    late_lost = (3 * args.timeout_s >= args.start_timeout_s
                 or os.environ.get("JMC_TRANSPORT", "").startswith("staged"))
    expected = sorted({plan[n][0] for n in plan
                       if fired[n] and n != "kill" and (n != "late" or late_lost)})
    summary = {"lost": lost, "traces": len(traces), "replay_ok": replay_ok}
    everyone = [json.loads(v) for v in bootstrap.all_gather("example:serve-summary",
                                                            json.dumps(summary))]
    problems = []
    losts = [e["lost"] for e in everyone]
    if any(lo != losts[0] for lo in losts):
        problems.append("lost steps differ: " + ", ".join(
            f"rank {r} {lo}" for r, lo in enumerate(losts)))
    elif losts[0] != expected:
        problems.append(f"lost steps {losts[0]}, expected {expected} (the faults' steps)")
    bad_traces = [r for r, e in enumerate(everyone) if e["traces"] != 1]
    if bad_traces:
        problems.append(f"the step was traced more than once on ranks {bad_traces}")
    bad_replay = [r for r, e in enumerate(everyone) if not e["replay_ok"]]
    if bad_replay:
        problems.append(f"outputs differ from a fault-free run on ranks {bad_replay}")
    if RANK == 0:
        print(f"SERVE FAILED {'; '.join(problems)}" if problems else
              f"SERVE PASSED lost steps {losts[0]} the same on every rank", flush=True)
    return EXIT_FAILED if problems else 0


if __name__ == "__main__":
    sys.exit(main())
