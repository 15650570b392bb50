"""The grouped-GEMM options of the expert MLPs (expert_gemm.py, issue 24) against the padded
einsum, on CPU: forward and gradients on ragged group sizes with empty and full experts, on
both layouts, SiLU and SiLU-gated experts, alone and through the MoE layer (reference
backend, jax.grad through dispatch and combine).

Tolerance: every option rounds the hidden activation to bf16 like the einsum, but sums in
another order and (tokamax's unfused path) applies SiLU after that rounding, so results agree
to a few bf16 ulps: max |option - einsum| <= 2e-2 x max |einsum| per tensor (forward and each
gradient), the bound the layer tests use for bf16.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe_comm import AllToAll, expert_gemm
from jax_moe_comm import testing as T
from jax_moe_comm.moe import MoELayerConfig, init_params

RTOL = 2e-2
OPTIONS = ("einsum", "ragged_dot", "tokamax", "masked")
TOKAMAX = expert_gemm.tokamax_problem()
needs_tokamax = pytest.mark.skipif(TOKAMAX is not None, reason=f"tokamax unusable: {TOKAMAX}")


def marks(option):
    return [needs_tokamax] if option == "tokamax" else []


def close(name, got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: not finite"
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= rtol, f"{name}: max |got - want| = {err:.3g} of max |want| {scale:.3g}"
    return err


# -- the functions alone ---------------------------------------------------------------------
L, R, H, F = 4, 6, 32, 48
COUNTS = np.array([3, 0, 6, 1], np.int32)  # an empty expert, a full one
TOTAL = 12  # packed rows: more than sum(COUNTS), as dispatch gives them


def padded_data(seed=0, gated=False):
    """x [L, R, H] random in every row (dead rows too: they must not matter), weights (gated:
    w_in [L, H, 2F]), and the output cotangent, zero on dead rows (combine never reads them)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((L, R, H)).astype(jnp.bfloat16)
    w_in = (rng.standard_normal((L, H, 2 * F if gated else F)) / np.sqrt(H)).astype(jnp.bfloat16)
    w_out = (rng.standard_normal((L, F, H)) / np.sqrt(F)).astype(jnp.bfloat16)
    live = np.arange(R)[None, :] < COUNTS[:, None]
    g = rng.standard_normal((L, R, H)).astype(np.float32) * live[..., None]
    return x, w_in, w_out, g, live


def to_packed(a, live):
    """[L, R, ...] -> [TOTAL, ...]: live rows of expert 0, then 1, ..., zero after them."""
    rows = a[live]
    out = np.zeros((TOTAL,) + a.shape[2:], a.dtype)
    out[:len(rows)] = rows
    return out


def to_padded(a, live):
    out = np.zeros(live.shape + a.shape[1:], np.float32)
    out[live] = np.asarray(a, np.float32)[:live.sum()]
    return out


def run(option, layout, x, w_in, w_out, g, gated=False):
    """(y, dx, dw_in, dw_out) of sum(g * mlp(x)), y f32 in the layout's shape."""
    counts = jnp.asarray(COUNTS)

    def f(x, w_in, w_out):
        return expert_gemm.expert_mlp(x, counts, w_in, w_out, option, rows_per_expert=R,
                                      total_rows=TOTAL, gated=gated)

    def loss(x, w_in, w_out):
        return jnp.sum(g * f(x, w_in, w_out))

    y = jax.jit(f)(x, w_in, w_out)
    return (y,) + jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w_in, w_out)


@pytest.fixture(scope="module", params=[False, True], ids=["silu", "gated"])
def reference(request):
    gated = request.param
    x, w_in, w_out, g, live = padded_data(gated=gated)
    y, dx, dwi, dwo = run("einsum", "padded", x, w_in, w_out, g, gated)
    return (x, w_in, w_out, g, live, gated), (np.asarray(y) * live[..., None],
                                              np.asarray(dx, np.float32) * live[..., None],
                                              dwi, dwo)


def test_gated_einsum_is_silu_of_the_gate_times_up():
    """The reference of the gated cases, against the convention written out in numpy: gate =
    w_in[e][:, :F], up = w_in[e][:, F:], h = silu(x @ gate) * (x @ up) in f32 rounded to bf16,
    y = h @ w_out[e] (the convention benchmarks' numpy oracle uses)."""
    x, w_in, w_out, _, live = padded_data(gated=True)
    got = np.asarray(expert_gemm.einsum_mlp(x, w_in, w_out, gated=True))
    xf, wi, wo = (np.asarray(v, np.float32) for v in (x, w_in, w_out))
    gate, up = xf @ wi[:, :, :F], xf @ wi[:, :, F:]  # [L, R, F] (batched over experts)
    h = (gate / (1 + np.exp(-gate)) * up).astype(jnp.bfloat16).astype(np.float32)
    close("gated y", got, h @ wo, rtol=1e-2)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("option", [pytest.param(o, marks=marks(o)) for o in OPTIONS])
