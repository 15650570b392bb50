"""Flax NNX module: a MoE layer over the all-to-all (`pip install jax_moe_comm[flax]`).

    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    moe = jax_moe_comm.flax.MoE(num_experts=32, experts_per_token=4, hidden=256, ffn=512,
                                max_num_tokens=64, mesh=mesh, expert_axis="expert",
                                data_axes="data", rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x: m(x))(moe, x)          # x [B, S, 256] or [T, 256], global
    moe.close()

Inputs and outputs are global arrays: x [B, S, H] or [T, H], its tokens (B*S rows, batch-major)
sharded over the token axes, `data_axes` then `expert_axis` (a mesh axis or a tuple of them):
any B and S whose B*S divides over the token shards (B below their count too), on meshes of
Explicit or Auto axes; y comes back with x's shape (and on Explicit axes x's sharding).
The all-to-all runs along the expert axis; experts are sharded over it (rank r holds experts
[r*L, (r+1)*L)) and replicated over the data axes; router and shared experts are replicated.
On the nvshmem backend the expert axis must span every process (one GPU each): with a
("data", "expert") mesh there, pass expert_axis=("data", "expert") (DeepSeek's data-parallel
attention with expert parallelism over all GPUs).

Per rank, the layer is moe.moe_forward with the router of router.py: scores, (grouped) top-k,
expert bias, normalized weights; dispatch, SiLU or SiLU-gated MLP experts (as `expert_gemm`
says), combine, and the shared experts' two GEMMs while tokens are in flight (the first in the
dispatch flight, the second in the combine flight: moe.py's docstring). It trains under
nnx.jit/nnx.grad on both backends (handles are made differentiable unless told otherwise).

Handles are created outside any trace, never under nnx.eval_shape or jit: by the constructor
when it runs eagerly (`eager_handles=True`, default), else by `create_handles(model)` or on the
first eager call. Layers of equal handle_key share one handle per budget in this process
(`share_handles=True`, default: a 60-layer model holds one handle per budget, not 60); a
handle is closed when the last layer holding it is closed. Calls on one handle within one
traced function run in the order they were traced (each call's dispatch waits for the previous
call's output). `max_num_tokens` (per rank) may be several budgets, e.g. (512, 8) for prefill
and decode: a call uses the smallest that holds its tokens per rank (padding up to it).
`symmetric_bytes(model)` and `nvshmem_symmetric_size(model)` say what the handles will take
before any exists.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import router as rtr
from . import sizes
from .api import AllToAll, _current_trace, _under_trace
from .config import refuse_renamed
from .errors import ProtocolError
from .moe import (SHARED_EXPERT_RENAMED, MoELayerConfig, dense_experts_and_shared,
                  experts_and_shared, param_shapes)

EXPERT_PARAMS = ("w_in", "w_out")  # sharded over the expert axis along experts
LOGICAL_AXES = {"router": ("embed", None), "w_in": ("expert", "embed", "mlp"),
                "w_out": ("expert", "mlp", "embed"), "shared_in": ("embed", "mlp"),
                "shared_out": ("mlp", "embed"), "expert_bias": (None,)}


class ExpertBias(nnx.Variable):
    """Per-expert selection bias of the router (DeepSeek-V3's aux-loss-free balancing): not an
    nnx.Param, so optimizers over nnx.Param leave it alone; update it with update_bias."""


class MoEAux(NamedTuple):
    aux_loss: jax.Array  # [] f32: router.aux_loss_coef * load_balancing_loss (global)
    expert_load: jax.Array  # [E] f32: routed slots per expert over every rank


class Routing(NamedTuple):
    """MoE.routing: the router's view of each token."""

    indices: jax.Array  # [..., k] int32: the experts chosen
    scores: jax.Array  # [..., E] f32: the selection scores (scores + expert bias) top-k ranks
    margin: jax.Array  # [...] f32: router.selection_margin, in selection score


class _Handles:
    """The layer's AllToAll per token budget; a static attribute shared by identity between
    the copies of the module graph that nnx transforms make (so it also names the layer as a
    holder of its handles)."""

    def __init__(self):
        self.by_budget: dict[int, AllToAll] = {}


# The handles of this process that layers share (share_handles=True), by MoE.handle_key. Every
# process creates and closes the same handles in the same order (both are collective), so the
# pool holds the same keys on every process.
_POOL: dict[tuple, AllToAll] = {}
# Who holds each handle a layer uses, pooled or not: id(AllToAll) -> (it, the _Handles of the
# layers that hold it). A layer's close() drops it; the handle is closed with its last holder.
# Weak: a layer collected without close() stops holding (its handle stays open, as a handle
# nobody closes does, and the pool hands it to the next layer of its key).
_HOLDERS: dict[int, tuple[AllToAll, weakref.WeakSet]] = {}
# The latest call on each handle in the function being traced: handle -> (weak reference to
# that trace, the call's y as token rows, its token axes). The next call on the handle in the
# same trace orders its dispatch after that y (MoE._order).
_LAST_CALL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_closed(a2a: AllToAll) -> bool:
    return bool(getattr(a2a, "_closed", False))


def _hold(a2a: AllToAll, holder: _Handles) -> None:
    entry = _HOLDERS.setdefault(id(a2a), (a2a, weakref.WeakSet()))
    entry[1].add(holder)


def _release(a2a: AllToAll, holder: _Handles) -> None:
    """holder stops holding a2a; a2a is closed (collective) when nobody holds it."""
    entry = _HOLDERS.get(id(a2a))
    if entry is not None:
        entry[1].discard(holder)
        if len(entry[1]):
            return
        del _HOLDERS[id(a2a)]
    for key in [k for k, v in _POOL.items() if v is a2a]:
        del _POOL[key]
    a2a.close()


def pooled_handles() -> int:
    """How many open handles the layers of this process share (share_handles=True)."""
    for key in [k for k, v in _POOL.items() if _is_closed(v)]:
        del _POOL[key]
    return len(_POOL)


def _axes(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _spec_entry(axes: tuple[str, ...]):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


# N(0, 1/fan_in): of a [E, in, out] expert stack per expert, and of an [in, out] kernel.
EXPERT_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2,
                                                out_axis=-1, batch_axis=(0,))
KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


@functools.cache
def _maker(init, shape, dtype, sharding):
    """init(key, shape, dtype) compiled to make each shard where it lives (cached: a model of
    many equal layers compiles it once)."""
    return jax.jit(lambda key: init(key, shape, dtype), out_shardings=sharding)


@refuse_renamed(**SHARED_EXPERT_RENAMED)
class MoE(nnx.Module):
    """A MoE layer on `mesh` (module docstring). Arguments:

    num_experts E, experts_per_token k, hidden H, ffn F (per expert), max_num_tokens: tokens
      per rank, an int or several budgets.
    expert_axis: the mesh axis (or tuple of axes) of expert parallelism; `axis_name` is its
      old name (default "ep"). data_axes: mesh axes that shard the tokens too, experts
      replicated over them.
    num_shared_experts S (default 1; 0: none), shared_ffn SF (default F): replicated experts
      every token goes through, one MLP of width S*SF (shared_in [H, S*SF], shared_out
      [S*SF, H]).
    gated: SiLU-gated experts, shared ones too (DeepSeek's): w_in [E, H, 2F] with the gate in
      columns [0:F] and the up projection in [F:2F], shared_in [H, 2*S*SF] likewise (every gate
      column first); default False: SiLU MLPs, w_in [E, H, F].
    router: router.RouterConfig (softmax/sigmoid, groups, expert bias, aux loss).
    dtype: compute dtype of the MLPs and of y (tokens travel bf16, or fp8 with fp8_dispatch);
      param_dtype: of the parameters; the router runs in f32.
    expert_init, kernel_init (shared experts [in, out]), router_init: initializers (key,
      shape, dtype); the parameters carry their partition specs (nnx.with_partitioning,
      LOGICAL_AXES as `logical_axes` metadata), so nnx.eval_shape, sharded init and Orbax
      restore place them without creating the handle.
    backend, layout, differentiable, expert_gemm, fp8_dispatch: as AllToAll / MoELayerConfig.
    capacity_factor, overflow: as MoELayerConfig: each handle's capacity is capacity_factor
      times its budget's mean load under uniform routing: packed rows per rank
      (MoEConfig.recv_rows_for) with layout="packed", padded rows per local expert
      (MoEConfig.rows_per_expert_for, for the batched einsum) with layout="padded".
    gemm_row_buckets: as MoELayerConfig (layout="packed" only): the expert GEMMs run on the
      smallest of these row counts (capacity factors of each budget's mean load) that holds
      the live rows, picked on the device.
    eager_handles: create the handles now when not tracing (else: create_handles(model)).
    share_handles: True (default): take each budget's handle from the handles this process's
      layers share (one per handle_key: equal shape, mesh, axes, backend, layout, capacity),
      so a stack of equal layers allocates one handle per budget. False: this layer's own
      handles (for layers that run side by side with no data between them, whose cycles
      would otherwise be serialized on one handle, and whose backward passes XLA may overlap).
    """

    def __init__(self, *, num_experts: int, experts_per_token: int, hidden: int, ffn: int,
                 max_num_tokens: int | Sequence[int], mesh: jax.sharding.Mesh,
                 expert_axis: str | Sequence[str] | None = None,
                 data_axes: str | Sequence[str] = (), axis_name: str | None = None,
                 num_shared_experts: int = 1, shared_ffn: int | None = None,
                 gated: bool = False,
                 router: rtr.RouterConfig | None = None, dtype: Any = jnp.bfloat16,
                 param_dtype: Any = jnp.float32, expert_init=None, kernel_init=None,
                 router_init=None, fp8_dispatch: bool = False, backend: str = "auto",
                 layout: str = "packed", differentiable: bool = True,
                 expert_gemm: str = "auto", capacity_factor: float | None = None,
                 overflow: str = "fail", gemm_row_buckets: Sequence[float] = (),
                 eager_handles: bool = True, share_handles: bool = True, rngs: nnx.Rngs):
        self.mesh = mesh
        self.expert_axes, self.data_axes = self._check_axes(mesh, expert_axis, axis_name,
                                                            data_axes)
        budgets = (max_num_tokens,) if isinstance(max_num_tokens, (int, np.integer)) else \
            tuple(max_num_tokens)
        if not budgets or any(not isinstance(b, (int, np.integer)) or b < 1 for b in budgets):
            raise ValueError(f"max_num_tokens={max_num_tokens!r}: one or more positive ints "
                             "(tokens per rank of each handle)")
        self.budgets = tuple(sorted({int(b) for b in budgets}))
        self.router_cfg = router or rtr.RouterConfig()
        self.router_cfg.check(num_experts, experts_per_token)
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise TypeError(f"dtype={jnp.dtype(dtype).name}: bfloat16 or float32")
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.layer = MoELayerConfig(num_experts=num_experts, experts_per_token=experts_per_token,
                                    hidden=hidden, ffn=ffn, max_num_tokens=self.budgets[-1],
                                    num_shared_experts=num_shared_experts,
                                    shared_ffn=shared_ffn, gated=gated, fp8_dispatch=fp8_dispatch,
                                    expert_gemm=expert_gemm, capacity_factor=capacity_factor,
                                    overflow=overflow, gemm_row_buckets=gemm_row_buckets)
        if self.layer.gemm_row_buckets and layout != "packed":
            raise ValueError(f"gemm_row_buckets={self.layer.gemm_row_buckets} needs "
                             f"layout='packed' (got {layout!r}): buckets cut packed rows")
        self.ep = int(np.prod([mesh.shape[a] for a in self.expert_axes]))
        self.comm = self.layer.comm_config(self.ep)  # validates E % EP, H, k
        self.layer.handle_kwargs(self.ep, layout)  # validates the capacity for the layout
        self.backend_arg, self.layout, self.differentiable = backend, layout, differentiable
        if not isinstance(share_handles, bool):
            raise ValueError(f"share_handles={share_handles!r}: True (layers of equal shape "
                             "share one handle per budget) or False (this layer's own)")
        self.share_handles = share_handles
        self.handles = _Handles()

        shapes = param_shapes(self.layer)
        kernel_init = kernel_init or KERNEL_INIT
        router_init = router_init or kernel_init
        expert_init = expert_init or EXPERT_INIT
        self.router = self._param(rngs, "router", router_init, shapes["router"],
                                  jnp.float32)  # f32
        self.w_in = self._param(rngs, "w_in", expert_init, shapes["w_in"])
        self.w_out = self._param(rngs, "w_out", expert_init, shapes["w_out"])
        if self.layer.num_shared_experts:
            self.shared_in = self._param(rngs, "shared_in", kernel_init, shapes["shared_in"])
            self.shared_out = self._param(rngs, "shared_out", kernel_init, shapes["shared_out"])
        if self.router_cfg.expert_bias:
            zeros = _maker(_zeros, (num_experts,), jnp.dtype(jnp.float32),
                           NamedSharding(mesh, P()))
            self.expert_bias = ExpertBias(nnx.with_partitioning(
                lambda *_: zeros(jax.random.key(0)), (None,), mesh=mesh,
                logical_axes=LOGICAL_AXES["expert_bias"])(None))
        if eager_handles and not _under_trace():
            self.create_handles()

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def _check_axes(mesh, expert_axis, axis_name, data_axes):
        if expert_axis is not None and axis_name is not None and \
                _axes(expert_axis) != _axes(axis_name):
            raise ValueError(f"expert_axis={expert_axis!r} and axis_name={axis_name!r} "
                             "disagree; axis_name is the old name of expert_axis: pass one")
        name = "axis_name" if expert_axis is None else "expert_axis"
        expert = _axes(expert_axis if expert_axis is not None else (axis_name or "ep"))
        data = _axes(data_axes)
        for label, axes in ((name, expert), ("data_axes", data)):
            for a in axes:
                if a not in mesh.shape:
                    shown = axes[0] if len(axes) == 1 and label == name else axes
                    raise ValueError(
                        f"{label}={shown!r} is not an axis of the mesh, whose axes are "
                        f"{tuple(mesh.shape)}: pass {label}= " +
                        ("the expert-parallel one" if label == name else
                         "the mesh axes that shard the tokens besides the expert axis"))
        if not expert:
            raise ValueError(f"{name} names no mesh axis: give the expert-parallel axis")
        both = set(expert) & set(data)
        if both or len(set(expert)) < len(expert) or len(set(data)) < len(data):
            raise ValueError(f"expert_axis {expert} and data_axes {data} must name distinct "
                             f"mesh axes (repeated: {sorted(both) or 'within one'})")
        return expert, data

    def _spec(self, name: str) -> tuple:
        ep = _spec_entry(self.expert_axes)
        return {"router": (None, None), "w_in": (ep, None, None), "w_out": (ep, None, None),
                "shared_in": (None, None), "shared_out": (None, None)}[name]

    def _param(self, rngs, name, init, shape, dtype=None):
        """nnx.Param made where it lives (each process computes only its shards), with its
        partition spec (nnx.with_partitioning) and logical axes as metadata."""
        dtype = dtype or self.param_dtype
        spec = self._spec(name)
        sharding = NamedSharding(self.mesh, P(*spec))

        def make(key, shape, dtype):
            return _maker(init, tuple(shape), jnp.dtype(dtype), sharding)(key)

        return nnx.Param(nnx.with_partitioning(make, spec, mesh=self.mesh,
                                               logical_axes=LOGICAL_AXES[name])(
            rngs.params(), shape, dtype))

    # -- handles -----------------------------------------------------------------------------
    def handle_key(self, budget: int) -> tuple:
        """Layers with equal keys can share a handle (create_handles does)."""
        return (dataclasses.replace(self.comm, max_num_tokens=budget), self.expert_axes,
                self.mesh, self.backend_arg, self.differentiable,
                tuple(sorted(self._handle_kwargs(budget).items())))

    def _handle_kwargs(self, budget: int) -> dict:
        """AllToAll's layout arguments for the handle of `budget` tokens per rank (its
        capacity scales with the budget)."""
        layer = dataclasses.replace(self.layer, max_num_tokens=budget)
        return layer.handle_kwargs(self.ep, self.layout)

    def create_handles(self, shared: dict | None = None) -> None:
        """Create this layer's handles (collective: every process, same order; outside any
        trace): from the process's shared handles (share_handles=True), else its own.
        `shared`: {handle_key: AllToAll} to reuse and fill instead of the process's."""
        if _under_trace():
            raise ProtocolError(
                "the MoE layer's all-to-all handles cannot be created while JAX is tracing "
                "(jit, eval_shape, an nnx transform): call jax_moe_comm.flax.create_handles"
                "(model) once, outside, after building or restoring the model")
        self._check_device_order()
        for budget in self.budgets:
            if budget in self.handles.by_budget:
                continue
            key = self.handle_key(budget)
            pool = shared if shared is not None else (_POOL if self.share_handles else None)
            a2a = None if pool is None else pool.get(key)
            if a2a is None or _is_closed(a2a):
                a2a = AllToAll(key[0], axis_name=_spec_entry(self.expert_axes),
                               backend=self.backend_arg, differentiable=self.differentiable,
                               **self._handle_kwargs(budget))
                if pool is not None:
                    pool[key] = a2a
            _hold(a2a, self.handles)
            self.handles.by_budget[budget] = a2a

    def symmetric_allocations(self, *, staged: bool = False) -> dict[tuple, tuple[int, ...]]:
        """{handle_key: bytes of each nvshmem_malloc of that handle, per rank} for this layer's
        budgets on the CUDA backend (sizes.allocations), known before any handle exists (also
        on a model made under nnx.eval_shape). staged: the ranks span nodes."""
        out = {}
        for budget in self.budgets:
            kwargs = self._handle_kwargs(budget)
            out[self.handle_key(budget)] = sizes.allocations(
                dataclasses.replace(self.comm, max_num_tokens=budget), layout=kwargs["layout"],
                max_recv_rows=kwargs.get("max_recv_rows"),
                expert_capacity=kwargs.get("expert_capacity"),
                differentiable=self.differentiable, staged=staged)
        return out

    def _check_device_order(self):
        from .api import resolve_backend

        if resolve_backend(self.backend_arg, None) != "nvshmem":
            return
        if any(self.mesh.shape[a] > 1 for a in self.data_axes):
            raise ValueError(
                f"data_axes={self.data_axes} shard the tokens over more than the expert axis, "
                "but the nvshmem backend's all-to-all spans every process (one GPU each): pass "
                f"expert_axis={self.data_axes + self.expert_axes} (experts sharded over all "
                "of them), or backend='reference'")
        order = [self.mesh.axis_names.index(a) for a in self.expert_axes]
        rest = [i for i in range(self.mesh.devices.ndim) if i not in order]
        devices = np.transpose(self.mesh.devices, rest + order).reshape(-1)
        procs = [d.process_index for d in devices]
        if procs != sorted(procs):
            raise ValueError(
                f"the mesh puts expert-parallel rank r on process {procs}: the nvshmem backend "
                "needs rank r on process r. Build the mesh from jax.devices() in order, e.g. "
                "jax.sharding.Mesh(np.array(jax.devices()).reshape(...), names)")

    def handle(self, rows_per_rank: int | None = None) -> AllToAll:
        """The handle of the smallest budget >= rows_per_rank (default: the largest)."""
        budget = self._budget(rows_per_rank or self.budgets[-1])
        a2a = self.handles.by_budget.get(budget)
        if a2a is None:
            if _under_trace():
                raise ProtocolError(
                    "this MoE layer has no all-to-all handle yet (it was built under a trace: "
                    "nnx.eval_shape, a jitted init, or restored from a checkpoint). Call "
                    "jax_moe_comm.flax.create_handles(model) once, outside jit, before the "
                    "first jitted call (collective: every process, same order)")
            self.create_handles()
            a2a = self.handles.by_budget[budget]
        return a2a

    @property
    def a2a(self) -> AllToAll:
        """The handle of the largest budget (created on first use outside a trace)."""
        return self.handle()

    @property
    def config(self):
        """The all-to-all's MoEConfig at the largest budget (world_size, max_num_tokens...)."""
        return self.a2a.config

    @property
    def axis_name(self):
        return _spec_entry(self.expert_axes)

    def _budget(self, rows: int) -> int:
        for b in self.budgets:
            if rows <= b:
                return b
        raise ValueError(
            f"x has {rows} tokens per rank, more than the largest max_num_tokens="
            f"{self.budgets[-1]} of this layer (tokens per rank of its handles): pass "
            f"max_num_tokens={self.budgets[:-1] + (rows,)} or a smaller batch")

    def close(self) -> None:
        """Let go of this layer's handles (collective): each is closed once no layer holds it
        (a handle shared with other layers stays open for them)."""
        for a2a in self.handles.by_budget.values():
            _release(a2a, self.handles)
        self.handles.by_budget.clear()

    # -- parameters ----------------------------------------------------------------------------
    def _params(self) -> dict:
        """The parameters as the layer computes with them: router f32, the rest in dtype."""
        names = list(param_shapes(self.layer))
        out = {n: getattr(self, n)[...] for n in names}
        return {n: v.astype(jnp.float32 if n == "router" else self.dtype)
                for n, v in out.items()}

    def _bias(self):
        return self.expert_bias[...] if self.router_cfg.expert_bias else None

    def update_bias(self, expert_load, rate: float = 1e-3) -> None:
        """router.balance_bias on this layer's ExpertBias (aux-loss-free balancing)."""
        if not self.router_cfg.expert_bias:
            raise ValueError("this layer has no expert bias: RouterConfig(expert_bias=True)")
        self.expert_bias[...] = rtr.balance_bias(self.expert_bias[...], expert_load, rate)

    # -- the call ------------------------------------------------------------------------------
    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.data_axes + self.expert_axes

    @property
    def num_token_shards(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.token_axes]))

    def __call__(self, x, num_tokens=None, *, mask=None, return_aux: bool = False):
        """y like x: its shape ([B, S, H] or [T, H]), the module's `dtype`, and on a mesh of
        Explicit axes x's sharding (so `x + moe(x)` needs no reshard); on Auto axes the
        token layout (token_layout) where one exists, else XLA's choice.

        x: bfloat16 or float32 (tokens travel bf16: f32 is rounded to bf16, the layer's
          precision). float16, float64 and fp8 are refused (a TypeError naming the dtype):
          cast x first; f16 is not rounded to bf16 behind the caller's back.
        num_tokens: None (every token live), a scalar (the first num_tokens rows of x
          flattened to [T, H] are live), or [num_token_shards] int32 (live rows of each
          shard's block, counted from its start). Dead rows give zero rows. A Python or NumPy
          value outside [0, T] (scalar) or [0, T / num_token_shards] (per shard) raises
          ValueError; a traced one is clamped to that range.
        mask: optional bool [B, S] / [T]: tokens where it is False route nowhere (zero rows).
        return_aux: also return MoEAux: router.aux_loss_coef * the load-balancing loss and the
          expert load (routed slots per expert), over every token (a psum over the token
          axes: XLA's all-reduce). Add the loss to the training loss; feed the load to
          update_bias (expert_bias).
        """
        flat, lead = self._flatten(x)
        m = flat.shape[0] // self.num_token_shards
        a2a = self.handle(m)
        counts = self._counts(num_tokens, flat.shape[0], m)
        live_mask = self._mask(mask, lead)
        y, aux = self._shard_mapped(a2a, flat, counts, live_mask, return_aux)
        y = self._from_tokens(y, lead, x)
        return (y, aux) if return_aux else y

    # Token rows: x [B, S, H] or [T, H] flattened batch-major to [T, H], T/n rows per token
    # shard, shard i of the token axes holding rows [i*T/n, (i+1)*T/n).
    def token_layout(self, lead: tuple[int, ...]) -> tuple | None:
        """The partition spec of an array of leading shape `lead` ([B, S] or [T]) whose
        shards are exactly the token shards' blocks (no data moves to flatten it or back),
        or None when the mesh has none. [T]: the token axes. [B, S]: the token axes on B when
        they divide it; else the first i of them on B and the rest on S, when the first i
        multiply to B and the rest divide S (on data=2 x expert=4: B = 8k gives
        (("data", "expert"), None), B = 2 ("data", "expert"), B = 1 (None, ("data",
        "expert")); B = 4 has none, nor has B = 4 on one axis of 8)."""
        axes = self.token_axes
        if len(lead) == 1:
            return (_spec_entry(axes),)
        B, S = lead
        size = [self.mesh.shape[a] for a in axes]
        if B % int(np.prod(size)) == 0:
            return (_spec_entry(axes), None)
        for i in range(len(axes) - 1, -1, -1):
            if B == int(np.prod(size[:i])) and S % int(np.prod(size[i:])) == 0:
                return (_spec_entry(axes[:i]), _spec_entry(axes[i:]))
        return None

    def _explicit(self) -> bool:
        return any(str(t).endswith("Explicit") for t in getattr(self.mesh, "axis_types", ()))

    def _type_spec(self, a) -> tuple | None:
        """a's partition spec from its type (one entry per dimension) on a mesh of Explicit
        axes, or None: Auto axes (the type carries no sharding) or an array on no mesh."""
        if not self._explicit():
            return None
        sharding = getattr(jax.typeof(a), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or getattr(mesh, "empty", False) or not getattr(mesh, "shape", None):
            return None
        spec = tuple(sharding.spec)
        return spec + (None,) * (a.ndim - len(spec))

    def _to_tokens(self, a, trailing: tuple[int, ...]):
        """a [*lead, *trailing] as token rows [T, *trailing] sharded over the token axes. On
        Explicit axes a reshape that names its output sharding (XLA moves rows between
        devices where a's layout is not the token layout: B below the token shards, or x
        replicated); on Auto axes a reshape and a sharding constraint."""
        a = jnp.asarray(a)
        T = int(np.prod(a.shape[:a.ndim - len(trailing)]))
        rows = NamedSharding(self.mesh, P(_spec_entry(self.token_axes),
                                          *([None] * len(trailing))))
        if self._type_spec(a) is not None:
            return jax.lax.reshape(a, (T,) + trailing, out_sharding=rows)
        return _place(a.reshape((T,) + trailing), rows)

    def _from_tokens(self, a, lead: tuple[int, ...], like=None):
        """Token rows a [T, *trailing] back to [*lead, *trailing], laid out as `like` (the
        caller's x) is on Explicit axes; else in token_layout(lead) where it exists (on
        Explicit axes replicated where it does not; on Auto axes left to XLA)."""
        trailing = tuple(a.shape[1:])
        shape = tuple(lead) + trailing
        spec = None if like is None else self._type_spec(like)
        if spec is not None:
            spec = spec[:len(lead)] + (None,) * len(trailing)
        else:
            natural = self.token_layout(tuple(lead))
            if natural is not None:
                spec = natural + (None,) * len(trailing)
            elif self._explicit():
                spec = (None,) * len(shape)
        if spec is None:
            return a.reshape(shape)
        out = NamedSharding(self.mesh, P(*spec))
        if self._explicit():
            return jax.lax.reshape(a, shape, out_sharding=out)
        return jax.lax.with_sharding_constraint(a.reshape(shape), out)

    def _flatten(self, x):
        H = self.layer.hidden
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) not in (2, 3) or shape[-1] != H:
            raise ValueError(f"x has shape {shape}; expected [B, S, {H}] or [T, {H}] (hidden="
                             f"{H}), a global array")
        check_x_dtype(x)
        lead = shape[:-1]
        T = int(np.prod(lead))
        n = self.num_token_shards
        if T % n:
            axes = " x ".join(f"{a}={self.mesh.shape[a]}" for a in self.token_axes)
            raise ValueError(f"x has {T} tokens ({' x '.join(map(str, lead))}), not a multiple "
                             f"of the {n} token shards (mesh axes {axes}): pad the batch to a "
                             f"multiple of {n} tokens")
        return self._to_tokens(x, (H,)), lead

    def _counts(self, num_tokens, T: int, m: int):
        """[num_token_shards] int32 live rows per shard."""
        n = self.num_token_shards
        rows = NamedSharding(self.mesh, P(_spec_entry(self.token_axes)))
        if num_tokens is None:
            return _place(jnp.full((n,), m, jnp.int32), rows)
        shape = tuple(getattr(num_tokens, "shape", np.shape(num_tokens)))
        per_shard = shape == (n,)  # (1,) on one shard: its count, the scalar's too
        if not per_shard and shape not in ((), (1,)):
            raise ValueError(
                f"num_tokens has shape {shape}; expected None (every token live), a scalar "
                f"(the first num_tokens of the {T} rows of x are live) or [{n}] int32: live "
                f"rows per token shard (mesh axes {self.token_axes})")
        check_num_tokens(num_tokens, T if not per_shard else m,
                         "per token shard" if per_shard else "of x")
        if not per_shard:
            total = jnp.asarray(num_tokens, jnp.int32).reshape(())
            start = jnp.arange(n, dtype=jnp.int32) * m
            return _place(jnp.clip(total - start, 0, m).astype(jnp.int32), rows)
        # A traced count outside [0, m] acts as its nearest end: the body's live rows are
        # arange(m) < count.
        return _place(jnp.asarray(num_tokens, jnp.int32), rows)

    def _mask(self, mask, lead):
        T = int(np.prod(lead))
        if mask is None:
            return _place(jnp.ones((T,), bool),
                          NamedSharding(self.mesh, P(_spec_entry(self.token_axes))))
        if tuple(getattr(mask, "shape", ())) != lead:
            raise ValueError(f"mask has shape {tuple(getattr(mask, 'shape', ()))}; expected "
                             f"{lead}, one bool per token of x")
        return self._to_tokens(jnp.asarray(mask, bool), ())

    def _order(self, a2a):
        """The y (token rows) of the latest call on a2a in the function being traced, if its
        token axes are this call's, else None. This call's dispatch waits for it: cycles on
        one handle must not overlap (the kernels refuse a second one in flight), and XLA
        orders work by data only, so layers with no data between them would race."""
        last = _LAST_CALL.get(a2a)
        if last is None:
            return None
        ref, y, axes = last
        trace = ref()
        if trace is None or trace is not _current_trace() or \
                not getattr(trace, "is_valid", lambda: True)() or axes != self.token_axes:
            return None
        return jax.lax.stop_gradient(y)  # an order, not a value: no cotangent flows back

    def _shard_mapped(self, a2a, x, counts, mask, want_aux: bool):
        tok = P(_spec_entry(self.token_axes))
        params = self._params()
        specs = {n: P(*self._spec(n)) for n in params}
        bias = self._bias()
        if bias is None:
            bias = jnp.zeros((self.layer.num_experts,), jnp.float32)
        token_axes, cfg, k = self.token_axes, self.router_cfg, self.layer.experts_per_token
        after = self._order(a2a)
        before = () if after is None else (after,)

        def body(p, x, n, mask, bias, *before):
            m, budget = x.shape[0], a2a.config.max_num_tokens
            if before and before[0].shape[0]:  # the previous call on this handle first
                n = _after(n, before[0], m)
            live = (jnp.arange(m) < n.reshape(())) & mask
            xb = x.astype(jnp.bfloat16)
            if budget > m:  # the smallest handle that holds m rows: pad up to it
                xb = jnp.pad(xb, ((0, budget - m), (0, 0)))
            lv = jnp.pad(live, (0, budget - m))
            y, stats = layer_forward(a2a, self.layer, cfg, p, xb, lv, bias)
            y = y[:m].astype(self.dtype)
            if not want_aux:
                return y, None
            stats = jax.lax.psum(rtr.LoadStats(*(s.astype(jnp.float32) for s in stats)),
                                 token_axes)
            loss = cfg.aux_loss_coef * rtr.load_balancing_loss(stats, k)
            return y, MoEAux(loss, stats.slots)

        aux_spec = MoEAux(P(), P()) if want_aux else None
        in_specs = (specs, tok, tok, tok, P()) + (tok,) * len(before)
        y, aux = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                               out_specs=(tok, aux_spec))(params, x, counts, mask, bias,
                                                          *before)
        if _under_trace():
            _LAST_CALL[a2a] = (weakref.ref(_current_trace()), y, self.token_axes)
        return y, aux

    def dense(self, x, num_tokens=None, *, mask=None, params=None):
        """The same layer with every expert applied densely and no all-to-all (the oracle):
        on global arrays under XLA's partitioner, or, with `params` (full values, e.g. from
        gather_params), on whatever device x is on. x, num_tokens and mask as for a call."""
        if params is None:
            flat, lead = self._flatten(x)
        else:
            check_x_dtype(x)
            flat, lead = jnp.asarray(x).reshape(-1, self.layer.hidden), tuple(x.shape[:-1])
        p, bias = self._params_and_bias(params)
        T = flat.shape[0]
        live = jnp.ones((T,), bool)
        if num_tokens is not None:
            shape = tuple(getattr(num_tokens, "shape", np.shape(num_tokens)))
            if shape in ((), (1,)):
                check_num_tokens(num_tokens, T, "of x")
                live = jnp.arange(T) < jnp.asarray(num_tokens).reshape(())
            else:
                m = T // shape[0]
                check_num_tokens(num_tokens, m, "per token shard")
                live = (jnp.arange(T) % m) < jnp.repeat(jnp.asarray(num_tokens), m)
        if mask is not None:
            live = live & (self._to_tokens(jnp.asarray(mask, bool), ()) if params is None
                           else jnp.asarray(mask, bool).reshape(-1))

        def forward(p, flat, live, bias):
            return dense_layer_forward(self.layer, self.router_cfg, p,
                                       flat.astype(jnp.bfloat16), live, bias)[0]

        if params is not None:
            return forward(p, flat, live, bias).astype(self.dtype).reshape(
                lead + (self.layer.hidden,))
        if self._explicit():  # indexing experts sharded over the mesh: XLA's partitioner's
            forward = jax.sharding.auto_axes(forward, out_sharding=NamedSharding(
                self.mesh, P(_spec_entry(self.token_axes))))
        return self._from_tokens(forward(p, flat, live, bias).astype(self.dtype), lead, x)

    def routing(self, x, *, params=None) -> Routing:
        """The router's view of x [B, S, H] or [T, H], as the layer and `dense` route it: the
        experts chosen for each token, the selection scores they were chosen by, and how far
        that choice is from changing (router.selection_margin). With `params` (full values, as
        for `dense`), on whatever device x is on.

        For checks against another implementation of the layer: where the two implementations'
        selection scores for a token differ by more than its margin, they may route it to other
        experts (a near-tie), and its output then differs by O(1)."""
        if params is None:
            flat, lead = self._flatten(x)
        else:
            check_x_dtype(x)
            flat, lead = jnp.asarray(x).reshape(-1, self.layer.hidden), tuple(x.shape[:-1])
        p, bias = self._params_and_bias(params)
        k = self.layer.experts_per_token
        logits = _router_logits(flat.astype(jnp.bfloat16), p["router"])
        select = rtr.scores(self.router_cfg, logits)
        if bias is not None:
            select = select + jnp.asarray(bias, jnp.float32)[None, :]
        out = (rtr.route(self.router_cfg, logits, k, bias).indices, select,
               rtr.selection_margin(self.router_cfg, logits, k, bias))
        if params is not None:
            return Routing(*(a.reshape(lead + a.shape[1:]) for a in out))
        return Routing(*(self._from_tokens(a, lead, x) for a in out))

    def _params_and_bias(self, params):
        """(the parameters as the layer computes with them, the expert bias or None): this
        layer's, or `params` (full values, on x's device) with its "expert_bias" if any."""
        p = dict(params if params is not None else self._params())
        bias = p.pop("expert_bias", None)
        if bias is None and self.router_cfg.expert_bias:
            bias = self._bias()
            if params is not None:  # a local copy, on x's device (the bias is replicated)
                bias = np.asarray(bias if bias.is_fully_addressable else
                                  bias.addressable_data(0))
        p = {n: jnp.asarray(v).astype(jnp.float32 if n == "router" else self.dtype)
             for n, v in p.items()}
        return p, bias


