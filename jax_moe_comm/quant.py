"""fp8 e4m3 block quantization (1x128 tiles, DeepSeek's), as the differentiable fp8 path uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import SCALE_BLOCK

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INV_FP8_MAX = np.float32(1.0 / FP8_MAX)  # rounded to f32 once, here


def round_to_e4m3(v):
    """f32 v rounded to the nearest float8_e4m3fn value (ties to even), still in f32.

    In exact f32 arithmetic (powers of two only), so the cast to fp8 that follows is exact
    and the result cannot depend on how XLA lowers an f32 -> fp8 conversion in a given fusion
    (on the GPU, the test oracle's quantize and the layer's once disagreed by one fp8 step in
    a few elements, enough to fail gradient checks; with this rounding they agree)."""
    _, e = jnp.frexp(v)  # |v| in [2^(e-1), 2^e)
    step = jnp.exp2(jnp.maximum(e - 4, -9).astype(jnp.float32))  # 3 mantissa bits; subnormals
    return jnp.clip(jnp.round(v / step) * step, -FP8_MAX, FP8_MAX)


def quantize(x):
    """x [m, H] -> (q [m, H] float8_e4m3fn, scale [m, H/128] f32): per 1x128 block,
    scale = max|x| * f32(1/448) and q = x / scale."""
    m, H = x.shape
    blocks = x.astype(jnp.float32).reshape(m, H // SCALE_BLOCK, SCALE_BLOCK)
    # A multiply by the f32 constant 1/448, not a division by 448: XLA rewrites a division by
    # a constant as this multiply inside some fusions and not in others (jax 0.12's CPU
    # backend), so a division gives eager and jitted callers scales an ulp apart, and the
    # oracle and the layer must quantize to the same bits.
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-12) * INV_FP8_MAX
    q = round_to_e4m3(blocks / scale[..., None]).reshape(m, H).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize(q, scale):
    """q [..., H] fp8 and scale [..., H/128] -> f32 [..., H]."""
    return q.astype(jnp.float32) * jnp.repeat(scale, SCALE_BLOCK, axis=-1)


def fake_quantize(x):
    """dequantize(quantize(x)) in x's dtype, with the straight-through gradient (identity):
    what the differentiable fp8 dispatch does to the values and to their gradient."""
    xq = jax.lax.stop_gradient(dequantize(*quantize(x)).astype(x.dtype))
    return xq + (x - jax.lax.stop_gradient(x))  # exactly xq; d/dx = 1