def test_option_matches_einsum_forward_and_gradients(option, layout, reference):
    (x, w_in, w_out, g, live, gated), (y_ref, dx_ref, dwi_ref, dwo_ref) = reference
    if layout == "packed":
        y, dx, dwi, dwo = run(option, layout, to_packed(x, live), w_in, w_out, to_packed(g, live),
                              gated)
        if option != "tokamax":  # tokamax leaves rows past the live ones unwritten
            assert not np.asarray(y)[live.sum():].any(), "rows past the live ones not zero"
        y, dx = to_padded(y, live), to_padded(dx, live)
    else:
        y, dx, dwi, dwo = run(option, layout, x, w_in, w_out, g, gated)
        y, dx = np.asarray(y), np.asarray(dx, np.float32)
        if option != "einsum":  # computed only for live rows, zero past them
            assert not y[~live].any(), "rows past the counts not zero"
        y, dx = y * live[..., None], dx * live[..., None]
    close("y", y, y_ref)
    close("d x", dx, dx_ref)
    close("d w_in", dwi, dwi_ref)
    close("d w_out", dwo, dwo_ref)
    empty = 1  # COUNTS[1] == 0
    assert not np.asarray(dwi)[empty].any() and not np.asarray(dwo)[empty].any(), \
        "an empty expert got a gradient"


class StandInTokamax:
    """tokamax's two entry points on XLA's ragged_dot, rows past sum(group_sizes) written NaN
    (tokamax leaves them undefined): runs expert_gemm's "tokamax" wiring (the fused forward,
    grouped_vjp's backward through tokamax.ragged_dot_general) on CPU, where tokamax does not
    install. The real kernels run in benchmarks/bench_gemm.py and the layer on the GPU."""

    @staticmethod
    def _undefined_past_live(out, group_sizes):
        live = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
        return jnp.where(live.reshape((-1,) + (1,) * (out.ndim - 1)), out, jnp.nan)

    def __init__(self):
        self.activations = []  # the activation= of each ragged_dot call (None: none fused)

    def ragged_dot(self, x, w, group_sizes, preferred_element_type=None, activation=None):
        self.activations.append(activation)
        out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
        out = activation(out) if activation is not None else out
        out = out.astype(preferred_element_type or out.dtype)
        return self._undefined_past_live(out, group_sizes)

    def ragged_dot_general(self, lhs, rhs, group_sizes, dims, preferred_element_type=None):
        out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims,
                                         preferred_element_type=preferred_element_type)
        if dims.dot_dimension_numbers[0][0] == [0]:  # contracting the rows: [L, K, N]
            return out
        return self._undefined_past_live(out, group_sizes)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_tokamax_wiring_on_a_stand_in(layout, reference, monkeypatch):
    """Not gated, SiLU is fused into the first GEMM (activation=silu); gated, the first GEMM
    has no activation (the gate and up columns of a row are in different output tiles)."""
    stand_in = StandInTokamax()
    monkeypatch.setattr(expert_gemm, "_tokamax", lambda: (stand_in, None))
    expert_gemm._tokamax_dot.cache_clear()
    try:
        test_option_matches_einsum_forward_and_gradients("tokamax", layout, reference)
    finally:
        expert_gemm._tokamax_dot.cache_clear()
    gated = reference[0][-1]
    assert stand_in.activations == [None if gated else jax.nn.silu, None], stand_in.activations


def test_the_weight_gradient_measured_wrong_needs_the_opt_in(monkeypatch):
    monkeypatch.setattr(expert_gemm, "_tokamax", lambda: (StandInTokamax(), None))
    expert_gemm._tokamax_dot.cache_clear()
    x, w_in, w_out, _, live = padded_data()
    args = (to_packed(x, live), jnp.asarray(COUNTS), w_in, w_out)
    try:
        for wgrad in expert_gemm.KNOWN_WRONG_TOKAMAX_WGRAD:
            with pytest.raises(ValueError, match="allow_known_wrong=True"):
                expert_gemm.tokamax_mlp(*args, wgrad=wgrad)
            measured = expert_gemm.tokamax_mlp(*args, wgrad=wgrad, allow_known_wrong=True)
            default = expert_gemm.tokamax_mlp(*args)
            rows = int(np.sum(COUNTS))
            np.testing.assert_array_equal(np.asarray(measured)[:rows],
                                          np.asarray(default)[:rows])
        with pytest.raises(ValueError, match="wgrad='kern': one of"):
            expert_gemm.tokamax_mlp(*args, wgrad="kern")
    finally:
        expert_gemm._tokamax_dot.cache_clear()


