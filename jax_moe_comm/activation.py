"""The MLPs' activation, SiLU or SiLU-gated (DeepSeek's experts), written once for every GEMM
option, the hand-written backward (grouped_vjp) and the oracles.

An MLP is y = act(x @ w_in) @ w_out with f32 accumulation; its first GEMM gives pre [..., N]
in f32 and the activation turns it into the hidden h [..., F] that the second GEMM reads (the
caller rounds h to bf16 first):

- not gated: N = F, h = silu(pre); w_in [..., H, F];
- gated: N = 2F, columns [0:F] of w_in the gate and [F:2F] the up projection,
  h = silu(pre[..., :F]) * pre[..., F:]; w_in [..., H, 2F].

w_out is [..., F, H] either way. S gated MLPs of width F are one gated MLP of width S*F whose
w_in holds every gate column first, then every up column (the layer's shared experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def in_width(ffn: int, gated: bool) -> int:
    """N, the width of w_in's output for an MLP of hidden width `ffn`."""
    return 2 * ffn if gated else ffn


def hidden(pre, gated: bool):
    """h [..., F] from the first GEMM's output pre [..., N] (in pre's dtype: f32)."""
    if not gated:
        return jax.nn.silu(pre)
    gate, up = jnp.split(pre, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _silu_grad(z):
    s = jax.nn.sigmoid(z)
    return s * (1 + z * (1 - s))


def hidden_vjp(pre, dh, gated: bool):
    """d pre [..., N] from the hidden's cotangent dh [..., F] (f32): the transpose of hidden
    at pre. Gated: [dh * up * silu'(gate), dh * silu(gate)]."""
    if not gated:
        return dh * _silu_grad(pre)
    gate, up = jnp.split(pre, 2, axis=-1)
    return jnp.concatenate([dh * up * _silu_grad(gate), dh * jax.nn.silu(gate)], axis=-1)


def check_weights(w_in, w_out, gated: bool, what: str = "w_in") -> int:
    """F, the hidden width, from w_in [..., H, N] and w_out [..., F, H]; a ValueError that
    names the shapes where N is not in_width(F, gated) or the H's differ."""
    wi, wo = tuple(jnp.shape(w_in)), tuple(jnp.shape(w_out))
    if len(wi) < 2 or len(wo) < 2:
        raise ValueError(f"{what} {list(wi)} and its w_out {list(wo)}: matrices [..., H, N] "
                         "and [..., F, H] expected")
    F = wo[-2]
    if wi[-1] != in_width(F, gated) or wi[-2] != wo[-1]:
        want = "[..., H, 2F] (gate columns [0:F], up [F:2F])" if gated else "[..., H, F]"
        raise ValueError(f"gated={gated}: {what} must be {want} for its w_out [..., F, H] = "
                         f"{list(wo)} (F={F}, H={wo[-1]}); got {list(wi)}")
    return F
