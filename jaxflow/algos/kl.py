"""KL estimators, KL controllers, the in-reward KL penalty, and token entropy (verl-compatible).

KL estimators (Schulman, "Approximating KL divergence", 2020; with ``d = logprob - ref``):

=====================  =====================================================
``kl`` / ``k1``        ``d``
``abs``                ``|d|``
``mse`` / ``k2``       ``0.5 d^2``
``low_var_kl`` / ``k3``  ``x = clamp(-d, -20, 20)``; ``clamp(e^x - x - 1, -10, 10)``
=====================  =====================================================

A ``+`` suffix (``k1+``, ``k3+``, ...) keeps that estimator's *value* but takes the gradient
of ``k2`` (straight-through: ``k2 - sg(k2) + sg(k)``), whose gradient is the unbiased one
(arXiv:2505.17508). New estimators register with ``@register_kl_estimator("name")``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflow.algos.advantages import masked_mean
from jaxflow.algos.policy_losses import agg_loss
from jaxflow.algos.registry import Registry, UnknownNameError

Array = jax.Array

KL_ESTIMATOR_REGISTRY = Registry("KL estimator")


def register_kl_estimator(name: str, *, override: bool = False):
    """Decorator registering ``fn(logprob, ref_logprob) -> [B, T]`` as KL estimator ``name``."""
    return KL_ESTIMATOR_REGISTRY.register(name, override=override)


def get_kl_estimator(name: str) -> Callable[[Array, Array], Array]:
    """The estimator ``name`` (a ``+`` suffix gives its straight-through k2-gradient variant)."""
    base_name = name[:-1] if isinstance(name, str) and name.endswith("+") else name
    if base_name not in KL_ESTIMATOR_REGISTRY:
        raise UnknownNameError(f"unknown KL estimator {name!r}; valid names: {', '.join(kl_estimator_names())}")
    base = KL_ESTIMATOR_REGISTRY.get(base_name)
    if base_name is name:
        return base
    return lambda logprob, ref_logprob: _straight_through(base, logprob, ref_logprob)


def kl_estimator_names() -> list[str]:
    names = KL_ESTIMATOR_REGISTRY.names()
    return names + [n + "+" for n in names]


@register_kl_estimator("kl")
@register_kl_estimator("k1")
def kl_k1(logprob: Array, ref_logprob: Array) -> Array:
    """``k1 = logprob - ref_logprob`` (unbiased value, high variance, can be negative)."""
    return logprob - ref_logprob


@register_kl_estimator("abs")
def kl_abs(logprob: Array, ref_logprob: Array) -> Array:
    """``|logprob - ref_logprob|``."""
    return jnp.abs(logprob - ref_logprob)


@register_kl_estimator("mse")
@register_kl_estimator("k2")
def kl_k2(logprob: Array, ref_logprob: Array) -> Array:
    """``k2 = 0.5 (logprob - ref_logprob)^2`` (its gradient is the unbiased KL gradient)."""
    return 0.5 * jnp.square(logprob - ref_logprob)


@register_kl_estimator("low_var_kl")
@register_kl_estimator("k3")
def kl_k3(logprob: Array, ref_logprob: Array) -> Array:
    """``k3``: ``x = clamp(ref - logprob, -20, 20)``; ``clamp(exp(x) - x - 1, -10, 10)``."""
    x = jnp.clip(ref_logprob - logprob, -20.0, 20.0)
    return jnp.clip(jnp.exp(x) - x - 1, -10.0, 10.0)


def _straight_through(base: Callable[[Array, Array], Array], logprob: Array, ref_logprob: Array) -> Array:
    forward = base(logprob, ref_logprob)
    backward = kl_k2(logprob, ref_logprob)
    return backward - lax.stop_gradient(backward) + lax.stop_gradient(forward)


def kl_penalty(logprob: Array, ref_logprob: Array, kind: str = "kl") -> Array:
    """Token-level KL estimate ``[B, T]`` between the policy and the reference (see module doc).

    ``kind`` is one of ``kl k1 abs mse k2 low_var_kl k3`` or a registered name, optionally with
    a ``+`` suffix for the straight-through variant (value of ``kind``, gradient of ``k2``).
    Unknown kinds raise an error listing the valid names.
    """
    return get_kl_estimator(kind)(logprob, ref_logprob)


# ----------------------------------------------------------------------------- controllers


def array_namespace(*args: Any):
    """``jax.numpy`` if any argument is a JAX array (or tracer), else ``numpy``: host-side
    scalars (controller state) then stay in float64 whatever the x64 setting."""
    return jnp if any(isinstance(a, jax.Array) for a in args) else np


def adaptive_kl_coef(value: Any, current_kl: Any, target_kl: Any, horizon: Any, n_steps: Any) -> Any:
    """One adaptive-KL step (Ziegler et al. 2019, arXiv:1909.08593), pure and jittable.

    ``e = clip(kl / target - 1, -0.2, 0.2)``;  ``beta <- beta (1 + e n / horizon)``.
    """
    xp = array_namespace(value, current_kl, target_kl, horizon, n_steps)
    err = xp.clip(current_kl / target_kl - 1, -0.2, 0.2)
    return value * (1 + err * n_steps / horizon)


class FixedKLController:
    """Constant KL coefficient ``beta`` (host-side, as verl's)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: Any, n_steps: Any) -> None:
        """No-op."""


class AdaptiveKLController:
    """Adaptive KL coefficient (arXiv:1909.08593): see :func:`adaptive_kl_coef`.

    ``update(current_kl, n_steps)`` with ``n_steps`` the batch size moves ``value`` towards the
    coefficient that keeps the measured KL near ``target_kl``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: Any, n_steps: Any) -> None:
        self.value = float(adaptive_kl_coef(self.value, float(current_kl), self.target, self.horizon, n_steps))


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Builds a controller from a config with ``type`` (``fixed``/``adaptive``), ``kl_coef``,
    and for ``adaptive`` ``target_kl`` and ``horizon`` (attributes or mapping keys)."""

    def get(key):
        return kl_ctrl[key] if isinstance(kl_ctrl, dict) else getattr(kl_ctrl, key)

    kind = get("type")
    if kind == "fixed":
        return FixedKLController(get("kl_coef"))
    if kind == "adaptive":
        return AdaptiveKLController(get("kl_coef"), get("target_kl"), get("horizon"))
    raise ValueError(f"unknown KL controller type {kind!r}; valid: adaptive, fixed")


@functools.partial(jax.jit, static_argnames="kind")
def apply_kl_penalty(
    token_level_scores: Array,
    old_log_prob: Array,
    ref_log_prob: Array,
    response_mask: Array,
    beta: Any,
    kind: str = "kl",
) -> tuple[Array, Array]:
    """In-reward KL penalty (verl's ``apply_kl_penalty``).

    ``kl = kl_penalty(old_log_prob, ref_log_prob, kind) m``;
    ``token_level_rewards = token_level_scores - beta kl``;
    ``current_kl = mean_i mean_m(kl_i)`` (batch mean of per-sequence masked means; verl's
    ``masked_mean`` so a fully masked row contributes 0). Returns
    ``(token_level_rewards, current_kl)``; feed ``current_kl`` to the KL controller.
    """
    m = jnp.asarray(response_mask).astype(old_log_prob.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind) * m
    rewards = token_level_scores - beta * kld
    current_kl = jnp.mean(masked_mean(kld, response_mask, axis=-1))
    return rewards, current_kl


# ----------------------------------------------------------------------------- entropy

_DEFAULT_CHUNK_ELEMENTS = 1 << 24  # ~64 MiB of float32 per chunk


def _entropy_rows(logits: Array) -> Array:
    z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    z = z - lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))
    p = jnp.exp(z - lse)
    return lse[..., 0] - jnp.sum(p * z, axis=-1)


