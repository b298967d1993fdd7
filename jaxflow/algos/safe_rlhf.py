"""Safe-RLHF pieces (Dai et al. 2023, arXiv:2310.12773) and PPO-ptx (Ouyang et al. 2022).

Safe RLHF trains against a reward model *and* a cost model under the constraint
``J_C(pi) = E[C] <= d``, through the Lagrangian ``min_theta max_{lambda >= 0}
-J_R(theta) + lambda (J_C(theta) - d)``:

* cost advantages are computed exactly like reward advantages (any estimator of
  :mod:`jaxflow.algos.advantages` applied to the token-level costs and a cost critic);
* the actor optimises the surrogate advantage ``(A_R - lambda A_C) / (1 + lambda)``
  (:func:`compute_lagrangian_advantages`) with the usual PPO loss;
* the multiplier follows ``lambda <- max(0, lambda + eta (J_C - d))``, on a linear or a log
  scale (:func:`update_lagrange_multiplier`, :class:`LagrangeMultiplier`).

PPO-ptx mixes a pretraining language-model loss into the actor loss:
``L = L_actor + ptx_coef * L_ptx`` with ``L_ptx = agg(-log pi(x_pretrain))``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflow.algos.advantages import masked_sum
from jaxflow.algos.kl import array_namespace
from jaxflow.algos.policy_losses import agg_loss

Array = jax.Array

LAGRANGE_SCALES = ("linear", "log")


def compute_lagrangian_advantages(reward_advantages: Array, cost_advantages: Array, lagrange_multiplier: Any) -> Array:
    """Safe-RLHF surrogate advantage ``(A_R - lambda A_C) / (1 + lambda)`` (``[B, T]``).

    Dividing by ``1 + lambda`` keeps the advantage scale bounded as ``lambda`` grows.
    """
    lam = jnp.asarray(lagrange_multiplier, reward_advantages.dtype)
    return (reward_advantages - lam * cost_advantages) / (1 + lam)


def compute_episode_cost(token_level_costs: Array, response_mask: Array) -> Array:
    """``J_C = mean_i sum_t c_{i,t} m_{i,t}``: the batch's mean episode cost."""
    return jnp.mean(masked_sum(token_level_costs, response_mask, axis=-1))


def update_lagrange_multiplier(
    multiplier: Any,
    episode_cost: Any,
    cost_threshold: Any,
    lr: Any,
    scale: str = "linear",
    max_multiplier: Any = None,
) -> Any:
    """One projected ascent step on the Lagrange multiplier (pure, jittable).

    * ``linear``: ``lambda <- max(0, lambda + lr (J_C - d))``
    * ``log``:    ``log lambda <- log lambda + lr (J_C - d)``, i.e.
      ``lambda <- lambda exp(lr (J_C - d))`` (stays positive; ``multiplier`` must be > 0)

    then ``lambda <- min(lambda, max_multiplier)`` when a cap is given. ``d`` is the cost
    threshold (the constraint is ``J_C <= d``).
    """
    if scale not in LAGRANGE_SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(LAGRANGE_SCALES)}")
    xp = array_namespace(multiplier, episode_cost, cost_threshold, lr, max_multiplier)
    gap = episode_cost - cost_threshold
    if scale == "linear":
        new = xp.maximum(0.0, multiplier + lr * gap)
    else:
        new = xp.exp(xp.log(multiplier) + lr * gap)
    if max_multiplier is not None:
        new = xp.minimum(new, max_multiplier)
    return new


class LagrangeMultiplier:
    """Host-side holder of ``lambda`` (like the KL controllers): ``update(J_C)`` applies
    :func:`update_lagrange_multiplier` with the fixed threshold, rate and scale."""

    def __init__(
        self,
        init_value: float,
        cost_threshold: float,
        lr: float,
        scale: str = "linear",
        max_value: float | None = None,
    ):
        if scale not in LAGRANGE_SCALES:
            raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(LAGRANGE_SCALES)}")
        if scale == "log" and not init_value > 0:
            raise ValueError("a log-scale multiplier must start > 0")
        if init_value < 0:
            raise ValueError("the multiplier must be >= 0")
        self.value = float(init_value)
        self.cost_threshold = cost_threshold
        self.lr = lr
        self.scale = scale
        self.max_value = max_value

    def update(self, episode_cost: Any) -> float:
        self.value = float(
            update_lagrange_multiplier(
                self.value, float(episode_cost), self.cost_threshold, self.lr, self.scale, self.max_value
            )
        )
        return self.value


def compute_ptx_loss(
    ptx_log_prob: Array, ptx_mask: Array, loss_agg_mode: str = "token-mean", **agg_kwargs: Any
) -> Array:
    """Pretraining (language-model) loss of PPO-ptx: ``agg(-log pi(x_t | x_<t), m)``.

    ``ptx_log_prob`` are the policy's log-probs of pretraining tokens ``[B, T]``; ``ptx_mask``
    marks the tokens that count. ``agg_kwargs`` are :func:`agg_loss`'s global normalisers.
    """
    return agg_loss(-ptx_log_prob, ptx_mask, loss_agg_mode, **agg_kwargs)


def add_ptx_loss(actor_loss: Array, ptx_loss: Array, ptx_coef: Any) -> Array:
    """PPO-ptx actor objective: ``L = L_actor + ptx_coef L_ptx`` (InstructGPT's gamma)."""
    return actor_loss + ptx_coef * ptx_loss