def _after(n, y_prev, m: int):
    """n (this rank's live-row count, [1] int32) computed from y_prev's data, so that what
    uses it (routing, dispatch_send) runs after y_prev exists: min(n, m + isnan(y0)) acts as
    n does (live rows are arange(m) < n), and XLA cannot fold a float's y0 != y0 (NaN). A
    data edge, not an order_after barrier: XLA:CPU compiled that barrier away, and the
    reference backend's protocol check then saw two side-by-side layers' cycles overlap."""
    y0 = y_prev[0, 0]
    return jnp.minimum(n, m + (y0 != y0).astype(n.dtype))


# -- what a call accepts -------------------------------------------------------------------------
X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_x_dtype(x) -> None:
    """TypeError unless x is bfloat16 or float32: tokens travel bf16, and f32 rounds to it as
    the layer's stated precision; float16 (3 more mantissa bits, less range), float64 and
    fp8 would change silently, and integers are not tokens."""
    dtype = jnp.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    if dtype in X_DTYPES:
        return
    kind = "a floating dtype the layer does not take" if jnp.issubdtype(
        dtype, jnp.floating) else "not a floating dtype"
    raise TypeError(f"x has dtype {dtype.name}, {kind}: the MoE layer takes bfloat16 or "
                    "float32 tokens (they travel as bf16). Cast x first, e.g. "
                    "x.astype(jnp.bfloat16); float16 is not rounded to bf16 silently")


