"""Advantage estimators (verl-compatible), masked statistics, and their registry.

Conventions (shared by the whole of ``jaxflow.algos``)
------------------------------------------------------
* Token tensors are ``[B, T]`` over the response (right-padded); ``response_mask`` ``m`` is 1 on
  valid response tokens and 0 elsewhere. ``group_ids`` is an int array ``[B]``: samples drawn
  for the same prompt share an id. Ids are arbitrary integers (no need to be contiguous).
* ``mean_m(x) = sum(x m) / (sum(m) + 1e-8)`` over all masked tokens of the batch, and
  ``var_m(x) = mean_m((x - mean_m(x))^2) * n / (n - 1)`` with ``n = sum(m)`` (unbiased), exactly
  as ``verl.utils.torch_functional.masked_mean / masked_var``.
  ``whiten_m(x) = (x - mean_m(x)) / sqrt(var_m(x) + 1e-8)``.
* ``s_i = sum_t r_{i,t} m_{i,t}`` is sequence ``i``'s score. (verl sums the rewards without the
  mask; the two agree whenever rewards are zero on padding, which is how rewards are built.)
* Every estimator returns ``(advantages, returns)``, both ``[B, T]``. They are pure functions
  compiled with ``jax.jit`` (so the driver may call them directly on NumPy columns); they
  vmap and hold no Python loop over the batch (recurrences over time use ``lax.scan``; group
  statistics use one sort to dense ids and segment sums).
* A group of one (a prompt with a single sample) has ``mean_g = 0, std_g = 1`` (verl's rule).

Registry and column dispatch
----------------------------
``get_adv_estimator_fn(name)`` returns the estimator wrapped so that it can be called with
keyword arguments by *column name* and silently ignores the keywords it does not take. A
trainer can therefore hand every column and hyper-parameter it has::

    fn = get_adv_estimator_fn(cfg.adv_estimator)          # "gae", "grpo", "rloo", ...
    advantages, returns = fn(token_level_rewards=r, response_mask=m, values=v,
                             group_ids=uid, reward_baselines=b, gamma=1.0, lam=0.95,
                             norm_adv_by_std_in_grpo=True)

Register your own with ``@register_adv_est("name")`` (verl spelling:
``register_adv_est``); its parameter names define which columns it receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflow.algos.registry import Registry, accepts_keywords

Array = jax.Array

# ----------------------------------------------------------------------------- masked statistics


def masked_sum(values: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(x m)`` over ``axis``; values outside the mask (even NaN) never leak in."""
    values = jnp.asarray(values)
    mask = jnp.asarray(mask)
    m = mask.astype(values.dtype)
    return jnp.sum(jnp.where(mask != 0, values, 0) * m, axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """verl's masked mean: ``sum(x m) / (sum(m) + 1e-8)`` (0 for an empty mask)."""
    values = jnp.asarray(values)
    m = jnp.asarray(mask).astype(values.dtype)
    return masked_sum(values, mask, axis) / (jnp.sum(m, axis=axis) + 1e-8)


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """verl's masked variance over all masked tokens.

    ``var = mean_m((x - mean_m(x))^2) * n / (n - 1)`` with ``n = sum(m)`` when ``unbiased``.
    verl raises for ``n <= 1``; a jitted function cannot, so ``n <= 1`` uses no Bessel factor
    (the variance of one token is then ~0).
    """
    m = jnp.asarray(mask).astype(values.dtype)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = jnp.sum(m)
        var = var * jnp.where(n > 1, n / jnp.where(n > 1, n - 1, 1), 1)
    return var


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """``whiten_m(x) = (x - mean_m(x)) / sqrt(var_m(x) + 1e-8)`` (statistics over masked tokens).

    Applied to every position (padding included); callers multiply by the mask where verl does.
    With ``shift_mean=False`` the mean is added back.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * lax.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ----------------------------------------------------------------------------- group statistics


def group_index(group_ids: Array) -> Array:
    """Remaps arbitrary integer ids ``[B]`` to dense indices in ``[0, B)`` (same id -> same index).

    One stable sort: runs of equal ids in sorted order get consecutive indices, scattered back
    to the samples' positions. Static shapes, so it jits, vmaps and shards.
    """
    group_ids = jnp.asarray(group_ids)
    if group_ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D [B], got shape {group_ids.shape}")
    order = jnp.argsort(group_ids, stable=True)
    sorted_ids = group_ids[order]
    starts = (sorted_ids[1:] != sorted_ids[:-1]).astype(jnp.int32)
    dense_sorted = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(starts)])
    return jnp.zeros_like(dense_sorted).at[order].set(dense_sorted)


def _group_sum(x: Array, gidx: Array) -> Array:
    """Per-sample sum over the sample's group: ``out_i = sum_{j in g(i)} x_j``."""
    b = x.shape[0]
    return jax.ops.segment_sum(x, gidx, num_segments=b)[gidx]


def group_mean_std(scores: Array, group_ids: Array, *, gidx: Array | None = None) -> tuple[Array, Array, Array]:
    """Per-sample group statistics of ``scores`` ``[B]``.

    Returns ``(mean_g, std_g, n_g)`` broadcast back to ``[B]``, where ``mean_g`` is the group's
    mean, ``std_g`` its unbiased standard deviation (``sqrt(sum (s - mean_g)^2 / (n_g - 1))``,
    as ``torch.std``) and ``n_g`` its size. Groups of one get ``mean 0, std 1`` (verl's rule).
    ``gidx`` may pass a precomputed :func:`group_index`.
    """
    if gidx is None:
        gidx = group_index(group_ids)
    n = _group_sum(jnp.ones_like(scores), gidx)
    single = n < 2
    mean = _group_sum(scores, gidx) / n
    dev = scores - mean
    var = _group_sum(dev * dev, gidx) / jnp.where(single, 1, n - 1)
    mean = jnp.where(single, 0, mean)
    std = jnp.where(single, 1, jnp.sqrt(var))
    return mean, std, n


def _as_float(x: Array) -> Array:
    """Rewards as a floating array (integer rewards are promoted to the default float)."""
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.result_type(float))


