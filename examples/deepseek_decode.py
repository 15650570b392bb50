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
the logits against the same model with a dense MoE on this process's own device.
"""

import argparse
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
p.add_argument("--reps", type=int, default=20, help="samples per breakdown timing")
args = p.parse_args()
RANK, NPROC = start()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_moe_comm.flax as jf  # noqa: E402
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
            ffn=args.ffn, shared_expert=True, mesh=MESH, expert_axis="ep",
            max_num_tokens=(args.batch_per_rank * S0, args.batch_per_rank),  # prefill, decode
            router=ROUTER,
            param_dtype=bf16, layout="padded", differentiable=False, backend=args.backend,
            eager_handles=False, rngs=rngs)

    def __call__(self, x, ck, cv, start, dense=False):
        a, ck, cv = self.attn(self.norm1(x), ck, cv, start)
        h = x + a
        hn = self.norm2(h)
        m = self.moe.dense(hn, params=self.moe._params()) if dense else self.moe(hn)
        return h + m, ck, cv


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = replicated(rngs, (args.vocab, H), scale=1.0)
        self.blocks = getattr(nnx, "List", list)([Block(rngs) for _ in range(args.layers)])
        self.norm = RMSNorm(rngs)
        self.head = replicated(rngs, (H, args.vocab))

    def __call__(self, tokens, caches, start, dense=False):
        x = self.embed[...][tokens]
        if not dense:
            x = jax.lax.with_sharding_constraint(x, ROWS)  # each rank its own sequences
        new = []
        for block, (ck, cv) in zip(self.blocks, caches):
            x, ck, cv = block(x, ck, cv, start, dense)
            new.append((ck, cv))
        return (self.norm(x) @ self.head[...]).astype(f32), new


def empty_caches(batch, sharding=None):
    make = lambda: [(jnp.zeros((batch, S_MAX, NH, DH), bf16),) * 2  # noqa: E731
                    for _ in range(args.layers)]
    return jax.jit(make, out_shardings=sharding)() if sharding is not None else make()


def steps(graphdef, dense=False):
    """(prefill, decode) jitted on the model's state: prefill -> last logits; decode one
    token -> logits, greedy next token."""
    def prefill(state, prompt, caches):
        logits, caches = nnx.merge(graphdef, state)(prompt, caches, 0, dense)
        return logits[:, -1], caches

    def decode(state, token, caches, pos):
        logits, caches = nnx.merge(graphdef, state)(token[:, None], caches, pos, dense)
        return logits[:, 0], jnp.argmax(logits[:, 0], -1).astype(jnp.int32), caches

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
            ey = out.expert_x if part == "combine" else experts_forward(a2a, p, out,
                                                                         layer.expert_gemm)
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
    logits, caches = prefill(state, prompt_g, caches)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    jax.block_until_ready(token)
    log(f"prefill (compile + run): {1e3 * (time.perf_counter() - t0):.1f} ms")
    compiled = decode.lower(state, token, caches, S0).compile()  # the step, compiled once
    found = sorted(set(collectives(compiled)))
    ours = {"all-to-all"} if backend == "reference" else set()
    log(f"XLA collectives in the decode step: {found or 'none'}")
    seen_logits, seen_tokens, times = [mine(logits)], [mine(token)], []
    for t in range(N):
        t0 = time.perf_counter()
        logits, nxt, caches = compiled(state, token, caches, S0 + t)
        jax.block_until_ready(nxt)
        times.append(time.perf_counter() - t0)
        if (t + 1) % args.check_every == 0 or t == N - 1:
            jf.check_handles(model)  # errors of replayed command buffers surface here
        seen_logits.append(mine(logits))
        token = nxt
        seen_tokens.append(mine(token))
    steady = np.array(times[1:] or times) * 1e3
    log("per-token latency (ms): " + " ".join(f"{1e3 * v:.2f}" for v in times)
        + f"  [compiled before; the first run is left out of the median]; steady median {np.median(steady):.3f}, "
        f"p90 {np.percentile(steady, 90):.3f}, {B / np.median(steady) * 1e3:.0f} tokens/s")

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
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    local_state = jax.tree_util.tree_unflatten(treedef, [
        local_copy(leaf, jax.tree_util.keystr(path)) for path, leaf in flat])
    d_prefill, d_decode = steps(graphdef, dense=True)
    rows = len(seen_tokens[0])
    d_caches = empty_caches(rows)
    mine_prompt = jnp.asarray(mine(prompt_g))
    d_logits, d_caches = d_prefill(local_state, mine_prompt, d_caches)
    worst = [np.abs(np.asarray(d_logits) - seen_logits[0]).max()]
    agree = int(np.sum(np.argmax(np.asarray(d_logits), -1) == seen_tokens[0]))
    for t in range(N):
        d_logits, d_next, d_caches = d_decode(local_state, jnp.asarray(seen_tokens[t]),
                                              d_caches, S0 + t)
        worst.append(np.abs(np.asarray(d_logits) - seen_logits[t + 1]).max())
        agree += int(np.sum(np.asarray(d_next) == seen_tokens[t + 1]))
    scale = max(float(np.abs(seen_logits[0]).max()), 1.0)
    ok = max(worst) <= 0.05 * scale and set(found) <= ours
    log(f"logits vs the dense-MoE model: max|diff| {max(worst):.4f} (logits up to {scale:.2f})"
        f", greedy tokens equal {agree}/{rows * (N + 1)} -> {'OK' if ok else 'FAILED'}")
    jf.close_handles(model)
    return 0 if ok else 1


def collectives(compiled):
    import re

    return [m.group(1) for m in re.finditer(
        r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(",
        compiled.as_text())]


if __name__ == "__main__":
    sys.exit(main())
