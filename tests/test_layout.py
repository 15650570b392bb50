"""The packed expert layout (expert_x [max_recv_rows, H], group_sizes [L], written so by the
backend) against the oracle and the padded layout on the reference backend, and the
pack/unpack helpers on their own. A capacity below the worst case: tests/test_capacity.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from jax_moe_comm import AllToAll, MoEConfig
from jax_moe_comm import testing as T
from jax_moe_comm.layout import pack_rows, unpack_rows
from jax_moe_comm.moe import MoELayerConfig, dense_forward, init_params, moe_forward

bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn

CASES = {  # name: (E, k, H, max_m, EP, token_replicas, dispatch dtype)
    "EP8-k4-bf16": (16, 4, 128, 8, 8, 1, bf16),
    "EP4-dp2-fp8": (8, 3, 256, 8, 4, 2, fp8),
    "EP2-k=E": (4, 4, 128, 4, 2, 1, bf16),  # min(k, L) = L: every row can come back L times
    "EP1": (8, 2, 128, 4, 1, 1, bf16),
}


def _cfg(E, k, H, m, ep, dp, dtype):
    return MoEConfig(num_experts=E, experts_per_token=k, hidden=H, max_num_tokens=m,
                     world_size=ep, token_replicas=dp, dispatch_dtype=dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("routing", ["random", "skewed", "duplicates"])
def test_packed_layout_matches_oracle(name, routing):
    cfg = _cfg(*CASES[name])
    a2a = AllToAll(cfg, layout="packed")
    seed = np.random.SeedSequence().entropy % 2**31
    T.run_and_check(a2a, T.make_mesh(cfg.world_size), T.make_inputs(cfg, seed, routing),
                    split=routing == "skewed")


LAYERS = {  # the MoE layer of moe.py at several shapes
    "EP8-k4": MoELayerConfig(num_experts=16, experts_per_token=4, hidden=128, ffn=256,
                             max_num_tokens=8),
    "EP8-dp2": MoELayerConfig(num_experts=16, experts_per_token=3, hidden=128, ffn=128,
                              max_num_tokens=8, token_replicas=2),
    "EP8-fp8-k=L": MoELayerConfig(num_experts=16, experts_per_token=2, hidden=256, ffn=128,
                                  max_num_tokens=4, fp8_dispatch=True, num_shared_experts=0),
    # gated experts (w_in [E, H, 2F]) with 0, 1 and 2 shared experts: the fused combine, and
    # the split one with the shared GEMMs in both flights
    "EP8-gated-no-shared": MoELayerConfig(num_experts=16, experts_per_token=2, hidden=128,
                                          ffn=64, max_num_tokens=4, gated=True,
                                          num_shared_experts=0),
    "EP8-gated-1-shared": MoELayerConfig(num_experts=16, experts_per_token=2, hidden=128,
                                         ffn=64, max_num_tokens=4, gated=True),
    "EP8-gated-2-shared": MoELayerConfig(num_experts=16, experts_per_token=2, hidden=128,
                                         ffn=64, max_num_tokens=4, gated=True,
                                         num_shared_experts=2, shared_ffn=48),
    "EP8-2-shared": MoELayerConfig(num_experts=16, experts_per_token=2, hidden=128, ffn=64,
                                   max_num_tokens=4, num_shared_experts=2),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_packed_layer_equals_padded_layer_and_dense(name):
    """moe_forward on a packed handle (the backend writes the packed rows) gives the padded
    handle's y bit for bit, and the dense layer's (moe.dense_forward) within bf16 rounding."""
    cfg, world = LAYERS[name], 8
    mesh = T.make_mesh(world)
    params = init_params(cfg, 1)
    rng = np.random.default_rng(2)
    m, dp = cfg.max_num_tokens, cfg.token_replicas
    x = np.repeat(rng.standard_normal((world // dp, m, cfg.hidden)), dp, axis=0)
    x = x.reshape(world * m, cfg.hidden).astype(bf16)  # replicas hold the same tokens
    nt = np.repeat(rng.integers(1, m + 1, world // dp), dp).astype(np.int32)
    ep, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
    pspec = {k: P("ep") if k in ("w_in", "w_out") else P() for k in params}
    dev = {k: jax.device_put(v, ep if k in ("w_in", "w_out") else rep)
           for k, v in params.items()}
    ys = {}
    for layout in ("packed", "padded"):
        a2a = AllToAll(cfg.comm_config(world), **cfg.handle_kwargs(world, layout))
        fn = jax.jit(jax.shard_map(lambda p, x, n, a2a=a2a: moe_forward(a2a, cfg, p, x,
                                                                          n.reshape(())),
                                   mesh=mesh, in_specs=(pspec, P("ep"), P("ep")),
                                   out_specs=P("ep")))
        ys[layout] = np.asarray(fn(dev, jax.device_put(x, ep), jax.device_put(nt, ep)),
                                np.float32)
    np.testing.assert_array_equal(ys["packed"], ys["padded"])
    dense = jax.jit(lambda p, x, n: dense_forward(cfg, p, x, n))
    for r in range(world):
        want = np.asarray(dense(params, x[r * m:(r + 1) * m], nt[r]), np.float32)
        np.testing.assert_allclose(ys["packed"][r * m:(r + 1) * m], want, atol=0.05,
                                   rtol=0.02, err_msg=f"rank {r}")


def test_packed_sizes():
    cfg = _cfg(*CASES["EP8-k4-bf16"])  # L = 2 < k = 4: at most 2 rows per token per rank
    assert cfg.max_recv_total == cfg.max_num_tokens * 8 * 2
    assert _cfg(*CASES["EP2-k=E"]).max_recv_total == 4 * 2 * 2


def test_every_token_to_one_rank_fills_the_packed_rows():
    cfg = _cfg(32, 4, 128, 8, 8, 1, bf16)  # L = 4 = k
    inp = T.make_inputs(cfg, 1, ragged=False)
    inp.indices[:] = np.arange(4, dtype=np.int32)  # every token to rank 0's 4 experts
    a2a = AllToAll(cfg, layout="packed")
    mesh = T.make_mesh(8)
    T.run_and_check(a2a, mesh, inp)
    _, _, counts, _ = T.make_step(a2a, mesh)(*T.global_inputs(cfg, mesh, inp))
    assert int(np.asarray(counts)[:4].sum()) == cfg.max_recv_total


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    L, R, H, total = 3, 5, 4, 9
    padded = jnp.asarray(rng.standard_normal((L, R, H)), jnp.float32)
    counts = jnp.array([2, 0, 4], jnp.int32)
    packed = pack_rows(padded, counts, total)
    want = np.concatenate([padded[0, :2], padded[2, :4], np.zeros((3, H))])
    np.testing.assert_array_equal(packed, want)
    back = unpack_rows(packed, counts, R)
    mask = (np.arange(R)[None, :] < np.asarray(counts)[:, None])[..., None]
    np.testing.assert_array_equal(back, np.where(mask, padded, 0))


def test_oracle_catches_a_wrong_packing(monkeypatch):
    """The packed checks fail when rows land in the wrong group: the backend's live rows
    shifted by one (each group's first row goes to the group before)."""
    from jax_moe_comm.backends.reference import ReferenceBackend

    real = ReferenceBackend.dispatch_recv

    def shifted(self, pending):
        ex, scale, counts, *rest = real(self, pending)
        i, n = jnp.arange(ex.shape[0]), jnp.maximum(jnp.sum(counts), 1)
        return (ex[jnp.where(i < n, (i + 1) % n, i)], scale, counts, *rest)

    monkeypatch.setattr(ReferenceBackend, "dispatch_recv", shifted)
    cfg = _cfg(*CASES["EP8-k4-bf16"])
    with pytest.raises(AssertionError, match="expected rows missing"):
        T.run_and_check(AllToAll(cfg, layout="packed"), T.make_mesh(8),
                        T.make_inputs(cfg, 2, ragged=False))


def test_packed_expert_y_shape_is_checked():
    from jax.sharding import PartitionSpec as P

    cfg = _cfg(*CASES["EP8-k4-bf16"])
    a2a = AllToAll(cfg, layout="packed")

    def body(x, idx, w, nt):
        out = a2a.dispatch(x, idx, nt)
        bad = jnp.zeros((cfg.num_local_experts, cfg.max_recv_tokens, cfg.hidden), bf16)
        return a2a.combine(bad, out.routing, idx, w, nt)

    fn = jax.shard_map(body, mesh=T.make_mesh(8), in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    sds = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match=r"expert_y has shape \(2, 64, 128\); expected "
                                         r"\(128, 128\) .*layout='packed'"):
        jax.jit(fn).lower(sds((64, 128), bf16), sds((64, 4), jnp.int32),
                          sds((64, 4), jnp.float32), sds((8,), jnp.int32))