def test_bad_option_names_raise_listing_the_choices():
    for bad in ("cublas", "", "Tokamax"):
        with pytest.raises(ValueError, match="expected one of .*'einsum'.*'tokamax'.*'masked'"):
            MoELayerConfig(expert_gemm=bad)
        with pytest.raises(ValueError, match="expected one of"):
            expert_gemm.resolve(bad)
    with pytest.raises(ValueError, match="expert_gemm='ragged'"):
        expert_gemm.expert_mlp(jnp.zeros((2, 4)), jnp.zeros(1, jnp.int32),
                               jnp.zeros((1, 4, 4)), jnp.zeros((1, 4, 4)), "ragged")


def test_auto_is_one_measured_option_per_platform_and_layout():
    assert set(expert_gemm.GPU_AUTO) == {"packed", "padded"}
    assert set(expert_gemm.GPU_AUTO.values()) <= set(OPTIONS) and expert_gemm.CPU_AUTO in OPTIONS
    assert MoELayerConfig().expert_gemm == "auto"
    for layout in ("packed", "padded"):
        assert expert_gemm.resolve("auto", "cpu", layout) == expert_gemm.CPU_AUTO == "einsum"
        gpu = expert_gemm.resolve("auto", "gpu", layout)
        want = expert_gemm.GPU_AUTO[layout]
        assert gpu == ("einsum" if want in expert_gemm.NEEDS_TOKAMAX and TOKAMAX else want)
        assert expert_gemm.NATIVE_LAYOUT[want] == layout, "auto must not convert layouts"
    assert expert_gemm.resolve("ragged_dot", "gpu") == "ragged_dot"


def test_tokamax_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(expert_gemm, "_tokamax", lambda: (None, "import tokamax failed: no"))
    x, w_in, w_out, g, live = padded_data()
    with pytest.raises(ImportError, match="pip install tokamax"):
        expert_gemm.expert_mlp(to_packed(x, live), jnp.asarray(COUNTS), w_in, w_out, "tokamax")
    for layout in ("packed", "padded"):  # auto falls back to the einsum, never fails
        assert expert_gemm.resolve("auto", "gpu", layout) == "einsum"
    assert expert_gemm.masked_inner() == "ragged_dot"  # "masked" still runs, on XLA's GEMM


def test_tokamax_implementation_names(monkeypatch):
    """None is tokamax's own choice unless JMC_TOKAMAX_IMPL names one; tokamax's own names
    pass through unchanged (kernel specs: below)."""
    monkeypatch.delenv("JMC_TOKAMAX_IMPL", raising=False)
    assert expert_gemm._tokamax_implementation(None) is None
    assert expert_gemm._tokamax_implementation("xla") == "xla"
    monkeypatch.setenv("JMC_TOKAMAX_IMPL", "xla")
    assert expert_gemm._tokamax_implementation(None) == "xla"
    assert expert_gemm._tokamax_implementation("mosaic") == "mosaic"  # an explicit name wins


@needs_tokamax
def test_a_changed_env_implementation_reaches_the_next_trace(monkeypatch):
    """JMC_TOKAMAX_IMPL is resolved before tokamax_mlp's cached builders, so each new trace
    sees the value of its time (bench_layer sets it per row), not the first one ever seen."""
    seen = []
    real_primal, real_dot = expert_gemm._tokamax_primal, expert_gemm._tokamax_dot
    monkeypatch.setattr(expert_gemm, "_tokamax_primal",
                        lambda impl=None: seen.append(("primal", impl)) or real_primal(impl))
    monkeypatch.setattr(expert_gemm, "_tokamax_dot",
                        lambda impl=None: seen.append(("dot", impl)) or real_dot(impl))
    x, w_in, w_out, _, live = padded_data()
    xp = to_packed(x, live)
    for env in ("xla", "mosaic:m128p1"):
        monkeypatch.setenv("JMC_TOKAMAX_IMPL", env)
        jax.jit(lambda v: expert_gemm.tokamax_mlp(v, jnp.asarray(COUNTS), w_in, w_out))(xp)
    assert seen == [("primal", "xla"), ("dot", "xla"), ("primal", "mosaic:m128p1"),
                    ("dot", "mosaic:m128p1")], seen


# -- kernel specs ("mosaic:<spec>", JMC_TOKAMAX_IMPL) ------------------------------------------
# tokamax 0.0.17's sm90 heuristic, as bench_gemm recorded it on the H200 (2026-12-05)
SM90 = {"block_m": 64, "block_n": 64, "block_k": 128, "num_stages": 2, "split_k": 1,
        "persistent": False, "grid_minor_dim": "m", "grid_tile_width": 1}


def test_spec_defaults_are_tokamax_sm90_heuristic():
    assert expert_gemm.TOKAMAX_SM90_DEFAULT == SM90
    assert expert_gemm.parse_tokamax_spec("m64") == SM90