def check_num_tokens(num_tokens, most: int, what: str) -> None:
    """TypeError for a num_tokens that is not integral; ValueError for a concrete (Python or
    NumPy) one outside [0, most]. A jax.Array's values (traced, or on a device) are not read
    here: the caller clamps them."""
    dtype = jnp.dtype(num_tokens.dtype if hasattr(num_tokens, "dtype") else
                      np.asarray(num_tokens).dtype)
    if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"num_tokens has dtype {dtype.name}; expected int32 counts of live "
                        "rows")
    if isinstance(num_tokens, jax.Array):
        return
    value = np.asarray(num_tokens)
    if value.size and (value.min() < 0 or value.max() > most):
        raise ValueError(f"num_tokens={value.tolist()} is outside [0, {most}] (live rows "
                         f"{what}): pass a count of rows that exist")


# -- the layer, per rank -------------------------------------------------------------------------
def _router_logits(x, router):
    """[m, E] f32 router logits of x [m, H] (bf16 in the layer): an f32 matmul at full
    precision."""
    return jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)


def route_tokens(layer: MoELayerConfig, cfg: rtr.RouterConfig, router, x, live, bias=None):
    """(router.Routed with dead rows' indices -1, LoadStats) of x [m, H] per rank."""
    logits = _router_logits(x, router)
    routed = rtr.route(cfg, logits, layer.experts_per_token, bias)
    indices = jnp.where(live[:, None], routed.indices, -1)
    return routed._replace(indices=indices), rtr.load_stats(routed, live)


