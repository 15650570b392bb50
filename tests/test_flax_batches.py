"""The Flax module on real batches and real models (issue 49): any [B, S, H] whose token count
divides over the token shards, B below their count included, on Explicit and Auto meshes; y
laid out as x; refusals of x dtypes and num_tokens out of range; handles shared per budget
across layers by default, calls on one handle ordered; the symmetric bytes of a config and of
a model before anything is allocated, checked against the native layout (csrc/core/layout.h
compiled here)."""

import dataclasses
import os
import shutil
import subprocess

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="flax is an optional extra: pip install "
                                             "jax_moe_comm[flax]")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_comm.flax as jf  # noqa: E402
from jax_moe_comm import AllToAll, MoEConfig, sizes  # noqa: E402

E, K, H, F = 8, 2, 64, 64
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def mesh_of(names, axis_type):
    kind = getattr(jax.sharding.AxisType, axis_type)
    shape = (8,) if len(names) == 1 else (2, 4)
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def make(mesh, **kw):
    names = mesh.axis_names
    args = dict(num_experts=E, experts_per_token=K, hidden=H, ffn=F, max_num_tokens=8,
                mesh=mesh, expert_axis=names[-1], data_axes=names[:-1], rngs=nnx.Rngs(0))
    args.update(kw)
    return jf.MoE(**args)


def dense_on_one_device(moe, x, **kw):
    local = jax.devices()[0]
    p = {k: jax.device_put(np.asarray(v), local) for k, v in moe._params().items()}
    return np.asarray(jax.jit(lambda x, p, kw: moe.dense(x, params=p, **kw))(
        jax.device_put(np.asarray(x), local), p, kw), np.float32)


def spec_of(a):
    spec = tuple(jax.typeof(a).sharding.spec)
    return spec + (None,) * (a.ndim - len(spec))


# (mesh axes, x shape, x's partition spec): B below, at and above the 8 token shards, x
# sharded as a caller would (batch over what divides it, sequence over the rest) or
# replicated.
BATCHES = [
    (("ep",), (4, 16, H), (None, "ep", None)),
    (("ep",), (2, 32, H), (None, "ep", None)),
    (("ep",), (4, 16, H), (None, None, None)),
    (("ep",), (1, 64, H), (None, "ep", None)),
    (("ep",), (8, 8, H), ("ep", None, None)),
    (("data", "expert"), (4, 16, H), ("data", "expert", None)),
    (("data", "expert"), (2, 32, H), ("data", "expert", None)),
    (("data", "expert"), (64, H), (("data", "expert"), None)),
]


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("names, shape, spec", BATCHES,
                         ids=[f"{'x'.join(n)}-{'x'.join(map(str, s[:-1]))}-{i}"
                              for i, (n, s, _) in enumerate(BATCHES)])
def test_any_batch_whose_tokens_divide_matches_the_dense_layer(axis_type, names, shape, spec):
    """The call, dense and routing on a batch of `shape`: y like x (shape, dtype, and on
    Explicit axes x's sharding in y's type), equal to the dense layer on one device, the
    scalar num_tokens and a mask applied over the batch-major token order."""
    mesh = mesh_of(names, axis_type)
    moe = make(mesh)
    rng = np.random.default_rng(sum(shape))
    xn = rng.standard_normal(shape).astype(jnp.bfloat16)
    x = jax.device_put(xn, NamedSharding(mesh, P(*spec)))
    mask = jax.device_put(rng.random(shape[:-1]) > 0.25, NamedSharding(mesh, P(*spec[:-1])))
    y = nnx.jit(lambda m, x, mask: m(x, 50, mask=mask))(moe, x, mask)
    assert y.shape == shape and y.dtype == jnp.bfloat16
    if axis_type == "Explicit":
        assert spec_of(y) == spec, (spec_of(y), spec)
    ref = dense_on_one_device(moe, xn, num_tokens=50, mask=np.asarray(mask))
    got = np.asarray(y, np.float32)
    assert np.abs(got - ref).max() <= 0.05
    assert not got.reshape(-1, H)[50:].any()  # the first 50 tokens of the flattened batch

    dense = nnx.jit(lambda m, x: m.dense(x))(moe, x)
    assert dense.shape == shape
    np.testing.assert_allclose(np.asarray(dense, np.float32), dense_on_one_device(moe, xn),
                               atol=0.05)
    r = nnx.jit(lambda m, x: m.routing(x))(moe, x)
    assert r.indices.shape == shape[:-1] + (K,) and r.margin.shape == shape[:-1]
    jf.check_handles(moe)
    moe.close()