@pytest.mark.parametrize("spec,changed", [
    ("m128", {"block_m": 128}), ("m8", {"block_m": 8}), ("n128", {"block_n": 128}),
    ("k256", {"block_k": 256}), ("s4", {"num_stages": 4}), ("p1", {"persistent": True}),
    ("p0", {"persistent": False}), ("gn", {"grid_minor_dim": "n"}),
    ("gm", {"grid_minor_dim": "m"}), ("w4", {"grid_tile_width": 4}),
    ("m128s4p1", {"block_m": 128, "num_stages": 4, "persistent": True}),
    ("p1s4m128", {"block_m": 128, "num_stages": 4, "persistent": True}),  # any order
    ("m128n32k64s3p1gnw8", {"block_m": 128, "block_n": 32, "block_k": 64, "num_stages": 3,
                            "persistent": True, "grid_minor_dim": "n", "grid_tile_width": 8}),
])
def test_spec_sets_each_letter_and_leaves_the_rest_at_the_defaults(spec, changed):
    assert expert_gemm.parse_tokamax_spec(spec) == SM90 | changed


@pytest.mark.parametrize("spec,why", [
    ("", "empty"), ("x4", "unknown letter 'x' at position 0"),
    ("m64q2", "unknown letter 'q' at position 3"), ("M64", "unknown letter 'M'"),
    ("m64 s4", "unknown letter ' '"), ("m", "letter 'm' .block_m. has no number"),
    ("s", "letter 's' .num_stages. has no number"), ("k-1", "letter 'k' .block_k. has no"),
    ("m60", "m60: block_m must be a positive multiple of 8"), ("m0", "m0: block_m must be"),
    ("n0", "n0: block_n must be >= 1"), ("s0", "s0: num_stages must be >= 1"),
    ("w0", "w0: grid_tile_width must be >= 1"), ("p2", "p2: p takes 0 or 1"),
    ("g", "g: g takes m or n"), ("gk", "gk: g takes m or n"), ("g1", "g1: g takes m or n"),
    ("m64m128", "letter 'm' given twice"), ("p1s2p0", "letter 'p' given twice"),
])
def test_bad_specs_name_the_letter_and_the_grammar(spec, why):
    with pytest.raises(ValueError, match=f"spec '{spec}': {why}.*m<block_m.*g<grid_minor_dim"):
        expert_gemm.parse_tokamax_spec(spec)


def test_spec_names(monkeypatch):
    spec = expert_gemm.tokamax_spec
    assert spec("mosaic:m128s4p1") == "m128s4p1" and spec("mosaic:") == ""
    assert spec(expert_gemm.TOKAMAX_PERSISTENT) == "p1"
    assert [spec(n) for n in (None, "mosaic", "xla", "triton", "m128")] == [None] * 5
    # A bad spec fails before anything of tokamax is imported, saying where it came from.
    monkeypatch.setenv("JMC_TOKAMAX_IMPL", "mosaic:m128x")
    with pytest.raises(ValueError, match="JMC_TOKAMAX_IMPL='mosaic:m128x': .*unknown letter 'x'"):
        expert_gemm._tokamax_implementation(None)
    with pytest.raises(ValueError, match="implementation='mosaic:p3': .*p takes 0 or 1"):
        expert_gemm._tokamax_implementation("mosaic:p3")
    with pytest.raises(ValueError, match="implementation='mosaic:': .*empty"):
        expert_gemm._tokamax_implementation("mosaic:")


def _config(**fields):
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common
    fields = SM90 | fields
    fields["grid_minor_dim"] = common.MatmulDimension[fields["grid_minor_dim"].upper()]
    return common.Config(**fields)


