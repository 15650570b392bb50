"""Capacities (issue 24) on the reference backend, 8 emulated CPU devices: a packed one,
AllToAll(layout="packed", max_recv_rows=C, overflow=...), whose rows past C are dropped (the
highest local experts' first), and a padded one per local expert, AllToAll(layout="padded",
expert_capacity=P, overflow=...), whose experts' rows past their first P are dropped. Their slots
add nothing to y, and overflow="fail" reports them; the oracle is the one of tests/test_layout.py
with exactly the dropped slots (row_keys(dropped=True)) routed nowhere."""

import re
from unittest import mock

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


def _capacity_kwargs(cfg, layout, factor=0.5):
    """AllToAll arguments of a capacity of `factor` times the mean load in `layout` (0.5:
    skewed routing overflows it)."""
    if layout == "packed":
        return dict(layout="packed", max_recv_rows=cfg.recv_rows_for(factor))
    return dict(layout="padded", expert_capacity=cfg.rows_per_expert_for(factor))


LAYOUTS = ["packed", "padded"]


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


def test_expected_rows_per_expert_and_rows_per_expert_for():
    r1 = MoEConfig(num_experts=256, experts_per_token=8, hidden=7168, max_num_tokens=128,
                   world_size=8)
    assert r1.expected_rows_per_expert == 8 * 128 * 8 // 256 == 32
    assert r1.max_recv_tokens == 1024
    assert r1.rows_per_expert_for(1.0) == 32
    assert r1.rows_per_expert_for(1.25) == 40
    assert r1.rows_per_expert_for(1.3) == 48  # ceil(41.6) = 42, up to a multiple of 8
    assert r1.rows_per_expert_for(100) == r1.max_recv_tokens  # never above the worst case
    prefill = MoEConfig(num_experts=256, experts_per_token=8, hidden=7168, max_num_tokens=4096,
                        world_size=8)
    assert prefill.rows_per_expert_for(1.25) == 1280  # of 32,768 rows per expert
    dp2 = _cfg(*CASES["EP4-dp2-fp8"])  # 2 token groups of 8 tokens, k=3, over 8 experts
    assert dp2.expected_rows_per_expert == -(-2 * 8 * 3 // 8) == 6
    assert dp2.rows_per_expert_for(1.0) == 8
    odd = MoEConfig(num_experts=6, experts_per_token=4, hidden=128, max_num_tokens=5,
                    world_size=2)
    assert odd.expected_rows_per_expert == -(-2 * 5 * 4 // 6) == 7  # rounded up
    for bad in (0, -1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="capacity_factor=.* must be a finite number > 0"):
            r1.rows_per_expert_for(bad)


def test_bad_capacity_arguments_say_what_to_pass():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    with pytest.raises(ValueError, match=r"max_recv_rows=64 is a capacity of the packed layout.*"
                                         r"layout='padded'.*expert_capacity=.*layout='packed'"):
        AllToAll(cfg, max_recv_rows=64)
    with pytest.raises(ValueError, match=r"expert_capacity=8 is a capacity of the padded layout.*"
                                         r"layout='packed'.*max_recv_rows=.*layout='padded'"):
        AllToAll(cfg, layout="packed", expert_capacity=8)
    for bad in (0, cfg.max_recv_tokens + 1, 8.0, True, -3):
        with pytest.raises(ValueError, match=rf"expert_capacity={bad!r} must be an int in \[1, "
                                             rf"max_recv_tokens={cfg.max_recv_tokens}\].*"
                                             r"expected_rows_per_expert=16"):
            AllToAll(cfg, expert_capacity=bad)
    for bad in (0, cfg.max_recv_total + 1, 16.0, True):
        with pytest.raises(ValueError, match=rf"max_recv_rows={bad!r} must be an int in \[1, "
                                             rf"max_recv_total={cfg.max_recv_total}\]"):
            AllToAll(cfg, layout="packed", max_recv_rows=bad)
    with pytest.raises(ValueError, match=r"overflow='ignore'; expected one of \('fail', "
                                         r"'drop'\)"):
        AllToAll(cfg, layout="packed", overflow="ignore")
    # A worst-case padded handle drops nothing: no keys (the nvshmem backend's shape too).
    assert AllToAll(cfg).backend.row_keys(None, dropped=True).shape == (0,)
    assert AllToAll(cfg).max_recv_rows is None
    assert AllToAll(cfg, layout="packed").max_recv_rows == cfg.max_recv_total
    assert AllToAll(cfg, layout="packed", max_recv_rows=np.int64(24)).max_recv_rows == 24
    assert AllToAll(cfg).expert_capacity == cfg.max_recv_tokens
    assert AllToAll(cfg, layout="packed").expert_capacity is None
    assert AllToAll(cfg, expert_capacity=np.int64(24)).expert_capacity == 24
    assert AllToAll(cfg).drops_nothing and AllToAll(cfg, layout="packed").drops_nothing
    assert not AllToAll(cfg, expert_capacity=cfg.max_recv_tokens - 1).drops_nothing
    assert T.dropped_keys_length(AllToAll(cfg, expert_capacity=24)) == cfg.max_recv_total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_y_must_have_the_capacity_rows(layout):
    """expert_x comes in the capacity's rows ([C, H] packed, [L, P, H] padded) and combine
    refuses expert_y in the worst case's."""
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    if layout == "packed":
        a2a = AllToAll(cfg, layout="packed", max_recv_rows=40)
        worst, want = (cfg.max_recv_total, cfg.hidden), (40, cfg.hidden)
    else:
        a2a = AllToAll(cfg, expert_capacity=24)
        worst, want = (2, cfg.max_recv_tokens, cfg.hidden), (2, 24, cfg.hidden)
    seen = []

    def body(x, idx, w, nt):
        out = a2a.dispatch(x, idx, nt)
        seen.append(out.expert_x.shape)
        bad = jnp.zeros(worst, bf16)  # the worst case, not the capacity
        return a2a.combine(bad, out.routing, idx, w, nt)

    fn = jax.shard_map(body, mesh=T.make_mesh(8), in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    sds = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match=rf"expert_y has shape {re.escape(str(worst))}; "
                                         rf"expected {re.escape(str(want))} .*"
                                         rf"layout='{layout}'"):
        jax.jit(fn).lower(sds((64, 128), bf16), sds((64, 4), jnp.int32),
                          sds((64, 4), jnp.float32), sds((8,), jnp.int32))
    assert seen == [want]


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


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("name", list(CASES))
def test_padded_drop_keeps_each_experts_first_rows_and_y_loses_only_the_dropped_slots(name,
                                                                                      split):
    """expert_capacity P of half the mean load per expert, skewed routing: each expert keeps
    min(arrived, P) rows (expert_x [L, P, H]), the rows past P are reported by key and
    count (dropped = sum over experts of max(0, arrived - P)), and y equals the oracle with
    exactly those slots routed nowhere; nothing raised."""
    cfg = _cfg(*CASES[name])
    a2a = AllToAll(cfg, **_capacity_kwargs(cfg, "padded"), overflow="drop")
    assert a2a.expert_capacity < cfg.max_recv_tokens
    mesh = T.make_mesh(cfg.world_size)
    inp = T.make_inputs(cfg, 3, "skewed", ragged=False)
    T.run_and_check(a2a, mesh, inp, split=split)  # counts, keys, dispatch rows and y
    P_ = a2a.expert_capacity
    want = sum(max(0, sum(c.values()) - P_) for r in range(cfg.world_size)
               for c in T.expected_rows(cfg, inp, r).values())
    assert want > 0 and a2a.dropped_rows() == want
    a2a.check()  # "drop" reports nothing


def test_padded_reference_drops_each_experts_last_rows_in_key_order():
    """The reference backend keeps an expert's rows in (source rank, token, slot) order, so the
    rows it drops are each expert's last arrivals: every kept key of an expert is below every
    dropped key of that expert, and the dropped keys come expert by expert (nvshmem keeps rows
    in the atomics' order: the tests above do not rely on this)."""
    cfg = _cfg(*CASES["EP4-dp2-fp8"])
    a2a = AllToAll(cfg, **_capacity_kwargs(cfg, "padded"), overflow="drop")
    mesh = T.make_mesh(cfg.world_size)
    inp = T.make_inputs(cfg, 4, "skewed", ragged=False)
    x, xs, idx, w, nt = T.global_inputs(cfg, mesh, inp)

    def body(x, xs, idx, nt):
        out = a2a.dispatch(x, idx, nt.reshape(()), x_scale=xs)
        b = out.routing.backend
        return a2a.backend.row_keys(b), a2a.backend.row_keys(b, dropped=True)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))
    kept, dropped = (np.asarray(a) for a in f(x, xs, idx, nt))
    L, m, k = cfg.num_local_experts, cfg.max_num_tokens, cfg.experts_per_token
    kept = kept.reshape(cfg.world_size, L, -1)
    dropped = dropped.reshape(cfg.world_size, -1)
    assert kept.shape[2] == a2a.expert_capacity and dropped.shape[1] == cfg.max_recv_total

    def expert(key):  # the global expert of a key's slot (dp 2: group g is ranks 2g, 2g+1)
        return inp.indices[key // (m * k) * cfg.token_replicas, key // k % m, key % k]

    seen = 0
    for r in range(cfg.world_size):
        d = dropped[r][dropped[r] >= 0]
        assert (dropped[r][len(d):] == -1).all()  # -1 past the dropped count
        experts = [expert(key) - r * L for key in d]
        assert experts == sorted(experts), experts  # expert by expert
        for e in range(L):
            mine_kept = kept[r, e][kept[r, e] >= 0]
            mine_dropped = [key for key, x in zip(d, experts) if x == e]
            assert sorted(mine_kept.tolist()) == mine_kept.tolist()  # arrival order
            if mine_dropped:
                assert len(mine_kept) == a2a.expert_capacity
                assert mine_kept.max() < min(mine_dropped), (r, e)
            seen += len(mine_dropped)
    assert seen == a2a.dropped_rows() > 0


def test_the_capacity_oracle_catches_a_wrong_drop_report(monkeypatch):
    """The drop checks fail when the backend reports other rows than it dropped."""
    from jax_moe_comm.backends.reference import ReferenceBackend

    real = ReferenceBackend.row_keys

    def shifted(self, routing, dropped=False):
        keys = real(self, routing, dropped)
        return jnp.where(keys >= 0, keys ^ 1, keys) if dropped else keys  # another slot

    monkeypatch.setattr(ReferenceBackend, "row_keys", shifted)
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    for layout in LAYOUTS:
        a2a = AllToAll(cfg, **_capacity_kwargs(cfg, layout), overflow="drop")
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
    padded = AllToAll(cfg, expert_capacity=cfg.max_recv_tokens, overflow="drop")
    T.run_and_check(padded, mesh, inp)
    assert padded.dropped_rows() == 0


# -- fail ------------------------------------------------------------------------------------
def _kept_until_recover_then_one_token_per_rank_is_right(a2a, cfg, mesh, step):
    """After a CapacityExceeded cycle: check() raises again until recover(), then the same
    compiled step is right on a cycle that fits (one token per rank) and drops nothing."""
    with pytest.raises(CapacityExceededError):  # kept until recover()
        a2a.check()
    a2a.recover()
    a2a.check()
    assert a2a.dropped_rows() == 0
    fits = T.make_inputs(cfg, 5, ragged=False)
    fits.num_tokens[:] = 1
    T.run_and_check(a2a, mesh, fits, step=step)
    a2a.check()
    assert a2a.dropped_rows() == 0


def test_overflow_fail_raises_until_recover_and_the_next_cycle_is_right():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    C = _small_capacity(cfg)
    a2a = AllToAll(cfg, layout="packed", max_recv_rows=C)  # overflow="fail", the default
    mesh = T.make_mesh(8)
    inp = T.make_inputs(cfg, 4, "skewed", ragged=False)
    step = T.make_step(a2a, mesh, dropped=True)
    T.run_and_check(a2a, mesh, inp, step=step)  # the rows past C were not written either way
    assert a2a.dropped_rows() == 0  # a "fail" cycle is reported by check(), not counted
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
    # one token per rank: at most 8 * min(k, L) rows per rank fit in C
    assert 8 * min(cfg.experts_per_token, cfg.num_local_experts) <= C
    _kept_until_recover_then_one_token_per_rank_is_right(a2a, cfg, mesh, step)


def test_padded_overflow_fail_raises_until_recover_and_the_next_cycle_is_right():
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    a2a = AllToAll(cfg, **_capacity_kwargs(cfg, "padded"))  # overflow="fail", the default
    P_ = a2a.expert_capacity
    mesh = T.make_mesh(8)
    inp = T.make_inputs(cfg, 4, "skewed", ragged=False)
    step = T.make_step(a2a, mesh, dropped=True)
    T.run_and_check(a2a, mesh, inp, step=step)  # the rows past P were not written either way
    assert a2a.dropped_rows() == 0  # a "fail" cycle is reported by check(), not counted
    with pytest.raises(CapacityExceededError) as err:
        a2a.check()
    msg = str(err.value)
    found = re.match(rf"CapacityExceeded: rank (\d) in dispatch_recv: (\d+) expert rows arrived "
                     rf"past expert_capacity={P_} \(per local expert\) this cycle", msg)
    assert found, msg
    rank, past = (int(g) for g in found.groups())
    want = sum(max(0, sum(c.values()) - P_) for c in T.expected_rows(cfg, inp, rank).values())
    assert past == want > 0, (msg, want)
    assert "expert_capacity" in msg and "rows_per_expert_for" in msg and "overflow='drop'" in msg
    assert 8 <= P_  # one token per rank: at most 8 rows per expert fit in P
    _kept_until_recover_then_one_token_per_rank_is_right(a2a, cfg, mesh, step)


# -- several cycles in one jitted loop ------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_jitted_loop_of_cycles_with_drops(layout):
    """lax.fori_loop of 4 dispatch/combine cycles with different routing (two skewed: they
    drop): each cycle's y equals the oracle without its dropped slots; the host count is the
    sum of the cycles' drops."""
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    a2a = AllToAll(cfg, **_capacity_kwargs(cfg, layout), overflow="drop")
    packed = layout == "packed"
    mesh = T.make_mesh(8)
    routings = ("skewed", "random", "skewed", "duplicates")
    inps = [T.make_inputs(cfg, 10 + i, r) for i, r in enumerate(routings)]
    cycles = len(inps)
    spill = T.dropped_keys_length(a2a)

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
            ey = T.expert_outputs(cfg, rank, out.expert_x, None,
                                  out.group_sizes if packed else None)
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
LAYER_CASES = [  # layout, capacity factor, overflow, expert_gemm, the handle's capacity argument
    ("packed", 0.75, "drop", "auto", dict(max_recv_rows=24)),
    ("padded", 0.75, "drop", "einsum", dict(expert_capacity=16)),  # 12, up to 8's multiple
    ("padded", 1.5, "fail", "einsum", dict(expert_capacity=24)),  # the busiest expert: 24 rows
]


@pytest.mark.parametrize("layout, factor, overflow, gemm, capacity", LAYER_CASES,
                         ids=lambda v: str(v) if not isinstance(v, dict) else "")
def test_layer_with_a_capacity_factor_equals_dense_without_the_dropped_slots(
        layout, factor, overflow, gemm, capacity):
    """moe_forward on a handle made from MoELayerConfig(capacity_factor=f, overflow=...) in
    either layout (padded: the batched einsum over [L, P, H], P = rows_per_expert_for(f))
    equals dense_forward with the dropped slots masked out (their keys from a dispatch of the
    same routing: the reference backend drops the same rows every time). At 1.5 no expert
    overflows this routing (its busiest gets 24 rows = P): y is dense's, nothing dropped or
    raised."""
    cfg = MoELayerConfig(num_experts=16, experts_per_token=4, hidden=128, ffn=256,
                         max_num_tokens=8, capacity_factor=factor, overflow=overflow,
                         expert_gemm=gemm)
    world = 8
    mesh = T.make_mesh(world)
    comm = cfg.comm_config(world)
    kwargs = cfg.handle_kwargs(world, layout)
    assert kwargs == dict(layout=layout, overflow=overflow, **capacity)
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
    shapes = []

    def layer(p, x, nt):
        from jax_moe_comm import moe

        real = moe.experts_forward

        def spy(a2a, params, out, *args, **kwargs):  # the expert GEMMs' input, as run
            shapes.append(out.expert_x.shape)
            return real(a2a, params, out, *args, **kwargs)

        with mock.patch.object(moe, "experts_forward", spy):
            return moe.moe_forward(a2a, cfg, p, x, nt.reshape(()))

    def dropped_keys(p, x, nt):
        indices, _ = route(p["router"], x, cfg.experts_per_token)
        out = a2a.dispatch(x, indices, nt.reshape(()))
        return a2a.backend.row_keys(out.routing.backend, dropped=True)

    y = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(pspec, P("ep"), P("ep")),
                              out_specs=P("ep")))(dev, jax.device_put(x, ep),
                                                  jax.device_put(nt, ep))
    rows = capacity.get("max_recv_rows")
    assert shapes == [(rows, H) if layout == "packed" else
                      (comm.num_local_experts, capacity["expert_capacity"], H)]
    keys = jax.jit(jax.shard_map(dropped_keys, mesh=mesh, in_specs=(pspec, P("ep"), P("ep")),
                                 out_specs=P("ep")))(dev, jax.device_put(x, ep),
                                                     jax.device_put(nt, ep))
    keys = np.asarray(keys)
    keys = keys[keys >= 0]
    assert a2a.dropped_rows() == 2 * len(keys)  # two dispatches
    assert (len(keys) > 0) == (factor < 1), len(keys)
    a2a.check()  # "drop" reports nothing, and at 1.5 nothing overflows
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
    assert cfg.handle_kwargs(8, "packed") == dict(layout="packed", overflow="fail")
    capped = MoELayerConfig(**base, capacity_factor=1.5, overflow="drop")
    assert capped.handle_kwargs(8, "padded") == dict(layout="padded", overflow="drop",
                                                     expert_capacity=24)  # 1.5 * 16
    assert capped.handle_kwargs(8, "packed") == dict(layout="packed", overflow="drop",
                                                     max_recv_rows=48)  # 1.5 * 32
    with pytest.raises(ValueError, match=r"layout='sparse'; expected one of"):
        capped.handle_kwargs(8, "sparse")
    with pytest.raises(ValueError, match="capacity_factor=0 must be a finite number > 0"):
        MoELayerConfig(**base, capacity_factor=0)
    with pytest.raises(ValueError, match=r"overflow='skip'; expected one of"):
        MoELayerConfig(**base, overflow="skip")
