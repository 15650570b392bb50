"""The expert MLPs' grouped-GEMM options (expert_gemm.py, issue 24) timed on one GPU.

On the GPU machine, tokamax and what it needs carried as wheels in .whl/ (one process, one
GPU, no NVSHMEM):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site python3 benchmarks/bench_gemm.py --out $OUT/gemm

    python3 benchmarks/bench_gemm.py --cpu-smoke --out /tmp/gemm   # tiny shapes on CPU: the
                                                                   # whole script end to end

One rank's experts after dispatch on 8 ranks: V2-Lite (E=64, k=6, H=2048, F=1408, L=8 local
experts) and R1 (E=256, k=8, H=7168, F=2048, L=32) with 1, 16, 128 tokens per rank. The rank
receives tokens*k live rows (8 ranks' tokens*k slots spread over 8 ranks), split over its L
experts by a seeded multinomial (some experts empty at 1 token); the padded layout holds
max_recv = 8*tokens rows per expert, the packed one 8*tokens*min(k, L) rows (the dispatch
shapes). Rows past the counts hold random values (they must not matter), the output
cotangent is zero there (combine never reads them).

Options (rows): einsum (padded), ragged_dot (packed, XLA's lowering), ragged_dot_triton (the
same with jax_ragged_dot_use_gpu_pallas_triton_lowering=True; its error recorded if it fails),
tokamax (packed, tokamax's own choice of kernel; `impl` says which custom calls the compiled
program holds; differentiated through grouped_vjp: tokamax's forward kernel for d x, XLA's
batched GEMM over a window of rows per expert for d w), masked (padded, live rows gathered,
tokamax's GEMM, scattered back).
tokamax_kernelwgrad: the same VJP with tokamax's ragged-contracting kernel for d w;
tokamax_alignedwgrad: that kernel on groups re-laid to start at multiples of 128 rows (its
k-block: does alignment avoid its fault? no control flow, unlike the window path's lax.cond);
tokamax_ownvjp: tokamax's own VJP (its d w were 0.5 wrong at 768-1024 rows on 2026-12-05).
Diagnosis variants of tokamax (issue 24: wrong at 128 tokens per rank, right at 1 and 16),
named tokamax[_<implementation>][_unfused]:
  tokamax_unfused   SiLU outside tokamax: each GEMM with preferred_element_type=f32 and no
                    activation=, SiLU in f32, then bf16 (tests "the fused activation is applied
                    to partial sums of a split-K kernel picked at larger M");
  tokamax_mosaic, tokamax_triton, tokamax_xla   tokamax's implementation= forced to that name
                    (its IMPLEMENTATIONS; "mosaic" is the Mosaic GPU kernel, "xla" jax.lax's),
                    e.g. tokamax_mosaic_unfused for both. A name tokamax lacks is recorded as the
                    row's error.
Kernel configs (issue 24: V2-Lite at 128 tokens is 1.79x its floor, its GEMMs ~2x the time of
reading the weights once), named tokamax_cfg_<spec>[_unfused], e.g. tokamax_cfg_m128s4p1:
tokamax_mlp with implementation="mosaic:<spec>", tokamax's Mosaic GPU kernel with a Config of
ours (expert_gemm.TOKAMAX_SPEC_GRAMMAR: m block_m, n block_n, k block_k, s num_stages,
p persistent 0/1, g the grid's minor dimension m/n, w grid tile width; letters left out take
tokamax's sm90 heuristic, m64n64k128s2p0gmw1), falling back to tokamax's "mosaic" (its own
config), then "xla", where the kernel refuses a problem. tokamax_mosaic_persistent is the spec
p1. Such a row's tokamax_config holds the spec, the Config asked for, and per forward GEMM
(w_in, w_out) "spec" where the kernel takes it, else why it refused (the fallback's config
beside it). The preset `sweep` in --options stands for SWEEP, 8 specs whose pairs differ in one
letter: m64s2p0 (the heuristic through this path: must match `tokamax`), m128s2p0, m64s2p1,
m64s4p0, m128s2p1, m128s4p0, m128s4p1, m128s4p1gn. They separate (a) block_m 64 vs 128 (with
~96-120 live rows per expert, 64 makes two row tiles: each weight tile read twice?), (b) not
persistent vs persistent (one block per 64-row tile of the whole packed buffer, 6,144 rows for
768 live at V2-Lite's worst case, most exiting at once: with --packed-rows-factor 1.25 the
non-persistent rows should gain far more than the persistent ones), (c) 2 vs 4 stages; gn: M
vs N as the grid's minor dimension. Each option compiles two programs per shape: ~8 s a row on
the H200 (2026-12-05: 14 rows in 116 s), so 2 configs x (einsum, tokamax, 8 specs) at one token
count are ~160 s, inside the default --budget-s 200 (rows not started by then are skipped and
say so). On the GPU, after the pip install above (~170 s each; both fit one 600 s call):

    PYTHONPATH=/tmp/site python3 benchmarks/bench_gemm.py --configs V2Lite,R1 --tokens 128 --options tokamax,sweep --packed-rows-factor 0 --out $OUT/sweep

    PYTHONPATH=/tmp/site python3 benchmarks/bench_gemm.py --configs V2Lite,R1 --tokens 128 --options tokamax,sweep --packed-rows-factor 1.25 --out $OUT/sweep125

In the fwd+bwd op tokamax computes y with return_residuals (the activation applied outside the
kernel), so err_y (fwd op, fused) beside err_y_fb (fwd+bwd op) separates the two as well.

Each option is first checked against einsum on the same data, per output: err_y (fwd op),
err_y_fb, err_dx (live rows), err_dw_in, err_dw_out (whole): max |option - einsum| relative to
max |einsum| of that tensor; err is their max, and a row over --tol is marked incorrect (never
a crash: every error is recorded in the row). bad_rows_y / bad_rows_dx count the live rows whose
own error passes --tol (relative to the tensor's max |einsum|), bad_experts_y lists up to 6
experts with such rows as [expert, its rows, bad rows, first bad row] (to see whether only rows
past a kernel tile, e.g. row 64, go wrong). group_sizes / group_min / group_max / groups_empty:
the rows per local expert of the case; tokamax_config (tokamax rows): the kernel config its
Mosaic GPU / Triton ragged_dot picks for the two forward GEMMs of the case (split_k shows there).
Then
fwd_us (y = silu(x w_in) w_out, bf16 in and out, f32 accumulation) and fwd_bwd_us (y and the
gradients of x, w_in, w_out for a given cotangent) per op: one jitted lax.fori_loop runs the op
N times (N sized to ~3 ms a call; its inputs pass an optimization barrier every iteration so
that XLA cannot hoist the op out, and are donated so that nothing is copied), timed with
time.perf_counter around jax.block_until_ready; the median of --runs calls after warm-up, /N.

Floors (H200: 4.0e12 B/s, 700e12 bf16 FLOP/s): floor_us = max(the local experts' weights read
once, the live rows' FLOPs); floor_fwd_bwd_us = max(weights read once and their gradients
written once, 3x the FLOPs).

Writes --out/gemm.json (meta + rows: config, tokens, option, impl, fwd_us, fwd_bwd_us,
floor_us, err, correct, error, ...) and --out/gemm.md, and prints a short table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's jax_moe_comm (the native module is not needed)

# name: (experts, top-k, hidden, expert ffn); L = experts / 8 ranks
CONFIGS = {"V2Lite": (64, 6, 2048, 1408), "R1": (256, 8, 7168, 2048)}
SMOKE_CONFIGS = {"tiny": (32, 4, 128, 256)}
RANKS = 8
HBM_BPS, PEAK_FLOPS = 4.0e12, 700e12
OPTIONS = ("einsum", "ragged_dot", "ragged_dot_triton", "tokamax", "masked", "tokamax_unfused",
           "tokamax_mosaic", "tokamax_xla", "tokamax_kernelwgrad", "tokamax_alignedwgrad",
           "tokamax_ownvjp", "bucketed_tokamax", "sliced_tokamax")
TOKAMAX_IMPLS = ("mosaic", "triton", "xla", "mosaic_gpu",  # tokamax 0.0.17's names
                 "mosaic_persistent")  # ours (expert_gemm.TOKAMAX_PERSISTENT)
# tokamax kernel specs (tokamax_cfg_<spec>) of the preset "sweep": pairs differing in one letter
# separate block_m 64/128, persistent or not, 2/4 stages (see the module docstring); the first
# is tokamax's sm90 heuristic itself, through the spec path.
SWEEP = ("m64s2p0", "m128s2p0", "m64s2p1", "m64s4p0", "m128s2p1", "m128s4p0", "m128s4p1",
         "m128s4p1gn")
PRESETS = {"sweep": tuple(f"tokamax_cfg_{spec}" for spec in SWEEP)}
TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gemm.json and gemm.md")
    p.add_argument("--configs", help=f"default: {','.join(CONFIGS)}")
    p.add_argument("--tokens", help="tokens per rank, default: 1,16,128")
    p.add_argument("--options", default=",".join(OPTIONS[:5]),
                   help=f"any of {', '.join(OPTIONS)}, tokamax[_<implementation>][_unfused], "
                   "tokamax_cfg_<kernel spec>[_unfused] (e.g. tokamax_cfg_m128s4p1), or the "
                   f"preset sweep ({len(SWEEP)} kernel specs)")
    p.add_argument("--packed-rows-factor", type=float, default=0.0,
                   help="packed buffer rows = this x the live rows (0: dispatch's worst case): "
                   "what a capacity does to the grouped GEMMs' time at the same live rows")
    p.add_argument("--runs", type=int, default=20, help="timed calls per measurement (>= 20)")
    p.add_argument("--target-ms", type=float, default=3.0, help="device time of one call")
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error vs einsum")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="rows not started by then are skipped (the run must stay < 4 min)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU, tiny shapes, 3 runs: checks the script end to end")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        a.runs, a.target_ms = 3, 1.0
    a.configs = a.configs or ("tiny" if a.cpu_smoke else ",".join(CONFIGS))
    a.tokens = a.tokens or ("1,4" if a.cpu_smoke else "1,16,128")
    return a


# Imported (the tests): the defaults, nothing run.
ARGS = parse(sys.argv[1:] if __name__ == "__main__" else ["--out", ""])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_moe_comm import expert_gemm as G  # noqa: E402
from jax_moe_comm.layout import pack_rows, unpack_rows  # noqa: E402

bf16, f32 = jnp.bfloat16, jnp.float32
T0 = time.perf_counter()


# -- data --------------------------------------------------------------------------------------
class Case:
    """One rank's dispatch output at (config, tokens), built on the device."""

    def __init__(self, name, tokens, seed=0, rows_factor=0.0):
        E, k, H, F = (CONFIGS | SMOKE_CONFIGS)[name]
        self.name, self.tokens, self.H, self.F = name, tokens, H, F
        self.L = L = E // RANKS
        self.R = R = RANKS * tokens  # max_recv: every rank's every token, per expert
        self.live = tokens * k
        self.T = R * min(k, L)  # max_recv_total, the packed rows
        if rows_factor:  # a packed capacity: rows_factor x the live rows (a multiple of 8)
            self.T = min(self.T, max(self.live, -(-int(rows_factor * self.live) // 8) * 8))
        rng = np.random.default_rng(seed)
        counts = rng.multinomial(self.live, np.full(L, 1.0 / L))
        assert counts.max() <= R
        self.counts_np = counts.astype(np.int32)
        keys = jax.random.split(jax.random.key(seed), 4)
        self.counts = jnp.asarray(self.counts_np)
        live = (jnp.arange(R)[None, :] < self.counts[:, None])[..., None]
        self.x = jax.random.normal(keys[0], (L, R, H), bf16)  # dead rows random too
        self.w_in = (jax.random.normal(keys[1], (L, H, F), f32) / np.sqrt(H)).astype(bf16)
        self.w_out = (jax.random.normal(keys[2], (L, F, H), f32) / np.sqrt(F)).astype(bf16)
        self.g = jnp.where(live, jax.random.normal(keys[3], (L, R, H), bf16), 0)
        pack = jax.jit(pack_rows, static_argnums=2)
        self.x_packed, self.g_packed = pack(self.x, self.counts, self.T), pack(self.g, self.counts,
                                                                             self.T)
        wbytes = 2 * L * H * F * 2  # w_in and w_out, bf16
        flops = 2 * 2 * self.live * H * F
        self.floor_us = 1e6 * max(wbytes / HBM_BPS, flops / PEAK_FLOPS)
        self.floor_fwd_bwd_us = 1e6 * max(2 * wbytes / HBM_BPS, 3 * flops / PEAK_FLOPS)
        self.weight_us, self.flop_us = 1e6 * wbytes / HBM_BPS, 1e6 * flops / PEAK_FLOPS

    def args(self, layout):
        x, g = (self.x, self.g) if layout == "padded" else (self.x_packed, self.g_packed)
        return x, self.counts, self.w_in, self.w_out, g


def option_fn(option, case=None):
    """(layout, mlp(x, counts, w_in, w_out) -> y bf16) of a bench option; the tokamax options'
    weight-gradient window as the MoE layer sizes it (twice the case's mean rows per expert)."""
    mean = None if case is None else -(-case.live // case.L)
    window = None if case is None else G.grad_window_for(case.T, case.L, mean_rows=mean)
    out = dict(out_dtype=bf16)
    tile = dict(mean_rows=mean)  # tokamax's tile as the layer picks it (layer_tokamax_spec)
    if option == "einsum":
        return "padded", lambda x, c, wi, wo: G.einsum_mlp(x, wi, wo, **out)
    if option in ("ragged_dot", "ragged_dot_triton"):
        return "packed", lambda x, c, wi, wo: G.ragged_dot_mlp(x, c, wi, wo, **out)
    if option == "tokamax":
        return "packed", lambda x, c, wi, wo: G.tokamax_mlp(x, c, wi, wo, grad_window=window,
                                                            **out, **tile)
    if option == "tokamax_kernelwgrad":  # our VJP, tokamax's ragged-contracting kernel for d w
        return "packed", lambda x, c, wi, wo: G.tokamax_mlp(x, c, wi, wo, wgrad="kernel", **out,
                                                            allow_known_wrong=True, **tile)
    if option == "tokamax_alignedwgrad":  # the same on groups aligned to its 128-row k-blocks
        return "packed", lambda x, c, wi, wo: G.tokamax_mlp(x, c, wi, wo, wgrad="kernel_aligned",
                                                            **out, **tile)
    if option == "tokamax_ownvjp":  # tokamax's own VJP (the layer's before grouped_vjp)
        return "packed", lambda x, c, wi, wo: G._tokamax_forward(x, c.astype(jnp.int32), wi, wo,
                                                                 bf16)
    if option in ("bucketed_tokamax", "sliced_tokamax"):  # row buckets (issue 24)
        # buckets of 1.25x and 2x the live rows, then the whole buffer (MoELayerConfig's
        # gemm_row_buckets=(1.25, 2.0)); "sliced" runs the first bucket's branch alone (no
        # conditional: what the switch costs on top of it)
        sizes = () if case is None else (1.25 * case.live, 2.0 * case.live)
        if option == "bucketed_tokamax":
            return "packed", lambda x, c, wi, wo: G.expert_mlp(
                x, c, wi, wo, "tokamax", grad_window=window, row_buckets=sizes, **out, **tile)

        def sliced(x, c, wi, wo):
            b = G.bucket_rows(x.shape[0], sizes)[0]
            y = G.tokamax_mlp(x[:b], c, wi, wo, grad_window=window and min(window, b), **out,
                              **tile)
            return jnp.pad(y, ((0, x.shape[0] - b), (0, 0)))
        return "packed", sliced
    if option.startswith("tokamax_"):
        impl, unfused = tokamax_variant(option)
        if unfused:
            return "packed", lambda x, c, wi, wo: tokamax_unfused_mlp(x, c, wi, wo, impl)
        return "packed", lambda x, c, wi, wo: G.tokamax_mlp(x, c, wi, wo, implementation=impl,
                                                            grad_window=window, **out)
    if option == "masked":
        return "padded", lambda x, c, wi, wo: G.masked_mlp(x, c, wi, wo, grad_window=window,
                                                           **out, **tile)
    raise ValueError(f"unknown option {option!r}; expected one of {OPTIONS}")


def expand_options(text):
    """--options' comma list -> the option names, presets (PRESETS) expanded, each once."""
    out = []
    for option in text.split(","):
        for name in PRESETS.get(option.strip(), (option.strip(),)):
            if name and name not in out:
                out.append(name)
    return out


def tokamax_variant(option):
    """tokamax[_<implementation>][_unfused] -> (implementation or None, unfused);
    tokamax_cfg_<spec>[_unfused] -> ("mosaic:<spec>", unfused)."""
    parts = option.split("_")[1:]
    unfused = parts[-1:] == ["unfused"]
    impl = "_".join(parts[:-1] if unfused else parts) or None
    if impl is not None and impl.startswith("cfg_"):
        try:
            G.parse_tokamax_spec(impl[len("cfg_"):])
        except ValueError as e:
            raise ValueError(f"option {option!r}: {e}") from None
        return G.TOKAMAX_SPEC_PREFIX + impl[len("cfg_"):], unfused
    if impl is not None and impl not in TOKAMAX_IMPLS:
        raise ValueError(f"option {option!r}: unknown tokamax implementation {impl!r}; "
                         f"expected tokamax[_<one of {TOKAMAX_IMPLS}>][_unfused] or "
                         "tokamax_cfg_<kernel spec>[_unfused], e.g. tokamax_cfg_m128s4p1")
    return impl, unfused


def tokamax_implementations():
    """The implementation names the installed tokamax knows (None when it does not import)."""
    try:
        from tokamax._src.ops.ragged_dot import api
        return sorted(api.IMPLEMENTATIONS) + ["mosaic"]
    except Exception:  # noqa: BLE001
        return None


def tokamax_config(case):
    """{implementation:gemm: the kernel config tokamax picks} for the two forward GEMMs of the
    case (block sizes, split_k, ...: autotuning cache, else its heuristics), or why not."""
    try:
        from tokamax._src.ops.ragged_dot import api
    except Exception as e:  # noqa: BLE001
        return {"error": short(e)}
    out = {}
    for name in ("mosaic_gpu", "triton"):
        op = api.IMPLEMENTATIONS.get(name)
        if op is None or not hasattr(op, "bind"):
            continue
        for gemm, lhs, rhs in forward_gemms(case):
            try:
                ba = op.bind(lhs, rhs, group_sizes=case.counts, preferred_element_type=bf16)
                cfg = ba.default_config
                out[f"{name}:{gemm}"] = str(cfg() if callable(cfg) else cfg)[:300]
            except Exception as e:  # noqa: BLE001
                out[f"{name}:{gemm}"] = short(e)[:300]
    return out


def forward_gemms(case):
    """(name, lhs, rhs) shapes of the case's two forward GEMMs, bf16."""
    return (("w_in", jax.ShapeDtypeStruct((case.T, case.H), bf16),
             jax.ShapeDtypeStruct(case.w_in.shape, bf16)),
            ("w_out", jax.ShapeDtypeStruct((case.T, case.F), bf16),
             jax.ShapeDtypeStruct(case.w_out.shape, bf16)))


def tokamax_spec_config(case, implementation):
    """A kernel spec's row (tokamax_cfg_<spec>, tokamax_mosaic_persistent): {spec, config: the
    Config it asks for, w_in / w_out: "spec" where tokamax's Mosaic GPU kernel takes it for that
    forward GEMM, else why not (NotImplementedError: tokamax falls back to "mosaic", whose own
    config, tokamax_config's mosaic_gpu:*, is added, then "xla")}. Traced only: a kernel that
    takes a config but fails to compile fails the row instead."""
    spec = G.tokamax_spec(implementation)
    out = {"spec": spec}
    try:
        out["full_spec"] = full_spec(spec)
        tk = G._require_tokamax()
        first = G._tokamax_implementation(implementation)[0]
    except Exception as e:  # noqa: BLE001
        out["error"] = short(e)[:300]
        return out
    out["config"] = str(first.config)[:300]
    refused = False
    for gemm, lhs, rhs in forward_gemms(case):
        try:  # tokamax's own call with our kernel alone: it raises where it would fall back
            jax.eval_shape(lambda a, b, gs: tk.ragged_dot(a, b, gs, preferred_element_type=bf16,
                                                          implementation=(first,)),
                           lhs, rhs, case.counts)
            out[gemm] = "spec"
        except Exception as e:  # noqa: BLE001
            refused = refused or isinstance(e, NotImplementedError)
            out[gemm] = ("refused, fell back: " if isinstance(e, NotImplementedError)
                         else "fails: ") + short(e)[:240]
    if refused:
        out.update(tokamax_config(case))
    return out


def full_spec(spec):
    """A kernel spec with every letter spelled out, e.g. m128s4p1 -> m128n64k128s4p1gmw1."""
    fields = G.parse_tokamax_spec(spec)
    return "".join(f"{letter}{int(v) if isinstance(v, bool) else v}" for letter, v in
                   ((letter, fields[f]) for letter, f in G.TOKAMAX_SPEC_LETTERS.items()))


def tokamax_unfused_mlp(x, c, w_in, w_out, implementation=None):
    """tokamax's two GEMMs with nothing fused: f32 out, SiLU in f32 outside, then bf16."""
    tk = G._require_tokamax()
    gs = c.astype(jnp.int32)
    implementation = G._tokamax_implementation(implementation)  # a kernel spec: its kernel
    kw = {} if implementation is None else {"implementation": implementation}
    h = tk.ragged_dot(x, w_in, gs, preferred_element_type=f32, **kw)
    h = jax.nn.silu(h).astype(bf16)
    return tk.ragged_dot(h, w_out, gs, preferred_element_type=f32, **kw).astype(bf16)


def fwd_op(mlp):
    return lambda x, c, wi, wo, g: (mlp(x, c, wi, wo),)


def fwd_bwd_op(mlp):
    def op(x, c, wi, wo, g):
        y, vjp = jax.vjp(lambda x, wi, wo: mlp(x, c, wi, wo), x, wi, wo)
        return (y,) + vjp(g)
    return op


# -- timing ------------------------------------------------------------------------------------
def looped(op):
    """jit of (n, args, outs) -> (args, outs): op applied n times, args and outs donated."""

    def run(n, args, outs):
        def body(i, carry):
            a, _ = carry
            a = jax.lax.optimization_barrier(a)  # a new value each iteration: nothing hoisted
            return a, op(*a)

        return jax.lax.fori_loop(0, n, body, (args, outs))

    return jax.jit(run, donate_argnums=(1, 2))


def hlo_counts(hlo_text: str) -> dict:
    """How many conditionals and copies the compiled program holds, and how many command-buffer
    computations XLA wrapped (definitions only: their call sites name them again). For a row
    bucket's lax.switch (recorded into a command buffer, or copying its operands?); the plain
    tokamax row's counts are the baseline (its VJP has conditionals and copies of its own)."""
    definitions = sum(1 for line in hlo_text.splitlines()
                      if line.lstrip().startswith("%command_buffer") and line.rstrip()[-1:] == "{")
    return {"conditional": hlo_text.count(" conditional("), "copy": hlo_text.count(" copy("),
            "command_buffers": definitions}


def custom_calls(hlo_text: str) -> str:
    """Which GEMM kernels the compiled program holds, e.g. 'cublas', 'mosaic_gpu'."""
    markers = (('custom_call_target="mosaic', "mosaic_gpu"),
               ("__gpu$xla.gpu.triton", "pallas_triton"), ("__triton_gemm", "xla_triton_gemm"),
               ("__cublas$lt", "cublasLt"), ("__cublas$gemm", "cublas"), ("__cudnn$", "cudnn"))
    return "+".join(name for key, name in markers if key in hlo_text) or "xla"


def measure(op, args, runs, target_s):
    """(per-op seconds, first outputs, impl, hlo_counts): compile, one call for the outputs, N
    sized to target_s, warm-up, median of `runs` calls / N."""
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    args = copy(args)  # this measurement's own buffers (they are donated)
    outs = jax.jit(lambda a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                          jax.eval_shape(op, *a)))(args)
    one = jnp.int32(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donation is not implemented on CPU
        compiled = looped(op).lower(one, args, outs).compile()
    text = compiled.as_text()
    impl, counts = custom_calls(text), hlo_counts(text)
    args, outs = compiled(one, args, outs)
    first = copy(outs)
    jax.block_until_ready((args, outs, first))
    t = time.perf_counter()
    args, outs = jax.block_until_ready(compiled(one, args, outs))
    t1 = time.perf_counter() - t
    n = jnp.int32(int(min(200, max(1, round(target_s / max(t1, 1e-6))))))
    for _ in range(2):
        args, outs = jax.block_until_ready(compiled(n, args, outs))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        args, outs = jax.block_until_ready(compiled(n, args, outs))
        times.append(time.perf_counter() - t)
    return statistics.median(times) / int(n), first, impl, counts


# -- correctness -------------------------------------------------------------------------------
@jax.jit
def _rel_err(got, want, counts):
    """max |got - want| / max |want| over live rows (padded [L, R, H]) or whole (weights)."""
    got, want = got.astype(f32), want.astype(f32)
    if got.ndim == 3 and counts is not None:
        live = (jnp.arange(got.shape[1])[None, :] < counts[:, None])[..., None]
        got, want = jnp.where(live, got, 0), jnp.where(live, want, 0)
    err = jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30)
    return jnp.where(jnp.all(jnp.isfinite(got)), err, jnp.inf)


_unpack = jax.jit(unpack_rows, static_argnums=2)


def errors(case, layout, outs, ref, padded=True):
    """Max relative error of the outputs against ref's (einsum's: rows padded [L, R, H]; with
    padded=False, ref is in the layout of outs); y and d x over the live rows only."""
    return max(output_errors(case, layout, outs, ref, padded).values())


OUTPUT_NAMES = ("y", "dx", "dw_in", "dw_out")


def output_errors(case, layout, outs, ref, padded=True, names=OUTPUT_NAMES):
    """{name: relative error} of each output (names in order: y, d x, d w_in, d w_out)."""
    errs = {}
    for i, (o, r, name) in enumerate(zip(outs, ref, names)):
        if i < 2 and layout == "packed":  # y and d x come packed: unpack the live rows
            o = _unpack(o, case.counts, case.R)
            r = r if padded else _unpack(r, case.counts, case.R)
        errs[name] = float(_rel_err(o, r, case.counts if i < 2 else None))
    return errs


@jax.jit
def _row_err(got, want, counts):
    """[L, R] max |got - want| per live row / max |want| over the tensor (0 past the counts)."""
    got, want = got.astype(f32), want.astype(f32)
    live = jnp.arange(got.shape[1])[None, :] < counts[:, None]
    d = jnp.where(live, jnp.max(jnp.abs(got - want), axis=-1), 0)
    d = jnp.where(jnp.isfinite(d), d, jnp.inf)
    scale = jnp.max(jnp.where(live[..., None], jnp.abs(want), 0))
    return d / jnp.maximum(scale, 1e-30)


def bad_rows(case, layout, got, want, tol):
    """(live rows over tol, [[expert, rows, bad rows, first bad row]] for up to 6 experts)."""
    if layout == "packed":
        got = _unpack(got, case.counts, case.R)
    err = np.asarray(_row_err(got, want, case.counts))
    bad = err > tol
    experts = [[int(e), int(case.counts_np[e]), int(bad[e].sum()), int(np.argmax(bad[e]))]
               for e in np.flatnonzero(bad.any(axis=1))[:6]]
    return int(bad.sum()), experts


def shard_map_check(option, case, tol):
    """The option under jax.shard_map on a one-device mesh, as the MoE layer runs it: fwd and
    grads against the plain call. '' when it matches."""
    from jax.sharding import PartitionSpec as P

    layout, mlp = option_fn(option, case)
    op = fwd_bwd_op(mlp)
    args = case.args(layout)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    spec = (P("ep"),) * 5
    sm = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=(P("ep"),) * 4))
    err = errors(case, layout, sm(*args), jax.jit(op)(*args), padded=False)
    return "" if err <= tol else f"under shard_map: relative error {err:.3g}"


# -- the run -----------------------------------------------------------------------------------
def short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:600]


