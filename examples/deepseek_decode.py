"""Decode with a small DeepSeek-style model: attention with a KV cache and a MoE layer with a
shared expert (jax_moe_comm.flax.MoE) per block, random weights.

    python examples/deepseek_decode.py                       # 8 emulated CPU devices, reference
    python -m jax_moe_comm.launch -n 8 --oversubscribe -- python examples/deepseek_decode.py

Each rank holds its own sequences (data-parallel attention, as DeepSeek serves) and 1/EP of
the experts (expert parallelism over every rank). The prompt is prefilled in one jitted call,
then --tokens tokens are decoded greedily, one jitted step each; the MoE layers run on two
handles, one per token budget: prefill (batch x prompt tokens per rank) and decode (batch
tokens per rank), shared by all layers. check() runs every --check-every steps (a replayed
command buffer reports errors only there). Printed: per-token latency, where a decode step's
time goes (attention, router, dispatch, experts, combine, shared expert: separate jitted
timings at decode shapes), the XLA collectives in the step (none on the CUDA backend), and
the dense check: every MoE layer, and the logits, against the same model with a dense MoE on
this process's own device, telling routing near-ties from errors (see "The dense check"
below; --fault breaks the distributed model on purpose, for its tests).
"""

import argparse
import json
import sys
import time

from _setup import local_copy, start

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--backend", default="auto", choices=("auto", "reference", "nvshmem"))
p.add_argument("--layers", type=int, default=4)
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--vocab", type=int, default=1024)
p.add_argument("--experts-per-rank", type=int, default=4)
p.add_argument("--k", type=int, default=4, help="experts per token")
p.add_argument("--ffn", type=int, default=256, help="per expert (and the shared expert)")
p.add_argument("--batch-per-rank", type=int, default=4, help="sequences per rank")
p.add_argument("--prompt", type=int, default=32)
p.add_argument("--tokens", type=int, default=32, help="tokens to decode")
p.add_argument("--check-every", type=int, default=8)
p.add_argument("--reps", type=int, default=20,
               help="samples per breakdown timing (0: no breakdown)")
p.add_argument("--fault", default="none", choices=("none", "expert", "ulp"),
               help="for the tests of the dense check: 'expert' zeroes expert 0's output "
               "weights in the distributed model (a wrong MoE: the check must fail), 'ulp' "
               "moves every MoE output element one bf16 ulp (another rounding: must pass)")
args = p.parse_args()
RANK, NPROC = start()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_moe_comm.flax as jf  # noqa: E402
from jax_moe_comm import bootstrap  # noqa: E402
from jax_moe_comm.moe import experts_forward  # noqa: E402
from jax_moe_comm.router import RouterConfig  # noqa: E402

EP = len(jax.devices())
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))  # rank r on process r
ROWS = NamedSharding(MESH, P("ep"))
B, S0, N = EP * args.batch_per_rank, args.prompt, args.tokens
S_MAX = S0 + N
H, NH = args.hidden, args.heads
DH = H // NH
bf16, f32 = jnp.bfloat16, jnp.float32


def log(msg):
    if RANK == 0:
        print(msg, flush=True)


def replicated(rngs, shape, scale=None):
    """A parameter replicated on every device, each process computing its copy."""
    std = scale if scale is not None else 1.0 / np.sqrt(shape[0])
    make = jax.jit(lambda k: (jax.random.normal(k, shape, f32) * std).astype(bf16),
                   out_shardings=NamedSharding(MESH, P()))
    return nnx.Param(make(rngs.params()))


class RMSNorm(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.jit(lambda: jnp.ones((H,), f32),
                                   out_shardings=NamedSharding(MESH, P()))())

    def __call__(self, x):
        xf = x.astype(f32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
                * self.w[...]).astype(bf16)