@needs_tokamax
@pytest.mark.parametrize("name,env,want", [
    ("mosaic:m128s4p1", None, {"block_m": 128, "num_stages": 4, "persistent": True}),
    ("mosaic:gnw2k256n128", None, {"grid_minor_dim": "n", "grid_tile_width": 2,
                                   "block_k": 256, "block_n": 128}),
    (None, "mosaic:m128s4p1", {"block_m": 128, "num_stages": 4, "persistent": True}),
    (None, "mosaic_persistent", {"persistent": True}),
    ("mosaic:m64", "mosaic:m128", {}),  # an explicit name wins over the environment's
    (expert_gemm.TOKAMAX_PERSISTENT, None, {"persistent": True}),
])
def test_spec_implementation_is_the_mosaic_kernel_with_that_config_then_fallbacks(
        name, env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("JMC_TOKAMAX_IMPL", raising=False)
    else:
        monkeypatch.setenv("JMC_TOKAMAX_IMPL", env)
    first, *rest = expert_gemm._tokamax_implementation(name)
    assert type(first).__name__ == "PallasMosaicGpuRaggedDot"
    assert first.config == _config(**want)
    from tokamax._src.ops.ragged_dot import api
    # then tokamax's own order: triton where this tokamax has it (as with nothing named)
    assert rest == ["mosaic"] + (["triton"] if "triton" in api.IMPLEMENTATIONS else []) + ["xla"]


@needs_tokamax
def test_tokamax_persistent_is_its_former_config():
    """TOKAMAX_PERSISTENT, once a Config of its own, is now the spec "p1": the same Config."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common
    before = common.Config(block_m=64, block_n=64, block_k=128, num_stages=2, split_k=1,
                           persistent=True, grid_minor_dim=common.MatmulDimension.M,
                           grid_tile_width=1)
    assert expert_gemm._tokamax_implementation(expert_gemm.TOKAMAX_PERSISTENT)[0].config == before


@needs_tokamax
@pytest.mark.parametrize("name", [expert_gemm.TOKAMAX_PERSISTENT, "mosaic:m128s4p1gn"])
def test_a_spec_the_kernel_refuses_falls_back_and_computes(name):
    # Where its kernel cannot run (here: no GPU) the layer still computes, on the fallbacks.
    x, w_in, w_out, _, live = padded_data()
    want = expert_gemm.expert_mlp(x, jnp.asarray(COUNTS), w_in, w_out, "einsum")
    got = expert_gemm.tokamax_mlp(to_packed(x, live), jnp.asarray(COUNTS), w_in, w_out,
                                  implementation=name)
    np.testing.assert_allclose(np.asarray(to_packed(want, live)[: live.sum()], np.float32),
                               np.asarray(got[: live.sum()], np.float32), rtol=2e-2, atol=2e-2)


# -- tokamax's tile by the mean rows per expert (TOKAMAX_TILE_BY_MEAN_ROWS) ------------------
def test_tile_rule_by_mean_rows():
    """n128 up to 48 mean rows per expert, m128 up to 384, tokamax's own choice past that
    (not measured) and where the caller gives no mean."""
    rule = expert_gemm.tokamax_spec_for_rows
    assert rule(None) is None
    assert [rule(m) for m in (0, 1, 4, 32, 48)] == ["mosaic:n128"] * 5
    assert [rule(m) for m in (49, 64, 96, 128, 129, 384)] == ["mosaic:m128"] * 6
    assert rule(385) is None and rule(1024) is None
    for _, spec in expert_gemm.TOKAMAX_TILE_BY_MEAN_ROWS:
        assert expert_gemm.parse_tokamax_spec(spec) != SM90  # a real change of tile
    # measured on sm90 GPUs only: elsewhere (here, CPU) the layer leaves tokamax its choice
    assert not expert_gemm.tile_rule_applies()
    assert expert_gemm.layer_tokamax_spec(96) is None


def spy_implementations(monkeypatch):
    """The implementations tokamax_mlp's builders (the forward's and the backward's GEMMs) are
    asked for, with the rule on as on an sm90 GPU; each then runs tokamax's own choice (a
    spec's Mosaic GPU kernel has no CPU path to test here)."""
    monkeypatch.setattr(expert_gemm, "tile_rule_applies", lambda: True)
    seen = []
    real_primal, real_dot = expert_gemm._tokamax_primal, expert_gemm._tokamax_dot
    monkeypatch.setattr(expert_gemm, "_tokamax_primal",
                        lambda impl=None: seen.append(impl) or real_primal(None))
    monkeypatch.setattr(expert_gemm, "_tokamax_dot",
                        lambda impl=None: seen.append(impl) or real_dot(None))
    return seen


@needs_tokamax
@pytest.mark.parametrize("option,layout,buckets", [
    ("tokamax", "packed", None), ("tokamax", "packed", (6,)), ("masked", "packed", None),
    ("tokamax", "padded", None), ("masked", "padded", None)])
def test_mean_rows_pick_the_tile_on_every_path(monkeypatch, option, layout, buckets):
    monkeypatch.delenv("JMC_TOKAMAX_IMPL", raising=False)
    seen = spy_implementations(monkeypatch)
    x, w_in, w_out, _, live = padded_data()
    xin = to_packed(x, live) if layout == "packed" else x
    for mean, want in ((96, "mosaic:m128"), (4, "mosaic:n128"), (None, None)):
        seen.clear()
        expert_gemm.expert_mlp(xin, jnp.asarray(COUNTS), w_in, w_out, option,
                               row_buckets=buckets, mean_rows=mean)
        assert seen and set(seen) == {want}, (mean, seen)
    for env, want in (("xla", "xla"), ("default", "default"), ("", "mosaic:m128")):
        monkeypatch.setenv("JMC_TOKAMAX_IMPL", env)  # a named implementation wins over the rule
        seen.clear()
        expert_gemm.expert_mlp(xin, jnp.asarray(COUNTS), w_in, w_out, option,
                               row_buckets=buckets, mean_rows=96)
        assert seen and set(seen) == {want}, (env, seen)


def test_default_is_tokamax_own_choice():
    """JMC_TOKAMAX_IMPL=default (TOKAMAX_OWN_CHOICE): no implementation passed to tokamax."""
    assert expert_gemm._tokamax_implementation(expert_gemm.TOKAMAX_OWN_CHOICE) is None


# -- through the MoE layer: jax.grad through dispatch, the experts and combine ----------------
LAYER = dict(num_experts=8, experts_per_token=3, hidden=64, ffn=96, max_num_tokens=6)
WORLD = 2
LAYER_CASES = [("einsum", "packed", False), ("ragged_dot", "packed", False),
               ("tokamax", "packed", False), ("masked", "padded", False),
               ("tokamax", "padded", False), ("ragged_dot", "packed", True),
               ("tokamax", "packed", True), ("masked", "padded", True)]


def layer_grads(option, layout, gated=False):
    cfg = MoELayerConfig(**LAYER, expert_gemm=option, gated=gated)
    mesh = T.make_mesh(WORLD)
    a2a = AllToAll(cfg.comm_config(WORLD), differentiable=True, layout=layout)
    params = [init_params(cfg, 3)]
    x, nt, G, drop = T.layer_grad_inputs(cfg, WORLD, 7, drop_rate=0.2)
    try:
        return T.run_layer_grads(a2a, cfg, mesh, params, x, nt, G, drop)
    finally:
        a2a.close()


@pytest.fixture(scope="module")
def einsum_layers():
    """gated -> the einsum option's layer gradients, computed on first use."""
    class Lazy(dict):
        def __missing__(self, gated):
            self[gated] = layer_grads("einsum", "padded", gated)
            return self[gated]
    return Lazy()


@pytest.fixture(scope="module")
def einsum_layer(einsum_layers):
    return einsum_layers[False]


@pytest.mark.parametrize("option,layout,gated",
                         [pytest.param(o, lay, g, marks=marks(o),
                                       id=f"{o}-{lay}" + ("-gated" if g else ""))
                          for o, lay, g in LAYER_CASES])
def test_layer_gradients_match_the_einsum_option(option, layout, gated, einsum_layers):
    """Every parameter's gradient (gated: w_in [E, H, 2F] and the shared experts' gated
    shared_in too) and d x through dispatch, the option's GEMMs and combine."""
    (grads,), dx = layer_grads(option, layout, gated)
    (want,), want_dx = einsum_layers[gated]
    for rank in range(WORLD):
        for name, g in grads[rank].items():
            close(f"rank {rank} d {name}", g, want[rank][name])
        close(f"rank {rank} d x", dx[rank], want_dx[rank])


@needs_tokamax
def test_the_layer_gives_tokamax_the_tile_for_its_expected_rows(monkeypatch):
    """moe.experts_forward passes MoEConfig.expected_rows_per_expert to the builders of the
    forward's and the backward's GEMMs."""
    monkeypatch.delenv("JMC_TOKAMAX_IMPL", raising=False)
    seen = spy_implementations(monkeypatch)
    layer_grads("tokamax", "packed")
    mean = MoELayerConfig(**LAYER).comm_config(WORLD).expected_rows_per_expert
    assert set(seen) == {expert_gemm.tokamax_spec_for_rows(mean)} == {"mosaic:n128"}, seen


def test_vary_like_types_an_invariant_kernel_output_as_its_inputs():
    """tokamax's Pallas outputs come back typed invariant under shard_map; _vary_like gives them
    their inputs' varying axes (else the layer's custom VJPs refuse the cotangents)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    seen = {}

    def body(x):
        kernel_out = jnp.ones(x.shape, x.dtype)  # invariant, as a Pallas call returns it
        seen["before"] = expert_gemm._varying_axes(kernel_out)
        out = expert_gemm._vary_like(kernel_out, x)
        seen["after"] = expert_gemm._varying_axes(out)
        return out * x

    spec = jax.sharding.PartitionSpec("ep")
    y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(jnp.arange(4.0))
    assert seen == {"before": set(), "after": {"ep"}}
    assert np.array_equal(np.asarray(y), np.arange(4.0))


def test_tokamax_grads_with_rows_over_dp_ep_and_weights_over_ep(monkeypatch):
    """Rows split over ("dp", "ep"), weights over "ep" only (the Flax module with data_axes):
    the custom VJP's weight cotangents must come back with the weights' type, summed over dp,
    as autodiff of XLA's ragged_dot gives them."""
    monkeypatch.setattr(expert_gemm, "_tokamax", lambda: (StandInTokamax(), None))
    expert_gemm._tokamax_dot.cache_clear()
    from jax.sharding import PartitionSpec as P
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "ep"))
    rng = np.random.default_rng(3)
    rows, h, f, L = 12, 16, 24, 2
    sizes = jnp.asarray([5, 4], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4 * rows, h)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((2 * L, h, f)) / 4, jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((2 * L, f, h)) / 5, jnp.bfloat16)

    def grads(option):
        def body(x, w_in, w_out):
            def loss(w_in, w_out):
                y = expert_gemm.expert_mlp(x, sizes, w_in, w_out, option)
                return jnp.sum(y[:9] ** 2)
            return jax.grad(loss, argnums=(0, 1))(w_in, w_out)
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(("dp", "ep")), P("ep"), P("ep")),
                          out_specs=(P("ep"), P("ep")))
        return jax.jit(f)(x, w_in, w_out)

    try:
        got, want = grads("tokamax"), grads("ragged_dot")
    finally:
        expert_gemm._tokamax_dot.cache_clear()
    close("d w_in", got[0], want[0])
    close("d w_out", got[1], want[1])