def test_the_token_layout_is_the_one_that_moves_no_rows():
    mesh = mesh_of(("data", "expert"), "Explicit")
    moe = make(mesh, eager_handles=False)
    assert moe.token_layout((16, 4)) == (("data", "expert"), None)
    assert moe.token_layout((2, 32)) == ("data", "expert")
    assert moe.token_layout((1, 64)) == (None, ("data", "expert"))
    assert moe.token_layout((4, 16)) is None  # 4 rows of B over data=2 x expert=4: none
    assert moe.token_layout((64,)) == (("data", "expert"),)
    one = make(mesh_of(("ep",), "Auto"), eager_handles=False)
    assert one.token_layout((4, 16)) is None and one.token_layout((1, 64)) == (None, "ep")
    # Where it exists, flattening x laid out so and restoring y are reshapes of local rows.
    x = jax.device_put(jnp.zeros((2, 32, H), jnp.bfloat16), NamedSharding(mesh, P("data",
                                                                                    "expert")))
    hlo = jax.jit(lambda x: moe._from_tokens(moe._flatten(x)[0] + 1, (2, 32), x)).lower(
        x).compile().as_text()
    assert not any(op in hlo for op in ("all-to-all", "all-gather", "collective-permute")), hlo


def test_tokens_that_do_not_divide_say_how_many_to_pad():
    moe = make(mesh_of(("ep",), "Explicit"))
    with pytest.raises(ValueError, match=r"x has 6 tokens \(2 x 3\), not a multiple of the 8 "
                                         r"token shards \(mesh axes ep=8\): pad the batch"):
        moe(jnp.zeros((2, 3, H), jnp.bfloat16))
    moe.close()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float16, jnp.uint8, jnp.bool_])
def test_x_of_another_dtype_is_refused_at_trace_time_naming_it(dtype):
    moe = make(mesh_of(("ep",), "Explicit"))
    x = jnp.zeros((4, 16, H), dtype)
    name = jnp.dtype(dtype).name
    for call in (lambda m, x: m(x), lambda m, x: m.dense(x), lambda m, x: m.routing(x)):
        with pytest.raises(TypeError, match=rf"x has dtype {name}, .*bfloat16 or float32"):
            nnx.jit(call)(moe, x)
    moe.close()


def test_float32_x_is_taken_and_gives_the_layers_bf16_result():
    moe = make(mesh_of(("ep",), "Auto"))
    xn = np.random.default_rng(5).standard_normal((2, 32, H)).astype(np.float32)
    y32 = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(xn))
    y16 = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(xn, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(y32, np.float32), np.asarray(y16, np.float32))
    moe.close()


@pytest.mark.parametrize("num_tokens, error, match", [
    (1000, ValueError, r"num_tokens=1000 is outside \[0, 64\] \(live rows of x\)"),
    (-1, ValueError, r"num_tokens=-1 is outside \[0, 64\]"),
    (np.int64(65), ValueError, r"num_tokens=65 is outside \[0, 64\]"),
    (np.array([8, 8, 9, 0, 0, 0, 0, 0], np.int32), ValueError,
     r"num_tokens=\[8, 8, 9, 0, 0, 0, 0, 0\] is outside \[0, 8\] \(live rows per token shard"),
    (np.full(8, -2, np.int32), ValueError, r"is outside \[0, 8\]"),
    (3.5, TypeError, r"num_tokens has dtype float64; expected int32 counts"),
    (True, TypeError, r"num_tokens has dtype bool"),
])
def test_concrete_num_tokens_out_of_range_are_refused(num_tokens, error, match):
    moe = make(mesh_of(("ep",), "Explicit"))
    x = jnp.zeros((4, 16, H), jnp.bfloat16)
    with pytest.raises(error, match=match):
        nnx.jit(lambda m, x: m(x, num_tokens))(moe, x)
    with pytest.raises(error, match=match):
        moe.dense(x, num_tokens)
    moe.close()


