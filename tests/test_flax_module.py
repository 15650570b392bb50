"""The Flax NNX module for real models (issue 26): [B, S, H] and [T, H] inputs on a
("data", "expert") mesh of 8 CPU devices against the dense oracle, eval_shape without a
handle, sharded init, Orbax round trip, token budgets, errors that say what to change."""

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="flax is an optional extra: pip install "
                                             "jax_moe_comm[flax]")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_comm.flax as jf  # noqa: E402
from jax_moe_comm import ProtocolError  # noqa: E402
from jax_moe_comm import router as rtr  # noqa: E402
from jax_moe_comm.router import RouterConfig  # noqa: E402

E, K, H, F = 8, 2, 128, 128


def mesh2(axis_types="Auto"):
    kind = getattr(jax.sharding.AxisType, axis_types)
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(kind, kind))


def make(mesh, **kw):
    args = dict(num_experts=E, experts_per_token=K, hidden=H, ffn=F, max_num_tokens=8,
                mesh=mesh, expert_axis="expert", data_axes="data", rngs=nnx.Rngs(0))
    args.update(kw)
    return jf.MoE(**args)


def sharded(mesh, *spec):
    return jax.sharding.NamedSharding(mesh, P(*spec))


def full_params(moe):
    return {k: np.asarray(v) for k, v in moe._params().items()}


def close_to_dense(moe, x, y, **kw):
    local = jax.devices()[0]
    p = {k: jax.device_put(v, local) for k, v in full_params(moe).items()}
    ref = jax.jit(lambda x, p, kw: moe.dense(x, params=p, **kw))(
        jax.device_put(np.asarray(x), local), p, kw)
    err = np.abs(np.asarray(y, np.float32) - np.asarray(ref, np.float32)).max()
    assert err <= 0.05, err
    return err


@pytest.mark.parametrize("shared,gated", [(1, False), (2, True)], ids=["1-shared", "gated-2-shared"])
def test_bsh_and_th_inputs_on_a_data_expert_mesh_match_the_dense_layer(shared, gated):
    mesh = mesh2()
    moe = make(mesh, router=RouterConfig(score="sigmoid", num_groups=4, topk_groups=2,
                                         expert_bias=True), shared_ffn=64,
               num_shared_experts=shared, gated=gated)
    moe.expert_bias[...] = jnp.linspace(-0.1, 0.1, E)  # selection only
    step = nnx.jit(lambda m, x, n, mask: m(x, n, mask=mask))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16, H)).astype(jnp.bfloat16)  # 64 tokens: 8 per device
    mask = rng.random((4, 16)) > 0.2
    y = step(moe, jnp.asarray(x), 50, jnp.asarray(mask))  # scalar: the first 50 tokens live
    assert y.shape == (4, 16, H) and y.dtype == jnp.bfloat16
    assert not np.asarray(y, np.float32).reshape(64, H)[50:].any()
    close_to_dense(moe, x, y, num_tokens=50, mask=mask)
    jf.check_handles(moe)  # nothing recorded (the reference counts per device: no false alarm)
    moe.close()


def test_row_buckets_give_the_dense_layers_output(monkeypatch):
    """gemm_row_buckets: the GEMMs on 0.5x or 1x the mean load's rows, or the whole buffer,
    whichever holds each rank's live rows; the output is still the dense layer's."""
    from jax_moe_comm import expert_gemm
    traced = []
    real = expert_gemm.bucketed_mlp
    monkeypatch.setattr(expert_gemm, "bucketed_mlp",
                        lambda *a: traced.append(a[-1]) or real(*a))
    moe = make(mesh2(), expert_gemm="ragged_dot", gemm_row_buckets=(0.5, 1.0))
    x = np.random.default_rng(3).standard_normal((64, H)).astype(jnp.bfloat16)
    y = nnx.jit(lambda m, x: m(x, 64))(moe, jnp.asarray(x))
    assert traced and len(traced[0]) == 3, traced  # two buckets and the whole buffer
    close_to_dense(moe, x, y, num_tokens=64)
    moe.close()