def _scores(token_level_rewards: Array, response_mask: Array) -> Array:
    """``s_i = sum_t r_{i,t} m_{i,t}``."""
    return masked_sum(_as_float(token_level_rewards), response_mask, axis=-1)


def _broadcast(per_seq: Array, response_mask: Array) -> Array:
    """``A_i * m_{i,t}``: a per-sequence value spread over the sequence's valid tokens."""
    return per_seq[:, None] * jnp.asarray(response_mask).astype(per_seq.dtype)


def _grpo_normalised(s: Array, group_ids: Array, epsilon: Any, norm_by_std: Any, gidx: Array | None = None) -> Array:
    """GRPO's ``(s_i - mean_g) / (std_g + epsilon)`` (unbiased std; a group of one: mean 0,
    std 1), or ``s_i - mean_g`` without ``norm_by_std`` (Dr.GRPO)."""
    mean, std, _ = group_mean_std(s, group_ids, gidx=gidx)
    return jnp.where(jnp.asarray(norm_by_std), (s - mean) / (std + epsilon), s - mean)


# ----------------------------------------------------------------------------- registry

ADV_ESTIMATOR_REGISTRY = Registry("advantage estimator")


def register_adv_est(name: str, *, override: bool = False):
    """Decorator: ``@register_adv_est("my_adv")`` makes ``cfg.adv_estimator="my_adv"``
    select the function. Its parameter names are the columns it receives."""
    return ADV_ESTIMATOR_REGISTRY.register(name, override=override)


def get_adv_estimator_fn(name: str) -> Callable[..., tuple[Array, Array]]:
    """The estimator registered under ``name``, callable with keyword arguments by column name.

    Keywords the estimator does not take are ignored, so a trainer may pass all its columns:
    ``get_adv_estimator_fn("grpo")(**columns)``. Unknown names raise an error listing the
    valid ones.
    """
    return accepts_keywords(ADV_ESTIMATOR_REGISTRY.get(name))


def advantage_estimator_names() -> list[str]:
    return ADV_ESTIMATOR_REGISTRY.names()


# ----------------------------------------------------------------------------- estimators