def bench_option(case, option, ref, known_errors):
    gs = case.counts_np
    row = dict(config=case.name, tokens=case.tokens, option=option, L=case.L, live_rows=case.live,
               padded_rows=case.L * case.R, packed_rows=case.T, impl="", fwd_us=None,
               fwd_bwd_us=None, floor_us=round(case.floor_us, 2),
               floor_fwd_bwd_us=round(case.floor_fwd_bwd_us, 2),
               weight_read_us=round(case.weight_us, 2), flop_us=round(case.flop_us, 2),
               group_min=int(gs.min()), group_max=int(gs.max()),
               groups_empty=int((gs == 0).sum()), group_sizes=[int(v) for v in gs],
               err=None, err_y=None, err_y_fb=None, err_dx=None, err_dw_in=None,
               err_dw_out=None, bad_rows_y=None, bad_experts_y=None, bad_rows_dx=None,
               correct=None, shard_map="", error="")
    if option in known_errors:  # the same failure at every shape: not tried again
        row["error"] = known_errors[option]
        return row, None
    if time.perf_counter() - T0 > ARGS.budget_s:
        row["error"] = f"skipped: past the {ARGS.budget_s:.0f} s budget"
        return row, None
    flag_set = False
    try:
        if option == "ragged_dot_triton":
            jax.config.update(TRITON_FLAG, True)
            flag_set = True
        layout, mlp = option_fn(option, case)
        args = case.args(layout)
        if option.startswith("tokamax"):
            impl = tokamax_variant(option)[0] if option.startswith("tokamax_") else None
            row["tokamax_config"] = (tokamax_config(case) if G.tokamax_spec(impl) is None
                                     else tokamax_spec_config(case, impl))
        target = ARGS.target_ms / 1e3
        fwd_s, fwd_out, impl, row["hlo_fwd"] = measure(fwd_op(mlp), args, ARGS.runs, target)
        row["fwd_us"] = round(fwd_s * 1e6, 2)
        fb_s, fb_out, impl_b, row["hlo_fwd_bwd"] = measure(fwd_bwd_op(mlp), args, ARGS.runs,
                                                            target)
        row["fwd_bwd_us"] = round(fb_s * 1e6, 2)
        row["impl"] = impl if impl == impl_b else f"fwd {impl}, bwd {impl_b}"
        if option == "masked":
            row["impl"] = f"gather+{G.masked_inner()}({row['impl']})+scatter"
        if ref is None:
            ref = fb_out  # einsum: the reference
        errs = output_errors(case, layout, fwd_out, ref[:1])
        errs.update(output_errors(case, layout, fb_out, ref,
                                  names=("y_fb", "dx", "dw_in", "dw_out")))
        for name, v in errs.items():
            row[f"err_{name}"] = float(f"{v:.3g}")
        row["bad_rows_y"], row["bad_experts_y"] = bad_rows(case, layout, fwd_out[0], ref[0],
                                                           ARGS.tol)
        row["bad_rows_dx"], _ = bad_rows(case, layout, fb_out[1], ref[1], ARGS.tol)
        err = max(errs.values())
        row["err"] = float(f"{err:.3g}")
        row["correct"] = bool(err <= ARGS.tol)
        if not row["correct"]:
            worst = max(errs, key=errs.get)
            row["error"] = (f"incorrect: relative error {err:.3g} > {ARGS.tol} (worst: {worst}; "
                            + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()) + ")")
        return row, fb_out
    except Exception as e:  # noqa: BLE001 -- recorded, never a crash
        row["error"] = short(e)
        if isinstance(e, ImportError) or (option == "ragged_dot_triton" and not isinstance(
                e, getattr(jax.errors, "JaxRuntimeError", ()))) or (
                option.startswith("tokamax_") and "implementation" in str(e).lower()):
            known_errors[option] = row["error"]  # not a size problem: the same everywhere
        return row, None
    finally:
        if flag_set:
            jax.config.update(TRITON_FLAG, False)


