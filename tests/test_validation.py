"""Bad input is refused at trace time with an error that names the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_moe_comm import AllToAll, MoEConfig, NativeUnavailableError, native
from jax_moe_comm import testing as T

BASE = dict(num_experts=16, experts_per_token=4, hidden=256, max_num_tokens=8, world_size=8)


@pytest.mark.parametrize("changes, match", [
    (dict(experts_per_token=17), "experts_per_token=17 exceeds num_experts=16"),
    (dict(num_experts=12), "num_experts=12 is not divisible by the 8 ranks"),
    (dict(token_replicas=3), "world_size=8 is not divisible by token_replicas=3"),
    (dict(hidden=100), "hidden=100 gives 200-byte bfloat16 rows"),
    (dict(hidden=200, dispatch_dtype=jnp.float8_e4m3fn), "200-byte float8_e4m3fn rows"),
    (dict(hidden=144, dispatch_dtype=jnp.float8_e4m3fn), "not a multiple of the fp8 scale block"),
    (dict(max_num_tokens=0), "max_num_tokens=0 must be a positive integer"),
    (dict(world_size=2.0), "world_size=2.0 must be a positive integer"),
])
def test_config_errors_name_the_value(changes, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **changes})


@pytest.mark.parametrize("field, dtype", [("dispatch_dtype", jnp.float16),
                                          ("combine_dtype", jnp.int8)])
def test_config_rejects_dtypes(field, dtype):
    with pytest.raises(TypeError, match=f"{field}=.* is not supported; expected one of"):
        MoEConfig(**BASE, **{field: dtype})


def test_dp_size_is_refused_naming_token_replicas():
    """pplx-kernels' dp_size is token_replicas here, the one name for it in both configs."""
    from jax_moe_comm.moe import MoELayerConfig

    for make in (lambda: MoEConfig(**BASE, dp_size=2), lambda: MoELayerConfig(dp_size=2)):
        with pytest.raises(TypeError, match=r"\(dp_size=\.\.\.\) is gone: pass token_replicas "
                                            r"\(pplx-kernels' dp_size"):
            make()
    assert MoELayerConfig(token_replicas=2).comm_config(8).token_replicas == 2
    assert not hasattr(MoEConfig(**BASE), "dp_size")
    assert not hasattr(MoEConfig(**BASE), "num_dp_groups")


def test_config_derived_sizes():
    cfg = MoEConfig(**BASE, token_replicas=2, dispatch_dtype=jnp.float8_e4m3fn)
    assert (cfg.num_local_experts, cfg.num_token_groups, cfg.max_recv_tokens, cfg.num_scales) == \
        (2, 4, 32, 2)


def _run(cfg, mesh, x, idx, nt, x_scale=None):
    a2a = AllToAll(cfg)

    def body(x, idx, nt):
        out = a2a.dispatch(x, idx, nt if not hasattr(nt, "reshape") else nt.reshape(()),
                           x_scale=x_scale)
        return out.expert_num_tokens

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"))
    return jax.jit(fn).lower(x, idx, nt)


