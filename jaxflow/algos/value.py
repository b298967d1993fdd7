"""The clipped value-function loss of PPO (verl's ``compute_value_loss``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflow.algos.advantages import masked_mean
from jaxflow.algos.policy_losses import agg_loss

Array = jax.Array


def compute_value_loss(
    vpreds: Array,
    returns: Array,
    values: Array,
    response_mask: Array,
    cliprange_value: Any,
    loss_agg_mode: str = "token-mean",
    **normalisers: Any,
) -> tuple[Array, Array]:
    """Clipped value loss (PPO; HF TRL's form, as verl).

    ::

        v_clip = clip(vpreds, values - eps_v, values + eps_v)
        loss   = 0.5 agg(max((vpreds - R)^2, (v_clip - R)^2))
        vf_clipfrac = mean_m((v_clip - R)^2 > (vpreds - R)^2)

    ``values`` are the critic's values at rollout time, ``R`` the returns. ``agg`` is
    :func:`jaxflow.algos.agg_loss` with ``loss_agg_mode`` and its global ``normalisers``
    (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``: e.g. a
    :func:`jaxflow.algos.global_batch_info`). Returns ``(vf_loss, vf_clipfrac)``.
    """
    v_clip = jnp.maximum(jnp.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    l1 = jnp.square(vpreds - returns)
    l2 = jnp.square(v_clip - returns)
    loss = 0.5 * agg_loss(jnp.maximum(l1, l2), response_mask, loss_agg_mode, **normalisers)
    vf_clipfrac = masked_mean((l2 > l1).astype(l1.dtype), response_mask)
    return loss, vf_clipfrac
