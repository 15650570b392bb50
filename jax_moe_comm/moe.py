"""A MoE layer over the all-to-all: router, top-k, dispatch, expert MLPs, combine, and the
shared experts.

Expert weights are sharded over the EP axis (rank r holds experts [r*L, (r+1)*L)); router and
shared experts are replicated. The experts are SiLU MLPs, y = silu(x @ w_in[e]) @ w_out[e], or
with MoELayerConfig.gated SiLU-gated ones (DeepSeek's): w_in[e] [H, 2F], columns [0:F] the gate
and [F:2F] the up projection, y = (silu(x @ gate) * (x @ up)) @ w_out[e] (activation.py; f32
accumulation, the hidden rounded to bf16, each expert's output rounded to bf16 before the
router-weighted f32 sum). The experts' two GEMMs run as MoELayerConfig.expert_gemm says
(expert_gemm.py: "auto", the fastest measured on the platform, or "einsum", "ragged_dot",
"tokamax", "masked"), on the handle's layout ("packed" or "padded").

Shared experts in the two flights. num_shared_experts S of width shared_ffn SF are one MLP of
width W = S * SF (shared_in [H, W], gated [H, 2W] with every gate column first; shared_out
[W, H]); every token goes through it and its output is added to combine's. It depends on x
alone, so it runs while tokens are on the wire, split over both windows:

    dispatch_send -> h = act(x @ shared_in)   -> dispatch_recv -> experts
    combine_send  -> s = h @ shared_out       -> combine_recv  -> y = combine + s

Each window's work depends only on x (h on x, s on h), never on the flight it overlaps; the
order_after ties (data edges XLA keeps) put it there. On the nvshmem backend a recv waits for
the slowest peer's rows; work placed between a send and its recv runs in that wait, so each
window hides up to its own GEMM's time: min(first GEMM, dispatch wait) + min(second GEMM,
combine wait), where the whole MLP in the dispatch window alone hid at most the dispatch
wait. The split is by GEMM, not by shared expert or hidden column: a slice of a weight is a
copy of it every step (at decode, where a GEMM reads each weight once, that doubles its
bytes), and one MLP of width W is two launches however many experts it holds (R1's single
shared expert could not be split by expert at all). Not gated, the two windows carry the same
FLOPs and weight bytes; gated, the first carries twice the second. The price: combine as two
launches instead of its fused one (~1.5 us, one kernel boundary on an H100, issue 23), so with
num_shared_experts=0 the layer calls the fused combine. Predicted gain, per layer at decode
sizes (H100, weights read at ~3.35 TB/s): R1 (H 7168, one gated shared expert of 2048: 88 MB)
~26 us of shared GEMMs, probably longer than the dispatch wait of a 1-token cycle (the whole
data-moving cycle is ~38 us, docs/performance.md), so up to the second GEMM's ~9 us moves into
the combine wait; V2-Lite (H 2048, two gated of 1408: 35 MB, ~10 us) gains only where its
~7 us first GEMM already fills the dispatch wait. To be measured on the GPU (bench_layer). On the reference backend the ties
are optimization barriers: the same values, no overlap.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import activation as act
from . import expert_gemm as gemm
from . import quant
from .api import LAYOUTS, OVERFLOWS, AllToAll, order_after
from .config import DP_SIZE_RENAMED, MoEConfig, check_capacity_factor, refuse_renamed

# The fp8 block quantization now lives in quant.py (dispatch quantizes bf16 x itself).
FP8_MAX = quant.FP8_MAX
quantize_fp8, dequantize_fp8 = quant.quantize, quant.dequantize
f32, bf16 = jnp.float32, jnp.bfloat16


SHARED_EXPERT_RENAMED = dict(shared_expert="num_shared_experts=1 (was True) or 0 (was False)")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@refuse_renamed(**SHARED_EXPERT_RENAMED, **DP_SIZE_RENAMED)
@dataclasses.dataclass(frozen=True, kw_only=True)
class MoELayerConfig:
    num_experts: int = 32
    experts_per_token: int = 4
    hidden: int = 256
    ffn: int = 512
    max_num_tokens: int = 32  # per rank
    # Shared experts: every token goes through them (one MLP of width num_shared_experts *
    # shared_ffn; shared_ffn None: ffn). DeepSeek-V2-Lite has 2, R1 1; 0: none.
    num_shared_experts: int = 1
    shared_ffn: int | None = None
    # SiLU-gated experts, shared ones too (DeepSeek's): w_in [E, H, 2F], gate columns [0:F],
    # up [F:2F]; False: y = silu(x @ w_in) @ w_out, w_in [E, H, F].
    gated: bool = False
    fp8_dispatch: bool = False
    token_replicas: int = 1  # consecutive ranks holding the same tokens (MoEConfig's)
    # how the expert MLPs' GEMMs run: expert_gemm.OPTIONS ("auto": fastest on the platform)
    expert_gemm: str = "auto"
    # The handle's capacity as a multiple of the mean load under uniform routing: packed rows
    # per rank (MoEConfig.recv_rows_for -> max_recv_rows) or padded rows per local expert
    # (MoEConfig.rows_per_expert_for -> expert_capacity); None: the worst case, nothing
    # drops. overflow: AllToAll's, for the rows past that capacity ("fail": check() raises;
    # "drop": their slots add nothing to y).
    capacity_factor: float | None = None
    overflow: str = "fail"
    # Packed layout: run the expert GEMMs on the smallest static prefix of the buffer's rows
    # that holds every live row, picked on the device from these sizes, each a multiple of the
    # mean load like capacity_factor (e.g. (1.25, 2.0); expert_gemm.bucketed_mlp). A GEMM's grid
    # is sized by its static rows, so a worst-case buffer otherwise pays for its idle tiles.
    # () runs every row; so does "auto" where it means the einsum (CPU). On a GPU it needs
    # CONDITIONAL in XLA's command buffers to avoid a host wait per layer (docs/knobs.md).
    # For inference: under jax.grad every bucket's saved values are kept (bucketed_mlp).
    # Measured slower than no buckets on an H100 (2026-12-06, docs/knobs.md): off by default.
    gemm_row_buckets: tuple[float, ...] = ()

    def __post_init__(self):
        gemm.check_option(self.expert_gemm)
        n, sf = self.num_shared_experts, self.shared_ffn
        if not _is_int(n) or n < 0:
            raise ValueError(f"num_shared_experts={n!r}: how many shared experts, an int >= 0 "
                             "(DeepSeek-V2-Lite 2, R1 1; 0 for none)")
        if sf is not None and (not _is_int(sf) or sf < 1):
            raise ValueError(f"shared_ffn={sf!r}: the hidden width of one shared expert, an int "
                             f">= 1, or None for ffn={self.ffn}")
        if not isinstance(self.gated, (bool, np.bool_)):
            raise ValueError(f"gated={self.gated!r}: True (SiLU-gated MLPs, w_in [E, H, 2F]) or "
                             "False (SiLU MLPs, w_in [E, H, F])")
        object.__setattr__(self, "num_shared_experts", int(n))
        object.__setattr__(self, "shared_ffn", None if sf is None else int(sf))
        object.__setattr__(self, "gated", bool(self.gated))
        if self.capacity_factor is not None:
            check_capacity_factor(self.capacity_factor)
        buckets = self.gemm_row_buckets
        if not isinstance(buckets, (tuple, list)):
            raise ValueError(f"gemm_row_buckets={buckets!r}: a tuple of capacity factors, e.g. "
                             "(1.25, 2.0), or () for none")
        for f in buckets:
            try:
                check_capacity_factor(f)
            except ValueError as e:
                raise ValueError(f"gemm_row_buckets={tuple(buckets)}: {e}") from None
        if buckets and self.expert_gemm == "einsum":
            raise ValueError(f"gemm_row_buckets={tuple(buckets)} with expert_gemm='einsum': "
                             "the einsum runs padded rows; buckets cut packed ones (tokamax, "
                             "ragged_dot, masked, or auto)")
        object.__setattr__(self, "gemm_row_buckets", tuple(float(f) for f in buckets))
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"overflow={self.overflow!r}; expected one of {OVERFLOWS}")

    @property
    def shared_width(self) -> int:
        """W, the shared experts' hidden width as one MLP: num_shared_experts * shared_ffn
        (shared_ffn None: ffn); 0 without shared experts."""
        return self.num_shared_experts * (self.shared_ffn or self.ffn)

    def comm_config(self, world_size: int) -> MoEConfig:
        return MoEConfig(num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                         hidden=self.hidden, max_num_tokens=self.max_num_tokens,
                         world_size=world_size, token_replicas=self.token_replicas,
                         dispatch_dtype=jnp.float8_e4m3fn if self.fp8_dispatch else jnp.bfloat16)

    def handle_kwargs(self, world_size: int, layout: str) -> dict:
        """AllToAll keyword arguments for this layer on world_size ranks in `layout`: the
        layout, and the capacity of capacity_factor (packed: max_recv_rows =
        recv_rows_for(f); padded: expert_capacity = rows_per_expert_for(f)) with its overflow
        policy. AllToAll(cfg.comm_config(world), **cfg.handle_kwargs(world, layout), ...)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
        kwargs = dict(layout=layout, overflow=self.overflow)
        if self.capacity_factor is not None:
            comm = self.comm_config(world_size)
            if layout == "packed":
                kwargs["max_recv_rows"] = comm.recv_rows_for(self.capacity_factor)
            else:
                kwargs["expert_capacity"] = comm.rows_per_expert_for(self.capacity_factor)
        return kwargs


