"""grouped_vjp (the expert MLP's backward written out, used under expert_gemm="tokamax") against
autodiff of a per-row dense MLP, on CPU with XLA's ragged_dot as the grouped GEMM: the batched
window path, the chunked path (a group longer than the window), empty groups, NaN in the rows
past the live ones (undefined in dispatch's output, never read), and under shard_map's varying
manual axes (tokamax's own VJP refused them); SiLU and SiLU-gated activations. Tolerance as test_expert_gemm: 2e-2 x max|want|.
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe_comm import activation, expert_gemm, grouped_vjp

RTOL = 2e-2
L, H, F, T = 4, 32, 48, 24
SIZES = np.array([5, 0, 11, 2], np.int32)  # 18 live rows of 24, an empty expert
f32, bf16 = jnp.float32, jnp.bfloat16


def data(seed=0, gated=False):
    rng = np.random.default_rng(seed)
    live = np.arange(T) < SIZES.sum()
    x = rng.standard_normal((T, H)).astype(np.float32)
    x[~live] = np.nan  # never read: a NaN here must not reach any output or gradient
    w_in = rng.standard_normal((L, H, 2 * F if gated else F)) / np.sqrt(H)
    w_out = rng.standard_normal((L, F, H)) / np.sqrt(F)
    dy = rng.standard_normal((T, H)).astype(np.float32)
    dy[~live] = np.nan
    return (jnp.asarray(x, bf16), jnp.asarray(w_in, bf16), jnp.asarray(w_out, bf16),
            jnp.asarray(dy), live)


def dense_mlp(x, w_in, w_out, live, gated=False):
    """The reference: every live row through its own expert's weights (gathered per row);
    gated: silu(gate) * up with the gate in w_in's columns [0:F], written out here."""
    expert = np.repeat(np.arange(L), SIZES)
    expert = np.concatenate([expert, np.zeros(T - expert.size, int)])
    xs = jnp.where(live[:, None], x, 0)
    pre = jnp.einsum("th,thf->tf", xs, w_in[expert], preferred_element_type=f32)
    h = (jax.nn.silu(pre[:, :F]) * pre[:, F:] if gated else jax.nn.silu(pre)).astype(bf16)
    y = jnp.einsum("tf,tfh->th", h, w_out[expert], preferred_element_type=f32)
    return jnp.where(live[:, None], y, 0)


def xla_primal(x, gs, w_in, w_out, out_dtype, gated):
    return expert_gemm.ragged_dot_mlp(x, gs, w_in, w_out, out_dtype, gated)


def ours(window, wgrad="windows", gated=False):
    def mlp(x, w_in, w_out):
        return grouped_vjp.grouped_mlp(x, jnp.asarray(SIZES), w_in, w_out, jnp.dtype(f32),
                                       grouped_vjp.xla_ragged_dot_general, xla_primal,
                                       window, wgrad, gated)
    return mlp


def value_and_grads(mlp, x, w_in, w_out, dy, live):
    y, pull = jax.vjp(mlp, x, w_in, w_out)
    cot = jnp.where(live[:, None], dy, 0)
    return (jnp.where(live[:, None], y, 0),) + pull(cot)


def close(name, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: not finite ({np.sum(~np.isfinite(got))} values)"
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= RTOL, f"{name}: max |got - want| = {err:.3g} of max |want| {scale:.3g}"


@pytest.mark.parametrize("window,wgrad,gated", [
    (16, "windows", False), (4, "windows", False), (1, "windows", False), (16, "kernel", False),
    (16, "kernel_aligned", False), (16, "windows", True), (4, "windows", True),
    (16, "kernel", True)],
    ids=["batched", "chunked", "chunks-of-one", "xla-ragged-contracting",
         "xla-ragged-contracting-aligned", "gated-batched", "gated-chunked",
         "gated-xla-ragged-contracting"])
def test_matches_autodiff_of_the_dense_mlp(window, wgrad, gated):
    x, w_in, w_out, dy, live = data(gated=gated)
    want = value_and_grads(lambda *a: dense_mlp(*a, live, gated), x, w_in, w_out, dy, live)
    got = jax.jit(lambda *a: value_and_grads(ours(window, wgrad, gated), *a, live))(
        x, w_in, w_out, dy)
    assert got[2].shape == w_in.shape == (L, H, 2 * F if gated else F)
    for name, g, w in zip(("y", "dx", "dw_in", "dw_out"), got, want):
        close(f"{name} (window {window}, {wgrad}, gated {gated})", g, w)
    assert not np.asarray(got[2])[1].any() and not np.asarray(got[3])[1].any(), \
        "the empty expert got a weight gradient"
    assert not np.asarray(got[1])[~live].any(), "rows past the live ones got a gradient"


def test_weight_grad_windows_batched_and_chunked_match_xla():
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((T, H)), bf16)
    b = jnp.asarray(rng.standard_normal((T, F)), bf16)
    gs = jnp.asarray(SIZES)
    batched = grouped_vjp.weight_grad_windows(a, b, gs, 11, f32)   # largest group fits
    chunked = grouped_vjp.weight_grad_windows(a, b, gs, 3, f32)    # every group in chunks
    want = jax.lax.ragged_dot_general(a, b, gs, grouped_vjp.CONTRACT_ROWS,
                                      preferred_element_type=f32)
    close("batched", batched, want)
    close("chunked", chunked, want)