def device_meta():
    tk, why = G._tokamax()
    d = jax.devices()[0]
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                jax=jax.__version__, platform=d.platform,
                device=getattr(d, "device_kind", str(d)),
                tokamax=getattr(tk, "__version__", None), tokamax_problem=why,
                tokamax_implementations=tokamax_implementations(),
                masked_inner=G.masked_inner(), gpu_auto=G.GPU_AUTO, runs=ARGS.runs,
                packed_rows_factor=ARGS.packed_rows_factor,
                target_ms=ARGS.target_ms, tol=ARGS.tol, hbm_bps=HBM_BPS,
                peak_flops=PEAK_FLOPS, ranks=RANKS)


def fmt(v, nd=1):
    return "" if v is None else f"{v:.{nd}f}"


def markdown(meta, rows):
    out = [f"# Expert GEMM options, {meta['device']} ({meta['date']})", "",
           f"jax {meta['jax']}, tokamax {meta['tokamax'] or '-'}"
           f"{' (' + meta['tokamax_problem'] + ')' if meta['tokamax_problem'] else ''}; "
           f"median of {meta['runs']} calls; floor = max(weights once / 4.0e12 B/s, "
           "FLOPs / 700e12); packed rows "
           + (f"{meta['packed_rows_factor']} x the live rows" if meta.get("packed_rows_factor")
              else "dispatch's worst case") + ".", "",
           "| config | tokens | live rows | rows per expert min-max (empty) | option | impl | "
           "fwd µs | fwd+bwd µs | floor µs | floor fwd+bwd µs | rel err | y | y (fwd+bwd) | "
           "d x | d w_in | d w_out | bad rows y / d x | bad experts y [e, rows, bad, first] | "
           "error |", "|" + "---|" * 19]

    def e(v):
        return "" if v is None else v

    for r in rows:
        groups = "" if r.get("group_min") is None else \
            f"{r['group_min']}-{r['group_max']} ({r['groups_empty']})"
        bad = "" if r.get("bad_rows_y") is None else f"{r['bad_rows_y']} / {r['bad_rows_dx']}"
        out.append(f"| {r['config']} | {r['tokens']} | {r['live_rows']} | {groups} | "
                   f"{r['option']} | {r['impl']} | {fmt(r['fwd_us'])} | {fmt(r['fwd_bwd_us'])} | "
                   f"{fmt(r['floor_us'], 2)} | {fmt(r['floor_fwd_bwd_us'], 2)} | "
                   f"{e(r['err'])} | {e(r.get('err_y'))} | {e(r.get('err_y_fb'))} | "
                   f"{e(r.get('err_dx'))} | {e(r.get('err_dw_in'))} | {e(r.get('err_dw_out'))} | "
                   f"{bad} | {e(r.get('bad_experts_y'))} | "
                   f"{r['error'].replace('|', '/')[:200]} |")
    specs = {}
    for r in rows:
        cfg = r.get("tokamax_config") or {}
        if "spec" in cfg and r["option"] not in specs:
            specs[r["option"]] = (f"{r['option']} = {cfg.get('full_spec', cfg.get('error'))}: "
                                  f"w_in {cfg.get('w_in', '-')[:120]}; "
                                  f"w_out {cfg.get('w_out', '-')[:120]}")
    if specs:
        out.append("\nKernel specs (every letter; per forward GEMM at the first shape, 'spec' "
                   "where tokamax's kernel took it; the Config: tokamax_config in gemm.json):")
        out += [f"- {text}" for text in specs.values()]
    for name, text in meta.get("shard_map", {}).items():
        out.append(f"\nunder shard_map, {name}: {text or 'matches'}")
    return "\n".join(out) + "\n"


