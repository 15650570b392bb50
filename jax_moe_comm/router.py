"""The router of a MoE layer: scores, (grouped) top-k, weights, load-balancing statistics.

The options are those of the model families the layer serves (names as in their configs):

- score: "softmax" (Mixtral, Qwen-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3's
  `scoring_func`), over the router logits [T, E] computed in f32.
- num_groups / topk_groups: grouped top-k (DeepSeek-V3 `n_group` / `topk_group`): experts
  come in num_groups equal groups, a group scores the sum of its two best selection scores,
  only the topk_groups best groups are eligible, then the usual top-k.
- expert bias (DeepSeek-V3's auxiliary-loss-free balancing, `e_score_correction_bias`): a
  per-expert bias added to the scores for *selection only*; the weights come from the unbiased
  scores. `balance_bias` is the update it is trained with (not by gradients).
- normalize (`norm_topk_prob`): the k weights of a token sum to 1; scale
  (`routed_scaling_factor`) multiplies them after.
- the auxiliary load-balancing loss (Switch Transformer / GShard): E * sum_e f_e * P_e, f_e the
  fraction of routed slots that chose expert e, P_e the mean probability of e (scores
  normalized over the experts), over the live tokens; 1 when perfectly balanced.

softmax with normalize=True and no groups or bias is `moe.route` (the softmax of the top-k
logits). `selection_margin` says how far each token's choice is from changing (for comparing
two implementations that round differently). Everything here is per rank and plain JAX;
`load_stats` gives the sums a caller adds over the token-sharded mesh axes before
`load_balancing_loss`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How tokens choose experts. Defaults: softmax top-k with normalized weights."""

    score: str = "softmax"
    num_groups: int = 1
    topk_groups: int | None = None  # None: every group
    normalize: bool = True
    scale: float = 1.0
    expert_bias: bool = False  # a non-trainable per-expert selection bias (balance_bias)
    aux_loss_coef: float = 0.0  # > 0: the layer reports coef * load_balancing_loss

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r}; expected one of {SCORES}")
        if not isinstance(self.num_groups, int) or self.num_groups < 1:
            raise ValueError(f"num_groups={self.num_groups!r} must be a positive integer")
        if self.topk_groups is not None and not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be in [1, num_groups="
                             f"{self.num_groups}]")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef={self.aux_loss_coef} must be >= 0")

    @property
    def kept_groups(self) -> int:
        return self.num_groups if self.topk_groups is None else self.topk_groups

    def check(self, num_experts: int, experts_per_token: int) -> None:
        """ValueError unless this router can choose k of num_experts experts."""
        G = self.num_groups
        if num_experts % G:
            raise ValueError(f"num_experts={num_experts} is not divisible by num_groups={G}: "
                             "expert groups are equal")
        eligible = num_experts // G * self.kept_groups
        if experts_per_token > eligible:
            raise ValueError(
                f"experts_per_token={experts_per_token} exceeds the {eligible} experts of the "
                f"topk_groups={self.kept_groups} groups kept (of num_groups={G}, "
                f"{num_experts // G} experts each): raise topk_groups or lower "
                "experts_per_token")


class Routed(NamedTuple):
    indices: jax.Array  # [T, k] int32, distinct experts per token
    weights: jax.Array  # [T, k] f32
    probs: jax.Array  # [T, E] f32: scores normalized over the experts (for the aux loss)


def scores(cfg: RouterConfig, logits):
    """[T, E] f32 scores of the logits."""
    logits = logits.astype(jnp.float32)
    return jax.nn.softmax(logits, axis=-1) if cfg.score == "softmax" else jax.nn.sigmoid(logits)


def _grouped(cfg: RouterConfig) -> bool:
    return cfg.num_groups > 1 and cfg.kept_groups < cfg.num_groups