# -- row buckets (expert_gemm.bucketed_mlp): fewer static rows when fewer are live -----------
def test_bucket_rows_align_drop_the_oversized_and_end_with_all_rows():
    assert expert_gemm.bucket_rows(6144, (960, 1536)) == (960, 1536, 6144)
    assert expert_gemm.bucket_rows(512, (100, 104, 600)) == (104, 512)  # 600 >= the rows
    assert expert_gemm.bucket_rows(96, ()) == (96,)
    assert expert_gemm.bucket_rows(96, (0.5,)) == (8, 96)  # rounded up, never to 0
    for bad in (0, -8, float("nan")):
        with pytest.raises(ValueError, match="at least one row"):
            expert_gemm.bucket_rows(96, (bad,))


@pytest.mark.parametrize("counts", [[10, 20, 5, 7], [100, 50, 30, 40], [200, 150, 100, 62]])
def test_bucketed_rows_give_the_same_live_rows_and_gradients(counts):
    """Loads that fit the first bucket, the second, and only the whole buffer (512 rows): the
    live rows and every gradient equal the unbucketed option's, rows past them are zero."""
    rng = np.random.default_rng(1)
    rows, gs = 512, jnp.asarray(counts, jnp.int32)
    n = int(gs.sum())
    x = jnp.asarray(rng.standard_normal((rows, H)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((L, H, F)) / np.sqrt(H), jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((L, F, H)) / np.sqrt(F), jnp.bfloat16)

    def loss(x, w_in, w_out, buckets):
        y = expert_gemm.expert_mlp(x, gs, w_in, w_out, "ragged_dot", row_buckets=buckets)
        return jnp.sum(y[:n].astype(jnp.float32) ** 2), y

    (_, want), want_g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        x, w_in, w_out, None)
    (_, got), got_g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        x, w_in, w_out, (100, 250))
    close("live rows", got[:n], want[:n], rtol=1e-6)
    assert not np.any(np.asarray(got[n:], np.float32))
    # bf16 gradients: a weight's sum over the bucket's rows instead of the buffer's may round
    # its last bit differently (XLA:CPU's unoptimized programs, tests/cpu_env.py, do not
    # keep one summation order across the two shapes); the error stays below one bf16 step
    # of the largest gradient
    for name, g, w in zip(("d x", "d w_in", "d w_out"), got_g, want_g):
        close(name, g, w, rtol=2.0 ** -8)
    # the switch picked a bucket by the load: its index is in the program, not a constant
    text = jax.jit(lambda x: expert_gemm.expert_mlp(x, gs, w_in, w_out, "ragged_dot",
                                                    row_buckets=(100, 250))).lower(x).as_text()
    assert "case" in text or "conditional" in text