def param_shapes(cfg: MoELayerConfig) -> dict[str, tuple[int, ...]]:
    """The full (unsharded) shape of each parameter: router [H, E] (f32), w_in [E, H, N],
    w_out [E, F, H], and with shared experts shared_in [H, NW], shared_out [W, H] (bf16);
    N = 2F and NW = 2W when gated (gate columns first, then up), else F and W;
    W = cfg.shared_width."""
    H, F, E, W = cfg.hidden, cfg.ffn, cfg.num_experts, cfg.shared_width
    shapes = {"router": (H, E), "w_in": (E, H, act.in_width(F, cfg.gated)), "w_out": (E, F, H)}
    if W:
        shapes.update(shared_in=(H, act.in_width(W, cfg.gated)), shared_out=(W, H))
    return shapes


def init_params(cfg: MoELayerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Full (unsharded) parameters as numpy (param_shapes), the same on every process for one
    seed: N(0, 1/fan_in), the router f32, the rest bf16."""
    rng = np.random.default_rng(seed)
    p = {}
    for name, shape in param_shapes(cfg).items():
        w = rng.standard_normal(shape) / np.sqrt(shape[-2])
        p[name] = w.astype(np.float32 if name == "router" else jnp.bfloat16)
    return p


def check_params(cfg: MoELayerConfig, params, local_experts: int | None = None) -> None:
    """A ValueError naming the parameter whose shape does not fit cfg (param_shapes; with
    local_experts, the expert weights of one rank: [local_experts, ...])."""
    want = param_shapes(cfg)
    if cfg.num_shared_experts and not {"shared_in", "shared_out"} <= set(params):
        raise ValueError(f"num_shared_experts={cfg.num_shared_experts} but the parameters have "
                         "no shared_in / shared_out (init_params(cfg) makes them; "
                         "num_shared_experts=0 for none)")
    for name, shape in want.items():
        got = tuple(jnp.shape(params[name]))
        if local_experts is not None and name in ("w_in", "w_out"):
            shape = (local_experts,) + shape[1:]
        if got != shape:
            raise ValueError(
                f"params[{name!r}] has shape {list(got)}; expected {list(shape)} for "
                f"hidden={cfg.hidden}, ffn={cfg.ffn}, num_shared_experts="
                f"{cfg.num_shared_experts}, shared_ffn={cfg.shared_ffn}, gated={cfg.gated}"
                + (" (gated: w_in's last axis is 2F, gate then up)" if cfg.gated else ""))


def route(router, x, k, drop=None):
    """Top-k experts per token and their softmax weights (f32); slots where the optional
    bool mask `drop` [m, k] is set get expert -1 (unused), as a capacity limit would do."""
    logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
    top, idx = jax.lax.top_k(logits, k)
    idx = idx.astype(jnp.int32)
    if drop is not None:
        idx = jnp.where(drop, -1, idx)
    return idx, jax.nn.softmax(top, axis=-1)


def mlp_hidden(x, w_in, gated: bool = False):
    """An MLP's first half: h = act(x @ w_in) [m, F] bf16 (f32 accumulation; activation.py:
    w_in [H, F], or gated [H, 2F])."""
    pre = jnp.dot(x, w_in, preferred_element_type=f32)
    return act.hidden(pre, gated).astype(bf16)


def mlp_output(h, w_out):
    """An MLP's second half: h [m, F] bf16 @ w_out [F, H] -> [m, H] f32."""
    return jnp.dot(h, w_out, preferred_element_type=f32)


