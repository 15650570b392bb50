"""A packed capacity (issue 24): AllToAll(layout="packed", max_recv_rows=C, overflow=...) on the
reference backend, 8 emulated CPU devices. Rows past C are dropped (the highest local experts'
first), their slots add nothing to y, and overflow="fail" reports them; the oracle is the one of
tests/test_layout.py with exactly the dropped slots (row_keys(dropped=True)) routed nowhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_moe_comm import AllToAll, CapacityExceededError, MoEConfig
from jax_moe_comm import testing as T
from jax_moe_comm.moe import MoELayerConfig, dense_forward, init_params, route

bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn

CASES = {  # name: (E, k, H, max_m, EP, token_replicas, dispatch dtype)
    "EP8-k4-bf16": (16, 4, 128, 8, 8, 1, bf16),
    "EP4-dp2-fp8": (8, 3, 256, 8, 4, 2, fp8),
}


def _cfg(E, k, H, m, ep, dp, dtype):
    return MoEConfig(num_experts=E, experts_per_token=k, hidden=H, max_num_tokens=m,
                     world_size=ep, token_replicas=dp, dispatch_dtype=dtype)


def _small_capacity(cfg):
    """Half the mean load: skewed routing (every token to expert 0) overflows it."""
    return cfg.recv_rows_for(0.5)


# -- sizes and arguments -----------------------------------------------------------------------
def test_expected_recv_rows_and_recv_rows_for():
    r1 = MoEConfig(num_experts=256, experts_per_token=8, hidden=7168, max_num_tokens=128,
                   world_size=8)
    assert r1.expected_recv_rows == 128 * 8 * 8 // 8 == 1024
    assert r1.max_recv_total == 8192
    assert r1.recv_rows_for(1.0) == 1024
    assert r1.recv_rows_for(1.3) == 1336  # ceil(1331.2) = 1332, up to a multiple of 8
    assert r1.recv_rows_for(100) == r1.max_recv_total  # never above the worst case
    dp2 = _cfg(*CASES["EP4-dp2-fp8"])  # 2 token groups of 8 tokens, k=3, over 4 ranks
    assert dp2.expected_recv_rows == -(-2 * 8 * 3 // 4) == 12
    assert dp2.recv_rows_for(1.0) == 16
    for bad in (0, -1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="capacity_factor=.* must be a finite number > 0"):
            r1.recv_rows_for(bad)


def test_bad_capacity_arguments_say_what_to_pass():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    with pytest.raises(ValueError, match=r"max_recv_rows=64 is a capacity of the packed layout.*"
                                         r"layout='padded'.*layout='packed'"):
        AllToAll(cfg, max_recv_rows=64)
    for bad in (0, cfg.max_recv_total + 1, 16.0, True):
        with pytest.raises(ValueError, match=rf"max_recv_rows={bad!r} must be an int in \[1, "
                                             rf"max_recv_total={cfg.max_recv_total}\]"):
            AllToAll(cfg, layout="packed", max_recv_rows=bad)
    with pytest.raises(ValueError, match=r"overflow='ignore'; expected one of \('fail', "
                                         r"'drop'\)"):
        AllToAll(cfg, layout="packed", overflow="ignore")
    with pytest.raises(ValueError, match=r"row_keys\(dropped=True\) is for layout='packed'"):
        AllToAll(cfg).backend.row_keys(None, dropped=True)
    assert AllToAll(cfg).max_recv_rows is None
    assert AllToAll(cfg, layout="packed").max_recv_rows == cfg.max_recv_total
    assert AllToAll(cfg, layout="packed", max_recv_rows=np.int64(24)).max_recv_rows == 24


def test_packed_expert_y_must_have_the_capacity_rows():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    a2a = AllToAll(cfg, layout="packed", max_recv_rows=40)

    def body(x, idx, w, nt):
        out = a2a.dispatch(x, idx, nt)
        bad = jnp.zeros((cfg.max_recv_total, cfg.hidden), bf16)  # the worst case, not C
        return a2a.combine(bad, out.routing, idx, w, nt)

    fn = jax.shard_map(body, mesh=T.make_mesh(8), in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    sds = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match=r"expert_y has shape \(128, 128\); expected "
                                         r"\(40, 128\) .*layout='packed'"):
        jax.jit(fn).lower(sds((64, 128), bf16), sds((64, 4), jnp.int32),
                          sds((64, 4), jnp.float32), sds((8,), jnp.int32))


# -- drop ------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("name", list(CASES))
def test_drop_keeps_the_first_packed_rows_and_y_loses_only_the_dropped_slots(name, split):
    """Skewed routing over a capacity of half the mean load: each rank keeps the packed rows
    < C in expert order (testing.capacity_counts), reports the others by key and count, and
    y equals the oracle with exactly those slots routed nowhere (no NaN); nothing raised."""
    cfg = _cfg(*CASES[name])
    a2a = AllToAll(cfg, layout="packed", max_recv_rows=_small_capacity(cfg), overflow="drop")
    mesh = T.make_mesh(cfg.world_size)
    T.run_and_check(a2a, mesh, T.make_inputs(cfg, 3, "skewed", ragged=False), split=split)
    assert a2a.dropped_rows() > 0
    a2a.check()  # "drop" reports nothing


def test_the_capacity_oracle_catches_a_wrong_drop_report(monkeypatch):
    """The drop checks fail when the backend reports other rows than it dropped."""
    from jax_moe_comm.backends.reference import ReferenceBackend

    real = ReferenceBackend.row_keys

    def shifted(self, routing, dropped=False):
        keys = real(self, routing, dropped)
        return jnp.where(keys >= 0, keys ^ 1, keys) if dropped else keys  # another slot

    monkeypatch.setattr(ReferenceBackend, "row_keys", shifted)
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    a2a = AllToAll(cfg, layout="packed", max_recv_rows=_small_capacity(cfg), overflow="drop")
    with pytest.raises(AssertionError):
        T.run_and_check(a2a, T.make_mesh(8), T.make_inputs(cfg, 3, "skewed", ragged=False))


def test_the_worst_case_capacity_drops_nothing_and_padded_reports_zero():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    inp = T.make_inputs(cfg, 1, ragged=False)
    inp.indices[:] = np.arange(4, dtype=np.int32)  # ranks 0 and 1 get the worst case
    mesh = T.make_mesh(8)
    for a2a in (AllToAll(cfg, layout="packed"), AllToAll(cfg)):
        x, _, idx, _, nt = T.global_inputs(cfg, mesh, inp)

        def body(x, idx, nt, a2a=a2a):
            return a2a.dispatch(x, idx, nt.reshape(())).dropped_rows

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                  out_specs=P("ep")))
        assert np.asarray(f(x, idx, nt)).tolist() == [0] * 8
        assert a2a.dropped_rows() == 0
    packed = AllToAll(cfg, layout="packed")
    T.run_and_check(packed, mesh, inp)


# -- fail ------------------------------------------------------------------------------------
def test_overflow_fail_raises_until_recover_and_the_next_cycle_is_right():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    C = _small_capacity(cfg)
    a2a = AllToAll(cfg, layout="packed", max_recv_rows=C)  # overflow="fail", the default
    mesh = T.make_mesh(8)
    inp = T.make_inputs(cfg, 4, "skewed", ragged=False)
    step = T.make_step(a2a, mesh, dropped=True)
    T.run_and_check(a2a, mesh, inp, step=step)  # the rows past C were not written either way
    dropped = a2a.dropped_rows()
    assert dropped > 0
    with pytest.raises(CapacityExceededError) as err:
        a2a.check()
    msg = str(err.value)
    found = re.match(r"CapacityExceeded: rank (\d) in dispatch_recv: (\d+) rows arrived for a "
                     rf"packed capacity of {C} rows \(max_recv_rows\); the (\d+) rows past it "
                     r"were not written", msg)
    assert found, msg
    rank, arrived, past = (int(g) for g in found.groups())
    want = sum(sum(c.values()) for c in T.expected_rows(cfg, inp, rank).values())
    assert arrived == want == C + past, (msg, want)
    assert "max_recv_rows" in msg and "overflow='drop'" in msg
    with pytest.raises(CapacityExceededError):  # kept until recover()
        a2a.check()
    a2a.recover()
    a2a.check()
    assert a2a.dropped_rows() == 0
    fits = T.make_inputs(cfg, 5, ragged=False)
    fits.num_tokens[:] = 1  # at most 8 * 2 rows per rank: fits in C
    assert 8 * min(cfg.experts_per_token, cfg.num_local_experts) <= C
    T.run_and_check(a2a, mesh, fits, step=step)
    a2a.check()
    assert a2a.dropped_rows() == 0


# -- several cycles in one jitted loop ------------------------------------------------------------
def test_a_jitted_loop_of_cycles_with_drops():
    """lax.fori_loop of 4 dispatch/combine cycles with different routing (two skewed: they
    drop): each cycle's y equals the oracle without its dropped slots; the host count is the
    sum of the cycles' drops."""
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    C = _small_capacity(cfg)
    a2a = AllToAll(cfg, layout="packed", max_recv_rows=C, overflow="drop")
    mesh = T.make_mesh(8)
    routings = ("skewed", "random", "skewed", "duplicates")
    inps = [T.make_inputs(cfg, 10 + i, r) for i, r in enumerate(routings)]
    cycles = len(inps)
    spill = cfg.max_recv_total - C

    def stacked(field):  # [cycles, EP * m, ...] sharded over the ranks' rows
        a = np.stack([getattr(i, field) for i in inps])
        a = a.reshape((cycles, -1) + a.shape[3:])
        return jax.device_put(a, NamedSharding(mesh, P(None, "ep")))

    def body(x, idx, w, nt):
        rank = jax.lax.axis_index("ep")

        def cycle(i, acc):
            ys, keys, drops = acc
            n = nt[i].reshape(())
            out = a2a.dispatch(x[i], idx[i], n)
            ey = T.expert_outputs(cfg, rank, out.expert_x, None, out.group_sizes)
            y = a2a.combine(ey, out.routing, idx[i], w[i], n)
            k = a2a.backend.row_keys(out.routing.backend, dropped=True)
            return ys.at[i].set(y), keys.at[i].set(k), drops.at[i].set(out.dropped_rows[0])

        init = (jnp.zeros((cycles,) + x.shape[1:], bf16),
                jnp.zeros((cycles, spill), jnp.int32), jnp.zeros((cycles,), jnp.int32))
        init = jax.tree.map(lambda a: jax.lax.pcast(a, "ep", to="varying"), init)
        ys, keys, drops = jax.lax.fori_loop(0, cycles, cycle, init)
        return ys, keys, drops[:, None]

    spec = P(None, "ep")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))
    ys, keys, drops = (np.asarray(a) for a in f(*(stacked(n) for n in (
        "x", "indices", "weights", "num_tokens"))))
    m = cfg.max_num_tokens
    assert drops[0].sum() > 0 and drops[2].sum() > 0
    assert a2a.dropped_rows() == drops.sum()
    for c, inp in enumerate(inps):
        assert (keys[c] >= 0).sum() == drops[c].sum()
        expect = T.without_slots(cfg, inp, keys[c])
        for rank in range(cfg.world_size):
            T.check_combine(cfg, expect, rank, ys[c, rank * m:(rank + 1) * m])


