"""What our custom calls and order_after lower to for the GPU (lowered here on CPU; nothing runs):
XLA must see a side effect, JAX must see none (jit's C++ dispatch), and order_after's edge must
be a custom call XLA keeps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_comm import api, native
from jax_moe_comm.backends import ffi_call


def cuda_hlo(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def barrier(x):
    return ffi_call.call("jmc_barrier", jax.ShapeDtypeStruct((1,), jnp.int32), x,
                         side_effect=True, handle=np.int64(7))


def test_primitive_is_available_on_this_jax():
    # Without it every jitted step with our ops loses jit's C++ dispatch (~400 us per call)
    assert ffi_call.fast_dispatch_supported()


def test_side_effect_for_xla_none_for_jax():
    x = jnp.ones((4,), jnp.float32)
    assert jax.make_jaxpr(barrier)(x).effects == set()
    (line,) = [ln for ln in cuda_hlo(barrier, x).splitlines() if "@jmc_barrier" in ln]
    assert "has_side_effect = true" in line and "handle = 7 : i64" in line


def test_unused_side_effecting_call_is_kept_pure_one_dropped():
    def f(x):
        barrier(x)  # result unused: must stay (a send without its recv breaks the protocol)
        ffi_call.call("jmc_pure_probe", jax.ShapeDtypeStruct((1,), jnp.int32), x)
        return x * 2

    hlo = cuda_hlo(f, jnp.ones((4,), jnp.float32))
    assert "@jmc_barrier" in hlo
    assert "@jmc_pure_probe" not in hlo


def test_tuple_results_come_back_as_tuple():
    def f(x):
        return ffi_call.call("jmc_probe", (jax.ShapeDtypeStruct((2,), jnp.int32),
                                           jax.ShapeDtypeStruct((3, 1), jnp.float32)), x,
                             side_effect=True)

    out = jax.eval_shape(f, jnp.ones((4,)))
    assert isinstance(out, tuple) and [o.shape for o in out] == [(2,), (3, 1)]


def test_order_after_on_gpu_is_an_aliasing_custom_call():
    x, d = jnp.ones((4,), jnp.float32), jnp.ones((3,), jnp.bfloat16)
    hlo = cuda_hlo(lambda x, d: api._order_after((x, x + 1), (d,), gpu=True), x, d)
    (line,) = [ln for ln in hlo.splitlines() if "@jmc_order_after" in ln]
    assert line.count("output_operand_alias<") == 2  # both value arrays, not the dep
    assert "tensor<3xbf16>" in line  # the dep is an operand: the edge XLA keeps
    assert "opt-barrier" not in hlo and "optimization_barrier" not in hlo


@pytest.mark.parametrize("gpu", [False, True])
def test_order_after_passes_gradients_through_the_value(gpu):
    def loss(x, d):
        a, n = api._order_after((x * 3, jnp.int32(2)), (d,), gpu=gpu)
        return (a * a).sum() * n

    x, d = jnp.arange(4.0), jnp.ones((3,))
    if gpu:  # lowers (the custom call has no CPU handler, so nothing runs)
        assert "@jmc_order_after" in cuda_hlo(jax.grad(loss), x, d)
    else:
        np.testing.assert_allclose(jax.grad(loss)(x, d), 2 * 2 * 9 * np.arange(4.0))


def test_order_after_here_keeps_values():
    if native.available():
        pytest.skip("a GPU is present: the custom call path runs in the GPU suites")
    v = {"a": jnp.arange(3), "b": (jnp.ones((2, 2)), None)}
    out = jax.jit(lambda v, d: api.order_after(v, d))(v, jnp.zeros(()))
    np.testing.assert_array_equal(out["a"], v["a"])
    assert out["b"][1] is None
    assert api.order_after(v) is v  # no deps: nothing to order


def test_operands_of_mixed_shard_map_variance():
    # A stand-in made inside shard_map (jnp.zeros) does not vary over "ep"; x does.
    from jax.sharding import PartitionSpec as P

    from jax_moe_comm.backends.nvshmem import result_type

    mesh = jax.make_mesh((2,), ("ep",))

    def per_rank(x):
        ticket = ffi_call.call("jmc_barrier", result_type(x, (1,), jnp.int32), x,
                               jnp.zeros((2, 0), jnp.float32), side_effect=True,
                               handle=np.int64(1))
        return api._order_after(x, (ticket,), gpu=True)

    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    x = jax.device_put(jnp.ones((8,)), jax.NamedSharding(mesh, P("ep")))
    hlo = cuda_hlo(fn, x)
    assert "@jmc_barrier" in hlo and "@jmc_order_after" in hlo


@pytest.mark.parametrize("policy", [None, "nothing_saveable"])
def test_checkpoint_never_recomputes_our_calls(policy):
    @functools.partial(jax.checkpoint, policy=policy and getattr(jax.checkpoint_policies, policy))
    def layer(x):
        ticket = barrier(jax.lax.stop_gradient(x))  # (our ops differentiate via custom_vjp)
        return jnp.sin(api._order_after(x, (ticket,), gpu=True)) * 2

    hlo = cuda_hlo(jax.grad(lambda x: layer(x).sum()), jnp.ones((4,), jnp.float32))
    assert hlo.count("@jmc_barrier(") == 1
    assert hlo.count("@jmc_order_after(") == 1


def test_floor_kernels_lower_with_their_attributes_and_refuse_bad_ones():
    # bench_loop's floor: one side-effecting call carrying kind and count; bad ones refused at
    # trace time with what was expected (a handle-less stand-in: nothing here runs)
    from jax_moe_comm import _bench
    from jax_moe_comm.backends.nvshmem import NvshmemBackend

    backend = object.__new__(NvshmemBackend)
    backend.handle = 7
    x = jnp.ones((4,), jnp.int32)
    hlo = cuda_hlo(lambda v: _bench.floor_kernels(backend, v, "barrier", 2), x)
    (line,) = [ln for ln in hlo.splitlines() if "@jmc_floor_kernels" in ln]
    assert "has_side_effect = true" in line
    assert "kind = 1 : i64" in line and "count = 2 : i64" in line and "handle = 7 : i64" in line
    with pytest.raises(ValueError, match="kind from"):
        _bench.floor_kernels(backend, x, "nap", 1)
    with pytest.raises(ValueError, match=r"count in \[1, 16\]"):
        _bench.floor_kernels(backend, x, "empty", 17)


def test_instruments_are_apart_from_the_product():
    # timing, counting, floors, events and the dense baseline live in jax_moe_comm._bench
    # (issue 50): the product's backend carries none, and they refuse a non-CUDA handle
    from jax_moe_comm import AllToAll, MoEConfig, _bench
    from jax_moe_comm.backends import nvshmem

    for name in ("floor_kernels", "set_timing", "read_timings", "staged_messages"):
        assert not hasattr(nvshmem.NvshmemBackend, name), name
    assert not hasattr(nvshmem, "record_event") and not hasattr(nvshmem, "DenseAllToAll")
    cfg = MoEConfig(num_experts=8, experts_per_token=2, hidden=64, max_num_tokens=4,
                    world_size=8)
    with AllToAll(cfg, backend="reference") as a2a:
        for instrument in (_bench.set_timing, _bench.count_staged_messages):
            with pytest.raises(ValueError, match="backend='nvshmem'"):
                instrument(a2a, True)