def mlp(x, w_in, w_out, gated: bool = False):
    """y = act(x @ w_in) @ w_out [m, H] f32, the hidden rounded to bf16."""
    act.check_weights(w_in, w_out, gated)
    return mlp_output(mlp_hidden(x, w_in, gated), w_out)


def experts_forward(a2a: AllToAll, params, out, expert_gemm: str = "auto",
                    row_buckets: tuple[float, ...] = (), *, gated: bool = False):
    """This rank's experts on dispatch's output: expert_y in the handle's layout and combine
    dtype. `params["w_in"]` [L, H, F] (gated: [L, H, 2F], gate columns [0:F], up [F:2F]),
    `params["w_out"]` [L, F, H] (this rank's slice). expert_gemm: how the GEMMs run
    (expert_gemm.OPTIONS). row_buckets: packed layout only, capacity factors of the GEMMs' row
    buckets (MoELayerConfig.gemm_row_buckets)."""
    ex = out.expert_x
    if out.expert_x_scale is not None:
        ex = dequantize_fp8(ex, out.expert_x_scale).astype(jnp.bfloat16)
    cfg = a2a.config
    # The other layout's size, for an option that converts: the most rows that can be live.
    if ex.ndim == 3:  # padded [L, P, H]: P = expert_capacity rows per expert
        rows_per_expert = ex.shape[1]
        total_rows = min(cfg.max_recv_total, cfg.num_local_experts * rows_per_expert)
    else:  # packed [C, H]: one expert holds at most min(C, max_recv_tokens) of them
        total_rows = ex.shape[0]
        rows_per_expert = min(total_rows, cfg.max_recv_tokens)
    if row_buckets and ex.ndim == 3:
        raise ValueError(f"gemm_row_buckets={tuple(row_buckets)} applies to the packed layout; "
                         "this handle's layout is padded (its expert_capacity sizes the rows)")
    return gemm.expert_mlp(ex, out.expert_num_tokens, params["w_in"], params["w_out"],
                           expert_gemm, out_dtype=cfg.combine_dtype,
                           rows_per_expert=rows_per_expert, total_rows=total_rows,
                           grad_window=gemm.grad_window_for(
                               rows_per_expert, cfg.num_local_experts,
                               mean_rows=cfg.expected_rows_per_expert),
                           row_buckets=tuple(cfg.recv_rows_for(f) for f in row_buckets),
                           mean_rows=cfg.expected_rows_per_expert, gated=gated)