def test_row_buckets_refuse_padded_rows_and_the_einsum():
    x, w_in, w_out, _, _ = padded_data()
    with pytest.raises(ValueError, match="needs packed rows"):
        expert_gemm.expert_mlp(jnp.asarray(x), jnp.asarray(COUNTS), w_in, w_out, "masked",
                               row_buckets=(8,))
    packed = jnp.zeros((TOTAL, H), jnp.bfloat16)
    with pytest.raises(ValueError, match="expert_gemm='einsum'"):
        expert_gemm.expert_mlp(packed, jnp.asarray(COUNTS), w_in, w_out, "einsum",
                               row_buckets=(8,))


@pytest.mark.parametrize("live,picked", [(0, 104), (104, 104), (105, 256), (256, 256),
                                         (257, 512), (512, 512), (600, 512)])
def test_the_switch_picks_the_smallest_bucket_that_holds_the_live_rows(live, picked):
    """A probe GEMM that answers with its own row count: the bucket taken for each load, at
    and across the boundaries (buckets 104, 256 and the whole 512 rows)."""
    buckets = expert_gemm.bucket_rows(512, (100, 256))
    assert buckets == (104, 256, 512)
    probe = lambda xb, gs, wi, wo, od: jnp.full((xb.shape[0], 1), xb.shape[0], od)  # noqa
    gs = jnp.asarray([live // 2, live - live // 2], jnp.int32)
    y = jax.jit(lambda x, gs: expert_gemm.bucketed_mlp(probe, x, gs, None, None, jnp.float32,
                                                       buckets))(jnp.zeros((512, 4)), gs)
    assert y.shape == (512, 1) and int(y[0, 0]) == picked
    assert not np.any(np.asarray(y[picked:]))  # padded past the bucket


@pytest.mark.parametrize("option", ["ragged_dot", "tokamax"])
def test_bucket_per_device_under_shard_map_with_gradients(option, monkeypatch):
    """Four devices with loads 5, 50, 110 and 128 of 128 rows take buckets 16, 64, 128 and 128
    in one step; y's live rows and every gradient equal the unbucketed option's. "tokamax" is
    the stand-in (rows past the live ones NaN), so its custom VJP runs inside the switch."""
    monkeypatch.setattr(expert_gemm, "_tokamax", lambda: (StandInTokamax(), None))
    expert_gemm._tokamax_dot.cache_clear()
    from jax.sharding import PartitionSpec as P
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("ep",))
    rng = np.random.default_rng(5)
    rows, h, f, L = 128, 16, 24, 2
    sizes = jnp.asarray([3, 2, 25, 25, 60, 50, 64, 64], jnp.int32)  # [device, expert]
    x = jnp.asarray(rng.standard_normal((4 * rows, h)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((4 * L, h, f)) / 4, jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((4 * L, f, h)) / 5, jnp.bfloat16)

    def run(buckets):
        def body(x, sizes, w_in, w_out):
            live = (jnp.arange(rows) < jnp.sum(sizes))[:, None]

            def loss(x, w_in, w_out):
                y = expert_gemm.expert_mlp(x, sizes, w_in, w_out, option, row_buckets=buckets)
                return jnp.sum(jnp.where(live, y, 0) ** 2), jnp.where(live, y, 0)
            return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w_in, w_out)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4,
                           out_specs=((P("ep"),) * 3, P("ep")))
        return jax.jit(fn)(x, sizes, w_in, w_out)

    try:
        (got_g, got_y), (want_g, want_y) = run((16, 64)), run(None)
    finally:
        expert_gemm._tokamax_dot.cache_clear()
    close("live y", got_y, want_y, rtol=1e-6)
    for name, g, w in zip(("d x", "d w_in", "d w_out"), got_g, want_g):
        close(name, g, w, rtol=1e-6)


