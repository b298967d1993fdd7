"""Optimal Token Baseline (OTB) advantage estimators, verl 0.9.1's ``optimal_token_baseline``
and ``tir_optimal_token_baseline`` (https://richardli.xyz/optimal-token-baseline).

A group baseline per *token position* instead of per trajectory, weighted by how much
gradient variance the trajectory has accumulated so far. With ``G_t`` the reward-to-go,
``pi_t = exp(old_log_probs_t)`` and ``S_t = sum_v pi(v | s_t)^2`` (``sum_pi_squared``, from
the actor's forward), the squared norm of the score function of a softmax policy is
``||grad log pi_t||^2 ~ 1 - 2 pi_t + S_t``; its running sum is the path-variance proxy::

    w_t = (1 - 2 pi_t + S_t) rho_t^2          # rho: rollout IS weights, 1 when absent
    W_t = sum_{j <= t} w_j m_j
    B_t = sum_{i in g} G_it W_it m_it / (sum_{i in g} W_it m_it + epsilon)
    A_t = (G_t - B_t) m_t

``B_t`` minimises the variance of ``(G_t - B_t) grad log pi`` under that proxy. A group of one
has no baseline (``A = G m``). ``handle_zero_tail``: when one trajectory of a group is the
unique longest, its baseline is 0 from the second-longest length on (where it alone would be
its own baseline and its advantage would vanish).

The TIR variant (tool-integrated, multi-turn responses whose mask has holes for tool
outputs) aligns the trajectories of a group by their *k-th generated token* rather than by
position, and leaves responses without a token out of the groups.

Both return ``(advantages, returns = G)``, ``[B, T]``; jitted, no Python loop over the batch.
Masks are 0/1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflow.algos.advantages import _as_float, group_index, register_adv_est

Array = jax.Array


def _returns_and_path_variance(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    """``(G [B, T], W [B, T], m [B, T])`` of the module docstring."""
    r = _as_float(token_level_rewards)
    m = jnp.asarray(response_mask).astype(r.dtype)
    g = jnp.flip(jnp.cumsum(jnp.flip(r * m, -1), -1), -1)
    w = 1.0 - 2.0 * jnp.exp(jnp.asarray(old_log_probs, r.dtype)) + jnp.asarray(sum_pi_squared, r.dtype)
    if rollout_is_weights is not None:
        w = w * jnp.asarray(rollout_is_weights, r.dtype) ** 2
    return g, jnp.cumsum(w * m, -1), m


def _group_sum_rows(x: Array, gidx: Array) -> Array:
    """``out_i = sum_{j in g(i)} x_j`` for ``x`` ``[B, ...]``."""
    return jax.ops.segment_sum(x, gidx, num_segments=x.shape[0])[gidx]


def _zero_tail_start(lengths_B: Array, member_B: Array, gidx: Array) -> tuple[Array, Array]:
    """``(is_tail [B], start [B])``: the rows that are the unique longest member of a group of
    at least two members, and the group's second-longest length (where their zero tail
    starts)."""
    b = lengths_B.shape[0]
    length = jnp.where(member_B, lengths_B, -jnp.inf)
    longest = jax.ops.segment_max(length, gidx, num_segments=b)[gidx]
    at_max = member_B & (length == longest)
    n_at_max = _group_sum_rows(at_max.astype(jnp.int32), gidx)
    n_members = _group_sum_rows(member_B.astype(jnp.int32), gidx)
    second = jax.ops.segment_max(jnp.where(at_max, -jnp.inf, length), gidx, num_segments=b)[gidx]
    return at_max & (n_at_max == 1) & (n_members >= 2), second


def _baseline(g, w, m, member_B, gidx, handle_zero_tail, epsilon):
    """``B [B, T]``: the group baseline over the members, 0 for groups of one member, with
    the unique longest member's zero tail."""
    member = member_B[:, None].astype(g.dtype)
    num = _group_sum_rows(g * w * m * member, gidx)
    den = _group_sum_rows(w * m * member, gidx) + epsilon
    n_members = _group_sum_rows(member_B.astype(jnp.int32), gidx)
    baseline = jnp.where((n_members >= 2)[:, None], num / den, 0.0)
    is_tail, start = _zero_tail_start(jnp.sum(m, -1), member_B, gidx)
    cols = jnp.arange(g.shape[-1], dtype=g.dtype)[None, :]
    tail = jnp.asarray(handle_zero_tail) & is_tail[:, None] & (cols >= start[:, None])
    return jnp.where(tail, 0.0, baseline)


def _by_position(g: Array, w: Array, m: Array, gidx: Array, handle_zero_tail: Any, epsilon: Any) -> Array:
    """OTB by token position (see the module docstring): every row of a group, an empty
    response included, is a member, and ``B_t`` sums over the group at position ``t``."""
    baseline = _baseline(g, w, m, jnp.ones(g.shape[:1], bool), gidx, handle_zero_tail, epsilon)
    return (g - baseline) * m


def _compact(x_BxT: Array, valid_BxT: Array, pos_BxT: Array) -> Array:
    """The valid entries of each row moved to its front, in order (zeros after them)."""
    rows = jnp.arange(x_BxT.shape[0])[:, None]
    return jnp.zeros_like(x_BxT).at[rows, pos_BxT].add(jnp.where(valid_BxT, x_BxT, 0))


def _by_generated_token(g: Array, w: Array, m: Array, gidx: Array, handle_zero_tail: Any, epsilon: Any) -> Array:
    """OTB for tool-integrated (multi-turn) responses (see the module docstring): ``G`` and
    ``W`` are read at each row's generated tokens, aligned by their index ``k`` among them
    (``B_k = sum_i G_ik W_ik / (sum_i W_ik + epsilon)`` over the group's non-empty responses),
    and the advantages written back to those tokens."""
    valid = m != 0
    pos = jnp.where(valid, jnp.cumsum(valid, -1) - 1, 0)
    g_k, w_k = _compact(g, valid, pos), _compact(w, valid, pos)
    lengths = jnp.sum(valid, -1)
    m_k = (jnp.arange(g.shape[-1])[None, :] < lengths[:, None]).astype(g.dtype)
    baseline_k = _baseline(g_k, w_k, m_k, lengths > 0, gidx, handle_zero_tail, epsilon)
    return jnp.take_along_axis(g_k - baseline_k, pos, axis=-1) * m


def _otb_estimator(advantages_of: Any, name: str) -> Any:
    """The jitted OTB estimator ``name`` whose advantages ``advantages_of(G, W, m, gidx,
    handle_zero_tail, epsilon)`` gives (its docstring); returns ``(advantages, G)``."""

    def estimator(
        token_level_rewards: Array,
        response_mask: Array,
        group_ids: Array,
        old_log_probs: Array,
        sum_pi_squared: Array,
        rollout_is_weights: Array | None = None,
        handle_zero_tail: Any = True,
        epsilon: float = 1e-8,
    ) -> tuple[Array, Array]:
        g, w, m = _returns_and_path_variance(
            token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
        )
        return advantages_of(g, w, m, group_index(group_ids), handle_zero_tail, epsilon), g

    estimator.__name__ = estimator.__qualname__ = name
    estimator.__doc__ = advantages_of.__doc__
    return jax.jit(estimator)


compute_optimal_token_baseline_advantage = register_adv_est("optimal_token_baseline")(
    _otb_estimator(_by_position, "compute_optimal_token_baseline_advantage")
)
compute_multi_turn_optimal_token_baseline_advantage = register_adv_est("tir_optimal_token_baseline")(
    _otb_estimator(_by_generated_token, "compute_multi_turn_optimal_token_baseline_advantage")
)
