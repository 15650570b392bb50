import jax.numpy as jnp
import numpy as np

from jax_moe_comm import routing


def test_first_occurrence_and_merged_weights():
    idx = jnp.array([[3, 3, -1, 5], [1, 2, 1, 1]], jnp.int32)
    w = jnp.array([[0.5, 0.25, 0.1, 0.2], [0.1, 0.2, 0.3, 0.4]], jnp.float32)
    np.testing.assert_array_equal(routing.first_occurrence(idx), [[3, -1, -1, 5], [1, 2, -1, -1]])
    first, merged = routing.merge_repeats(idx, w)
    np.testing.assert_array_equal(first, routing.first_occurrence(idx))
    np.testing.assert_allclose(merged, [[0.75, 0, 0, 0.2], [0.8, 0.2, 0, 0]], rtol=1e-6)
