"""The expert MLP on packed rows with its backward written out (issue 24).

tokamax's grouped GEMM computes the forward right on the H200, but the VJP tokamax ships with it
gave weight gradients 0.45-0.73 wrong at 768-1024 packed rows (bench_gemm, 2026-12-05, tokamax
0.0.17: d x right, d w_in and d w_out wrong; right at <= 128 rows in all, the largest measured
right being 96), and it refuses shard_map's varying manual axes. Here the MLP's VJP is ours:

- d h and d x: the same forward grouped GEMM on the transposed weights (tokamax's forward
  kernel, the part measured right); d pre from d h by activation.hidden_vjp (SiLU, or the
  SiLU-gated activation: w_in [L, H, 2F], gate columns [0:F], up [F:2F]);
- d w_in and d w_out ("weight gradients": for every expert e, a_e^T @ b_e over its rows) through
  XLA's batched GEMM on a window of `window` rows per expert (one cuBLAS call over L * window
  rows): an expert with more rows than the window takes a loop over window-sized chunks instead
  (lax.cond on the largest group; correct for any routing, slower when it is skewed; on a GPU
  the cond's predicate may cost a device-to-host read per weight: measure before relying on
  it inside a recorded graph).
  wgrad="kernel" uses the grouped GEMM's own ragged-contracting dot instead (to measure it;
  tokamax's is wrong past 128 rows), "kernel_aligned" the same on groups re-laid to start at
  multiples of 128 rows (no control flow; whether that avoids tokamax's fault is to measure).

`grouped_ragged_dot` is any function with jax.lax.ragged_dot_general's signature (lhs, rhs,
group_sizes, ragged_dot_dimension_numbers, preferred_element_type): XLA's, or tokamax's.
Rows past sum(group_sizes) are read as zero and get zero gradient. The output cotangent is
rounded to bf16 before the GEMMs (the weights' dtype), also when out_dtype is f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import activation as act

f32, bf16 = jnp.float32, jnp.bfloat16

# lhs [T, K] ragged in T, rhs [L, K, N]: out[rows of e] = lhs[rows of e] @ rhs[e]
ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# the same with rhs [L, N, K] read transposed (d x from the forward weights, no copy of ours)
ROWS_TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# lhs [T, K], rhs [T, N], contracting the ragged T: out [L, K, N] (the weight gradient)
CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])

WGRAD = ("windows", "kernel", "kernel_aligned")
# "kernel_aligned": every group's rows start at a multiple of this (tokamax's k-block on sm90),
# so no k-block of the ragged-contracting kernel holds two groups' rows.
ALIGN_ROWS = 128


def xla_ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                           preferred_element_type=None):
    """jax.lax.ragged_dot_general (XLA's lowering), in the signature grouped_mlp takes."""
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                                      preferred_element_type=preferred_element_type)


def _group_starts(group_sizes):
    return jnp.cumsum(group_sizes) - group_sizes


def _zeros_like_both(a, b, shape, dtype):
    """Zeros varying over the manual axes a or b vary over (a loop carry under shard_map must
    start with the type its body returns); zeros_like keeps them, jnp.zeros does not."""
    return jnp.zeros_like(a, dtype, shape=shape) + jnp.zeros_like(b, dtype, shape=shape)


def _windows(a, group_sizes, starts, window, offset):
    """a's rows [starts[e] + offset, + window) of every expert e, zero past its group: [L, W, K].
    `where`, not a product: rows past the live ones are undefined (NaN must not leak)."""
    r = offset + jnp.arange(window)
    keep = r[None, :] < group_sizes[:, None]
    rows = jnp.clip(starts[:, None] + r[None, :], 0, a.shape[0] - 1)
    return jnp.where(keep[..., None], a[rows], jnp.zeros((), a.dtype))


def weight_grad_windows(a, b, group_sizes, window: int, out_dtype=bf16):
    """[L, K, N]: a_e^T @ b_e over every expert e's rows (a [T, K], b [T, N], packed by
    group_sizes [L]). One batched GEMM over `window` rows per expert when no group is longer;
    else a loop over the experts and their window-sized chunks (f32 accumulator of one expert)."""
    gs = group_sizes.astype(jnp.int32)
    starts = _group_starts(gs)
    L, K, N = gs.shape[0], a.shape[1], b.shape[1]

    def batched(_):
        aw, bw = _windows(a, gs, starts, window, 0), _windows(b, gs, starts, window, 0)
        # Straight to out_dtype (f32 accumulation inside the GEMM either way): an f32 result
        # then a cast would write and read L*K*N*4 bytes more (1.9 GB per weight at R1).
        return jnp.einsum("lwk,lwn->lkn", aw, bw, preferred_element_type=out_dtype)

    def chunked(_):
        def expert(e, out):
            def chunk(c, acc):  # rows [c * window, + window) of expert e alone
                ac, bc = (_windows(v, gs[e][None], starts[e][None], window, c * window)[0]
                          for v in (a, b))
                return acc + jnp.einsum("wk,wn->kn", ac, bc, preferred_element_type=f32)

            chunks = (gs[e] + window - 1) // window
            acc = jax.lax.fori_loop(0, chunks, chunk, _zeros_like_both(a, b, (K, N), f32))
            return out.at[e].set(acc.astype(out_dtype))

        return jax.lax.fori_loop(0, L, expert, _zeros_like_both(a, b, (L, K, N), out_dtype))

    return jax.lax.cond(jnp.max(gs) <= window, batched, chunked, None)