def rope(x, pos):
    """Rotary embedding of x [B, S, NH, DH] at positions pos [S]."""
    half = DH // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=f32) / half))
    ang = pos.astype(f32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half].astype(f32), x[..., half:].astype(f32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(bf16)


class Attention(nnx.Module):
    """Multi-head attention over a KV cache [B, S_MAX, NH, DH]; the S new tokens of every
    sequence sit at positions start .. start + S - 1."""

    def __init__(self, rngs):
        self.wq, self.wk, self.wv = (replicated(rngs, (H, H)) for _ in range(3))
        self.wo = replicated(rngs, (H, H))

    def __call__(self, x, ck, cv, start):
        b, s, _ = x.shape
        pos = start + jnp.arange(s)
        q, k, v = ((x @ w[...]).reshape(b, s, NH, DH) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, pos), rope(k, pos)
        ck = jax.lax.dynamic_update_slice(ck, k, (0, start, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v, (0, start, 0, 0))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, ck, preferred_element_type=f32) / np.sqrt(DH)
        visible = jnp.arange(ck.shape[1])[None, :] <= pos[:, None]  # causal, within the cache
        probs = jax.nn.softmax(jnp.where(visible[None, None], scores, -1e30), -1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(bf16), cv)
        return out.reshape(b, s, H) @ self.wo[...], ck, cv


E = args.experts_per_rank * EP
GROUPS = 4 if E % 4 == 0 else 1  # DeepSeek-V3 routing: 2 of 4 groups where they hold k
ROUTER = RouterConfig(score="sigmoid", num_groups=GROUPS,
                      topk_groups=2 if GROUPS == 4 and E // 2 >= args.k else None, scale=2.5)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1, self.attn, self.norm2 = RMSNorm(rngs), Attention(rngs), RMSNorm(rngs)
        self.moe = jf.MoE(
            num_experts=E, experts_per_token=args.k, hidden=H,
            ffn=args.ffn, num_shared_experts=1, mesh=MESH, expert_axis="ep",
            max_num_tokens=(args.batch_per_rank * S0, args.batch_per_rank),  # prefill, decode
            router=ROUTER,
            param_dtype=bf16, layout="padded", differentiable=False, backend=args.backend,
            eager_handles=False, rngs=rngs)

    def __call__(self, x, ck, cv, start, dense=False):
        """(x after the block, caches, (the MoE layer's input, its output))."""
        a, ck, cv = self.attn(self.norm1(x), ck, cv, start)
        h = x + a
        hn = self.norm2(h)
        m = self.moe.dense(hn, params=self.moe._params()) if dense else self.moe(hn)
        if args.fault == "ulp" and not dense:  # another rounding: one bf16 ulp up or down
            m = one_ulp(m)
        return h + m, ck, cv, (hn, m)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = replicated(rngs, (args.vocab, H), scale=1.0)
        self.blocks = getattr(nnx, "List", list)([Block(rngs) for _ in range(args.layers)])
        self.norm = RMSNorm(rngs)
        self.head = replicated(rngs, (H, args.vocab))

    def __call__(self, tokens, caches, start, dense=False):
        """(logits, caches, (MoE inputs, MoE outputs) [B, layers, S, H] each)."""
        x = self.embed[...][tokens]
        if not dense:
            x = jax.lax.with_sharding_constraint(x, ROWS)  # each rank its own sequences
        new, moe = [], []
        for block, (ck, cv) in zip(self.blocks, caches):
            x, ck, cv, io = block(x, ck, cv, start, dense)
            new.append((ck, cv))
            moe.append(io)
        io = tuple(jnp.stack([m[i] for m in moe], 1) for i in range(2))
        if not dense:
            io = tuple(jax.lax.with_sharding_constraint(a, ROWS) for a in io)
        return (self.norm(x) @ self.head[...]).astype(f32), new, io


def one_ulp(y):
    """y (bf16) with every nonzero element one ulp larger or smaller in magnitude, alternating
    along the last axis: a kernel that rounds differently."""
    bits = jax.lax.bitcast_convert_type(y, jnp.uint16)
    step = jnp.where(jnp.arange(y.shape[-1]) % 2 == 0, 1, -1).astype(jnp.int16)
    moved = (bits.astype(jnp.int32) + step).astype(jnp.uint16)
    return jnp.where(y == 0, y, jax.lax.bitcast_convert_type(moved, bf16))


def drop_expert(state, e):
    """state with expert e's output weights zero in every MoE layer (a wrong MoE)."""
    def fix(path, leaf):
        if "['w_out']" not in jax.tree_util.keystr(path):
            return leaf
        return jax.jit(lambda w: w.at[e].set(0), out_shardings=leaf.sharding)(leaf)
    return jax.tree_util.tree_map_with_path(fix, state)


def empty_caches(batch, sharding=None):
    make = lambda: [(jnp.zeros((batch, S_MAX, NH, DH), bf16),) * 2  # noqa: E731
                    for _ in range(args.layers)]
    return jax.jit(make, out_shardings=sharding)() if sharding is not None else make()


def steps(graphdef, dense=False):
    """(prefill, decode) jitted on the model's state: prefill -> last logits; decode one
    token -> logits, greedy next token. Both also return caches and every MoE layer's input
    and output at the new positions ([B, layers, S, H]; the check below compares them)."""
    def prefill(state, prompt, caches):
        logits, caches, io = nnx.merge(graphdef, state)(prompt, caches, 0, dense)
        return logits[:, -1], caches, io

    def decode(state, token, caches, pos):
        logits, caches, io = nnx.merge(graphdef, state)(token[:, None], caches, pos, dense)
        return logits[:, 0], jnp.argmax(logits[:, 0], -1).astype(jnp.int32), caches, io

    return jax.jit(prefill), jax.jit(decode)


def mine(arr) -> np.ndarray:
    """This process's rows of a global array sharded over the ranks on its first axis."""
    shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def median_ms(fn, *a):
    jax.block_until_ready(fn(*a))  # compile
    t = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        t.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(t))


def breakdown(model, state, graphdef, x1, caches):
    """ms per layer at decode shapes, by separate jitted programs (block 0)."""
    moe = model.blocks[0].moe
    a2a, layer, cfg = moe.handle(args.batch_per_rank), moe.layer, moe.router_cfg
    params = moe._params()
    specs = {n: P(*moe._spec(n)) for n in params}

    def comm(part):
        def body(p, x):
            live = jnp.ones((x.shape[0],), bool)
            routed, _ = jf.route_tokens(layer, cfg, p["router"], x, live)
            if part == "router":
                return routed.weights
            n = x.shape[0]
            out = a2a.dispatch(x, routed.indices, n)
            if part == "dispatch":
                return out.expert_num_tokens
            ey = out.expert_x if part == "combine" else experts_forward(
                a2a, p, out, layer.expert_gemm, gated=layer.gated)
            return a2a.combine(ey, out.routing, routed.indices, routed.weights, n)
        return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(specs, P("ep")),
                                     out_specs=P("ep")))

    xt = jax.jit(lambda x: x.reshape(-1, H), out_shardings=ROWS)(x1)
    t = {part: median_ms(comm(part), params, xt)
         for part in ("router", "dispatch", "combine", "experts")}
    def attention(s, x, ck, cv):
        b = nnx.merge(graphdef, s).blocks[0]
        return b.attn(b.norm1(x), ck, cv, S0)[0]

    t_attn = median_ms(jax.jit(attention), state, x1, *caches[0])
    t_moe = median_ms(jax.jit(lambda s, x: nnx.merge(graphdef, s).blocks[0].moe(x)), state, x1)
    # Each program adds one part to the previous one; a part is the difference of two
    # medians (clamped at 0: at tiny shapes the noise can exceed it).
    return [("attention", t_attn, t_attn), ("router", t["router"], t["router"]),
            ("dispatch", t["dispatch"], t["dispatch"] - t["router"]),
            ("combine (identity experts)", t["combine"], t["combine"] - t["dispatch"]),
            ("experts", t["experts"], t["experts"] - t["combine"]),
            ("MoE layer: + shared expert, overlap", t_moe, t_moe - t["experts"])]


