"""The router options (jax_moe_comm.router) against a numpy reference written from the
model papers' definitions: softmax / sigmoid scores, grouped top-k, expert bias for selection
only, normalized and scaled weights, the load-balancing loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_comm import moe
from jax_moe_comm import router as R


def np_route(logits, k, score, num_groups=1, topk_groups=None, bias=None, normalize=True,
             scale=1.0):
    T, E = logits.shape
    s = (np.exp(logits - logits.max(-1, keepdims=True)) if score == "softmax"
         else 1 / (1 + np.exp(-logits)))
    if score == "softmax":
        s = s / s.sum(-1, keepdims=True)
    sel = s + (0 if bias is None else bias[None])
    idx = np.zeros((T, k), np.int64)
    for t in range(T):
        row = sel[t].copy()
        if num_groups > 1 and (topk_groups or num_groups) < num_groups:
            g = row.reshape(num_groups, E // num_groups)
            gs = np.sort(g, axis=1)[:, ::-1][:, :min(2, E // num_groups)].sum(1)
            keep = np.argsort(-gs, kind="stable")[:topk_groups]
            allowed = np.zeros(num_groups, bool)
            allowed[keep] = True
            row = np.where(np.repeat(allowed, E // num_groups), row, -np.inf)
        idx[t] = np.argsort(-row, kind="stable")[:k]
    w = np.take_along_axis(s, idx, 1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return idx, w * scale, s / s.sum(-1, keepdims=True)


CASES = {
    "softmax": dict(score="softmax"),
    "softmax-unnormalized": dict(score="softmax", normalize=False),
    "sigmoid-scaled": dict(score="sigmoid", scale=2.5),
    "sigmoid-grouped-bias (DeepSeek-V3)": dict(score="sigmoid", num_groups=4, topk_groups=2,
                                               bias=True, scale=2.5),
    "softmax-grouped": dict(score="softmax", num_groups=8, topk_groups=3),
}


def random_case(name: str, seed: int):
    """CASES[name] on 64 tokens x 16 experts of random logits (and expert bias where the case
    has one): (cfg, numpy kwargs for np_route/np_margin, logits, bias or None)."""
    kw = dict(CASES[name])
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((64, 16)).astype(np.float32) * 2
    bias = (rng.standard_normal(16) * 0.3).astype(np.float32) if kw.pop("bias", False) else None
    return R.RouterConfig(expert_bias=bias is not None, **kw), kw, logits, bias


@pytest.mark.parametrize("name", list(CASES))
def test_route_matches_numpy(name):
    cfg, kw, logits, bias = random_case(name, 0)
    k = 4
    got = R.route(cfg, jnp.asarray(logits), k, None if bias is None else jnp.asarray(bias))
    idx, w, p = np_route(logits, k, bias=bias, **kw)
    np.testing.assert_array_equal(np.sort(np.asarray(got.indices), 1), np.sort(idx, 1))
    order = np.argsort(np.asarray(got.indices), 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got.weights), order, 1),
                               np.take_along_axis(w, np.argsort(idx, 1), 1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.probs), p, rtol=1e-5, atol=1e-7)
    if bias is not None:  # selection moved by the bias, weights not: sigmoid of the logits
        sig = 1 / (1 + np.exp(-logits))
        chosen = np.take_along_axis(sig, np.asarray(got.indices), 1)
        np.testing.assert_allclose(np.asarray(got.weights) * chosen.sum(1, keepdims=True) / 2.5,
                                   chosen, rtol=1e-5)


def test_default_router_is_the_layers_softmax_top_k():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 8)) / 8, jnp.float32)
    idx, weights = moe.route(w, x, 3)
    got = R.route(R.RouterConfig(), x @ w, 3)
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(idx))
    np.testing.assert_allclose(np.asarray(got.weights), np.asarray(weights), rtol=1e-5)


def test_load_balancing_loss_and_bias_update():
    T, E, k = 6, 4, 2
    idx = np.array([[0, 1], [0, 1], [0, 2], [0, 1], [3, 1], [0, 2]], np.int32)
    probs = np.full((T, E), 0.25, np.float32)
    routed = R.Routed(jnp.asarray(idx), jnp.ones((T, k)), jnp.asarray(probs))
    live = jnp.asarray([True] * 5 + [False])  # the last token does not count
    stats = R.load_stats(routed, live)
    np.testing.assert_array_equal(np.asarray(stats.slots), [4, 4, 1, 1])
    assert float(stats.tokens) == 5
    f = np.array([4, 4, 1, 1]) / 10
    assert float(R.load_balancing_loss(stats, k)) == pytest.approx(E * np.sum(f * 0.25))
    uniform = R.LoadStats(jnp.full((E,), 5.0), jnp.full((E,), 2.5), jnp.asarray(10.0))
    assert float(R.load_balancing_loss(uniform, k)) == pytest.approx(1.0)
    bias = R.balance_bias(jnp.zeros(E), stats.slots, rate=0.1)
    np.testing.assert_allclose(np.asarray(bias), [-0.1, -0.1, 0.1, 0.1])


@pytest.mark.parametrize("kw, match", [
    (dict(score="relu"), "score='relu'"),
    (dict(num_groups=4, topk_groups=5), r"topk_groups=5 must be in \[1, num_groups=4\]"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0 must be >= 0"),
])
def test_bad_router_options(kw, match):
    with pytest.raises(ValueError, match=match):
        R.RouterConfig(**kw)


def test_groups_must_divide_the_experts_and_hold_k():
    with pytest.raises(ValueError, match="num_experts=10 is not divisible by num_groups=4"):
        R.RouterConfig(num_groups=4).check(10, 2)
    with pytest.raises(ValueError, match="experts_per_token=5 exceeds the 4 experts"):
        R.RouterConfig(num_groups=4, topk_groups=1).check(16, 5)


def np_margin(logits, k, score, num_groups=1, topk_groups=None, bias=None, **_):
    """router.selection_margin from its definition: half the gap between the k-th and the
    (k+1)-th eligible selection score, a quarter of the gap between the last kept and the best
    dropped group's score."""
    T, E = logits.shape
    s = (np.exp(logits - logits.max(-1, keepdims=True)) if score == "softmax"
         else 1 / (1 + np.exp(-logits)))
    if score == "softmax":
        s = s / s.sum(-1, keepdims=True)
    sel = s + (0 if bias is None else bias[None])
    out = np.zeros(T)
    for t in range(T):
        row, group_gap = sel[t], np.inf
        kept = topk_groups or num_groups
        if num_groups > 1 and kept < num_groups:
            g = row.reshape(num_groups, E // num_groups)
            gs = np.sort(np.sort(g, axis=1)[:, ::-1][:, :2].sum(1))[::-1]
            group_gap = gs[kept - 1] - gs[kept]
            keep = np.argsort(-np.sort(g, axis=1)[:, ::-1][:, :2].sum(1), kind="stable")[:kept]
            row = np.concatenate([g[i] for i in sorted(keep)])
        row = np.sort(row)[::-1]
        expert_gap = row[k - 1] - row[k] if len(row) > k else np.inf
        out[t] = min(expert_gap / 2, group_gap / 4)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_selection_margin_matches_numpy(name):
    cfg, kw, logits, bias = random_case(name, 2)
    k = 4
    got = R.selection_margin(cfg, jnp.asarray(logits), k,
                             None if bias is None else jnp.asarray(bias))
    assert got.shape == (logits.shape[0],) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np_margin(logits, k, bias=bias, **kw),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["sigmoid-scaled", "sigmoid-grouped-bias (DeepSeek-V3)",
                                  "softmax-grouped"])
