"""Layer shape of one MoE all-to-all: what every handle and every op is sized from."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

# fp8 block scales cover this many hidden elements each (DeepSeek's 1x128 tiles).
SCALE_BLOCK = 128
# Every token row travels as whole 16-byte vectors.
ROW_ALIGN_BYTES = 16
# recv_rows_for and rows_per_expert_for round a capacity up to a multiple of this many rows
# (whole GEMM tiles).
RECV_ROWS_ALIGN = 8

DISPATCH_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)
COMBINE_DTYPES = (jnp.bfloat16, jnp.float32)


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _check_dtype(name: str, dtype: Any, allowed: tuple) -> Any:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}={dtype!r} is not a dtype") from e
    if dt not in [np.dtype(a) for a in allowed]:
        names = ", ".join(_dtype_name(a) for a in allowed)
        raise TypeError(f"{name}={dt.name} is not supported; expected one of: {names}")
    return dt


def check_capacity_factor(capacity_factor) -> float:
    """capacity_factor as a float, or a ValueError: it must be finite and > 0."""
    if isinstance(capacity_factor, bool) or not isinstance(
            capacity_factor, (int, float, np.integer, np.floating)) or \
            not math.isfinite(capacity_factor) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0 "
                         "(1.0: rows for the mean load under uniform routing)")
    return float(capacity_factor)


def refuse_renamed(**renamed):
    """Class decorator: a keyword argument in `renamed` (old name -> what to pass now) raises a
    TypeError saying what replaced it, instead of Python's bare "unexpected keyword"."""
    def wrap(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            for old, new in renamed.items():
                if old in kwargs:
                    raise TypeError(f"{cls.__name__}({old}=...) is gone: pass {new}")
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls
    return wrap


# MoEConfig and MoELayerConfig: one name for ranks holding the same tokens.
DP_SIZE_RENAMED = {"dp_size": "token_replicas (pplx-kernels' dp_size: how many consecutive "
                              "ranks hold the same tokens)"}


@refuse_renamed(**DP_SIZE_RENAMED)
@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Static shape of one expert-parallel all-to-all.

    num_experts: E, experts over all ranks.
    experts_per_token: k, router slots per token.
    hidden: H, elements per token row.
    max_num_tokens: max_m, tokens *per rank* (the static row count of each rank's x; the
        global x along the expert-parallel axis has world_size * max_m rows).
    world_size: EP, ranks along the expert-parallel axis.
    token_replicas: how many consecutive ranks of the axis hold the *same* tokens (e.g. the
        tensor-parallel ranks of one model replica). 1, the usual case, means every rank holds
        its own tokens, as the ranks of a JAX data-parallel axis do. With R > 1, ranks
        [g*R, (g+1)*R) hold identical x/indices/weights, split the sending between them and
        all receive the combined y. (pplx-kernels calls this dp_size.)
    dispatch_dtype: bf16, or float8_e4m3fn with f32 block scales [max_m, H/128].
    combine_dtype: dtype of expert_y (bf16 or f32); y is always bf16.
    """

    num_experts: int
    experts_per_token: int
    hidden: int
    max_num_tokens: int
    world_size: int
    token_replicas: int = 1
    dispatch_dtype: Any = jnp.bfloat16
    combine_dtype: Any = jnp.bfloat16

    def __post_init__(self):
        for name in ("num_experts", "experts_per_token", "hidden", "max_num_tokens",
                     "world_size", "token_replicas"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        object.__setattr__(self, "dispatch_dtype",
                           _check_dtype("dispatch_dtype", self.dispatch_dtype, DISPATCH_DTYPES))
        object.__setattr__(self, "combine_dtype",
                           _check_dtype("combine_dtype", self.combine_dtype, COMBINE_DTYPES))
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}")
        if self.num_experts % self.world_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the "
                             f"{self.world_size} ranks of the expert-parallel axis")
        if self.world_size % self.token_replicas:
            raise ValueError(f"world_size={self.world_size} is not divisible by "
                             f"token_replicas={self.token_replicas} (ranks holding the same "
                             "tokens come in whole groups)")
        row_bytes = self.hidden * self.dispatch_dtype.itemsize
        if row_bytes % ROW_ALIGN_BYTES:
            raise ValueError(f"hidden={self.hidden} gives {row_bytes}-byte "
                             f"{self.dispatch_dtype.name} rows; rows must be a multiple of "
                             f"{ROW_ALIGN_BYTES} bytes")
        out_row_bytes = self.hidden * self.combine_dtype.itemsize
        if out_row_bytes % ROW_ALIGN_BYTES:
            raise ValueError(f"hidden={self.hidden} gives {out_row_bytes}-byte "
                             f"{self.combine_dtype.name} rows; rows must be a multiple of "
                             f"{ROW_ALIGN_BYTES} bytes")
        if self.is_fp8 and self.hidden % SCALE_BLOCK:
            raise ValueError(f"hidden={self.hidden} is not a multiple of the fp8 scale block "
                             f"({SCALE_BLOCK})")

    @property
    def is_fp8(self) -> bool:
        return self.dispatch_dtype == np.dtype(jnp.float8_e4m3fn)

    @property
    def num_local_experts(self) -> int:
        """L = E / EP experts held by each rank."""
        return self.num_experts // self.world_size

    @property
    def num_token_groups(self) -> int:
        """Groups of ranks with distinct tokens: world_size / token_replicas."""
        return self.world_size // self.token_replicas

    @property
    def max_recv_tokens(self) -> int:
        """Rows per local expert: each token group sends a token at most once per expert."""
        return self.max_num_tokens * self.num_token_groups

    @property
    def max_recv_total(self) -> int:
        """Rows of the packed layout: a token brings at most min(k, L) rows to one rank."""
        return self.max_recv_tokens * min(self.experts_per_token, self.num_local_experts)

    @property
    def expected_recv_rows(self) -> int:
        """Rows a rank receives on average when routing is uniform: every token group's
        max_m tokens times k slots, spread over the world_size ranks. The unit of a capacity
        factor (recv_rows_for)."""
        slots = self.num_token_groups * self.max_num_tokens * self.experts_per_token
        return -(-slots // self.world_size)

    def recv_rows_for(self, capacity_factor: float) -> int:
        """Packed rows per rank for a capacity factor (AllToAll(max_recv_rows=...)):
        capacity_factor * expected_recv_rows, rounded up to a multiple of 8, at most
        max_recv_total (the worst case, where nothing can overflow). 1.0 holds exactly the
        mean load; real routing is skewed, so leave headroom (e.g. 1.25-2)."""
        rows = math.ceil(check_capacity_factor(capacity_factor) * self.expected_recv_rows)
        return min(self.max_recv_total, -(-rows // RECV_ROWS_ALIGN) * RECV_ROWS_ALIGN)

    @property
    def expected_rows_per_expert(self) -> int:
        """Rows one expert receives on average when routing is uniform: every token group's
        max_m tokens times k slots, spread over the num_experts experts. The unit of a
        per-expert capacity factor (rows_per_expert_for)."""
        slots = self.num_token_groups * self.max_num_tokens * self.experts_per_token
        return -(-slots // self.num_experts)

    def rows_per_expert_for(self, capacity_factor: float) -> int:
        """Padded rows per local expert for a capacity factor (AllToAll(expert_capacity=...),
        GShard's expert capacity): capacity_factor * expected_rows_per_expert, rounded up to a
        multiple of 8, at most max_recv_tokens (the worst case, where nothing can overflow).
        expert_x is then [L, this, H] instead of [L, max_recv_tokens, H]; leave headroom for
        skewed routing (e.g. 1.25-2)."""
        rows = math.ceil(check_capacity_factor(capacity_factor) * self.expected_rows_per_expert)
        return min(self.max_recv_tokens, -(-rows // RECV_ROWS_ALIGN) * RECV_ROWS_ALIGN)

    @property
    def num_scales(self) -> int:
        """f32 block scales per token row (0 for bf16 dispatch)."""
        return math.ceil(self.hidden / SCALE_BLOCK) if self.is_fp8 else 0


TRANSPORTS = ("auto", "staged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTuning:
    """Launch shape of the CUDA kernels. DEFAULT: one full wave of this process's SM share."""

    num_blocks: int = 0  # 0: derive from the SM count the process sees
    warps_per_block: int = 16
    # How tokens reach peers. "auto": load/store where NVSHMEM maps the peer's memory (one
    # node), staged puts and signals through NVSHMEM's transport otherwise (another node).
    # "staged": every peer outside this rank's emulated node of `node_size` consecutive ranks
    # is sent to exactly as a peer on another node would be (staging buffers, puts, fences,
    # signals), even where load/store would work: the multi-node path, run on one node.
    # node_size=1: every other rank staged; world // 2: two emulated nodes. Agreed across
    # ranks at creation; the environment's JMC_TRANSPORT (staged, staged:<node_size>) applies
    # where this says "auto".
    transport: str = "auto"
    node_size: int = 1

    def __post_init__(self):
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 0 (0 = auto)")
        if not 2 <= self.warps_per_block <= 16:  # the kernels' __launch_bounds__: 512 threads
            raise ValueError(f"warps_per_block={self.warps_per_block} must be in [2, 16]")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}; expected one of {TRANSPORTS}")
        if self.node_size < 1:
            raise ValueError(f"node_size={self.node_size} must be >= 1")
        if self.node_size > 1 and self.transport != "staged":
            raise ValueError(f"node_size={self.node_size} emulates nodes for "
                             "transport='staged' only; with 'auto' NVSHMEM decides per peer")


KernelTuning.DEFAULT = KernelTuning()