def main() -> int:
    model = Model(nnx.Rngs(0))
    handles = jf.create_handles(model)  # collective: prefill and decode budgets, all layers
    backend = model.blocks[0].moe.handle().backend_name
    graphdef, state = nnx.split(model)
    true_state = state  # what the dense model runs
    if args.fault == "expert":
        state = drop_expert(state, 0)
    prefill, decode = steps(graphdef)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, (B, S0)).astype(np.int32)
    prompt_g = jax.make_array_from_callback(prompt.shape, ROWS, lambda i: prompt[i])
    caches = empty_caches(B, ROWS)
    log(f"backend={backend} ranks={EP} processes={NPROC} platform={jax.default_backend()}: "
        f"{args.layers} layers, H={H}, {E} experts (k={args.k}, "
        f"shared expert), {B} sequences ({args.batch_per_rank}/rank), prompt {S0}, "
        f"{N} new tokens, {handles} handles (budgets {model.blocks[0].moe.budgets} per rank)")

    t0 = time.perf_counter()
    logits, caches, io = prefill(state, prompt_g, caches)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    jax.block_until_ready(token)
    log(f"prefill (compile + run): {1e3 * (time.perf_counter() - t0):.1f} ms")
    compiled = decode.lower(state, token, caches, S0).compile()  # the step, compiled once
    found = sorted(set(collectives(compiled)))
    ours = {"all-to-all"} if backend == "reference" else set()
    log(f"XLA collectives in the decode step: {found or 'none'}")
    seen_logits, seen_tokens, times = [mine(logits)], [mine(token)], []
    seen_io = [tuple(mine(a) for a in io)]
    for t in range(N):
        t0 = time.perf_counter()
        logits, nxt, caches, io = compiled(state, token, caches, S0 + t)
        jax.block_until_ready(nxt)
        times.append(time.perf_counter() - t0)
        if (t + 1) % args.check_every == 0 or t == N - 1:
            jf.check_handles(model)  # errors of replayed command buffers surface here
        seen_logits.append(mine(logits))
        seen_io.append(tuple(mine(a) for a in io))
        token = nxt
        seen_tokens.append(mine(token))
    steady = np.array(times[1:] or times) * 1e3
    log("per-token latency (ms): " + " ".join(f"{1e3 * v:.2f}" for v in times)
        + f"  [compiled before; the first run is left out of the median]; steady median {np.median(steady):.3f}, "
        f"p90 {np.percentile(steady, 90):.3f}, {B / np.median(steady) * 1e3:.0f} tokens/s")

    if args.reps > 0:
        x1 = rng.standard_normal((B, 1, H)).astype(bf16)  # one token per sequence
        parts = breakdown(model, state, graphdef,
                          jax.make_array_from_callback(x1.shape, ROWS, lambda i: x1[i]), caches)
        log(f"where a decode step's time goes, per layer (x{args.layers} layers): separate jitted "
            f"programs at decode shapes, median of {args.reps}, ms")
        log(f"  {'part':38s} {'program':>9s} {'part':>9s} {'x layers':>9s}")
        for name, program, part in parts:
            part = max(part, 0.0)
            log(f"  {name:38s} {program:9.3f} {part:9.3f} {part * args.layers:9.3f}")
        log(f"  {'whole decode step (embed, layers, head)':38s} {'':9s} {'':9s} "
            f"{np.median(steady):9.3f}")

    # The same model with a dense MoE, on this process's device and sequences.
    flat, treedef = jax.tree_util.tree_flatten_with_path(true_state)
    local_state = jax.tree_util.tree_unflatten(treedef, [
        local_copy(leaf, jax.tree_util.keystr(path)) for path, leaf in flat])
    seen_io = [np.concatenate(a, axis=2) for a in zip(*seen_io)]  # [rows, layers, S0 + N, H]
    ok = against_dense(graphdef, local_state, jnp.asarray(mine(prompt_g)), seen_logits,
                       seen_tokens, seen_io) and set(found) <= ours
    jf.close_handles(model)
    return 0 if ok else 1