def test_routing_is_the_layers_choice_with_its_scores_and_margin():
    """MoE.routing, on global arrays and on one device with full params: the experts the
    layer's router (route_tokens) chooses, the selection scores (sigmoid + expert bias) and
    router.selection_margin of the same f32 logits."""
    cfg = RouterConfig(score="sigmoid", num_groups=4, topk_groups=2, expert_bias=True)
    moe = make(mesh2(), router=cfg)
    moe.expert_bias[...] = jnp.linspace(-0.1, 0.1, E)
    x = np.random.default_rng(2).standard_normal((4, 16, H)).astype(jnp.bfloat16)
    r = moe.routing(jnp.asarray(x))
    assert isinstance(r, jf.Routing)
    assert (r.indices.shape, r.scores.shape, r.margin.shape) == ((4, 16, K), (4, 16, E), (4, 16))
    local = jax.devices()[0]
    p = {k: jax.device_put(v, local) for k, v in full_params(moe).items()}
    r1 = jax.jit(lambda x, p: moe.routing(x, params=p))(jax.device_put(x, local), p)
    for a, b in zip(r, r1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    flat = jnp.asarray(x.reshape(-1, H))
    bias = np.asarray(moe.expert_bias[...])
    routed, _ = jf.route_tokens(moe.layer, cfg, p["router"], flat, jnp.ones(64, bool), bias)
    np.testing.assert_array_equal(np.asarray(r.indices).reshape(-1, K), np.asarray(routed.indices))
    logits = np.asarray(flat, np.float32) @ np.asarray(p["router"], np.float32)
    np.testing.assert_allclose(np.asarray(r.scores).reshape(-1, E),
                               1 / (1 + np.exp(-logits)) + bias, rtol=1e-5, atol=1e-6)
    margin = np.asarray(rtr.selection_margin(cfg, jnp.asarray(logits), K, jnp.asarray(bias)))
    np.testing.assert_allclose(np.asarray(r.margin).reshape(-1), margin, rtol=1e-3, atol=1e-6)
    assert (margin > 0).all()
    moe.close()


def test_expert_axis_over_both_mesh_axes_and_token_budgets():
    """expert_axis=("data", "expert"): the nvshmem layout on a 2-axis mesh (experts over all 8
    devices); budgets (8, 2): [T, H] with one token per device and per-shard counts takes the
    small handle, padded to 2. capacity_factor: each budget's handle holds that multiple of
    its own mean load (3x: 16 rows at budget 2, room for the 12 rows that can come)."""
    mesh = mesh2("Explicit")
    moe = make(mesh, expert_axis=("data", "expert"), data_axes=(), max_num_tokens=(8, 2),
               num_experts=16, num_shared_experts=0, gated=True, capacity_factor=3.0)
    assert {b: a.config.max_num_tokens for b, a in moe.handles.by_budget.items()} == {8: 8, 2: 2}
    assert {b: (a.layout, a.max_recv_rows) for b, a in moe.handles.by_budget.items()} == \
        {8: ("packed", 3 * 8 * 8 * K // 8), 2: ("packed", 16)}
    assert moe.handles.by_budget[8].config.world_size == 8
    assert nnx.get_partition_spec(nnx.state(moe, nnx.Param))["w_in"].get_value() == \
        P(("data", "expert"), None, None)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, H)).astype(jnp.bfloat16)  # 1 per device, padded to 2
    counts = np.array([1, 0, 1, 1, 0, 1, 1, 1], np.int32)
    y = nnx.jit(lambda m, x, n: m(x, n))(moe, jnp.asarray(x), jnp.asarray(counts))
    assert not np.asarray(y, np.float32)[counts == 0].any()
    close_to_dense(moe, x, y, num_tokens=counts)
    jf.check_handles(moe)
    moe.close()


def test_padded_layout_with_a_capacity_factor_sizes_each_budgets_experts():
    """layout="padded" with capacity_factor: each budget's handle holds that multiple of its
    own mean load per expert (MoEConfig.rows_per_expert_for: 2x 8 = 16 of 32 rows at budget
    8, 8 of 8 at budget 2); the batched einsum runs on them and, with room for this routing,
    y is the dense layer's (overflow="fail": check_handles would raise a drop)."""
    mesh = mesh2()
    moe = make(mesh, layout="padded", capacity_factor=2.0, max_num_tokens=(8, 2),
               num_shared_experts=0, expert_gemm="einsum")
    assert {b: (a.layout, a.expert_capacity, a.config.max_recv_tokens)
            for b, a in moe.handles.by_budget.items()} == {8: ("padded", 16, 32),
                                                          2: ("padded", 8, 8)}
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 16, H)).astype(jnp.bfloat16)  # 8 tokens per device
    y = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    close_to_dense(moe, x, y)
    jf.check_handles(moe)
    assert moe.handles.by_budget[8].dropped_rows() == 0
    moe.close()