def test_selection_margin_is_how_far_the_choice_is_from_changing(name):
    """Moving every selection score by 0.99 x the margin against the choice (the chosen down,
    the others up) keeps it; where the expert gap sets the margin, 1.01 x the margin on the
    k-th and (k+1)-th alone changes it. Selection scores move through the bias, which route
    adds to them."""
    kw = dict(CASES[name])
    kw.pop("bias", None)
    cfg = R.RouterConfig(**kw)
    rng = np.random.default_rng(3)
    T, E, k = 24, 16, 4
    logits = jnp.asarray(rng.standard_normal((T, E)).astype(np.float32) * 2)
    margin = np.asarray(R.selection_margin(cfg, logits, k))
    chosen = np.sort(np.asarray(R.route(cfg, logits, k).indices), 1)
    select = np.asarray(R.scores(cfg, logits))
    route = jax.jit(lambda x, b: R.route(cfg, x, k, b).indices)
    tight = 0
    for t in range(T):
        mine = np.isin(np.arange(E), chosen[t])
        against = np.where(mine, -1.0, 1.0) * 0.99 * margin[t]
        kept = np.sort(np.asarray(route(logits[t:t + 1], jnp.asarray(against, jnp.float32))))
        np.testing.assert_array_equal(kept[0], chosen[t], err_msg=f"token {t}")
        # the k-th chosen and the best eligible one not chosen, in selection score
        eligible = np.asarray(jnp.isfinite(R._eligible(cfg, jnp.asarray(select[t:t + 1]),
                                                       None)[0]))[0]
        order = [e for e in np.argsort(-select[t], kind="stable") if eligible[e]]
        if len(order) <= k or (select[t, order[k - 1]] - select[t, order[k]]) / 2 > \
                margin[t] * (1 + 1e-6):
            continue  # the group gap sets the margin: no tightness claim
        push = np.zeros(E)
        push[order[k - 1]], push[order[k]] = -1.01 * margin[t], 1.01 * margin[t]
        moved = np.sort(np.asarray(route(logits[t:t + 1], jnp.asarray(push, jnp.float32))))
        assert not np.array_equal(moved[0], chosen[t]), f"token {t}"
        tight += 1
    assert tight >= T // 2, tight  # most tokens' margin is their expert gap
