"""The two row layouts of a dispatch's output, converted into each other.

padded: [L, R, ...], local expert e's rows at [e, :counts[e]], zero past them (R rows per
expert); packed: [total, ...], expert 0's live rows, then expert 1's, ..., zero past
sum(counts). The backends write either layout themselves; these convert for code that computes
on the other one (expert_gemm.py, the benchmarks).
"""

from __future__ import annotations

import jax.numpy as jnp


def _packed_rows(counts, total: int, rows_per_expert: int):
    """For packed rows i < total: (local expert, row within it, live)."""
    counts = jnp.minimum(counts, rows_per_expert)
    ends = jnp.cumsum(counts)
    i = jnp.arange(total, dtype=ends.dtype)
    expert = jnp.searchsorted(ends, i, side="right")  # == L past the last live row
    last = counts.shape[0] - 1
    row = i - (ends - counts)[jnp.minimum(expert, last)]
    return expert, row, i < ends[-1]


def pack_rows(padded, counts, total: int):
    """[L, R, ...] rows (r < counts[e] live) -> [total, ...]: expert 0's live rows, then expert
    1's, ...; rows >= sum(counts) are zero."""
    L, R = padded.shape[:2]
    expert, row, live = _packed_rows(counts, total, R)
    rows = padded[jnp.minimum(expert, L - 1), jnp.clip(row, 0, R - 1)]
    live = live.reshape(live.shape + (1,) * (rows.ndim - 1))
    return jnp.where(live, rows, jnp.zeros((), rows.dtype))


def unpack_rows(packed, counts, rows_per_expert: int):
    """The inverse of pack_rows: [total, ...] -> [L, R, ...], zero past each expert's count."""
    L, R = counts.shape[0], rows_per_expert
    expert, row, _ = _packed_rows(counts, packed.shape[0], R)
    out = jnp.zeros_like(packed, shape=(L, R) + packed.shape[1:])  # varying like packed
    return out.at[expert, row].set(packed, mode="drop")  # expert == L: past the live rows