def align_groups(a, group_sizes, align: int = ALIGN_ROWS):
    """a's rows [T, K] regrouped so that group e starts at a multiple of `align` (zero rows
    between groups): ([T + L * (align - 1) rounded up to align, K], the aligned group sizes).
    Static shapes, no control flow."""
    gs = group_sizes.astype(jnp.int32)
    L = gs.shape[0]
    rows = -(-(a.shape[0] + L * (align - 1)) // align) * align
    sizes = -(-gs // align) * align
    ends = jnp.cumsum(sizes)
    i = jnp.arange(rows, dtype=jnp.int32)
    e = jnp.minimum(jnp.searchsorted(ends, i, side="right"), L - 1).astype(jnp.int32)
    within = i - (ends - sizes)[e]
    keep = (within < gs[e]) & (i < ends[-1])
    src = jnp.clip(_group_starts(gs)[e] + within, 0, a.shape[0] - 1)
    return jnp.where(keep[:, None], a[src], jnp.zeros((), a.dtype)), sizes


def _weight_grad(a, b, gs, dot, window, wgrad, out_dtype):
    if wgrad == "kernel_aligned":  # the grouped GEMM's own kernel on block-aligned groups
        (aa, sizes), (ba, _) = align_groups(a, gs), align_groups(b, gs)
        return dot(aa, ba, sizes, CONTRACT_ROWS, preferred_element_type=f32).astype(out_dtype)
    if wgrad == "kernel":  # rows past the live ones zeroed: only the kernel's arithmetic counts
        live = (jnp.arange(a.shape[0]) < jnp.sum(gs))[:, None]
        a = jnp.where(live, a, jnp.zeros((), a.dtype))
        b = jnp.where(live, b, jnp.zeros((), b.dtype))
        return dot(a, b, gs, CONTRACT_ROWS, preferred_element_type=f32).astype(out_dtype)
    return weight_grad_windows(a, b, gs, window, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def grouped_mlp(x, group_sizes, w_in, w_out, out_dtype, dot, primal, window, wgrad,
                gated=False):
    """y = act(x @ w_in[e]) @ w_out[e] on packed rows x [T, H] (group_sizes [L]), the hidden
    activation rounded to bf16; [T, H] in out_dtype. act: SiLU, or with `gated` the SiLU-gated
    activation of w_in [L, H, 2F] (activation.py); w_out [L, F, H].

    dot: the grouped GEMM (ragged_dot_general's signature) for the backward and for the
    forward under differentiation; primal: (x, group_sizes, w_in, w_out, out_dtype, gated) ->
    y, the forward when not differentiated (e.g. tokamax with SiLU fused). window: rows per
    expert of the weight gradients' batched GEMM (expert_gemm.grad_window_for: 2x the mean,
    >= 64); wgrad: WGRAD."""
    return primal(x, group_sizes, w_in, w_out, out_dtype, gated)


def _fwd(x, group_sizes, w_in, w_out, out_dtype, dot, primal, window, wgrad, gated):
    gs = group_sizes.astype(jnp.int32)
    pre = dot(x, w_in, gs, ROWS, preferred_element_type=f32)
    h = act.hidden(pre, gated).astype(bf16)
    y = dot(h, w_out, gs, ROWS, preferred_element_type=out_dtype)
    return y, (x, gs, w_in, w_out, pre, h)


def _bwd(out_dtype, dot, primal, window, wgrad, gated, res, dy):
    x, gs, w_in, w_out, pre, h = res
    live = jnp.arange(x.shape[0]) < jnp.sum(gs)
    dy = jnp.where(live[:, None], dy, 0).astype(bf16)  # rows past the live ones: no gradient
    dh = dot(dy, w_out, gs, ROWS_TRANS_RHS, preferred_element_type=f32)
    dpre = act.hidden_vjp(pre, dh, gated).astype(bf16)
    dx = dot(dpre, w_in, gs, ROWS_TRANS_RHS, preferred_element_type=f32)
    dx = jnp.where(live[:, None], dx, 0).astype(x.dtype)
    dw_in = _weight_grad(x, dpre, gs, dot, window, wgrad, w_in.dtype)
    dw_out = _weight_grad(h, dy, gs, dot, window, wgrad, w_out.dtype)
    return dx, None, dw_in, dw_out


grouped_mlp.defvjp(_fwd, _bwd)