# -- the MoE layer -----------------------------------------------------------------------------
def test_layer_with_a_capacity_factor_equals_dense_without_the_dropped_slots():
    """moe_forward on a handle made from MoELayerConfig(capacity_factor=0.75, overflow="drop")
    equals dense_forward with the dropped slots masked out (their keys from a dispatch of the
    same routing: the reference backend drops the same rows every time)."""
    cfg = MoELayerConfig(num_experts=16, experts_per_token=4, hidden=128, ffn=256,
                         max_num_tokens=8, capacity_factor=0.75, overflow="drop")
    world = 8
    mesh = T.make_mesh(world)
    comm = cfg.comm_config(world)
    kwargs = cfg.handle_kwargs(world, "packed")
    assert kwargs == dict(layout="packed", overflow="drop", max_recv_rows=24)
    a2a = AllToAll(comm, **kwargs)
    params = init_params(cfg, 2)
    rng = np.random.default_rng(5)
    m, H = cfg.max_num_tokens, cfg.hidden
    x = rng.standard_normal((world * m, H)).astype(bf16)
    nt = np.full(world, m, np.int32)
    ep, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
    pspec = {k: P("ep") if k in ("w_in", "w_out") else P() for k in params}
    dev = {k: jax.device_put(v, ep if k in ("w_in", "w_out") else rep)
           for k, v in params.items()}

    def layer(p, x, nt):
        from jax_moe_comm.moe import moe_forward

        return moe_forward(a2a, cfg, p, x, nt.reshape(()))

    def dropped_keys(p, x, nt):
        indices, _ = route(p["router"], x, cfg.experts_per_token)
        out = a2a.dispatch(x, indices, nt.reshape(()))
        return a2a.backend.row_keys(out.routing.backend, dropped=True)

    y = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(pspec, P("ep"), P("ep")),
                              out_specs=P("ep")))(dev, jax.device_put(x, ep),
                                                  jax.device_put(nt, ep))
    keys = jax.jit(jax.shard_map(dropped_keys, mesh=mesh, in_specs=(pspec, P("ep"), P("ep")),
                                 out_specs=P("ep")))(dev, jax.device_put(x, ep),
                                                     jax.device_put(nt, ep))
    keys = np.asarray(keys)
    keys = keys[keys >= 0]
    assert len(keys) > 0 and a2a.dropped_rows() == 2 * len(keys)  # two dispatches
    k = cfg.experts_per_token
    drop = np.zeros((world, m, k), bool)
    drop[keys // (m * k), keys // k % m, keys % k] = True  # dp 1: the group is the rank
    dense = jax.jit(lambda p, x, nt, d: dense_forward(cfg, p, x, nt, drop=d))
    y = np.asarray(y, np.float32)
    assert np.isfinite(y).all()
    for r in range(world):
        want = np.asarray(dense(params, x[r * m:(r + 1) * m], nt[r], drop[r]), np.float32)
        np.testing.assert_allclose(y[r * m:(r + 1) * m], want, atol=0.05, rtol=0.02,
                                   err_msg=f"rank {r}")


def test_layer_config_capacity_arguments():
    base = dict(num_experts=16, experts_per_token=4, hidden=128, ffn=256, max_num_tokens=8)
    cfg = MoELayerConfig(**base)
    assert cfg.handle_kwargs(8, "padded") == dict(layout="padded", overflow="fail")
    with pytest.raises(ValueError, match=r"capacity_factor=1.5 sizes the packed layout.*"
                                         r"layout='padded'"):
        MoELayerConfig(**base, capacity_factor=1.5).handle_kwargs(8, "padded")
    with pytest.raises(ValueError, match="capacity_factor=0 must be a finite number > 0"):
        MoELayerConfig(**base, capacity_factor=0)
    with pytest.raises(ValueError, match=r"overflow='skip'; expected one of"):
        MoELayerConfig(**base, overflow="skip")