# The dense check. The distributed model (kernels) and the dense one (every expert applied,
# no all-to-all) round differently: their GEMMs run at other shapes and the kernels' combine
# adds a token's expert rows in another order. So their hidden states differ by bf16 rounding,
# and so do the router's selection scores computed from them. Where a token's k-th and
# (k+1)-th choice (or the last kept and first dropped group) nearly tie, that is enough for
# the two models to route it to different experts (a routing flip), which changes its output
# by O(1) and, through the KV cache, every later position of its sequence. That is no error;
# anything else beyond rounding is. The check proves which one it saw:
# 1. each MoE layer, at every position, fed the distributed model's own input, against the
#    dense layer on that same input: within LAYER_TOL; the routing of identical inputs can
#    differ only by the f32 rounding of the router's logits, so a row beyond the tolerance is
#    excused only by a margin under SAME_INPUT_TIE;
# 2. the logits, the dense model fed the distributed model's tokens: each (sequence, step)
#    beyond LOGIT_TOL must come at or after the first routing flip of its sequence (the two
#    models' top-k sets differ at some layer and position), and up to and including that flip
#    the two models' selection scores must agree within NEAR_TIE everywhere: their hidden
#    states differed by rounding only, so the flip was a near-tie (its margin,
#    router.selection_margin, is printed too, and is under NEAR_TIE).
# How many rows flips explain is printed, not capped: once a sequence flips, its later
# positions differ through the KV cache, so the count grows with the sequence's length and the
# model's depth (at the defaults on CPU, 31 of 32 sequences flip somewhere in their 64
# positions x 4 layers and 7% of the rows exceed the tolerance, all after a near-tie flip).
# Check 1 bounds what a flip can hide: every layer at every position, flipped or not.
#
# NEAR_TIE: sigmoid selection scores; the k-th and (k+1)-th sit in [0.5, 1) in this model
# (median 0.77 at the defaults), where a bf16 ulp is 2^-8. The scores are computed in f32,
# but from the bf16 hidden state, whose rounding moves them by about that much: on CPU at the
# defaults (reference backend) the two models' scores differed by up to 0.0064 (1.6 ulps,
# median 0.6) up to the first flip, 0.0087 with every MoE output a further ulp off
# (--fault ulp). 4 ulps, 2^-6, leaves room for another device's rounding; a wrong layer moves
# the scores by O(0.1) (--fault expert: 0.18).
NEAR_TIE = 2.0 ** -6
# f32 logits of the same bf16 input from two GEMMs (summation order over H = 512 terms): a
# few 2^-24 relative, well under 2^-14 in the scores.
SAME_INPUT_TIE = 2.0 ** -14
LAYER_TOL = 2.0 ** -5  # x the layer's largest |output|: 4 to 8 bf16 ulps of it
LOGIT_TOL = 0.05  # x the largest |logit| at the first step