def test_eval_shape_makes_no_handle_then_sharded_init_and_orbax_round_trip(tmp_path):
    mesh = mesh2()
    made = []
    real = jf.AllToAll
    jf.AllToAll = lambda *a, **k: made.append(1) or real(*a, **k)
    try:
        abstract = nnx.eval_shape(lambda: make(mesh))
        assert not made and not abstract.handles.by_budget
        specs = nnx.get_partition_spec(nnx.state(abstract, nnx.Param))
        assert specs["w_in"].get_value() == P("expert", None, None)
        assert specs["router"].get_value() == P(None, None)
        assert abstract.w_in.get_metadata()["logical_axes"] == ("expert", "embed", "mlp")

        @nnx.jit
        def sharded_init():  # the Flax recipe: every parameter made where it lives
            return make(mesh)

        model = sharded_init()
        assert not made  # traced: no handle yet
        w_in = model.w_in[...]
        assert w_in.sharding.is_equivalent_to(sharded(mesh, "expert", None, None), 3)
        assert w_in.dtype == jnp.float32
        assert len(w_in.addressable_shards[0].data) == E // 4
        with pytest.raises(ProtocolError, match=r"create_handles\(model\)"):
            nnx.jit(lambda m, x: m(x))(model, jnp.zeros((16, H), jnp.bfloat16))
        assert jf.create_handles(model) == 1 and len(made) == 1
    finally:
        jf.AllToAll = real
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, H)), jnp.bfloat16)
    step = nnx.jit(lambda m, x: m(x))
    y = step(model, x)

    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint not installed")
    path = tmp_path / "moe"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, nnx.state(model, nnx.Param))
    graphdef, abs_state, rest = nnx.split(nnx.eval_shape(lambda: make(mesh, rngs=nnx.Rngs(7))),
                                          nnx.Param, ...)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abs_state, nnx.get_named_sharding(abs_state, mesh))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path, target)
    back = nnx.merge(graphdef, restored, rest)
    assert back.w_in[...].sharding.is_equivalent_to(sharded(mesh, "expert", None, None), 3)
    jf.create_handles(back)
    np.testing.assert_array_equal(np.asarray(step(back, x), np.float32), np.asarray(y, np.float32))
    jf.close_handles(model)
    jf.close_handles(back)


def test_layers_share_one_handle_and_train_like_the_dense_layer():
    mesh = mesh2()

    class Two(nnx.Module):
        def __init__(self, rngs):
            kw = dict(mesh=mesh, eager_handles=False, rngs=rngs,
                      router=RouterConfig(aux_loss_coef=0.01))
            self.a, self.b = make(**kw), make(**kw)

        def __call__(self, x, dense=False):
            if dense:
                return self.b.dense(self.a.dense(x).astype(jnp.float32) + x), None
            # one call per layer: two cycles on a shared handle must depend on each other
            # (XLA orders by data; the kernels refuse a second cycle in flight)
            y, aux = self.a(x, return_aux=True)
            return self.b(y.astype(jnp.float32) + x), aux

    model = Two(nnx.Rngs(3))
    assert jf.create_handles(model) == 1
    assert model.a.handle() is model.b.handle()
    x = jnp.asarray(np.random.default_rng(4).standard_normal((32, H)) * 0.5, jnp.float32)

    def grads(dense):
        def loss(m):
            y, aux = m(x, dense)
            if aux is not None:  # layer a's aux loss and load, over every token
                assert_aux(aux)
            return jnp.mean(y.astype(jnp.float32) ** 2)
        return nnx.jit(nnx.grad(loss))(model)

    def assert_aux(aux):
        jax.debug.callback(lambda loss, load: checked.append(
            (0.9 < float(loss) / 0.01 < 3, float(load.sum()) == 32 * K)), aux.aux_loss,
            aux.expert_load)

    checked = []

    g, g_dense = grads(False), grads(True)
    for name in ("router", "w_in", "shared_out"):
        a = np.asarray(getattr(g.a, name)[...], np.float32)
        b = np.asarray(getattr(g_dense.a, name)[...], np.float32)
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max() + 1e-6, name
    jax.effects_barrier()
    assert checked and all(all(c) for c in checked), checked
    jf.check_handles(model)
    jf.close_handles(model)