def main():
    os.makedirs(ARGS.out, exist_ok=True)
    meta = device_meta()
    print(f"bench_gemm: {meta['device']}, jax {meta['jax']}, tokamax {meta['tokamax']} "
          f"{meta['tokamax_problem'] or ''}", flush=True)
    options = expand_options(ARGS.options)
    meta["options"] = options
    for o in options:
        option_fn(o)  # a bad name fails before any work
    rows, known_errors, shard_map = [], {}, {}
    for name in ARGS.configs.split(","):
        for tokens in (int(t) for t in ARGS.tokens.split(",")):
            try:
                case = Case(name, tokens, rows_factor=ARGS.packed_rows_factor)
            except Exception as e:  # noqa: BLE001
                rows += [dict(config=name, tokens=tokens, option=o, error=short(e), impl="",
                              fwd_us=None, fwd_bwd_us=None, floor_us=None, err=None,
                              floor_fwd_bwd_us=None, live_rows=None) for o in options]
                continue
            ref = None
            for option in ["einsum"] + [o for o in options if o != "einsum"]:
                row, out = bench_option(case, option, ref, known_errors)
                if option == "einsum":
                    ref = out
                if option in options:
                    rows.append(row)
                    print(f"{name:7s} {tokens:4d} {option:22s} fwd {fmt(row['fwd_us']):>9s} "
                          f"fwd+bwd {fmt(row['fwd_bwd_us']):>9s} "
                          f"floor {fmt(row['floor_us'], 2):>7s} err {row['err']} {row['impl']} "
                          f"{row['error'][:160]}", flush=True)
                if option not in shard_map and option != "ragged_dot_triton" \
                        and not option.startswith("tokamax_") and not row["error"]:
                    try:  # once per option, at the first shape
                        shard_map[option] = shard_map_check(option, case, ARGS.tol)
                    except Exception as e:  # noqa: BLE001
                        shard_map[option] = short(e)
                    row["shard_map"] = shard_map[option] or "ok"
            del case, ref
    meta["shard_map"] = shard_map
    meta["elapsed_s"] = round(time.perf_counter() - T0, 1)
    with open(os.path.join(ARGS.out, "gemm.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(ARGS.out, "gemm.md"), "w") as f:
        f.write(markdown(meta, rows))
    print(f"\n{'config':7s} {'tok':>4s} {'option':22s} {'fwd us':>9s} {'fwd+bwd':>9s} "
          f"{'floor':>7s} {'err':>8s}  impl / error")
    for r in rows:
        print(f"{r['config']:7s} {r['tokens']:4d} {r['option']:22s} {fmt(r['fwd_us']):>9s} "
              f"{fmt(r['fwd_bwd_us']):>9s} {fmt(r['floor_us'], 2):>7s} "
              f"{'' if r['err'] is None else r['err']:>8}  {r['impl']} {r['error'][:100]}")
    for o, text in shard_map.items():
        print(f"shard_map {o}: {text or 'ok'}")
    print(f"wrote {ARGS.out}/gemm.json, gemm.md in {meta['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