def layer_views(graphdef):
    """jitted (state, MoE inputs [rows, layers, P, H], dense?) -> (MoE.routing per layer
    stacked on axis 1: indices [rows, layers, P, k], scores, margins; with dense, each dense
    MoE layer's output on those inputs [rows, layers, P, H])."""
    def f(state, x, dense):
        out = []
        for layer, block in enumerate(nnx.merge(graphdef, state).blocks):
            p = block.moe._params()
            r = tuple(block.moe.routing(x[:, layer], params=p))
            out.append(r + ((block.moe.dense(x[:, layer], params=p),) if dense else ()))
        return tuple(jnp.stack(z, 1) for z in zip(*out))

    jitted = jax.jit(f, static_argnums=2)
    return lambda state, x, dense: tuple(np.asarray(a) for a in jitted(state, jnp.asarray(x),
                                                                       dense))


def against_dense(graphdef, state, prompt, seen_logits, seen_tokens, seen_io) -> bool:
    """The dense check (above) of this process's sequences; prints every process's together.
    seen_io: the distributed model's MoE (inputs, outputs) [rows, layers, S0 + N, H]."""
    rows = len(seen_tokens[0])
    d_prefill, d_decode = steps(graphdef, dense=True)
    caches = empty_caches(rows)
    d_logits, caches, io = d_prefill(state, prompt, caches)
    d_logits, d_in = [np.asarray(d_logits)], [np.asarray(io[0])]
    for t in range(N):
        logits, _, caches, io = d_decode(state, jnp.asarray(seen_tokens[t]), caches, S0 + t)
        d_logits.append(np.asarray(logits))
        d_in.append(np.asarray(io[0]))
    d_logits = np.stack(d_logits, 1)  # [rows, N + 1, vocab]
    views = layer_views(graphdef)
    idx, score, margin, y_ref = views(state, seen_io[0], True)
    d_idx, d_score, d_margin = views(state, np.concatenate(d_in, 2), False)

    y, y_ref = seen_io[1].astype(f32), y_ref.astype(f32)
    logits = np.stack(seen_logits, 1)  # [rows, N + 1, vocab]
    # the scales of the tolerances, over every process: each layer's largest |output|, the
    # largest |logit| at the first step
    scales = np.max([json.loads(v) for v in bootstrap.all_gather(
        "example:dense-check-scales", json.dumps(
            np.abs(y_ref).max((0, 2, 3)).tolist() + [float(np.abs(logits[:, 0]).max())]))], 0)
    scale, logit_scale = scales[:-1], max(float(scales[-1]), 1.0)

    # 1. each layer on the distributed model's own inputs
    layer_diff = np.abs(y - y_ref).max(-1)  # [rows, layers, P]
    beyond = layer_diff > LAYER_TOL * scale[None, :, None]
    layer_ties = beyond & (margin < SAME_INPUT_TIE)

    # 2. the logits. A flip: the two models' top-k sets differ at a layer and position, or
    # check 1 caught the distributed model's own router choosing otherwise than our replay of
    # it on the same input (then the margin that counts is that input's)
    flips = np.any(np.sort(idx, -1) != np.sort(d_idx, -1), -1) | layer_ties  # [rows, layers, P]
    flip_margin = np.where(layer_ties, margin, d_margin)
    P_ = flips.shape[2]
    flipped = flips.any((1, 2))
    first = np.where(flipped, np.argmax(flips.any(1), -1), P_)  # [rows]: position
    first_layer = np.argmax(flips[np.arange(rows), :, np.minimum(first, P_ - 1)], -1)
    pos, lay = np.arange(P_), np.arange(flips.shape[1])
    upto = ((pos[None, None, :] < first[:, None, None])  # up to and including the first flip
            | ((pos[None, None, :] == first[:, None, None])
               & (lay[None, :, None] <= first_layer[:, None, None])))
    score_diff = np.where(upto, np.abs(score - d_score).max(-1), 0.0).max((1, 2))  # [rows]
    r_flip = np.flatnonzero(flipped)
    first_margin = flip_margin[r_flip, first_layer[r_flip], first[r_flip]]
    near_tie = np.zeros(rows, bool)  # sequences whose first flip is a near-tie
    near_tie[r_flip] = (first_margin < NEAR_TIE) & (score_diff[r_flip] <= NEAR_TIE)
    diff = np.abs(d_logits - logits).max(-1)  # [rows, N + 1]
    over = diff > LOGIT_TOL * logit_scale
    after_flip = (S0 - 1 + np.arange(N + 1))[None, :] >= first[:, None]
    explained = over & after_flip & near_tie[:, None]
    agree = int(np.sum(np.argmax(d_logits, -1) == np.stack(seen_tokens, 1)))
    mine_ = {
        "tokens": int(flips.size), "layer_rows": int(beyond.size),
        "layer_max": float(layer_diff.max()), "layer_scale": float(scale.max()),
        "layer_beyond": int(beyond.sum()), "layer_ties": int(layer_ties.sum()),
        "rows": int(diff.size), "seqs": rows, "within": int((~over).sum()),
        "explained": int(explained.sum()), "unexplained": int((over & ~explained).sum()),
        "max_diff": float(diff.max()), "clean_max": float(diff[~after_flip].max(initial=0.0)),
        "agree": agree, "flips": int(flips.sum()),
        "first_margins": [float(m) for m in first_margin],
        "not_ties": int(flipped.sum() - near_tie.sum()),
        "noise": float(score_diff.max()), "logit_scale": logit_scale}
    return report([json.loads(v) for v in bootstrap.all_gather("example:dense-check",
                                                               json.dumps(mine_))])