def test_grad_under_shard_map_varying_axes():
    """Each of 2 devices its own rows and weights (manual axis "ep" varying): jax.grad of the
    summed output goes through the custom VJP on both cond branches without a type error."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    x, w_in, w_out, dy, live = data()
    xs, wis, wos = (jnp.stack([v, v]) for v in (x, w_in, w_out))
    spec = jax.sharding.PartitionSpec("ep")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    def step(x, w_in, w_out):
        def loss(x, w_in, w_out, window):
            y = ours(window)(x[0], w_in[0], w_out[0])
            return jnp.sum(jnp.where(live[:, None], y, 0) ** 2)
        g_batched = jax.grad(loss, argnums=(1, 2))(x, w_in, w_out, 16)
        g_chunked = jax.grad(loss, argnums=(1, 2))(x, w_in, w_out, 4)
        return jnp.stack([g_batched[0], g_chunked[0]])[None]

    out = np.asarray(jax.jit(step)(xs, wis, wos), np.float64)
    assert np.all(np.isfinite(out))
    close("shard_map dw_in, chunked vs batched", out[:, 1], out[:, 0])


def test_grad_window_for_is_twice_the_mean_at_least_64():
    assert expert_gemm.grad_window_for(8192, 32) == 512      # no mean given: an even share
    assert expert_gemm.grad_window_for(8192, 32, mean_rows=96) == 192
    assert expert_gemm.grad_window_for(8192, 32, mean_rows=4) == 64   # the floor
    assert expert_gemm.grad_window_for(40, 32, mean_rows=4) == 40     # at most the rows


def test_align_groups_starts_every_group_at_a_multiple():
    a = jnp.arange(T, dtype=f32)[:, None] + 1  # row r holds r + 1
    aligned, sizes = grouped_vjp.align_groups(a, jnp.asarray(SIZES), align=8)
    assert list(np.asarray(sizes)) == [8, 0, 16, 8]
    got = np.asarray(aligned)[:, 0]
    assert got.shape[0] % 8 == 0 and got.shape[0] >= T + 4 * 7
    want = np.zeros_like(got)
    want[0:5] = np.arange(1, 6)       # expert 0: rows 0-4
    want[8:19] = np.arange(6, 17)     # expert 2: rows 5-15, at 8 (expert 1 is empty)
    want[24:26] = np.arange(17, 19)   # expert 3: rows 16-17, at 24
    assert np.array_equal(got, want)


@pytest.mark.parametrize("gated", [False, True])
def test_hidden_vjp_is_the_transpose_of_hidden(gated):
    """activation.hidden_vjp (the backward grouped_mlp writes out) against jax.vjp of
    activation.hidden, in f32 at random points, gate and up of both signs."""
    rng = np.random.default_rng(4)
    pre = jnp.asarray(rng.standard_normal((6, 2 * F if gated else F)) * 3, f32)
    dh = jnp.asarray(rng.standard_normal((6, F)), f32)
    _, pull = jax.vjp(lambda p: activation.hidden(p, gated), pre)
    np.testing.assert_allclose(np.asarray(activation.hidden_vjp(pre, dh, gated)),
                               np.asarray(pull(dh)[0]), rtol=1e-5, atol=1e-6)


def test_weights_of_the_other_activation_are_refused():
    """A gated w_in [L, H, 2F] under gated=False, or a plain one under gated=True, is a
    ValueError naming the shapes, not a silent half-width MLP."""
    x, w_in, w_out, _, _ = data()
    _, w_gated, _, _, _ = data(gated=True)
    with pytest.raises(ValueError, match=r"gated=True: w_in must be \[..., H, 2F\]"):
        expert_gemm.expert_mlp(x, jnp.asarray(SIZES), w_in, w_out, "ragged_dot", gated=True)
    with pytest.raises(ValueError, match=r"gated=False: w_in must be \[..., H, F\].*got "
                                         r"\[4, 32, 96\]"):
        expert_gemm.expert_mlp(x, jnp.asarray(SIZES), w_gated, w_out, "ragged_dot")
