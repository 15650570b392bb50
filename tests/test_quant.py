"""fp8 block quantization: exact rounding, so every fusion XLA makes of it gives the same bits."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_comm import quant


def test_round_to_e4m3_equals_the_cast():
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.standard_normal(50_000) * 100, rng.standard_normal(50_000) * 0.01,
                        rng.uniform(-460, 460, 50_000),
                        [0.0, 448.0, -448.0, 500.0, 2**-9, 2**-10, 3 * 2**-10, 1.0625, 1.1875,
                         -1.0625, 1e-12]]).astype(np.float32)
    got = np.asarray(quant.round_to_e4m3(jnp.asarray(v)))
    want = np.asarray(jnp.asarray(np.clip(v, -448, 448)).astype(jnp.float8_e4m3fn)
                      .astype(jnp.float32))
    np.testing.assert_array_equal(got, want)


def test_quantize_is_the_same_in_every_fusion():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 256)), jnp.bfloat16)
    alone = quant.dequantize(*quant.quantize(x))
    fused = jax.jit(lambda a: quant.dequantize(*quant.quantize(a * 1)) + 0.0)(x)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(fused))
    np.testing.assert_allclose(np.asarray(alone), np.asarray(x, np.float32), rtol=0.07,
                               atol=0.01)  # subnormals near 0