@pytest.mark.parametrize("kw, match", [
    (dict(expert_axis="ep"), r"expert_axis='ep' is not an axis of the mesh, whose axes are "
                             r"\('data', 'expert'\)"),
    (dict(data_axes="expert"), "must name distinct mesh axes"),
    (dict(num_experts=6), "num_experts=6 is not divisible by the 4 ranks"),
    (dict(layout="sparse"), r"layout='sparse'; expected one of \('padded', 'packed'\)"),
    (dict(layout="padded", gemm_row_buckets=(1.0,)), "needs layout='packed'"),
    (dict(gemm_row_buckets=1.25), "a tuple of capacity factors"),
    (dict(router=RouterConfig(num_groups=4, topk_groups=1), experts_per_token=3),
     "experts_per_token=3 exceeds the 2 experts of the topk_groups=1 groups"),
    (dict(num_shared_experts=-1), r"num_shared_experts=-1: how many shared experts, an int >= 0"),
    (dict(num_shared_experts=1.5), r"num_shared_experts=1.5: how many shared experts"),
    (dict(shared_ffn=0), r"shared_ffn=0: the hidden width of one shared expert, an int >= 1"),
    (dict(shared_ffn=64.0), r"shared_ffn=64.0: the hidden width"),
    (dict(gated="yes"), r"gated='yes': True \(SiLU-gated MLPs"),
])
def test_construction_errors_say_what_to_change(kw, match):
    with pytest.raises(ValueError, match=match):
        make(mesh2(), **kw)


def test_shared_expert_is_renamed_num_shared_experts():
    with pytest.raises(TypeError, match=r"MoE\(shared_expert=...\) is gone: pass "
                                        r"num_shared_experts=1 \(was True\) or 0"):
        make(mesh2(), shared_expert=True)


def test_gated_and_shared_experts_parameter_shapes_and_specs():
    """num_shared_experts=2 of shared_ffn=48: one shared MLP of width 96; gated: w_in [E, H,
    2F] and shared_in [H, 2 * 96] (gate columns, then up), the sharding names unchanged;
    num_shared_experts=0: no shared parameters. eval_shape only: no handle."""
    mesh = mesh2()
    moe = nnx.eval_shape(lambda: make(mesh, num_shared_experts=2, shared_ffn=48, gated=True))
    shapes = {k: tuple(v.shape) for k, v in nnx.state(moe, nnx.Param).items()}
    assert shapes == {"router": (H, E), "w_in": (E, H, 2 * F), "w_out": (E, F, H),
                      "shared_in": (H, 2 * 96), "shared_out": (96, H)}, shapes
    specs = nnx.get_partition_spec(nnx.state(moe, nnx.Param))
    assert specs["w_in"].get_value() == P("expert", None, None)
    assert specs["shared_in"].get_value() == P(None, None)
    assert moe.shared_in.get_metadata()["logical_axes"] == ("embed", "mlp")
    none = nnx.eval_shape(lambda: make(mesh, num_shared_experts=0))
    assert set(nnx.state(none, nnx.Param)) == {"router", "w_in", "w_out"}


def test_call_errors_say_what_to_change():
    moe = make(mesh2())
    for x_shape, match in [
            ((2, 8, 64), r"expected \[B, S, 128\] or \[T, 128\]"),
            ((3, 5, H), "not a multiple of the 8 token shards .mesh axes data=2 x expert=4"),
            ((2, 40, H), r"10 tokens per rank, more than the largest max_num_tokens=8 .*"
                         r"max_num_tokens=\(10,\)")]:
        with pytest.raises(ValueError, match=match):
            moe(jnp.zeros(x_shape, jnp.bfloat16))
    x = jnp.zeros((2, 8, H), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"num_tokens has shape \(3,\); expected None"):
        moe(x, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"mask has shape \(16,\); expected \(2, 8\)"):
        moe(x, mask=jnp.ones((16,), bool))
    moe.close()