def experts_and_shared(a2a: AllToAll, cfg: MoELayerConfig, params, x, indices, weights,
                       num_tokens):
    """Per rank, inside shard_map, from the routing on: dispatch, the experts, combine, and
    the shared experts in the two flights (module docstring) -> y [max_m, H] f32, combine's
    bf16 sum plus the shared output. Rows >= num_tokens are not defined here (callers zero
    them)."""
    check_params(cfg, params, a2a.config.num_local_experts)
    pending = a2a.dispatch_send(x, indices, num_tokens)
    h = None
    if cfg.num_shared_experts:  # the dispatch window: the first GEMM and the activation
        with jax.named_scope("jax_moe_comm.shared_experts_in"):
            h = mlp_hidden(x, params["shared_in"], cfg.gated)
        # only the state is tied: tying the gradient rule's inputs too would copy x
        pending = pending._replace(state=order_after(pending.state, h))
    out = a2a.dispatch_recv(pending)
    with jax.named_scope("jax_moe_comm.experts"):
        expert_y = experts_forward(a2a, params, out, cfg.expert_gemm, cfg.gemm_row_buckets,
                                   gated=cfg.gated)
    if h is None:  # nothing to overlap: the fused combine (one launch at decode sizes)
        return a2a.combine(expert_y, out.routing, indices, weights, num_tokens).astype(f32)
    sent = a2a.combine_send(expert_y, out.routing)
    # The combine window: the second GEMM. Its input is tied after combine_send, or nothing
    # would order it after the send (XLA could run it in the dispatch window, or before the
    # send, delaying the rows); the recv's state is tied after its output.
    with jax.named_scope("jax_moe_comm.shared_experts_out"):
        s = mlp_output(order_after(h, sent.state), params["shared_out"])
    sent = sent._replace(state=order_after(sent.state, s))
    y = a2a.combine_recv(sent, indices, weights, num_tokens)
    return y.astype(f32) + s


