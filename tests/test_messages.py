"""Every message of issue 12, as a new user meets it: what was expected and what to do."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_comm as jmc
from jax_moe_comm import (AllToAll, InvalidRoutingError, MoEConfig, NativeUnavailableError,
                          ProtocolError, ReferenceFallbackWarning, api, bootstrap, native)
from jax_moe_comm import testing as T

BASE = dict(num_experts=16, experts_per_token=4, hidden=128, max_num_tokens=8, world_size=8)
sds = jax.ShapeDtypeStruct


def _lower(fn, mesh, *args, specs=None):
    specs = specs or tuple(P(mesh.axis_names[0]) for _ in args)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs,
                                 out_specs=P(mesh.axis_names[0]))).lower(*args)


def _inputs(cfg):
    n = cfg.world_size * cfg.max_num_tokens
    return (sds((n, cfg.hidden), jnp.bfloat16), sds((n, cfg.experts_per_token), jnp.int32),
            sds((n, cfg.experts_per_token), jnp.float32), sds((cfg.world_size,), jnp.int32))


# 1. close() before the first step
def test_closed_handle_says_when_to_close():
    cfg = MoEConfig(**BASE)
    a2a = AllToAll(cfg)
    a2a.close()
    with pytest.raises(ProtocolError, match="close a handle after the last step that uses it"
                                            "|Close a handle after the last step"):
        _lower(lambda x, i, w, n: a2a.dispatch(x, i, n).expert_num_tokens, T.make_mesh(8),
               *_inputs(cfg))


# 3. num_tokens: one count per rank, a global [EP] array
def test_num_tokens_per_rank_shape_accepted_and_wrong_shape_explained():
    cfg = MoEConfig(**BASE)
    a2a = AllToAll(cfg)
    mesh = T.make_mesh(8)
    _lower(lambda x, i, w, n: a2a.dispatch(x, i, n).expert_num_tokens, mesh, *_inputs(cfg))
    x, i, w, _ = _inputs(cfg)
    with pytest.raises(ValueError, match=r"num_tokens has shape \(2,\) on this rank; expected "
                                         r"one int32 count per rank.*global \[world_size\]"):
        _lower(lambda x, i, w, n: a2a.dispatch(x, i, n).expert_num_tokens, mesh, x, i, w,
               sds((16,), jnp.int32))


# 5. one process driving several GPUs
def test_process_layout_names_the_launcher():
    problem = bootstrap.process_layout_problem(8)  # this process drives 8 CPU devices
    assert "one process per GPU" in problem
    assert "python -m jax_moe_comm.launch -n 8 -- python your_script.py" in problem
    assert "backend='reference'" in problem


def _pretend_gpu(monkeypatch, native_reason=""):
    monkeypatch.setattr(api, "_platform", lambda: "gpu")
    monkeypatch.setattr(native, "unavailable_reason", lambda: native_reason)


def test_auto_falls_back_with_a_warning_when_one_process_drives_all_gpus(monkeypatch):
    _pretend_gpu(monkeypatch)
    with pytest.warns(ReferenceFallbackWarning, match="python -m jax_moe_comm.launch -n 8"):
        a2a = AllToAll(MoEConfig(**BASE))
    assert a2a.backend_name == "reference"
    with pytest.raises(NativeUnavailableError, match="one process per GPU"):
        AllToAll(MoEConfig(**BASE), backend="nvshmem")


def test_auto_on_gpu_without_the_native_module_warns_how_to_build(monkeypatch):
    if native.built():
        pytest.skip("the native module is built here")
    reason = native.unavailable_reason()
    _pretend_gpu(monkeypatch, reason)
    assert "installed without its CUDA module" in reason
    with pytest.warns(ReferenceFallbackWarning, match=r"pip install '\.\[cuda13\]'"):
        assert jmc.resolve_backend("auto") == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jmc.resolve_backend("reference") == "reference"  # asked for: no warning


def test_world_size_must_be_the_process_count(monkeypatch):
    monkeypatch.setattr(jax, "local_devices", lambda: [object()])
    problem = bootstrap.process_layout_problem(8)
    assert "world_size=8 but jax.process_count()=1" in problem


def test_gpu_arch_not_built_for_is_explained(monkeypatch):
    class Dev:
        compute_capability = "7.5"
        device_kind = "Tesla T4"

    monkeypatch.setattr(native, "built_archs", lambda: ((80, 90, 100), 100))
    msg = native.device_problem(Dev())
    assert "Tesla T4 is sm_75" in msg and "built for sm_80, sm_90, sm_100" in msg
    assert "cmake.define.JMC_CUDA_ARCHS=75" in msg
    monkeypatch.setattr(native, "_native_build", type("B", (), {"CUDA_VERSION": "12.4.131"}))
    assert "pip install '.[cuda12]' -C" in native.device_problem(Dev())  # the module's CUDA
    for ok in ("8.0", "8.6", "9.0", "10.0", "10.3", "12.0"):
        Dev.compute_capability = ok
        assert native.device_problem(Dev()) == "", ok
    assert not native.arch_supported(90, (80, 100), None)  # no sm_90 code, no PTX


# 7. wrong axis_name, wrong routing object
def test_wrong_axis_name_lists_the_bound_axes():
    a2a = AllToAll(MoEConfig(**BASE))  # axis_name="ep"
    mesh = T.make_mesh(8, axis="data")
    with pytest.raises(ValueError, match=r"axis_name='ep' is not a mesh axis of the enclosing "
                                         r"shard_map, whose axes are 'data' \(8 devices\).*"
                                         r"axis_name='data'"):
        _lower(lambda x, i, w, n: a2a.dispatch(x, i, n).expert_num_tokens, mesh,
               *_inputs(a2a.config))
    with pytest.raises(ValueError, match="no shard_map is active here"):
        a2a.dispatch(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((8, 4), jnp.int32), 1)


def test_wrong_routing_object_is_named():
    cfg = MoEConfig(**BASE)
    a2a = AllToAll(cfg)

    def body(x, i, w, n):
        out = a2a.dispatch(x, i, n)
        return a2a.combine(out.expert_x, (out.expert_num_tokens, i), i, w, n)

    with pytest.raises(TypeError, match="routing must be the DispatchOutput.routing that "
                                        "dispatch .* returned, passed unchanged; got tuple"):
        _lower(body, T.make_mesh(8), *_inputs(cfg))


# 9. NaN / inf router weights on slots that are not used
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_nan_weights_on_unused_skipped_and_padding_slots_do_not_reach_y(layout):
    cfg = MoEConfig(**{**BASE, "world_size": 4})
    inp = T.make_inputs(cfg, 3)
    inp.num_tokens[:] = [8, 5, 0, 3]
    inp.indices[:, 0, -1] = -1  # an unused slot
    inp.indices[1, 1, -1] = cfg.num_experts + 2  # an out-of-range (skipped) slot
    holes = inp.indices < 0
    holes[1, 1, -1] = True
    w = inp.weights
    w[holes] = np.nan
    w[:, 0, -1] = np.inf
    w[1, 6:] = np.nan  # padding rows (>= num_tokens)
    ok = inp.weights.copy()
    ok[~np.isfinite(ok)] = 0.0
    a2a = AllToAll(cfg, layout=layout)
    mesh = T.make_mesh(4)
    ex, exs, counts, y = T.make_step(a2a, mesh)(*T.global_inputs(cfg, mesh, inp))
    y = np.asarray(y, np.float32).reshape(4, cfg.max_num_tokens, cfg.hidden)
    assert np.all(np.isfinite(y))
    clean = type(inp)(inp.x, inp.x_scale, inp.indices, ok, inp.num_tokens)
    for rank in range(4):
        T.check_combine(cfg, clean, rank, y[rank])
    with pytest.raises(InvalidRoutingError):
        a2a.check()  # the out-of-range slot is reported (and was skipped)


def test_merge_repeats_keeps_nan_off_live_slots():
    from jax_moe_comm import routing

    idx = jnp.array([[3, -1, 3, 5]], jnp.int32)
    w = jnp.array([[0.5, jnp.nan, 0.25, jnp.inf]], jnp.float32)
    first, merged = routing.merge_repeats(idx, w)
    np.testing.assert_array_equal(first, [[3, -1, -1, 5]])
    np.testing.assert_array_equal(merged[0, :3], [0.75, 0, 0])


# 10. padding rows are ignored; check() reports each error once
def test_bad_index_in_padding_rows_is_ignored_and_check_forgets_after_raising():
    cfg = MoEConfig(**{**BASE, "world_size": 2})
    a2a = AllToAll(cfg)
    mesh = T.make_mesh(2)
    step = T.make_step(a2a, mesh)
    inp = T.make_inputs(cfg, 4, ragged=False)
    inp.num_tokens[:] = [5, 0]
    inp.indices[0, 6, 1] = 99  # row 6 >= num_tokens: padding
    inp.indices[1, :, :] = -7
    T.run_and_check(a2a, mesh, inp, step=step)
    a2a.check()  # nothing live was bad
    inp.indices[0, 2, 0] = 99  # a live row
    T.run_and_check(a2a, mesh, inp, step=step)
    with pytest.raises(InvalidRoutingError, match=r"token 2 has expert index 99 outside "
                                                  r"\[-1, num_experts=16\); that slot was skipped"):
        a2a.check()
    a2a.check()  # reported once; the handle keeps working
    inp.indices[0, 2, 0] = 1
    T.run_and_check(a2a, mesh, inp, step=step)
    a2a.check()


# 11. names
def test_token_replicas_is_the_one_name_and_the_doc_names_pplx_dp_size():
    a = MoEConfig(**BASE, token_replicas=2)
    assert a.token_replicas == 2 and a.num_token_groups == 4
    with pytest.raises(TypeError, match="pass token_replicas"):  # test_validation: the rest
        MoEConfig(**BASE, dp_size=2)
    assert "tokens *per rank*" in MoEConfig.__doc__
    assert "token_replicas" in MoEConfig.__doc__ and "calls this dp_size" in MoEConfig.__doc__


# The kernels' error records reach Python as the class their kind names (csrc/handle.cc writes
# "Kind: rank r in phase: ..."); a ProtocolError is how a replayed command buffer reports a
# send/recv out of order (the handler that used to refuse it does not run under replay).
@pytest.mark.parametrize("kind, cls", [
    ("PeerTimeout", jmc.PeerTimeoutError), ("InvalidRouting", InvalidRoutingError),
    ("PeerAborted", jmc.PeerAbortedError), ("CorruptData", jmc.CorruptDataError),
    ("ProtocolError", ProtocolError)])
def test_recorded_error_kind_is_its_class(kind, cls):
    from jax_moe_comm.backends.nvshmem import raise_recorded
    with pytest.raises(cls, match=f"^{kind}: rank 3 in dispatch_recv"):
        raise_recorded(f"{kind}: rank 3 in dispatch_recv: what happened")
    raise_recorded("")  # no error recorded: nothing raised