@register_adv_est("gae")
@jax.jit
def compute_gae_advantage_return(
    token_level_rewards: Array, values: Array, response_mask: Array, gamma: Any, lam: Any
) -> tuple[Array, Array]:
    """Generalised Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438), verl's form.

    Backward over ``t = T-1 .. 0`` with ``V_next = 0, A_next = 0``::

        delta_t = r_t + gamma V_next - V_t
        Ahat_t  = delta_t + gamma lam A_next
        V_next <- m_t V_t    + (1 - m_t) V_next      # masked tokens are skipped
        A_next <- m_t Ahat_t + (1 - m_t) A_next      # stored advantage at t is this A_next

    ``returns = A + V`` (before whitening); ``advantages = whiten_m(A)`` (not re-masked, as verl).
    The recurrence is a ``lax.scan`` over time.
    """
    r = _as_float(token_level_rewards)
    v = jnp.asarray(values).astype(r.dtype)
    m = jnp.asarray(response_mask).astype(r.dtype)
    gamma = jnp.asarray(gamma, r.dtype)
    lam = jnp.asarray(lam, r.dtype)

    def step(carry, xs):
        next_v, last_a = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_v - v_t
        a_t = delta + gamma * lam * last_a
        next_v = v_t * m_t + (1 - m_t) * next_v
        last_a = a_t * m_t + (1 - m_t) * last_a
        return (next_v, last_a), last_a

    zeros = jnp.zeros(r.shape[:-1], r.dtype)
    _, adv_t = lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv_t.T
    returns = adv + v
    return masked_whiten(adv, response_mask), returns


@register_adv_est("grpo")
@register_adv_est("grpo_vectorized")
@jax.jit
def compute_grpo_outcome_advantage(
    token_level_rewards: Array,
    response_mask: Array,
    group_ids: Array,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Any = True,
) -> tuple[Array, Array]:
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300); Dr.GRPO without std.

    ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the unbiased group std, or
    ``A_i = s_i - mean_g`` when ``norm_adv_by_std_in_grpo`` is false (Dr.GRPO,
    arXiv:2503.20783). A group of one uses ``mean 0, std 1``. Advantages ``= returns = A_i m``.
    """
    a = _grpo_normalised(_scores(token_level_rewards, response_mask), group_ids, epsilon, norm_adv_by_std_in_grpo)
    adv = _broadcast(a, response_mask)
    return adv, adv


def _check_groups_of_two(group_ids: Array) -> None:
    if isinstance(group_ids, jax.core.Tracer):
        return  # cannot inspect values under jit; singletons then get advantage 0
    _, counts = np.unique(np.asarray(group_ids), return_counts=True)
    if counts.size and counts.min() < 2:
        raise ValueError(f"pass@k needs at least 2 samples per group, got a group of {counts.min()}")


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Array,
    response_mask: Array,
    group_ids: Array,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Any = True,
) -> tuple[Array, Array]:
    """Pass@k GRPO advantage (arXiv:2503.19595).

    Only the best sample of each group is credited: ``A_{i*} = r_max - r_second`` (divided by
    ``std_g + epsilon`` when normalising, std unbiased); every other sample gets 0. Ties at the
    top give 0 whichever sample is chosen. Needs ``n_g >= 2``: raises ``ValueError`` when called
    on concrete ids; under jit a group of one gets 0. Advantages ``= returns = A_i m``.
    """
    _check_groups_of_two(group_ids)
    return _passk(token_level_rewards, response_mask, group_ids, epsilon, norm_adv_by_std_in_grpo)


@jax.jit
def _passk(token_level_rewards, response_mask, group_ids, epsilon, norm_adv_by_std_in_grpo):
    s = _scores(token_level_rewards, response_mask)
    b = s.shape[0]
    gidx = group_index(group_ids)
    idx = jnp.arange(b)
    r_max = jax.ops.segment_max(s, gidx, num_segments=b)[gidx]
    i_max = jax.ops.segment_min(jnp.where(s == r_max, idx, b), gidx, num_segments=b)[gidx]
    is_best = idx == i_max
    r_second = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, s), gidx, num_segments=b)[gidx]
    _, std, n = group_mean_std(s, group_ids, gidx=gidx)
    gap = jnp.where(n >= 2, r_max - jnp.where(n >= 2, r_second, 0), 0)
    gap = jnp.where(jnp.asarray(norm_adv_by_std_in_grpo), gap / (std + epsilon), gap)
    adv = _broadcast(jnp.where(is_best, gap, 0), response_mask)
    return adv, adv


@register_adv_est("rloo")
@register_adv_est("rloo_vectorized")
@jax.jit
def compute_rloo_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, group_ids: Array
) -> tuple[Array, Array]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740).

    ``A_i = s_i - (1/(n-1)) sum_{j != i} s_j = (s_i - mean_g) n / (n - 1)``; a group of one keeps
    ``A_i = s_i``. Advantages ``= returns = A_i m``.
    """
    s = _scores(token_level_rewards, response_mask)
    mean, _, n = group_mean_std(s, group_ids)
    scale = n / jnp.where(n > 1, n - 1, 1)
    a = jnp.where(n > 1, s * scale - mean * scale, s)
    adv = _broadcast(a, response_mask)
    return adv, adv


