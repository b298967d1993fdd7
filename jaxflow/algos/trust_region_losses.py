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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxflow.algos.advantages import masked_mean
from jaxflow.algos.policy_losses import (
    DEFAULT_CLIP_RANGE,
    ClipRange,
    PolicyLossColumns,
    _ratio,
    register_policy_loss,
    token_policy_loss,
)

Array = jax.Array


def _dppo_loss(trust_region: Callable[..., Array], name: str) -> Callable[..., tuple[Array, dict]]:
    """The DPPO policy loss ``name`` whose trust region is ``trust_region(columns, clip) ->
    valid [B, T]`` (detached)::

        L = -A sg(min(rho, c)) log_prob valid

    Outside the region a token gets no gradient. ``c = clip_ratio_c`` truncates the IS ratio
    (the paper's Section 5.4 recommends a large one; verl falls back to 20 only when the actor
    has no ``clip_ratio_c``, whose default is 3). Metrics: ``pg_clipfrac = mean_m(1 - valid)``
    (tokens outside the trust region), ``pg_clipfrac_lower = mean_m([rho > c] valid)``
    (truncated IS ratios), ``ppo_kl``.
    """

    def token_loss(
        columns: PolicyLossColumns, *, clip: ClipRange = DEFAULT_CLIP_RANGE, clip_ratio_c: float = 20.0
    ) -> tuple[Array, dict]:
        old_log_prob, log_prob, advantages, response_mask = columns
        dtype = log_prob.dtype
        neg_kl, ratio = _ratio(old_log_prob, log_prob)
        valid = trust_region(columns, clip)
        valid = lax.stop_gradient(valid.astype(dtype))
        truncated = lax.stop_gradient(jnp.minimum(ratio, clip_ratio_c))
        return -advantages * truncated * log_prob * valid, dict(
            pg_clipfrac=masked_mean(1.0 - valid, response_mask),
            pg_clipfrac_lower=masked_mean((ratio > clip_ratio_c).astype(dtype) * valid, response_mask),
            ppo_kl=masked_mean(-neg_kl, response_mask),
        )

    token_loss.__name__ = token_loss.__qualname__ = name
    token_loss.__doc__ = f"{trust_region.__doc__}\n\n    The loss: see `_dppo_loss`."
    return token_policy_loss()(token_loss)


def _binary_tv_region(columns: PolicyLossColumns, clip: ClipRange) -> Array:
    """DPPO-Binary-TV (Divergence PPO, arXiv:2602.04879), verl's form.

    The trust region bounds the sampled token's probability change ``d = p - p_old`` (``p =
    exp(log_prob)``), a binary total-variation distance; ``clip_ratio_low/high`` are its
    thresholds (not ratio clips)::

        valid = (d <= clip_ratio_high)  if A > 0
                (d >= -clip_ratio_low)  otherwise
    """
    d = jnp.exp(columns.log_prob) - jnp.exp(columns.old_log_prob)
    return jnp.where(columns.advantages > 0, d <= clip.high, d >= -clip.low)


def _binary_kl_region(columns: PolicyLossColumns, clip: ClipRange) -> Array:
    """DPPO-Binary-KL (arXiv:2602.04879), verl's form.

    The trust region bounds the KL divergence between the old and new Bernoulli distributions
    of "this token or not"::

        KL_b  = p_old (lp_old - lp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = KL_b <= clip_ratio_high or p <= p_old   if A > 0
                KL_b <= clip_ratio_low  or p >= p_old   otherwise

    (a move that lowers the loss's pull is always allowed).
    """
    old_log_prob, log_prob, advantages, _ = columns
    p, p_old = jnp.exp(log_prob), jnp.exp(old_log_prob)
    binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    return jnp.where(
        advantages > 0,
        (binary_kl <= clip.high) | (p <= p_old),
        (binary_kl <= clip.low) | (p >= p_old),
    )


compute_policy_loss_dppo_tv = register_policy_loss("dppo_tv")(
    _dppo_loss(_binary_tv_region, "compute_policy_loss_dppo_tv")
)
compute_policy_loss_dppo_kl = register_policy_loss("dppo_kl")(
    _dppo_loss(_binary_kl_region, "compute_policy_loss_dppo_kl")
)


@register_policy_loss("sapo")
@token_policy_loss("seq-mean-token-mean", agg_mode_fixed=True)
def compute_policy_loss_sapo(
    columns: PolicyLossColumns, *, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> tuple[Array, dict]:
    """Soft Adaptive Policy Optimisation, SAPO (arXiv:2511.20347), verl's form.

    A smooth, temperature-controlled gate replaces the hard clip::

        tau = tau_pos if A > 0 else tau_neg
        f   = sigmoid(tau (rho - 1)) 4 / tau        # f'(1) = 1: the PPO gradient on-policy
        L   = -f A

    Always aggregated ``seq-mean-token-mean`` (as verl; the actor's ``loss_agg_mode`` is not
    used). Metrics: ``ppo_kl``; the clip fractions are 0.
    """
    old_log_prob, log_prob, advantages, response_mask = columns
    neg_kl, ratio = _ratio(old_log_prob, log_prob)
    dtype = advantages.dtype
    tau = jnp.where(advantages > 0, jnp.asarray(tau_pos, dtype), jnp.asarray(tau_neg, dtype))
    gates = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gates * advantages, dict(ppo_kl=masked_mean(-neg_kl, response_mask))


def _check_dro_beta(dro_beta: Any) -> None:
    if dro_beta is None or (not isinstance(dro_beta, jax.core.Tracer) and not float(dro_beta) > 0):
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {dro_beta}")


@register_policy_loss("dro")
@token_policy_loss()
def compute_policy_loss_dro(columns: PolicyLossColumns, *, dro_beta: float | None = None) -> tuple[Array, dict]:
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
    old_log_prob, log_prob, advantages, response_mask = columns
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * jnp.square(log_ratio))
    return pg_losses, dict(ppo_kl=masked_mean(-log_ratio, response_mask))
