"""Policy losses that bound the update by a divergence, a smooth gate or a quadratic penalty
instead of PPO's ratio clip: DPPO (binary TV and binary KL), SAPO and DRO, as verl 0.9.1
registers them (``dppo_tv``, ``dppo_kl``, ``sapo``, ``dro``).

Same contract as `jaxflow.algos.policy_losses`: ``(old_log_prob, log_prob, advantages,
response_mask)`` ``[B, T]`` in, ``(loss, metrics)`` out with ``pg_clipfrac``,
``pg_clipfrac_lower`` and ``ppo_kl`` (0 where verl reports none), IS weights multiplying the
per-token loss before `agg_loss`. Notation: ``m`` the response mask, ``rho = exp(clamp(lp -
lp_old, -20, 20))``, ``sg`` stop-gradient, ``mean_m`` verl's masked mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxflow.algos.advantages import masked_mean
from jaxflow.algos.policy_losses import _agg, _metrics, register_policy_loss

Array = jax.Array


def _dppo(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    valid: Array,
    clip_ratio_c: float,
    loss_agg_mode: str,
    rollout_is_weights: Array | None,
    global_batch_info: Mapping[str, Any] | None,
) -> tuple[Array, dict]:
    """The part DPPO's two variants share, given the trust-region mask ``valid`` (detached)::

        L = -A sg(min(rho, c)) log_prob valid

    Metrics: ``pg_clipfrac = mean_m(1 - valid)`` (tokens outside the trust region),
    ``pg_clipfrac_lower = mean_m([rho > c] valid)`` (truncated IS ratios), ``ppo_kl``.
    """
    dtype = log_prob.dtype
    neg_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    valid = lax.stop_gradient(valid.astype(dtype))
    truncated = lax.stop_gradient(jnp.minimum(ratio, clip_ratio_c))
    pg_losses = -advantages * truncated * log_prob * valid
    loss = _agg(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, _metrics(
        masked_mean(1.0 - valid, response_mask),
        masked_mean((ratio > clip_ratio_c).astype(dtype) * valid, response_mask),
        masked_mean(-neg_kl, response_mask),
        like=loss,
    )


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    rollout_is_weights: Array | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[Array, dict]:
    """DPPO-Binary-TV (Divergence PPO, arXiv:2602.04879), verl's form.

    The trust region bounds the sampled token's probability change ``d = p - p_old`` (``p =
    exp(log_prob)``), a binary total-variation distance; ``clip_ratio_low/high`` are its
    thresholds (not ratio clips)::

        valid = (d <= clip_ratio_high)  if A > 0
                (d >= -clip_ratio_low)  otherwise
        L     = -A sg(min(rho, c)) log_prob valid

    Outside the region a token gets no gradient. ``c = clip_ratio_c`` truncates the IS ratio
    (the paper's Section 5.4 recommends a large one; verl falls back to 20 only when the actor
    has no ``clip_ratio_c``, whose default is 3). Metrics: see `_dppo`.
    """
    d = jnp.exp(log_prob) - jnp.exp(old_log_prob)
    valid = jnp.where(advantages > 0, d <= clip_ratio_high, d >= -clip_ratio_low)
    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        valid,
        clip_ratio_c,
        loss_agg_mode,
        rollout_is_weights,
        global_batch_info,
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    rollout_is_weights: Array | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[Array, dict]:
    """DPPO-Binary-KL (arXiv:2602.04879), verl's form.

    The trust region bounds the KL divergence between the old and new Bernoulli distributions
    of "this token or not"::

        KL_b  = p_old (lp_old - lp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = KL_b <= clip_ratio_high or p <= p_old   if A > 0
                KL_b <= clip_ratio_low  or p >= p_old   otherwise
        L     = -A sg(min(rho, c)) log_prob valid

    (a move that lowers the loss's pull is always allowed). Metrics: see `_dppo`.
    """
    p, p_old = jnp.exp(log_prob), jnp.exp(old_log_prob)
    binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = jnp.where(
        advantages > 0,
        (binary_kl <= clip_ratio_high) | (p <= p_old),
        (binary_kl <= clip_ratio_low) | (p >= p_old),
    )
    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        valid,
        clip_ratio_c,
        loss_agg_mode,
        rollout_is_weights,
        global_batch_info,
    )


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: Array | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[Array, dict]:
    """Soft Adaptive Policy Optimisation, SAPO (arXiv:2511.20347), verl's form.

    A smooth, temperature-controlled gate replaces the hard clip::

        tau = tau_pos if A > 0 else tau_neg
        f   = sigmoid(tau (rho - 1)) 4 / tau        # f'(1) = 1: the PPO gradient on-policy
        L   = -f A

    Always aggregated ``seq-mean-token-mean`` (as verl; the actor's ``loss_agg_mode`` is not
    used). Metrics: ``ppo_kl``; the clip fractions are 0.
    """
    neg_kl = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    dtype = advantages.dtype
    tau = jnp.where(advantages > 0, jnp.asarray(tau_pos, dtype), jnp.asarray(tau_neg, dtype))
    gates = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    loss = _agg(pg_losses, response_mask, "seq-mean-token-mean", rollout_is_weights, global_batch_info)
    return loss, _metrics(None, None, masked_mean(-neg_kl, response_mask), like=loss)


def _check_dro_beta(dro_beta: Any) -> None:
    if dro_beta is None or (not isinstance(dro_beta, jax.core.Tracer) and not float(dro_beta) > 0):
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {dro_beta}")


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    dro_beta: float | None = None,
    rollout_is_weights: Array | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[Array, dict]:
    """Policy gradient with a quadratic log-ratio penalty, verl's ``dro`` (the regularised
    objective of Direct Reward Optimisation, Richemond et al. 2024, arXiv:2405.19107, taken
    around the sampling policy; verl cites no paper)::

        L = -(log_prob A - beta / 2 (log_prob - old_log_prob)^2)

    so ``dL/dlog_prob = -A + beta (log_prob - old_log_prob)``: the pull of the advantage is
    balanced once the log-ratio reaches ``A / beta``. ``dro_beta`` must be > 0 (a
    ``ValueError`` otherwise, as verl). Metrics: ``ppo_kl = mean_m(old_log_prob -
    log_prob)`` (unclamped); the clip fractions are 0.
    """
    _check_dro_beta(dro_beta)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * jnp.square(log_ratio))
    loss = _agg(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, _metrics(None, None, masked_mean(-log_ratio, response_mask), like=loss)