def compute_entropy_from_logits(logits: Array, chunk_size: int | None = None) -> Array:
    """Categorical entropy per position: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

    Computed on max-shifted logits (stable for any magnitude), in at least float32.
    ``logits`` is ``[..., V]``; the result is ``[...]``. When there are more positions than
    ``chunk_size`` (default: as many rows as fit in 2^24 elements), positions are processed in
    chunks by a loop of dynamic slices, forward *and* backward (a custom VJP with
    ``dH/dz = -p (z - E_p[z])`` recomputing ``p`` per chunk), so the working memory stays
    ``O(chunk_size V)`` beside the input and its gradient, even for a large vocabulary.
    """
    logits = jnp.asarray(logits)
    lead, v = logits.shape[:-1], logits.shape[-1]
    n = 1
    for d in lead:
        n *= d
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_ELEMENTS // max(v, 1))
    if n <= chunk_size:
        return _entropy_rows(logits)
    return _chunked_entropy(logits.reshape(n, v), chunk_size).reshape(lead)


def _entropy_grad_rows(logits: Array, ct: Array) -> Array:
    """``ct * dH/dz = -ct p (z - E_p[z])`` for rows of logits."""
    z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    z = z - jnp.max(z, axis=-1, keepdims=True)
    p = jax.nn.softmax(z, axis=-1)
    mean_z = jnp.sum(p * z, axis=-1, keepdims=True)
    return (-ct[:, None].astype(z.dtype) * p * (z - mean_z)).astype(logits.dtype)


def _chunk_loop(n: int, chunk: int, body_rows: Callable[[Array, Array], Array], init: Array) -> Array:
    """``out[rows] = body_rows(start)`` for consecutive chunks; the last chunk overlaps the
    previous one (recomputing identical values) so every slice has the static size ``chunk``."""

    def body(i, out):
        start = jnp.minimum(i * chunk, n - chunk)
        return lax.dynamic_update_slice_in_dim(out, body_rows(start), start, axis=0)

    return lax.fori_loop(0, -(-n // chunk), body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _chunked_entropy(flat: Array, chunk: int) -> Array:
    n = flat.shape[0]
    rows = lambda start: _entropy_rows(lax.dynamic_slice_in_dim(flat, start, chunk, axis=0))
    return _chunk_loop(n, chunk, rows, jnp.zeros((n,), jnp.promote_types(flat.dtype, jnp.float32)))


def _chunked_entropy_fwd(flat: Array, chunk: int):
    return _chunked_entropy(flat, chunk), flat


def _chunked_entropy_bwd(chunk: int, flat: Array, ct: Array):
    n = flat.shape[0]

    def rows(start):
        z = lax.dynamic_slice_in_dim(flat, start, chunk, axis=0)
        return _entropy_grad_rows(z, lax.dynamic_slice_in_dim(ct, start, chunk, axis=0))

    return (_chunk_loop(n, chunk, rows, jnp.zeros_like(flat)),)


_chunked_entropy.defvjp(_chunked_entropy_fwd, _chunked_entropy_bwd)


def compute_entropy_loss(
    logits: Array, response_mask: Array, loss_agg_mode: str = "token-mean", **agg_kwargs: Any
) -> Array:
    """``agg_loss(H(logits), m, loss_agg_mode)``: the entropy bonus term (verl's helper)."""
    return agg_loss(compute_entropy_from_logits(logits), response_mask, loss_agg_mode, **agg_kwargs)