def _group_scores(cfg: RouterConfig, select):
    """[T, G] f32: each group's score, the sum of its two best selection scores."""
    T, E = select.shape
    grouped = select.reshape(T, cfg.num_groups, E // cfg.num_groups)
    return jnp.sum(jax.lax.top_k(grouped, min(2, E // cfg.num_groups))[0], axis=-1)


def _eligible(cfg: RouterConfig, s, bias):
    """(selection scores [T, E]: s + bias, -inf outside the kept groups; group scores [T, G]
    or None without grouped top-k)."""
    select = s if bias is None else s + bias.astype(jnp.float32)[None, :]
    if not _grouped(cfg):
        return select, None
    T, E = select.shape
    G = cfg.num_groups
    group = _group_scores(cfg, select)
    _, keep = jax.lax.top_k(group, cfg.kept_groups)  # [T, kept]
    mask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
    return jnp.where(jnp.repeat(mask, E // G, axis=1), select, -jnp.inf), group


def _gap(values, n: int):
    """[T] f32: values' n-th largest less its (n+1)-th; inf where there is none to lose to."""
    if n >= values.shape[-1]:
        return jnp.full(values.shape[:1], jnp.inf, jnp.float32)
    top = jax.lax.top_k(values, n + 1)[0]
    gap = top[:, n - 1] - top[:, n]
    return jnp.where(jnp.isfinite(top[:, n]), gap, jnp.inf)


def route(cfg: RouterConfig, logits, k: int, bias=None) -> Routed:
    """Top-k experts of each token of logits [T, E] (see the module docstring)."""
    cfg.check(logits.shape[1], k)
    s = scores(cfg, logits)
    select, _ = _eligible(cfg, s, bias)
    _, indices = jax.lax.top_k(select, k)
    weights = jnp.take_along_axis(s, indices, axis=-1)
    if cfg.normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.scale
    probs = s if cfg.score == "softmax" else s / (jnp.sum(s, axis=-1, keepdims=True) + 1e-20)
    return Routed(indices.astype(jnp.int32), weights.astype(jnp.float32), probs)


def selection_margin(cfg: RouterConfig, logits, k: int, bias=None):
    """[T] f32: how far each token's choice of experts in `route` is from changing.

    The k experts `route` chooses for a token stay the same under any change of its selection
    scores (scores + bias) smaller than the margin in every expert. It is the smaller of half
    the gap between the k-th and the (k+1)-th eligible expert's score and, with grouped top-k,
    a quarter of the gap between the last kept group's score and the best dropped one's (a
    group scores the sum of two selection scores, so it moves twice as far). inf where nothing
    competes (no more than k eligible experts, every group kept).

    For comparing two implementations of a layer: where their scores differ by less than a
    token's margin, they choose the same experts for it; a token whose margin is within their
    rounding differences may be routed differently by each (a near-tie).
    """
    cfg.check(logits.shape[1], k)
    select, group = _eligible(cfg, scores(cfg, logits), bias)
    margin = _gap(select, k) / 2
    if group is not None:
        margin = jnp.minimum(margin, _gap(group, cfg.kept_groups) / 4)
    return margin


class LoadStats(NamedTuple):
    """Sums over this rank's live tokens; add them over the ranks, then load_balancing_loss."""

    slots: jax.Array  # [E] f32: routed slots per expert
    probs: jax.Array  # [E] f32: sum of the normalized scores
    tokens: jax.Array  # [] f32: live tokens


def load_stats(routed: Routed, live) -> LoadStats:
    """live: [T] bool (tokens that count)."""
    E = routed.probs.shape[-1]
    onehot = (routed.indices[..., None] == jnp.arange(E)) & live[:, None, None]
    slots = jnp.sum(onehot, axis=(0, 1), dtype=jnp.float32)
    probs = jnp.sum(jnp.where(live[:, None], routed.probs, 0.0), axis=0)
    return LoadStats(slots, probs, jnp.sum(live, dtype=jnp.float32))


def load_balancing_loss(stats: LoadStats, k: int):
    """E * sum_e f_e P_e of (global) stats: 1 when the load is uniform; 0 with no live token."""
    E = stats.slots.shape[-1]
    n = jnp.maximum(stats.tokens, 1.0)
    return E * jnp.sum((stats.slots / (n * k)) * (stats.probs / n))


def balance_bias(bias, expert_load, rate: float = 1e-3):
    """DeepSeek-V3's auxiliary-loss-free update: raise the bias of under-loaded experts,
    lower the over-loaded ones', by `rate` (expert_load: [E] routed slots, e.g. the layer's
    reported load summed over a step)."""
    load = expert_load.astype(jnp.float32)
    return (bias + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)