@pytest.fixture
def setup():
    cfg = MoEConfig(**BASE)
    mesh = T.make_mesh(8)
    x = jax.ShapeDtypeStruct((8 * 8, 256), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((8 * 8, 4), jnp.int32)
    nt = jax.ShapeDtypeStruct((8,), jnp.int32)
    return cfg, mesh, x, idx, nt


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("arg, value, exc, match", [
    ("x", _sds((64, 128), jnp.bfloat16), ValueError,
     r"x has shape \(8, 128\); expected \(8, 256\)"),
    ("x", _sds((64, 256), jnp.float32), TypeError, "x has dtype float32; expected bfloat16"),
    ("idx", _sds((64, 3), jnp.int32), ValueError, r"indices has shape \(8, 3\); expected \(8, 4\)"),
    ("idx", _sds((64, 4), jnp.float32), TypeError, "indices must be an int32 array"),
    ("nt", _sds((8,), jnp.float32), TypeError, "num_tokens has dtype float32"),
])
def test_op_input_errors(setup, arg, value, exc, match):
    cfg, mesh, x, idx, nt = setup
    args = dict(x=x, idx=idx, nt=nt)
    args[arg] = value
    with pytest.raises(exc, match=match):
        _run(cfg, mesh, args["x"], args["idx"], args["nt"])


def _lower_static_dispatch(a2a, ranks, num_tokens):
    """Lower dispatch with a Python-int num_tokens over a mesh of `ranks` devices."""
    fn = jax.shard_map(lambda x, i: a2a.dispatch(x, i, num_tokens).expert_num_tokens,
                       mesh=T.make_mesh(ranks), in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    rows = ranks * a2a.config.max_num_tokens
    return jax.jit(fn).lower(_sds((rows, 256), jnp.bfloat16), _sds((rows, 4), jnp.int32))


def test_static_num_tokens_out_of_range():
    a2a = AllToAll(MoEConfig(**BASE))
    with pytest.raises(ValueError, match=r"num_tokens=9 is outside \[0, max_num_tokens=8\]"):
        _lower_static_dispatch(a2a, 8, 9)


def test_fp8_needs_scales_and_bf16_refuses_them():
    mesh = T.make_mesh(8)
    fp8 = MoEConfig(**{**BASE, "dispatch_dtype": jnp.float8_e4m3fn})
    with pytest.raises(ValueError, match="x_scale is required for float8_e4m3fn"):
        _run(fp8, mesh, _sds((64, 256), jnp.float8_e4m3fn), _sds((64, 4), jnp.int32),
             _sds((8,), jnp.int32))
    bf16 = MoEConfig(**BASE)
    with pytest.raises(ValueError, match="x_scale is only taken with float8_e4m3fn"):
        _run(bf16, mesh, _sds((64, 256), jnp.bfloat16), _sds((64, 4), jnp.int32),
             _sds((8,), jnp.int32), x_scale=jnp.ones((8, 2), jnp.float32))


def test_combine_checks_expert_y_and_weights():
    cfg = MoEConfig(**BASE)
    a2a = AllToAll(cfg)
    mesh = T.make_mesh(8)

    def body(x, idx, w, nt, bad_y):
        out = a2a.dispatch(x, idx, nt.reshape(()))
        ey = out.expert_x.astype(jnp.float32) if bad_y else out.expert_x
        return a2a.combine(ey, out.routing, idx, w, nt.reshape(()))

    for bad_y, w, match in ((True, _sds((64, 4), jnp.float32), "expert_y has dtype float32"),
                            (False, _sds((64, 3), jnp.float32), r"weights has shape \(8, 3\)")):
        fn = jax.shard_map(lambda x, i, w, n: body(x, i, w, n, bad_y), mesh=mesh,
                           in_specs=(P("ep"),) * 4, out_specs=P("ep"))
        with pytest.raises((TypeError, ValueError), match=match):
            jax.jit(fn).lower(_sds((64, 256), jnp.bfloat16), _sds((64, 4), jnp.int32), w,
                              _sds((8,), jnp.int32))


def test_mesh_axis_mismatch_and_unbound_axis():
    a2a = AllToAll(MoEConfig(**BASE))
    with pytest.raises(ValueError, match="mesh axis 'ep' has 4 devices but the handle was made "
                                         "for world_size=8"):
        _lower_static_dispatch(a2a, 4, 1)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        a2a.dispatch(jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((8, 4), jnp.int32), 1)


def test_backend_choice():
    cfg = MoEConfig(**BASE)
    assert AllToAll(cfg).backend_name == "reference"  # CPU
    with pytest.raises(ValueError, match="backend='cuda'"):
        AllToAll(cfg, backend="cuda")
    with pytest.raises(NativeUnavailableError):
        AllToAll(cfg, backend="nvshmem")
    assert native.unavailable_reason()
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        AllToAll(dict(BASE))


def test_closed_handle_refuses():
    cfg = MoEConfig(**BASE)
    with AllToAll(cfg) as a2a:
        pass
    with pytest.raises(Exception, match="closed"):
        _lower_static_dispatch(a2a, 8, 1)


def test_split_api_takes_its_own_pending():
    cfg = MoEConfig(**BASE)
    a2a = AllToAll(cfg)
    with pytest.raises(TypeError, match="dispatch_recv takes the PendingDispatch"):
        a2a.dispatch_recv(np.zeros(3))


def test_staged_transport_setting(monkeypatch):
    """KernelTuning(transport="staged", node_size=) and JMC_TRANSPORT pick the peers sent to as
    over a network (issue 25); bad values are named before any handle exists."""
    from jax_moe_comm import KernelTuning
    from jax_moe_comm.backends.nvshmem import forced_node_size

    monkeypatch.delenv("JMC_TRANSPORT", raising=False)
    assert forced_node_size(KernelTuning(), 8) == 0
    assert forced_node_size(KernelTuning(transport="staged"), 8) == 1
    assert forced_node_size(KernelTuning(transport="staged", node_size=4), 8) == 4
    with pytest.raises(ValueError, match="node_size=3"):
        forced_node_size(KernelTuning(transport="staged", node_size=3), 8)
    with pytest.raises(ValueError, match="transport='staged' only"):
        KernelTuning(node_size=2)
    with pytest.raises(ValueError, match="transport='network'"):
        KernelTuning(transport="network")
    monkeypatch.setenv("JMC_TRANSPORT", "staged:2")
    assert forced_node_size(KernelTuning(), 8) == 2
    assert forced_node_size(KernelTuning(transport="staged", node_size=4), 8) == 4  # code wins
    monkeypatch.setenv("JMC_TRANSPORT", "ib")
    with pytest.raises(ValueError, match="JMC_TRANSPORT='ib'"):
        forced_node_size(KernelTuning(), 8)