def layer_forward(a2a: AllToAll, layer: MoELayerConfig, cfg: rtr.RouterConfig, params, x,
                  live, bias=None):
    """Per rank, inside shard_map: x [max_m, H] bf16, live [max_m] bool -> (y [max_m, H] bf16,
    LoadStats). Dead rows route nowhere and give zero rows (padding need not come last)."""
    routed, stats = route_tokens(layer, cfg, params["router"], x, live, bias)
    # rows up to the last live one go (dead ones route nowhere); the rest are not read
    n = jnp.max(jnp.where(live, jnp.arange(1, x.shape[0] + 1), 0)).astype(jnp.int32)
    y = experts_and_shared(a2a, layer, params, x, routed.indices, routed.weights, n)
    return jnp.where(live[:, None], y, 0.0).astype(jnp.bfloat16), stats


def dense_layer_forward(layer: MoELayerConfig, cfg: rtr.RouterConfig, params, x, live,
                        bias=None):
    """layer_forward on one device with every expert applied densely (the oracle)."""
    routed, stats = route_tokens(layer, cfg, params["router"], x, live, bias)
    y = dense_experts_and_shared(layer, params, x, routed.indices, routed.weights)
    return jnp.where(live[:, None], y, 0.0).astype(jnp.bfloat16), stats


