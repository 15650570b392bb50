"""A MoE layer over the all-to-all: router, top-k, dispatch, expert MLPs, combine.

The shared expert runs between dispatch_send and dispatch_recv, so on the nvshmem backend it
overlaps the tokens' flight. Expert weights are sharded over the EP axis (rank r holds experts
[r*L, (r+1)*L)); router and shared expert are replicated. The experts' two GEMMs run as
MoELayerConfig.expert_gemm says (expert_gemm.py: "auto", the fastest measured on the platform,
or "einsum", "ragged_dot", "tokamax", "masked"), on the handle's layout ("packed" or "padded").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import expert_gemm as gemm
from . import quant
from .api import LAYOUTS, OVERFLOWS, AllToAll, order_after
from .config import MoEConfig, check_capacity_factor

# The fp8 block quantization now lives in quant.py (dispatch quantizes bf16 x itself).
FP8_MAX = quant.FP8_MAX
quantize_fp8, dequantize_fp8 = quant.quantize, quant.dequantize


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoELayerConfig:
    num_experts: int = 32
    experts_per_token: int = 4
    hidden: int = 256
    ffn: int = 512
    max_num_tokens: int = 32  # per rank
    shared_expert: bool = True
    fp8_dispatch: bool = False
    dp_size: int = 1  # ranks per DP group (they hold the same tokens)
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

    def comm_config(self, world_size: int) -> MoEConfig:
        return MoEConfig(num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                         hidden=self.hidden, max_num_tokens=self.max_num_tokens,
                         world_size=world_size, dp_size=self.dp_size,
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


def init_params(cfg: MoELayerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Full (unsharded) parameters as numpy, the same on every process for one seed."""
    rng = np.random.default_rng(seed)
    H, F, E = cfg.hidden, cfg.ffn, cfg.num_experts
    p = {
        "router": (rng.standard_normal((H, E)) / np.sqrt(H)).astype(np.float32),
        "w_in": (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(jnp.bfloat16),
        "w_out": (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(jnp.bfloat16),
    }
    if cfg.shared_expert:
        p["shared_in"] = (rng.standard_normal((H, F)) / np.sqrt(H)).astype(jnp.bfloat16)
        p["shared_out"] = (rng.standard_normal((F, H)) / np.sqrt(F)).astype(jnp.bfloat16)
    return p


def route(router, x, k, drop=None):
    """Top-k experts per token and their softmax weights (f32); slots where the optional
    bool mask `drop` [m, k] is set get expert -1 (unused), as a capacity limit would do."""
    logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
    top, idx = jax.lax.top_k(logits, k)
    idx = idx.astype(jnp.int32)
    if drop is not None:
        idx = jnp.where(drop, -1, idx)
    return idx, jax.nn.softmax(top, axis=-1)


def mlp(x, w_in, w_out):
    h = jax.nn.silu(jnp.dot(x, w_in, preferred_element_type=jnp.float32))
    return jnp.dot(h.astype(jnp.bfloat16), w_out, preferred_element_type=jnp.float32)


def experts_forward(a2a: AllToAll, params, out, expert_gemm: str = "auto",
                    row_buckets: tuple[float, ...] = ()):
    """This rank's experts on dispatch's output: expert_y in the handle's layout and combine
    dtype. `params["w_in"]` [L, H, F], `params["w_out"]` [L, F, H] (this rank's slice).
    expert_gemm: how the GEMMs run (expert_gemm.OPTIONS). row_buckets: packed layout only,
    capacity factors of the GEMMs' row buckets (MoELayerConfig.gemm_row_buckets)."""
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
                           mean_rows=cfg.expected_rows_per_expert)


def moe_forward(a2a: AllToAll, cfg: MoELayerConfig, params, x, num_tokens, drop=None,
                route_x=None):
    """Per rank, inside shard_map: x [max_m, H] bf16 -> y [max_m, H] bf16.

    Differentiable (jax.grad) on a differentiable handle; with fp8 dispatch, x goes to the
    handle in bf16 and is quantized there (gradient straight through the quantization).
    route_x: the tensor the router reads (default x).
    """
    indices, weights = route(params["router"], x if route_x is None else route_x,
                             cfg.experts_per_token, drop)
    pending = a2a.dispatch_send(x, indices, num_tokens)
    shared = mlp(x, params["shared_in"], params["shared_out"]) if cfg.shared_expert else None
    if shared is not None:  # the shared expert runs while the tokens are on the wire
        # only the state is tied: tying the gradient rule's inputs too would copy x
        pending = pending._replace(state=order_after(pending.state, shared))
    out = a2a.dispatch_recv(pending)
    expert_y = experts_forward(a2a, params, out, cfg.expert_gemm, cfg.gemm_row_buckets)
    y = a2a.combine(expert_y, out.routing, indices, weights, num_tokens)
    if shared is not None:
        y = (y.astype(jnp.float32) + shared).astype(jnp.bfloat16)
    rows = jnp.arange(cfg.max_num_tokens)[:, None] < num_tokens
    return jnp.where(rows, y, 0)


def dense_forward(cfg: MoELayerConfig, params, x, num_tokens, drop=None, route_x=None):
    """The same layer on one device, every expert applied densely: the oracle of the demo
    (values and, with fp8 dispatch through quant.fake_quantize, gradients)."""
    indices, weights = route(params["router"], x if route_x is None else route_x,
                             cfg.experts_per_token, drop)
    xe = quant.fake_quantize(x) if cfg.fp8_dispatch else x

    def add_expert(e, y):
        w = jnp.sum(jnp.where(indices == e, weights, 0.0), axis=-1, keepdims=True)
        ye = mlp(xe, params["w_in"][e], params["w_out"][e]).astype(jnp.bfloat16)
        return y + w * ye.astype(jnp.float32)

    y = jax.lax.fori_loop(0, cfg.num_experts, add_expert,
                          jnp.zeros(x.shape, jnp.float32))
    if cfg.shared_expert:
        y = y + mlp(x, params["shared_in"], params["shared_out"])
    y = y.astype(jnp.bfloat16)
    rows = jnp.arange(x.shape[0])[:, None] < num_tokens
    return jnp.where(rows, y, 0)