def test_traced_num_tokens_are_clamped():
    """A traced count past the rows (1000, or 9 of a shard's 8) is every row; below 0, none."""
    moe = make(mesh_of(("ep",), "Auto"))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 16, H)), jnp.bfloat16)
    step = nnx.jit(lambda m, x, n: m(x, n))
    every = np.asarray(nnx.jit(lambda m, x: m(x))(moe, x), np.float32)
    assert np.abs(every).max() > 0
    np.testing.assert_array_equal(np.asarray(step(moe, x, jnp.int32(1000)), np.float32), every)
    assert not np.asarray(step(moe, x, jnp.int32(-3)), np.float32).any()
    per_shard = step(moe, x, jnp.array([9, 8, 8, 8, 8, 8, 8, -1], jnp.int32))
    got = np.asarray(per_shard, np.float32).reshape(8, 8, H)
    np.testing.assert_array_equal(got[:7], every.reshape(8, 8, H)[:7])
    assert not got[7].any()
    with pytest.raises(TypeError, match="num_tokens has dtype float32; expected int32"):
        step(moe, x, jnp.float32(3))
    moe.close()


# -- handles shared across layers --------------------------------------------------------------
@pytest.fixture
def counted(monkeypatch):
    """The AllToAlls the module creates, in order."""
    made = []
    real = jf.AllToAll

    def counting(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(jf, "AllToAll", counting)
    return made


def test_layers_share_one_handle_per_budget_by_default(counted):
    """Three eagerly built layers of one shape and two budgets hold two handles (not six);
    closing a layer leaves a handle another layer holds open; share_handles=False gives a
    layer its own."""
    mesh = mesh_of(("data", "expert"), "Explicit")
    layers = [make(mesh, max_num_tokens=(8, 2)) for _ in range(3)]
    assert len(counted) == 2 and jf.pooled_handles() == 2
    for budget in (8, 2):
        assert len({id(m.handles.by_budget[budget]) for m in layers}) == 1
    own = make(mesh, max_num_tokens=(8, 2), share_handles=False)
    assert len(counted) == 4 and jf.pooled_handles() == 2
    assert own.handle(8) is not layers[0].handle(8)
    other = make(mesh, max_num_tokens=(8, 2), ffn=2 * F)  # ffn is not the handle's shape
    assert len(counted) == 4 and other.handle(8) is layers[0].handle(8)
    wider = make(mesh, max_num_tokens=8, hidden=2 * H)
    assert len(counted) == 5 and wider.handle() is not layers[0].handle()

    shared = layers[0].handle(8)
    layers[0].close()
    assert not shared._closed and layers[1].handle(8) is shared
    x = jnp.zeros((2, 32, H), jnp.bfloat16)
    assert nnx.jit(lambda m, x: m(x))(layers[1], x).shape == x.shape
    for m in layers[1:] + [other]:
        m.close()
    assert shared._closed and jf.pooled_handles() == 1  # wider's
    assert not own.handle(8)._closed
    own.close()
    wider.close()
    assert jf.pooled_handles() == 0 and all(a._closed for a in counted)


def test_a_model_built_without_eager_handles_gets_one_per_budget(counted):
    mesh = mesh_of(("ep",), "Auto")

    class Stack(nnx.Module):
        def __init__(self, n, **kw):
            self.layers = getattr(nnx, "List", list)(
                [make(mesh, max_num_tokens=(8, 2), eager_handles=False, **kw)
                 for _ in range(n)])

    model = Stack(4)
    assert not counted
    assert jf.create_handles(model) == 2 and len(counted) == 2
    apart = Stack(2, share_handles=False)
    assert jf.create_handles(apart) == 4 and len(counted) == 6
    jf.close_handles(model)
    jf.close_handles(apart)
    assert all(a._closed for a in counted) and jf.pooled_handles() == 0


class SideBySide(nnx.Module):
    """Two layers on the same x (no data between them) and a third on their sum."""

    def __init__(self, mesh, **kw):
        self.a, self.b, self.c = make(mesh, **kw), make(mesh, **kw), make(mesh, **kw)

    def __call__(self, x):
        return self.c(self.a(x) + self.b(x))


def test_layers_on_one_handle_in_one_jit_run_in_order_and_match_the_dense_layers():
    """Three layers of one jitted forward on one handle, two of them side by side (no data
    between them): each later call takes the previous call's y as an operand (its dispatch
    depends on it; the same layers on their own handles do not), the reference backend's
    protocol check records no overlap over several steps, and y is the dense layers'."""
    mesh = mesh_of(("data", "expert"), "Explicit")
    shared, apart = SideBySide(mesh), SideBySide(mesh, share_handles=False)
    assert shared.a.handle() is shared.c.handle()
    rng = np.random.default_rng(7)
    xn = (rng.standard_normal((2, 32, H)) * 0.5).astype(jnp.bfloat16)
    x = jax.device_put(xn, NamedSharding(mesh, P("data", "expert")))

    def operands(model):
        jaxpr = jax.make_jaxpr(lambda x: model(x))(x).jaxpr
        return [len(e.invars) for e in jaxpr.eqns if e.primitive.name == "shard_map"]

    alone = operands(apart)
    assert len(alone) == 3 and len(set(alone)) == 1
    assert operands(shared) == [alone[0], alone[0] + 1, alone[0] + 1]
    fwd = nnx.jit(lambda m, x: m(x))
    for _ in range(3):
        y = np.asarray(fwd(shared, x), np.float32)
    jf.check_handles(shared)
    a = dense_on_one_device(shared.a, xn)
    b = dense_on_one_device(shared.b, xn)
    ref = dense_on_one_device(shared.c, (a + b).astype(jnp.bfloat16))
    assert np.abs(y - ref).max() <= 0.1
    jf.close_handles(shared)
    jf.close_handles(apart)


def test_a_stack_of_layers_on_one_handle_trains_in_one_jit():
    """Four layers in sequence (x + layer(x)) on one shared handle: forward and gradient in
    one jitted step, the gradient of every layer's experts nonzero and finite."""
    mesh = mesh_of(("ep",), "Explicit")

    class Stack(nnx.Module):
        def __init__(self):
            self.layers = getattr(nnx, "List", list)([make(mesh) for _ in range(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = x + layer(x).astype(x.dtype)
            return x

    model = Stack()
    assert len({id(m.handle()) for m in model.layers}) == 1
    x = jax.device_put(jnp.asarray(np.random.default_rng(8).standard_normal((4, 16, H)),
                                   jnp.float32), NamedSharding(mesh, P(None, "ep")))
    grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))(model)
    for i in range(4):
        g = np.asarray(grads.layers[i].w_in[...], np.float32)
        assert np.isfinite(g).all() and np.abs(g).max() > 0
    jf.check_handles(model)
    jf.close_handles(model)


# -- symmetric bytes ---------------------------------------------------------------------------
CARVE = r"""
#include <cstdio>
#include "core/layout.h"
int main() {  // one Shape per line on stdin -> SymmetricLayout::carve's size
  jmc::Shape s{};
  int staged = 0;
  while (std::scanf("%d %d %d %d %d %d %d %d %d %d", &s.num_experts, &s.experts_per_token,
                    &s.hidden, &s.max_num_tokens, &s.world_size, &s.dp_size,
                    &s.in_elem_bytes, &s.num_scales, &s.out_elem_bytes, &staged) == 10) {
    size_t bytes = 0;
    jmc::SymmetricLayout::carve(s, staged != 0, nullptr, &bytes);
    std::printf("%zu\n", bytes);
  }
}
"""


@pytest.fixture(scope="module")
def native_carve(tmp_path_factory):
    """csrc/core/layout.h's carve compiled for the host (the header is host/device code: its
    CUDA qualifiers stubbed), as a function of the configs."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build csrc/core/layout.h for the host")
    d = tmp_path_factory.mktemp("carve")
    (d / "stub").mkdir()
    (d / "stub" / "cuda_runtime.h").write_text("#pragma once\n#define __host__\n"
                                               "#define __device__\n")
    (d / "carve.cc").write_text(CARVE)
    subprocess.run([cxx, "-std=c++17", "-O0", "-I", str(d / "stub"), "-I",
                    os.path.join(ROOT, "csrc"), str(d / "carve.cc"), "-o", str(d / "carve")],
                   check=True, capture_output=True, timeout=120)

    def carve(items):
        lines = [" ".join(map(str, (c.num_experts, c.experts_per_token, c.hidden,
                                    c.max_num_tokens, c.world_size, c.token_replicas,
                                    c.dispatch_dtype.itemsize, c.num_scales,
                                    c.combine_dtype.itemsize, int(staged))))
                 for c, staged in items]
        out = subprocess.run([str(d / "carve")], input="\n".join(lines) + "\n", text=True,
                             capture_output=True, check=True, timeout=60).stdout
        return [int(v) for v in out.split()]

    return carve


def configs():
    """Shapes across world sizes, token replicas, top-k against local experts, hidden sizes
    and both dtypes of each direction."""
    out = []
    for world, experts in ((1, 4), (2, 8), (8, 64), (16, 256), (64, 256)):
        for k, m, hidden in ((1, 1, 128), (2, 7, 256), (8, 128, 7168), (6, 512, 2048)):
            if k > experts:
                continue
            for dispatch, combine in ((jnp.bfloat16, jnp.bfloat16),
                                      (jnp.float8_e4m3fn, jnp.float32)):
                replicas = 2 if world % 2 == 0 and world > 1 else 1
                for r in {1, replicas}:
                    out.append(MoEConfig(num_experts=experts, experts_per_token=k,
                                         hidden=hidden, max_num_tokens=m, world_size=world,
                                         token_replicas=r, dispatch_dtype=dispatch,
                                         combine_dtype=combine))
    return out


def test_layout_bytes_are_the_native_carve(native_carve):
    cases = [(c, staged) for c in configs() for staged in (False, True)]
    assert len(cases) > 100
    want = native_carve(cases)
    got = [sizes.layout_bytes(c, staged=s) for c, s in cases]
    assert got == want
    assert len(set(want)) > len(cases) // 3  # the shapes do change the size


@pytest.mark.parametrize("layout, capacity, replicas, differentiable, handles", [
    ("padded", None, 1, False, 1), ("packed", None, 1, False, 1),
    ("padded", None, 1, True, 2), ("packed", None, 1, True, 2),
    ("packed", 24, 1, True, 3), ("padded", 8, 1, True, 3), ("packed", None, 2, True, 3),
])
def test_handle_configs_are_the_backends_an_alltoall_makes(layout, capacity, replicas,
                                                           differentiable, handles):
    """sizes.handle_configs against the backends AllToAll itself creates (the reference
    backend records the config of each), for both layouts, capacities and replicas."""
    cfg = MoEConfig(num_experts=8, experts_per_token=2, hidden=128, max_num_tokens=8,
                    world_size=4, token_replicas=replicas)
    cap = {} if capacity is None else (
        {"max_recv_rows": capacity} if layout == "packed" else {"expert_capacity": capacity})
    a2a = AllToAll(cfg, backend="reference", layout=layout, differentiable=differentiable,
                   **cap)
    try:
        made = [b.cfg for b in a2a._backends]
    finally:
        a2a.close()
    planned = sizes.handle_configs(cfg, layout=layout, differentiable=differentiable, **cap)
    assert list(planned) == made and len(made) == handles
    assert sizes.symmetric_bytes(cfg, layout=layout, differentiable=differentiable, **cap) == \
        sum(sizes.layout_bytes(c) for c in made)


def test_symmetric_bytes_of_a_config_scale_with_its_shape():
    cfg = MoEConfig(num_experts=256, experts_per_token=8, hidden=7168, max_num_tokens=128,
                    world_size=8, dispatch_dtype=jnp.float8_e4m3fn)
    one = sizes.symmetric_bytes(cfg)
    # the dominant regions: recv records [G][m] (header 80 B, 7168 fp8, 56 scales) and the
    # combine rows [m][k] of bf16
    assert one >= 8 * 128 * (80 + 7168 + 224) + 128 * 8 * 7168 * 2
    assert sizes.symmetric_bytes(dataclasses.replace(cfg, max_num_tokens=256)) > 1.9 * one
    assert sizes.symmetric_bytes(cfg, staged=True) > one
    trained = sizes.symmetric_bytes(cfg, layout="packed", differentiable=True)
    assert trained == one + sizes.layout_bytes(dataclasses.replace(
        cfg, dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32))
    with pytest.raises(ValueError, match=r"max_recv_rows=0 must be an int in \[1, "):
        sizes.symmetric_bytes(cfg, layout="packed", max_recv_rows=0)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        sizes.layout_bytes({"hidden": 7168})


def test_heap_size_holds_every_allocation_with_headroom():
    allocs = [5 * 2 ** 20 + 3, 7 * 2 ** 20, 128]
    heap = sizes.heap_bytes(allocs)
    assert heap >= (1 + sizes.HEAP_SLACK) * sum(allocs) and heap % sizes.MIB == 0
    assert heap < 2 * sum(allocs)
    assert sizes.nvshmem_symmetric_size(allocs) == f"{heap // sizes.MIB}M"
    assert sizes.heap_bytes([]) == 0 and sizes.heap_bytes([2 ** 30]) > 2 ** 30


def test_a_models_symmetric_bytes_before_any_handle():
    """jf.symmetric_bytes(model) under nnx.eval_shape (no handle made): each distinct
    (handle_key) handle once where layers share, each layer's where they do not; the heap
    setting holds it."""
    mesh = mesh_of(("data", "expert"), "Auto")

    class Model(nnx.Module):
        def __init__(self, share, rngs):
            kw = dict(max_num_tokens=(8, 2), share_handles=share, capacity_factor=2.0,
                      rngs=rngs)
            self.layers = getattr(nnx, "List", list)([make(mesh, **kw) for _ in range(3)])

    shared = nnx.eval_shape(lambda: Model(True, nnx.Rngs(0)))
    apart = nnx.eval_shape(lambda: Model(False, nnx.Rngs(0)))
    assert not any(m.handles.by_budget for m in jf.moe_layers(shared))
    layer = jf.moe_layers(shared)[0]
    per_layer = 0
    for budget in (8, 2):
        kw = layer._handle_kwargs(budget)
        per_layer += sizes.symmetric_bytes(
            dataclasses.replace(layer.comm, max_num_tokens=budget), layout=kw["layout"],
            max_recv_rows=kw.get("max_recv_rows"), differentiable=True)
    assert jf.symmetric_bytes(shared) == per_layer > 0
    assert jf.symmetric_bytes(apart) == 3 * per_layer
    assert jf.symmetric_bytes(shared, staged=True) > per_layer
    size = jf.nvshmem_symmetric_size(apart)
    assert size.endswith("M") and int(size[:-1]) * sizes.MIB >= 3 * per_layer
