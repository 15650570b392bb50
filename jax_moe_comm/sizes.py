"""NVSHMEM symmetric memory of a handle, known before anything is allocated.

    bytes = jax_moe_comm.symmetric_bytes(config, layout="packed", differentiable=True)
    env = jax_moe_comm.sizes.nvshmem_symmetric_size(
        jax_moe_comm.sizes.allocations(config, layout="packed", differentiable=True))

An `AllToAll` makes one native handle for its forward all-to-all and, when differentiable,
one or two for the backward (api.py: `AllToAll.__init__`); each native handle is one
`nvshmem_malloc` of `SymmetricLayout::carve`'s size (csrc/core/layout.h). `layout_bytes`
repeats that carve here, offset by offset; tests/test_flax_batches.py compiles the header
itself and compares the two for many shapes, so a change to the layout there fails a test
until this file follows.

The size does not depend on the layout or the capacity (expert_x and expert_y live in XLA
buffers, not in symmetric memory); the capacity only decides whether a differentiable handle
needs its third, worst-case backward handle. The reference backend allocates no symmetric
memory (its `AllToAll.symmetric_bytes` is 0): these are the CUDA backend's numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax.numpy as jnp

from .config import MoEConfig

# csrc/core/layout.h: every region of the buffer starts on a 128-byte boundary.
REGION_ALIGN = 128
# csrc/core/layout.h: kStartedKernels (the `started` words), the one heartbeat word, and
# kEntryHeaderBytes (a staged combine entry's header).
STARTED_KERNELS = 4
HEARTBEAT_WORDS = 1
ENTRY_HEADER_BYTES = 16

# Headroom of nvshmem_symmetric_size: NVSHMEM adds its own internal buffers on top of
# NVSHMEM_SYMMETRIC_SIZE, but its allocator rounds each nvshmem_malloc up and keeps a header per
# block inside it, and closing handles in another order than they were made fragments it.
# Each allocation is counted as a whole number of ALLOC_GRANULE plus one more, and the sum gets
# HEAP_SLACK on top (a rule with margin, not a measurement of the allocator).
ALLOC_GRANULE = 2 ** 16
HEAP_SLACK = 0.125
MIB = 2 ** 20


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def layout_bytes(config: MoEConfig, *, staged: bool = False) -> int:
    """Bytes of one native handle's symmetric buffer for `config`: SymmetricLayout::carve of
    csrc/core/layout.h. staged: some peer is not reachable by load/store (another node), so
    the handle also holds its staging buffers (send records, combine out/in)."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    G, m, k, W = (config.num_token_groups, config.max_num_tokens, config.experts_per_token,
                  config.world_size)
    H, L = config.hidden, config.num_local_experts
    # A token record: header (token index, k expert ids, k weights), the payload, the scales.
    record = (_round_up(4 * (1 + 2 * k), 16) + H * config.dispatch_dtype.itemsize +
              _round_up(4 * config.num_scales, 16))
    combine_row = H * config.combine_dtype.itemsize
    combine_cap = m * min(k, L)  # rows one rank returns to one home at most
    regions = [8 * 1, 8 * STARTED_KERNELS, 8 * HEARTBEAT_WORDS, 8 * G, 8 * W, 8 * m * k, 8 * W,
               8 * W, 8 * W, G * m * record, m * k * combine_row]
    if staged:
        entries = W * combine_cap * (ENTRY_HEADER_BYTES + combine_row)
        regions += [m * G * record, entries, entries]
    return sum(_round_up(r, REGION_ALIGN) for r in regions)


def handle_configs(config: MoEConfig, *, layout: str = "padded",
                   max_recv_rows: int | None = None, expert_capacity: int | None = None,
                   differentiable: bool = False) -> tuple[MoEConfig, ...]:
    """The configs of the native handles `AllToAll(config, layout=..., max_recv_rows=...,
    expert_capacity=..., differentiable=...)` creates, in creation order: the forward one;
    when differentiable, the backward one (bf16 dispatch, f32 combine) and, when
    token_replicas > 1 or the capacity is below the worst case, a second backward one with
    token_replicas 1 (its dy dispatch must drop nothing)."""
    from .api import LAYOUTS, _check_expert_capacity, _check_recv_rows

    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
    rows = _check_recv_rows(config, layout, max_recv_rows)
    capacity = _check_expert_capacity(config, layout, expert_capacity)
    out = [config]
    if differentiable:
        bwd = dataclasses.replace(config, dispatch_dtype=jnp.bfloat16,
                                  combine_dtype=jnp.float32)
        out.append(bwd)
        drops_nothing = (rows == config.max_recv_total if layout == "packed" else
                         capacity == config.max_recv_tokens)
        if config.token_replicas > 1 or not drops_nothing:
            out.append(dataclasses.replace(bwd, token_replicas=1))
    return tuple(out)


def allocations(config: MoEConfig, *, layout: str = "padded", max_recv_rows: int | None = None,
                expert_capacity: int | None = None, differentiable: bool = False,
                staged: bool = False) -> tuple[int, ...]:
    """Bytes of each nvshmem_malloc of that AllToAll, per rank, in creation order."""
    return tuple(layout_bytes(c, staged=staged) for c in handle_configs(
        config, layout=layout, max_recv_rows=max_recv_rows, expert_capacity=expert_capacity,
        differentiable=differentiable))


def symmetric_bytes(config: MoEConfig, *, layout: str = "padded",
                    max_recv_rows: int | None = None, expert_capacity: int | None = None,
                    differentiable: bool = False, staged: bool = False) -> int:
    """NVSHMEM symmetric bytes per rank that `AllToAll(config, layout=..., max_recv_rows=...,
    expert_capacity=..., differentiable=...)` allocates on the CUDA backend: what its
    `symmetric_bytes` reports once made, known before. The arguments are AllToAll's; staged:
    the ranks span nodes (a peer not reachable by load/store: staging buffers too)."""
    return sum(allocations(config, layout=layout, max_recv_rows=max_recv_rows,
                           expert_capacity=expert_capacity, differentiable=differentiable,
                           staged=staged))


def heap_bytes(sizes: Iterable[int]) -> int:
    """A NVSHMEM_SYMMETRIC_SIZE in bytes that holds nvshmem_mallocs of these sizes at once,
    with headroom (ALLOC_GRANULE, HEAP_SLACK), in whole MiB."""
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"allocation sizes must be >= 0, got {sizes}")
    held = sum(_round_up(s, ALLOC_GRANULE) + ALLOC_GRANULE for s in sizes if s)
    return _round_up(math.ceil(held * (1 + HEAP_SLACK)), MIB)


def nvshmem_symmetric_size(sizes: Iterable[int]) -> str:
    """heap_bytes(sizes) as the value of NVSHMEM_SYMMETRIC_SIZE, e.g. "1536M" (set it for every
    process before jax_moe_comm.init(); the launcher's default is 2G)."""
    return f"{heap_bytes(sizes) // MIB}M"