@pytest.mark.skipif(expert_gemm.resolve("auto", layout="packed") != "einsum",
                    reason="'auto' is a packed GEMM on this platform: it takes the buckets")
def test_auto_where_it_means_the_einsum_runs_without_buckets():
    """On CPU "auto" is the padded einsum: buckets are dropped, not an error (the same layer
    config runs on a GPU with them)."""
    x, w_in, w_out, _, live = padded_data()
    packed = jnp.asarray(to_packed(x, live))
    want = expert_gemm.expert_mlp(packed, jnp.asarray(COUNTS), w_in, w_out, "auto")
    got = expert_gemm.expert_mlp(packed, jnp.asarray(COUNTS), w_in, w_out, "auto",
                                 row_buckets=(8,))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("buckets,why", [(1.25, "a tuple of capacity factors"),
                                         ((1.25, 0.0), "finite number > 0"),
                                         ((float("nan"),), "finite number > 0")])
def test_layer_config_refuses_bad_row_buckets(buckets, why):
    with pytest.raises(ValueError, match=why):
        MoELayerConfig(**LAYER, gemm_row_buckets=buckets)
    with pytest.raises(ValueError, match="the einsum runs padded rows"):
        MoELayerConfig(**LAYER, expert_gemm="einsum", gemm_row_buckets=(1.25,))


def test_layer_gradients_with_row_buckets_match_the_einsum_option(einsum_layer):
    """Through dispatch, the bucketed GEMMs and combine under shard_map: buckets of 0.25x and
    0.5x the mean load, then the whole buffer: 8, 16 and 36 rows (these inputs load 10 and 13
    rows: the middle bucket)."""
    cfg = MoELayerConfig(**LAYER, expert_gemm="ragged_dot", gemm_row_buckets=(0.25, 0.5))
    mesh = T.make_mesh(WORLD)
    a2a = AllToAll(cfg.comm_config(WORLD), differentiable=True, layout="packed")
    comm = a2a.config
    assert expert_gemm.bucket_rows(comm.max_recv_total,
                                   [comm.recv_rows_for(f) for f in (0.25, 0.5)]) == (8, 16, 36)
    x, nt, G, drop = T.layer_grad_inputs(cfg, WORLD, 7, drop_rate=0.2)
    try:
        (grads,), dx = T.run_layer_grads(a2a, cfg, mesh, [init_params(cfg, 3)], x, nt, G, drop)
    finally:
        a2a.close()
    (want,), want_dx = einsum_layer
    for rank in range(WORLD):
        for name, g in grads[rank].items():
            close(f"rank {rank} d {name}", g, want[rank][name])
        close(f"rank {rank} d x", dx[rank], want_dx[rank])