def report(parts) -> bool:
    """Every process's dense check summed, printed; OK for all of them or for none."""
    tot = {k: sum(p[k] for p in parts) for k in ("tokens", "layer_rows", "layer_beyond",
                                                 "layer_ties", "rows", "seqs", "within",
                                                 "explained", "unexplained", "agree", "flips",
                                                 "not_ties")}
    mx = {k: max(p[k] for p in parts) for k in ("layer_max", "layer_scale", "max_diff",
                                                "clean_max", "noise", "logit_scale")}
    margins = sorted(m for p in parts for m in p["first_margins"])
    layers_ok = tot["layer_beyond"] == tot["layer_ties"]
    logits_ok = tot["unexplained"] == 0 and tot["not_ties"] == 0 and mx["noise"] <= NEAR_TIE
    log(f"dense check 1, every MoE layer at every position fed the distributed model's own "
        f"input ({tot['layer_rows']} token-layers): max|diff| {mx['layer_max']:.4f} (outputs "
        f"up to {mx['layer_scale']:.2f}, tolerance 2^{np.log2(LAYER_TOL):.0f} x a layer's "
        f"largest); beyond it {tot['layer_beyond']}, of them at a router near-tie of identical "
        f"inputs (margin < 2^{np.log2(SAME_INPUT_TIE):.0f}) {tot['layer_ties']} -> "
        f"{'OK' if layers_ok else 'FAILED'}")
    shown = " ".join(f"{m:.1e}" for m in margins[:6]) + (
        f" ... {margins[-1]:.1e}" if len(margins) > 6 else "")
    log(f"dense check 2, the logits against the same model with a dense MoE fed the same "
        f"tokens: {tot['rows']} rows ({tot['seqs']} sequences x {N + 1} steps), tolerance "
        f"{LOGIT_TOL * mx['logit_scale']:.3f} ({LOGIT_TOL} x logits up to "
        f"{mx['logit_scale']:.2f})\n"
        f"  within tolerance {tot['within']}; beyond it at or after a routing near-tie flip in "
        f"their sequence {tot['explained']}; unexplained {tot['unexplained']}\n"
        f"  max|diff| {mx['max_diff']:.4f}, in rows no flip reaches {mx['clean_max']:.4f}; "
        f"greedy tokens equal {tot['agree']}/{tot['rows']}\n"
        f"  routing flips (the models' top-k sets differ at a layer and position): "
        f"{tot['flips']} of {tot['tokens']} token-layers; the first of {len(margins)} of "
        f"{tot['seqs']} sequences at margins (half the score gap) {shown or '-'}, not at a "
        f"near-tie {tot['not_ties']}\n"
        f"  selection scores up to each sequence's first flip differ by at most "
        f"{mx['noise']:.4f} (near-tie threshold 2^{np.log2(NEAR_TIE):.0f}: 4 bf16 ulps of a "
        f"score in [0.5, 1)) -> {'OK' if logits_ok else 'FAILED'}")
    return layers_ok and logits_ok


def collectives(compiled):
    import re

    return [m.group(1) for m in re.finditer(
        r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(",
        compiled.as_text())]


if __name__ == "__main__":
    sys.exit(main())