def dense_experts_and_shared(cfg: MoELayerConfig, params, x, indices, weights):
    """experts_and_shared on one device with every expert applied densely (the oracles'):
    each expert's output rounded to bf16, their router-weighted f32 sum rounded to bf16 (as
    combine returns it), plus the shared experts' f32 output -> [m, H] f32. x: the tokens the
    shared experts read; the routed experts read them fake-quantized under fp8_dispatch."""
    check_params(cfg, params)
    xe = quant.fake_quantize(x) if cfg.fp8_dispatch else x

    def add_expert(e, y):
        w = jnp.sum(jnp.where(indices == e, weights, 0.0), axis=-1, keepdims=True)
        ye = mlp(xe, params["w_in"][e], params["w_out"][e], cfg.gated).astype(bf16)
        return y + w * ye.astype(f32)

    y = jax.lax.fori_loop(0, cfg.num_experts, add_expert, jnp.zeros(x.shape, f32))
    y = y.astype(bf16).astype(f32)  # combine's bf16 output
    if cfg.num_shared_experts:
        y = y + mlp(x, params["shared_in"], params["shared_out"], cfg.gated)
    return y


def moe_forward(a2a: AllToAll, cfg: MoELayerConfig, params, x, num_tokens, drop=None,
                route_x=None):
    """Per rank, inside shard_map: x [max_m, H] bf16 -> y [max_m, H] bf16.

    params: this rank's (param_shapes, expert weights [L, ...]). The shared experts run in the
    dispatch and combine flights (module docstring). Differentiable (jax.grad) on a
    differentiable handle; with fp8 dispatch, x goes to the handle in bf16 and is quantized
    there (gradient straight through the quantization). route_x: the tensor the router reads
    (default x).
    """
    with jax.named_scope("jax_moe_comm.router"):
        indices, weights = route(params["router"], x if route_x is None else route_x,
                                 cfg.experts_per_token, drop)
    y = experts_and_shared(a2a, cfg, params, x, indices, weights, num_tokens)
    rows = jnp.arange(cfg.max_num_tokens)[:, None] < num_tokens
    return jnp.where(rows, y, 0).astype(bf16)


def dense_forward(cfg: MoELayerConfig, params, x, num_tokens, drop=None, route_x=None):
    """The same layer on one device, every expert applied densely: the oracle of the demo
    (values and, with fp8 dispatch through quant.fake_quantize, gradients)."""
    indices, weights = route(params["router"], x if route_x is None else route_x,
                             cfg.experts_per_token, drop)
    y = dense_experts_and_shared(cfg, params, x, indices, weights).astype(bf16)
    rows = jnp.arange(x.shape[0])[:, None] < num_tokens
    return jnp.where(rows, y, 0)
