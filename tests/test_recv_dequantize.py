"""Dequantize on receive (JMC_RECV_DEQUANTIZE, issue 24), on 8 emulated CPU devices: the
wiring around the nvshmem receive kernel that writes an fp8 handle's rows as bf16, run on a
stand-in backend (the reference backend wrapped to do what the kernel does). The kernel itself
is checked bit for bit against XLA's pass on the GPU (tests/gpu_layout_worker.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_grad import EP4_FP8, LAYER_CASES, FusedShuffledBackend, _expand, _flat, _global

from jax_moe_comm import AllToAll, autodiff, quant
from jax_moe_comm import testing as T
from jax_moe_comm.moe import init_params

bf16 = jnp.bfloat16


def _dequantized(ex, exs, counts, calls):
    """What the nvshmem receive kernel writes with dequantize=True: bf16 rows, payload times
    block scales rounded once from f32 (as XLA's quant.dequantize), and, past the counts,
    whatever is there: NaN here."""
    calls["dequantize"] += 1
    deq = quant.dequantize(ex, exs).astype(bf16)
    if ex.ndim == 2:
        live = jnp.arange(ex.shape[0]) < jnp.sum(counts)
    else:
        live = jnp.arange(ex.shape[1])[None, :] < counts[:, None]
    return jnp.where(_expand(live, deq), deq, jnp.asarray(jnp.nan, bf16))


class RecvDequantizingBackend(FusedShuffledBackend):
    """FusedShuffledBackend that dequantizes fp8 rows on receive when asked, as the nvshmem
    backend's kernels do; shuffle=False keeps the reference's row order (to compare expert_x
    row for row)."""

    dequantizes_on_recv = True

    def __init__(self, inner, seed=0, shuffle=True):
        super().__init__(inner, seed)
        self.shuffle = shuffle

    def dispatch_recv(self, pending, dequantize=False):
        recv = super().dispatch_recv if self.shuffle else self.inner.dispatch_recv
        ex, exs, counts, routing, ew, dropped = recv(pending)
        if dequantize:
            ex, exs = _dequantized(ex, exs, counts, self.fused_calls), None
        return ex, exs, counts, routing, ew, dropped

    def dispatch(self, x, x_scale, indices, num_tokens, weights=None, dequantize=False):
        self.fused_calls["dispatch"] += 1
        return self.dispatch_recv(self.inner.dispatch_send(x, x_scale, indices, num_tokens,
                                                           weights=weights), dequantize)


def recv_dequantizing_all_to_all(cfg, shuffle=True, **kw):
    class RecvDequantizingAllToAll(AllToAll):
        def _make_backend(self, *args):
            return RecvDequantizingBackend(super()._make_backend(*args),
                                           seed=len(self._backends), shuffle=shuffle)

    return RecvDequantizingAllToAll(cfg, **kw)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_recv_dequantize_asks_the_backend_and_changes_no_value(monkeypatch, layout, split):
    """A handle created under JMC_RECV_DEQUANTIZE=1 asks a backend that can dequantize on
    receive to (fused and split dispatch) and skips XLA's pass; its live rows are bit for bit
    those of XLA's pass. One created under 0 never asks. The setting is the handle's:
    flipping the variable after creation, before the step is traced, changes nothing."""
    cfg = EP4_FP8.cfg()
    mesh = T.make_mesh(EP4_FP8.ep)
    inp = T.make_inputs(cfg, 23, "duplicates")
    x = _global(mesh, _flat(T.differentiable_x(cfg, inp)))
    idx, nt = _global(mesh, _flat(inp.indices)), _global(mesh, inp.num_tokens)

    def run(env):
        monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, env)
        a2a = recv_dequantizing_all_to_all(cfg, shuffle=False, layout=layout)
        monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, "0" if env == "1" else "1")

        def body(x, idx, nt):
            nt = nt.reshape(())
            if split:
                out = a2a.dispatch_recv(a2a.dispatch_send(x, idx, nt))
            else:
                out = a2a.dispatch(x, idx, nt)
            assert out.expert_x.dtype == bf16 and out.expert_x_scale is None
            return out.expert_x[None], out.expert_num_tokens[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                  out_specs=(P("ep"), P("ep"))))
        ex, counts = (np.asarray(v) for v in f(x, idx, nt))
        return ex, counts, a2a.backend.fused_calls["dequantize"]

    ex_xla, counts, asked = run("0")
    assert asked == 0
    ex_kernel, counts_kernel, asked = run("1")
    assert asked == 1
    np.testing.assert_array_equal(counts_kernel, counts)
    for rank in range(EP4_FP8.ep):
        if layout == "packed":
            live = np.arange(ex_xla.shape[1]) < counts[rank].sum()
        else:
            live = np.arange(ex_xla.shape[2])[None, :] < counts[rank][:, None]
        want, got = ex_xla[rank][live], ex_kernel[rank][live]
        assert want.size and np.isfinite(want.astype(np.float32)).all()
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_recv_dequantize_default_is_on_for_every_handle(monkeypatch):
    """Unset or 1: a handle on a backend that can dequantize on receive asks it to, inference
    and differentiable alike (the GPU layout suite checked it bit for bit against XLA's pass,
    the GPU gradient suite passed with it); 0 turns it off; a backend that cannot is never
    asked; any other value is refused by name."""
    monkeypatch.delenv(autodiff.RECV_DEQUANTIZE_ENV, raising=False)
    can = type("Can", (), {"dequantizes_on_recv": True})()
    assert autodiff.recv_dequantizes(can) is True
    assert autodiff.recv_dequantizes(object()) is False
    monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, "1")
    assert autodiff.recv_dequantizes(can) is True
    assert autodiff.recv_dequantizes(object()) is False
    monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, "0")
    assert autodiff.recv_dequantizes(can) is False
    monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, "yes")
    with pytest.raises(ValueError, match="JMC_RECV_DEQUANTIZE='yes'"):
        autodiff.recv_dequantizes(can)
    # the handle's own, fixed at creation: both kinds ask with the variable unset, neither with 0
    cfg = EP4_FP8.cfg()
    monkeypatch.delenv(autodiff.RECV_DEQUANTIZE_ENV)
    assert recv_dequantizing_all_to_all(cfg)._plan.recv_dequantize is True
    assert recv_dequantizing_all_to_all(cfg, differentiable=True)._plan.recv_dequantize is True
    monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, "0")
    assert recv_dequantizing_all_to_all(cfg, differentiable=True)._plan.recv_dequantize is False


def test_recv_dequantize_keeps_differentiable_padding_zero(monkeypatch):
    """With the kernel dequantizing (NaN past the counts: its rows are undefined there), a
    differentiable handle still zeroes the padding rows, so the fp8 layer's gradients equal
    the dense layer's: the padded einsum's weight gradients sum over every row, and a NaN row
    times its zero cotangent would poison them. (Packed rows on CPU run the einsum through a
    scatter of the live rows only, which never sees the NaN: no packed case.)"""
    monkeypatch.setenv(autodiff.RECV_DEQUANTIZE_ENV, "1")
    cfg, drop_rate, _, _ = LAYER_CASES["fp8"]
    world = 8
    mesh = T.make_mesh(world)
    a2a = recv_dequantizing_all_to_all(cfg.comm_config(world), differentiable=True)
    params = [init_params(cfg, 0)]
    x, nt, G, drop = T.layer_grad_inputs(cfg, world, 6, drop_rate)
    moe = T.run_layer_grads(a2a, cfg, mesh, params, x, nt, G, drop)
    assert a2a.backend.fused_calls["dequantize"] >= 1
    dense = T.dense_layer_grads(cfg, params, x, nt, G, drop)
    T.compare_layer_grads(*moe, *dense, range(world), cfg.num_experts // world, cfg.token_replicas)