@register_adv_est("reinforce_plus_plus")
@jax.jit
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, gamma: Any
) -> tuple[Array, Array]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262).

    Backward discounted return, reset after the end of the response::

        G_t = r_t + gamma G_{t+1};   then G_{t+1} <- G_t m_t for the next (earlier) step

    ``returns = G``; ``advantages = whiten_m(G) m``. The recurrence is a ``lax.scan``.
    """
    r = _as_float(token_level_rewards)
    m = jnp.asarray(response_mask).astype(r.dtype)
    gamma = jnp.asarray(gamma, r.dtype)

    def step(running, xs):
        r_t, m_t = xs
        running = r_t + gamma * running
        return running * m_t, running

    _, g_t = lax.scan(step, jnp.zeros(r.shape[:-1], r.dtype), (r.T, m.T), reverse=True)
    returns = g_t.T
    adv = masked_whiten(returns, response_mask) * m
    return adv, returns


@register_adv_est("reinforce_plus_plus_baseline")
@jax.jit
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, group_ids: Array
) -> tuple[Array, Array]:
    """REINFORCE++ with a group-mean baseline (arXiv:2501.03262).

    ``A = whiten_m((s_i - mean_g) m) m`` (a group of one has ``mean_g = 0``); returns = A.
    """
    s = _scores(token_level_rewards, response_mask)
    mean, _, _ = group_mean_std(s, group_ids)
    m = jnp.asarray(response_mask).astype(s.dtype)
    a = _broadcast(s - mean, response_mask)
    adv = masked_whiten(a, response_mask) * m
    return adv, adv


@register_adv_est("remax")
@jax.jit
def compute_remax_outcome_advantage(
    token_level_rewards: Array, reward_baselines: Array, response_mask: Array
) -> tuple[Array, Array]:
    """ReMax (Li et al. 2023, arXiv:2310.10505).

    ``G_t = sum_{t' >= t} r_{t'} m_{t'}`` (reward-to-go); ``A_t = G_t - b_i m_t`` with ``b_i``
    the greedy response's summed reward ``[B]``. Not whitened; ``returns = G``.
    """
    r = _as_float(token_level_rewards)
    m = jnp.asarray(response_mask).astype(r.dtype)
    rm = jnp.where(m != 0, r, 0) * m
    returns = jnp.flip(jnp.cumsum(jnp.flip(rm, -1), -1), -1)
    adv = returns - jnp.asarray(reward_baselines).astype(r.dtype)[:, None] * m
    return adv, returns


@register_adv_est("opo")
@jax.jit
def compute_opo_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, group_ids: Array
) -> tuple[Array, Array]:
    """On-Policy RL with Optimal reward baseline (arXiv:2505.23585).

    Length-weighted baseline ``b_g = sum_j |o_j| s_j / sum_j |o_j|`` (``|o_j| = sum_t m_{j,t}``);
    ``A_i = s_i - b_g``; a group of one has ``b = 0`` (a group whose lengths are all 0 too).
    Advantages ``= returns = A_i m``.
    """
    s = _scores(token_level_rewards, response_mask)
    length = jnp.sum(jnp.asarray(response_mask).astype(s.dtype), axis=-1)
    gidx = group_index(group_ids)
    n = _group_sum(jnp.ones_like(s), gidx)
    num = _group_sum(length * s, gidx)
    den = _group_sum(length, gidx)
    ok = (n > 1) & (den > 0)
    baseline = jnp.where(ok, num / jnp.where(ok, den, 1), 0)
    adv = _broadcast(s - baseline, response_mask)
    return adv, adv


@register_adv_est("gpg")
@jax.jit
def compute_gpg_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, group_ids: Array, f_norm: Any = 1.0
) -> tuple[Array, Array]:
    """Group Policy Gradient (arXiv:2504.02546).

    ``alpha = B / max(1, #{i : s_i != 0})``; ``A_i = alpha (s_i - mean_g) / f_norm`` (a group of
    one has ``mean_g = 0``). Advantages ``= returns = A_i m``.
    """
    s = _scores(token_level_rewards, response_mask)
    mean, _, _ = group_mean_std(s, group_ids)
    alpha = s.shape[0] / jnp.maximum(1, jnp.count_nonzero(s)).astype(s.dtype)
    adv = _broadcast(alpha * (s - mean) / jnp.asarray(f_norm, s.dtype), response_mask)
    return adv, adv


@register_adv_est("gdpo")
def compute_gdpo_outcome_advantage(
    token_level_rewards: Array,
    response_mask: Array,
    group_ids: Array,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Any = True,
    gdpo_scores: Array | None = None,
    gdpo_reward_weights: Any = None,
) -> tuple[Array, Array]:
    """Group reward-Decoupled normalisation Policy Optimisation, GDPO (arXiv:2601.05242),
    verl's form.

    Each reward dimension is normalised within its group *before* the dimensions are
    combined, so that a dominant reward does not drown the others::

        A_k,i = (s_k,i - mean_g s_k) / (std_g s_k + epsilon)     # GRPO per dimension k
        A_i   = sum_k w_k A_k,i
        adv   = whiten_m(A_i m) m                                # over the batch's tokens

    ``gdpo_scores`` ``[K, B]``: the sequence scores of the ``K`` dimensions (verl reads them
    from the reward function's dict under ``algorithm.gdpo_reward_keys``); without them the
    one dimension ``s_i = sum_t r_t m_t`` of ``token_level_rewards``. ``gdpo_reward_weights``
    ``[K]`` (``algorithm.gdpo_reward_weights``; None: all 1). ``norm_adv_by_std_in_grpo=False``
    drops the per-dimension std (as Dr.GRPO). Groups of one use ``mean 0, std 1``.
    Advantages ``= returns``.
    """
    if gdpo_scores is None:
        scores_KxB = _scores(token_level_rewards, response_mask)[None]
    else:
        scores_KxB = _as_float(gdpo_scores)
        if scores_KxB.ndim != 2 or scores_KxB.shape[1] != jnp.shape(response_mask)[0]:
            raise ValueError(
                f"gdpo_scores must be [K, B] with B={jnp.shape(response_mask)[0]} rows, got {scores_KxB.shape}"
            )
    num_scores = scores_KxB.shape[0]
    if gdpo_reward_weights is None:
        weights_K = jnp.ones((num_scores,), scores_KxB.dtype)
    else:
        weights_K = jnp.asarray(gdpo_reward_weights, scores_KxB.dtype).reshape(-1)
        if weights_K.shape[0] != num_scores:
            raise ValueError(f"gdpo_reward_weights has {weights_K.shape[0]} weights for {num_scores} reward dimensions")
    return _gdpo(scores_KxB, weights_K, response_mask, group_ids, epsilon, norm_adv_by_std_in_grpo)


@jax.jit
def _gdpo(scores_KxB, weights_K, response_mask, group_ids, epsilon, norm_adv_by_std_in_grpo):
    gidx = group_index(group_ids)

    def normalise(s_B: Array) -> Array:
        return _grpo_normalised(s_B, group_ids, epsilon, norm_adv_by_std_in_grpo, gidx)

    a_B = jnp.sum(weights_K[:, None] * jax.vmap(normalise)(scores_KxB), axis=0)
    m = jnp.asarray(response_mask).astype(a_B.dtype)
    adv = masked_whiten(_broadcast(a_B, response_mask), response_mask) * m
    return adv, adv