# -- a model's MoE layers ------------------------------------------------------------------------
def moe_layers(model) -> list[MoE]:
    """Every MoE module in `model`'s graph, in graph order."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, MoE)]


def create_handles(model) -> int:
    """Create the handles of every MoE layer of `model` that has none (collective: every
    process, same order; outside any trace): the layers of equal handle_key share one per
    budget (with share_handles=False, a layer gets its own). Returns how many handles the
    model uses."""
    for layer in moe_layers(model):
        layer.create_handles()
    return len({id(a) for layer in moe_layers(model) for a in layer.handles.by_budget.values()})


def close_handles(model) -> None:
    """Let go of every handle of `model`'s MoE layers (collective): each is closed once no
    layer holds it (layers of another model sharing a handle keep it open)."""
    for layer in moe_layers(model):
        layer.close()


def check_handles(model) -> None:
    """AllToAll.check() of every handle of `model` (a decode loop calls it every few steps)."""
    seen = {}
    for layer in moe_layers(model):
        for a2a in layer.handles.by_budget.values():
            seen[id(a2a)] = a2a
    for a2a in seen.values():
        a2a.check()


def symmetric_allocations(model, *, staged: bool = False) -> list[int]:
    """Bytes per rank of every nvshmem_malloc `model`'s handles make on the CUDA backend, as
    create_handles(model) would make them (one handle per handle_key where layers share,
    one per layer where they do not), before any exists."""
    shared: dict[tuple, tuple[int, ...]] = {}
    own: list[int] = []
    for layer in moe_layers(model):
        for key, allocs in layer.symmetric_allocations(staged=staged).items():
            if layer.share_handles:
                shared.setdefault(key, allocs)
            else:
                own.extend(allocs)
    return [b for allocs in shared.values() for b in allocs] + own


def symmetric_bytes(model, *, staged: bool = False) -> int:
    """NVSHMEM symmetric bytes per rank that `model`'s handles take on the CUDA backend (the
    sum of their AllToAll.symmetric_bytes once made), known before any exists. staged: the
    ranks span nodes."""
    return sum(symmetric_allocations(model, staged=staged))


def nvshmem_symmetric_size(model, *, staged: bool = False) -> str:
    """The NVSHMEM_SYMMETRIC_SIZE to set for `model`'s handles, with headroom
    (sizes.nvshmem_symmetric_size), e.g. "96M"; add what else the process allocates."""
    return sizes.nvshmem_symmetric_size(symmetric_allocations(model, staged=staged))


def _place(x, sharding: NamedSharding):
    """x laid out as shard_map's in_specs expect: a no-op when it already is; on a mesh of
    Explicit axes (jax.make_mesh's default) a reshard, else a sharding constraint."""
    current = getattr(jax.typeof(x), "sharding", None)
    if current is not None and getattr(current, "spec", None) == sharding.spec:
        return x
    explicit = any(str(t).endswith("Explicit") for t in getattr(sharding.mesh, "axis_types", ()))
    if explicit and hasattr(jax, "reshard"):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
