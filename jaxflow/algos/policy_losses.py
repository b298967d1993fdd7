"""Policy-gradient losses (verl-compatible), loss aggregation, and the policy-loss registry.

All losses share the signature of :func:`compute_policy_loss`'s positional columns
``(old_log_prob, log_prob, advantages, response_mask)`` (``[B, T]`` each) and return
``(loss, metrics)`` where ``metrics`` always holds the scalars ``pg_clipfrac``,
``pg_clipfrac_lower`` and ``ppo_kl`` (zeros where a loss has no such notion), plus any metric
of the loss's own under its verl name (``bypass_mode``'s ``rollout_corr/*``). Gradients flow
through ``log_prob`` only. The built-in losses are written over one `PolicyLossColumns` record
of the four columns (and one `ClipRange` for ``clip_ratio_low/high``);
:func:`policy_loss_over_columns` gives such a loss verl's signature. A loss that aggregates a
per-token loss is written as its per-token maths under :func:`token_policy_loss`, which adds
that signature, the shared keywords and the aggregation. verl 0.9.1's newer losses live beside this module:
`jaxflow.algos.trust_region_losses` (``dppo_tv``, ``dppo_kl``, ``sapo``, ``dro``) and
`jaxflow.algos.rollout_correction` (``bypass_mode``).

Global normalisation
--------------------
``agg_loss`` divides by the *local* number of valid tokens (or sequences) unless given the
mini-batch totals. With ``batch_num_tokens`` / ``global_batch_size`` set to the totals of the
whole mini-batch, the losses of its gradient-accumulation micro-batches and data-parallel
shards *sum* exactly to the full-batch loss (``dp_size=1``), or *average* to it when
``dp_size`` is the number of shards (verl's convention, for optimisers that all-reduce-mean
the gradients). :func:`global_batch_info` computes the totals.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxflow.algos.advantages import masked_mean, masked_sum
from jaxflow.algos.registry import Registry, accepts_keywords

Array = jax.Array

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _safe_div(num: Array, den: Array) -> Array:
    """``num / den``, and 0 where ``den == 0`` (an empty micro-batch contributes nothing)."""
    den = jnp.asarray(den, num.dtype)
    return jnp.where(den != 0, num / jnp.where(den != 0, den, 1), 0)


def agg_loss(
    loss_mat: Array,
    loss_mask: Array,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> Array:
    """Aggregates a ``[B, T]`` loss matrix into a scalar (verl's ``agg_loss``).

    With ``L`` the loss, ``m`` the mask, ``N_tok = sum m`` and ``N_seq = #{i : sum_t m_it > 0}``:

    * ``token-mean``:              ``sum(L m) / N_tok``
    * ``token-sum``:               ``sum(L m)``
    * ``seq-mean-token-sum``:      ``sum_i (sum_t L m) / N_seq``
    * ``seq-mean-token-mean``:     ``sum_i (sum_t L m / (sum_t m + 1e-8)) / N_seq``
    * ``seq-mean-token-sum-norm``: ``sum_i (sum_t L m / K) / N_seq`` with ``K =
      loss_scale_factor`` or the padded length ``T`` (Dr.GRPO's constant normaliser)

    Fully masked rows are excluded from ``N_seq``. ``batch_num_tokens`` (token-mean) and
    ``global_batch_size`` (seq-mean-*) replace ``N_tok`` / ``N_seq`` by mini-batch totals, and
    the result is multiplied by ``dp_size``; see the module docstring. verl requires the totals
    when ``dp_size > 1``; so do we. An empty normaliser gives 0, not NaN.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"invalid loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    loss_mat = jnp.asarray(loss_mat)
    m = jnp.asarray(loss_mask).astype(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = jnp.sum(m)
        return _safe_div(masked_sum(loss_mat, loss_mask), batch_num_tokens) * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size

    tokens_per_seq = jnp.sum(m, axis=-1)
    seq_mask = (tokens_per_seq > 0).astype(loss_mat.dtype)
    seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (tokens_per_seq + 1e-8)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = jnp.sum(seq_mask)
    loss = _safe_div(masked_sum(seq_losses, seq_mask), global_batch_size) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        factor = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        loss = loss / jnp.asarray(factor, loss.dtype)
    return loss


def global_batch_info(response_mask: Array, dp_size: int = 1, loss_scale_factor: Any = None) -> dict:
    """The normalisers of a whole mini-batch, to pass to every micro-batch / shard's loss.

    Returns ``{"dp_size", "batch_num_tokens": sum m, "global_batch_size": #rows with a valid
    token, "loss_scale_factor"}`` (verl's ``config.global_batch_info``). Call it on the full
    mini-batch mask (or ``psum`` the local values over the data axis inside ``shard_map``).
    """
    m = jnp.asarray(response_mask)
    if m.dtype == jnp.bool_:
        m = m.astype(jnp.int32)
    return {
        "dp_size": dp_size,
        "batch_num_tokens": jnp.sum(m),
        "global_batch_size": jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.int32)),
        "loss_scale_factor": loss_scale_factor,
    }


# ----------------------------------------------------------------------------- registry

POLICY_LOSS_REGISTRY = Registry("policy loss")

# Hyper-parameters every policy loss may take; a loss that does not declare one is not passed
# it. (``rollout_is_weights`` and ``global_batch_info`` are passed only when given, and a loss
# that cannot honour them then raises instead of silently ignoring them.)
COMMON_POLICY_LOSS_KEYWORDS = ("loss_agg_mode", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


def register_policy_loss(name: str, *, override: bool = False):
    """Decorator registering a policy loss under ``name`` (selected by ``loss_mode``).

    A loss takes ``(old_log_prob, log_prob, advantages, response_mask, *, ...)`` and returns
    ``(loss, metrics)``. It may declare any of the common keywords ``loss_agg_mode,
    clip_ratio_low, clip_ratio_high, clip_ratio_c`` (those it omits are not passed),
    ``rollout_is_weights`` and ``global_batch_info`` (passed when the caller gives them), plus
    its own mode-specific keywords. Stack it on :func:`token_policy_loss` to write only the
    per-token maths over `PolicyLossColumns`.
    """
    return POLICY_LOSS_REGISTRY.register(name, override=override)


def get_policy_loss_fn(name: str) -> Callable[..., tuple[Array, dict]]:
    """The policy loss registered under ``name``; unknown names raise listing the valid ones.

    The returned callable ignores the common hyper-parameters (``loss_agg_mode``,
    ``clip_ratio_low/high/c``) the loss does not declare; any other unknown keyword raises
    ``TypeError``.
    """
    return accepts_keywords(POLICY_LOSS_REGISTRY.get(name), droppable=COMMON_POLICY_LOSS_KEYWORDS)


def policy_loss_names() -> list[str]:
    return POLICY_LOSS_REGISTRY.names()


def compute_policy_loss(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_mode: str = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Array | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    **mode_kwargs: Any,
) -> tuple[Array, dict]:
    """Dispatches to the policy loss ``loss_mode`` (``vanilla``, ``gspo``, ``gpg``, ``cispo``,
    ``clip_cov``, ``kl_cov``, ``geo_mean``, ``dppo_tv``, ``dppo_kl``, ``sapo``, ``dro``,
    ``bypass_mode`` or a user-registered one).

    Clip ratios and ``loss_agg_mode`` are dropped for modes that do not use them;
    ``mode_kwargs`` are passed as-is, so a misspelt mode option raises ``TypeError``.
    ``rollout_is_weights`` ``[B, T]``, when given, multiply the per-token loss before
    aggregation. ``global_batch_info`` (see :func:`global_batch_info`) sets the global
    normalisers of :func:`agg_loss`. Passing either to a loss that does not take it raises.
    """
    fn = get_policy_loss_fn(loss_mode)
    optional = dict(rollout_is_weights=rollout_is_weights, global_batch_info=global_batch_info)
    return fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        **{k: v for k, v in optional.items() if v is not None},
        **mode_kwargs,
    )


# ----------------------------------------------------------------------------- helpers


SAFETY_BOUND = 20.0  # log-ratios are clamped to [-20, 20] before exp (verl's bound)


def _ratio(old_log_prob: Array, log_prob: Array) -> tuple[Array, Array]:
    """``(d, rho)``: the clamped log-ratio ``d = clamp(log_prob - old_log_prob, -20, 20)`` and
    the importance ratio ``rho = exp(d)``."""
    log_ratio = jnp.clip(log_prob - old_log_prob, -SAFETY_BOUND, SAFETY_BOUND)
    return log_ratio, jnp.exp(log_ratio)


def _surrogates(advantages: Array, ratio: Array, clip: ClipRange) -> tuple[Array, Array]:
    """PPO's two surrogate losses ``(L1, L2) = (-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))``."""
    return -advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip.low, 1 + clip.high)


class PolicyLossColumns(NamedTuple):
    """The ``[B, T]`` columns every policy loss takes, in verl's positional order."""

    old_log_prob: Array
    log_prob: Array
    advantages: Array
    response_mask: Array


# The columns every policy loss takes first, ``[B, T]`` each.
POLICY_LOSS_COLUMNS = PolicyLossColumns._fields


class ClipRange(NamedTuple):
    """PPO's ratio clip ``[1 - low, 1 + high]``: verl's ``clip_ratio_low`` and
    ``clip_ratio_high`` (a loss may read them as other thresholds; its docstring says)."""

    low: Any = 0.2
    high: Any = 0.2


DEFAULT_CLIP_RANGE = ClipRange()  # verl's defaults


def policy_loss_over_columns(loss_of_columns: Callable[..., tuple[Array, dict]]) -> Callable[..., tuple[Array, dict]]:
    """Decorator giving a policy loss written as ``loss(columns: PolicyLossColumns, *,
    <options>)`` verl's signature ``loss(old_log_prob, log_prob, advantages, response_mask,
    *, <options>)``.

    An option ``clip: ClipRange`` is taken as verl's keywords ``clip_ratio_low`` and
    ``clip_ratio_high`` (defaults: the fields of ``clip``'s default).
    """
    sig = inspect.signature(loss_of_columns)
    first, *options = sig.parameters.values()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if first.kind not in positional or any(p.kind in positional for p in options):
        raise TypeError(f"a policy loss over columns takes (columns: PolicyLossColumns, *, <options>), got {sig}")
    clip = sig.parameters.get("clip")
    if clip is not None and not isinstance(clip.default, ClipRange):
        raise TypeError(f"the option clip of {loss_of_columns.__name__} needs a ClipRange default")

    def loss(old_log_prob: Array, log_prob: Array, advantages: Array, response_mask: Array, **kw: Any):
        if "clip" in kw:  # the public form takes verl's keywords only; a ClipRange would be overwritten
            raise TypeError(f"{loss_of_columns.__name__} takes clip_ratio_low/clip_ratio_high, not clip")
        if clip is not None:
            default = clip.default
            kw["clip"] = ClipRange(kw.pop("clip_ratio_low", default.low), kw.pop("clip_ratio_high", default.high))
        return loss_of_columns(PolicyLossColumns(old_log_prob, log_prob, advantages, response_mask), **kw)

    functools.update_wrapper(loss, loss_of_columns)
    loss.__signature__ = _verl_signature(sig)
    return loss


def _verl_signature(sig: inspect.Signature) -> inspect.Signature:
    """``sig`` of a loss over columns, with the columns first and ``clip`` as verl's keywords."""
    columns = [inspect.Parameter(c, inspect.Parameter.POSITIONAL_OR_KEYWORD) for c in POLICY_LOSS_COLUMNS]
    params = []
    for p in list(sig.parameters.values())[1:]:
        if p.name == "clip":
            keyword = inspect.Parameter.KEYWORD_ONLY
            params += [
                inspect.Parameter("clip_ratio_low", keyword, default=p.default.low),
                inspect.Parameter("clip_ratio_high", keyword, default=p.default.high),
            ]
        else:
            params.append(p)
    return sig.replace(parameters=columns + params)


def token_policy_loss(loss_agg_mode: str = "token-mean", *, agg_mode_fixed: bool = False):
    """Decorator turning a policy loss's per-token maths into the verl-compatible loss.

    The decorated ``token_loss(columns: PolicyLossColumns, *, <its options>)`` returns
    ``(pg_losses [B, T], metrics)``, ``metrics`` holding any of ``pg_clipfrac``,
    ``pg_clipfrac_lower`` and ``ppo_kl`` (the others are reported as 0); an option ``clip:
    ClipRange`` becomes ``clip_ratio_low/high`` (`policy_loss_over_columns`). The loss it
    becomes takes verl's columns and the options plus ``loss_agg_mode`` (default
    ``loss_agg_mode``; not a parameter when ``agg_mode_fixed``), ``rollout_is_weights`` ``w``
    and ``global_batch_info``, and returns::

        (agg_loss(pg_losses w, response_mask, loss_agg_mode, **global_batch_info), metrics)
    """

    def decorator(token_loss: Callable[..., tuple[Array, dict]]) -> Callable[..., tuple[Array, dict]]:
        def loss(
            columns: PolicyLossColumns,
            *,
            rollout_is_weights: Array | None = None,
            global_batch_info: Mapping[str, Any] | None = None,
            **options: Any,
        ) -> tuple[Array, dict]:
            agg_mode = loss_agg_mode if agg_mode_fixed else options.pop("loss_agg_mode", loss_agg_mode)
            pg_losses, metrics = token_loss(columns, **options)
            if rollout_is_weights is not None:
                pg_losses = pg_losses * rollout_is_weights
            total = agg_loss(pg_losses, columns.response_mask, agg_mode, **dict(global_batch_info or {}))
            return total, _metrics(**metrics, like=total)

        functools.update_wrapper(loss, token_loss)
        loss.__signature__ = _with_shared_keywords(token_loss, None if agg_mode_fixed else loss_agg_mode)
        return policy_loss_over_columns(loss)

    return decorator


def _with_shared_keywords(token_loss: Callable[..., Any], loss_agg_mode: str | None) -> inspect.Signature:
    """``token_loss``'s signature plus the keywords `token_policy_loss` adds, so that
    `get_policy_loss_fn` sees which common hyper-parameters the loss declares."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [] if loss_agg_mode is None else [inspect.Parameter("loss_agg_mode", keyword, default=loss_agg_mode)]
    added += [inspect.Parameter(name, keyword, default=None) for name in ("rollout_is_weights", "global_batch_info")]
    sig = inspect.signature(token_loss)
    return sig.replace(parameters=[*sig.parameters.values(), *added])


def _metrics(pg_clipfrac=None, pg_clipfrac_lower=None, ppo_kl=None, *, like: Array) -> dict:
    """The metrics every policy loss reports, 0 (of ``like``'s dtype) where it has no such notion."""
    zero = jnp.zeros((), like.dtype)
    return {
        "pg_clipfrac": zero if pg_clipfrac is None else pg_clipfrac,
        "pg_clipfrac_lower": zero if pg_clipfrac_lower is None else pg_clipfrac_lower,
        "ppo_kl": zero if ppo_kl is None else ppo_kl,
    }


def _check_dual_clip(clip_ratio_c: Any) -> None:
    if not isinstance(clip_ratio_c, jax.core.Tracer) and not float(clip_ratio_c) > 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1, got {clip_ratio_c}")


def _frac(cond: Array, mask: Array, dtype) -> Array:
    return masked_mean(cond.astype(dtype), mask)


# ----------------------------------------------------------------------------- losses


@register_policy_loss("vanilla")
@token_policy_loss()
def compute_policy_loss_vanilla(
    columns: PolicyLossColumns, *, clip: ClipRange = DEFAULT_CLIP_RANGE, clip_ratio_c: float = 3.0
) -> tuple[Array, dict]:
    """PPO clipped surrogate with dual clip (Schulman et al. 2017; Ye et al. 2019, arXiv:1912.09729).

    ::

        rho   = exp(clamp(log_prob - old_log_prob, -20, 20))
        L1    = -A rho
        L2    = -A clip(rho, 1 - eps_low, 1 + eps_high)
        Lclip = max(L1, L2)
        L3    = -A c                                  # dual clip, c > 1
        L     = min(L3, Lclip) if A < 0 else Lclip

    Metrics: ``pg_clipfrac = mean_m(L2 > L1)``, ``pg_clipfrac_lower = mean_m(Lclip > L3 and
    A < 0)``, ``ppo_kl = mean_m(old_log_prob - log_prob)`` (clamped log-ratio).
    """
    _check_dual_clip(clip_ratio_c)
    old_log_prob, log_prob, advantages, response_mask = columns
    dtype = log_prob.dtype
    neg_kl, ratio = _ratio(old_log_prob, log_prob)
    ppo_kl = masked_mean(-neg_kl, response_mask)
    l1, l2 = _surrogates(advantages, ratio, clip)
    lclip = jnp.maximum(l1, l2)
    l3 = -advantages * clip_ratio_c
    neg = advantages < 0
    pg_losses = jnp.where(neg, jnp.minimum(l3, lclip), lclip)
    return pg_losses, dict(
        pg_clipfrac=_frac(l2 > l1, response_mask, dtype),
        pg_clipfrac_lower=_frac((lclip > l3) & neg, response_mask, dtype),
        ppo_kl=ppo_kl,
    )


@register_policy_loss("gspo")
@token_policy_loss("seq-mean-token-mean")
def compute_policy_loss_gspo(columns: PolicyLossColumns, *, clip: ClipRange = DEFAULT_CLIP_RANGE) -> tuple[Array, dict]:
    """Group Sequence Policy Optimisation (Zheng et al. 2025, arXiv:2507.18071), verl's form.

    Sequence-level ratio with a token-level gradient path::

        log s_i    = sum_t (log_prob - old_log_prob) m / max(1, sum_t m)
        log s_it   = min(sg(log s_i) + log_prob - sg(log_prob), 10)
        L1, L2     = -A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high);  L = max(L1, L2)

    Aggregated with ``loss_agg_mode`` as verl 0.9.1 does (the paper's ``seq-mean-token-mean``
    is this function's default; the actor passes its own setting, ``token-mean`` unless set).
    Metrics: ``pg_clipfrac = mean_m(L2 > L1)``, ``ppo_kl = mean_m(old_log_prob - log_prob)``.
    """
    old_log_prob, log_prob, advantages, response_mask = columns
    dtype = log_prob.dtype
    neg_kl = log_prob - old_log_prob
    lengths = jnp.maximum(jnp.sum(jnp.asarray(response_mask).astype(dtype), axis=-1), 1)
    seq_log_ratio = masked_sum(neg_kl, response_mask, axis=-1) / lengths
    log_s = log_prob - lax.stop_gradient(log_prob) + lax.stop_gradient(seq_log_ratio)[:, None]
    l1, l2 = _surrogates(advantages, jnp.exp(jnp.minimum(log_s, 10.0)), clip)
    pg_losses = jnp.maximum(l1, l2)
    return pg_losses, dict(pg_clipfrac=_frac(l2 > l1, response_mask, dtype), ppo_kl=masked_mean(-neg_kl, response_mask))


@register_policy_loss("gpg")
@token_policy_loss()
def compute_policy_loss_gpg(columns: PolicyLossColumns) -> tuple[Array, dict]:
    """Group Policy Gradient (arXiv:2504.02546): plain REINFORCE, ``L = -log_prob A``."""
    return -columns.log_prob * columns.advantages, {}


@register_policy_loss("cispo")
@token_policy_loss()
def compute_policy_loss_cispo(
    columns: PolicyLossColumns, *, clip: ClipRange = DEFAULT_CLIP_RANGE
) -> tuple[Array, dict]:
    """Clipped IS-weight Policy Optimisation (MiniMax-M1, arXiv:2506.13585).

    ::

        rho = exp(clamp(log_prob - old_log_prob, -20, 20))
        L   = -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log_prob

    Every token keeps a gradient (through ``log_prob``). Metrics: ``pg_clipfrac =
    mean_m(rho != clip(rho))``, ``ppo_kl``.
    """
    old_log_prob, log_prob, advantages, response_mask = columns
    dtype = log_prob.dtype
    neg_kl, ratio = _ratio(old_log_prob, log_prob)
    clipped = jnp.clip(ratio, 1 - clip.low, 1 + clip.high)
    pg_losses = -lax.stop_gradient(clipped) * advantages * log_prob
    return pg_losses, dict(
        pg_clipfrac=_frac(ratio != clipped, response_mask, dtype), ppo_kl=masked_mean(-neg_kl, response_mask)
    )


def _random_subset(candidates: Array, k: Array, key: Array | None) -> Array:
    """A uniformly random subset of ``min(k, #candidates)`` of the True entries of ``candidates``.

    Each entry gets a priority (uniform noise with ``key``; its flat position without one, i.e.
    the first candidates in row-major order); candidates are ranked by priority and the ``k``
    best kept. The same distribution as verl's ``randperm(...)[:k]``.
    """
    flat = candidates.reshape(-1)
    if key is None:
        prio = jnp.arange(flat.size, dtype=jnp.float32)
    else:
        prio = jax.random.uniform(key, flat.shape)
    prio = jnp.where(flat, prio, jnp.inf)
    rank = jnp.argsort(jnp.argsort(prio, stable=True), stable=True)
    return (flat & (rank < k)).reshape(candidates.shape)


@register_policy_loss("clip_cov")
@token_policy_loss()
def compute_policy_loss_clip_cov(
    columns: PolicyLossColumns,
    *,
    clip: ClipRange = DEFAULT_CLIP_RANGE,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    key: Array | None = None,
) -> tuple[Array, dict]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617).

    ::

        rho    = exp(log_prob - old_log_prob)
        L1, L2 = -A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)
        cov_t  = (A - mean_m(A)) (log_prob - mean_m(log_prob))        # no gradient
        C      = {t : m_t, not (L2 > L1), lb < cov_t < ub}             # candidates
        D      = random subset of C of size min(|C|, max(1, floor(ratio sum m)))
        L      = max(L1, L2) (1 - [t in D])                            # detach those tokens

    ``key`` (a ``jax.random`` key) draws ``D``; without one the first candidates in row-major
    order are taken (deterministic). Metrics: ``pg_clipfrac = mean_m(t in D)``, ``ppo_kl``.
    """
    old_log_prob, log_prob, advantages, response_mask = columns
    dtype = log_prob.dtype
    valid = jnp.asarray(response_mask) != 0
    neg_kl = log_prob - old_log_prob
    l1, l2 = _surrogates(advantages, jnp.exp(neg_kl), clip)
    lp = lax.stop_gradient(log_prob)
    adv = lax.stop_gradient(advantages)
    cov = (adv - masked_mean(adv, response_mask)) * (lp - masked_mean(lp, response_mask))
    candidates = valid & ~(l2 > l1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n_tok = jnp.sum(jnp.asarray(response_mask).astype(dtype))
    k = jnp.maximum(jnp.floor(clip_cov_ratio * n_tok), 1)
    detached = _random_subset(candidates, k, key)
    corr = 1 - detached.astype(dtype)
    pg_losses = jnp.maximum(l1, l2) * corr
    return pg_losses, dict(
        pg_clipfrac=_frac(detached, response_mask, dtype), ppo_kl=masked_mean(-neg_kl, response_mask)
    )


@register_policy_loss("kl_cov")
@token_policy_loss()
def compute_policy_loss_kl_cov(
    columns: PolicyLossColumns, *, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 1.0
) -> tuple[Array, dict]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617).

    ::

        rho   = exp(log_prob - old_log_prob)
        cov_t = (A - mean(A)) (log_prob - mean(log_prob))   # plain means over valid tokens
        K     = the k = max(1, floor(ratio N)) valid tokens of largest cov_t (N valid tokens)
        L     = -A rho + [t in K] ppo_kl_coef |log_prob - old_log_prob|

    Metrics: ``ppo_kl = mean_m(|log_prob - old_log_prob|)`` (as verl); clip fractions 0.
    """
    old_log_prob, log_prob, advantages, response_mask = columns
    dtype = log_prob.dtype
    valid = jnp.asarray(response_mask) != 0
    neg_kl = log_prob - old_log_prob
    abs_kl = jnp.abs(neg_kl)
    ratio = jnp.exp(neg_kl)
    lp = lax.stop_gradient(log_prob)
    adv = lax.stop_gradient(advantages)
    n_valid = jnp.sum(valid)
    denom = jnp.maximum(n_valid, 1).astype(dtype)
    adv_mean = jnp.sum(jnp.where(valid, adv, 0)) / denom
    lp_mean = jnp.sum(jnp.where(valid, lp, 0)) / denom
    cov = (adv - adv_mean) * (lp - lp_mean)
    k = jnp.maximum(jnp.floor(n_valid.astype(dtype) * kl_cov_ratio), 1)
    order_key = jnp.where(valid, -cov, jnp.inf).reshape(-1)
    rank = jnp.argsort(jnp.argsort(order_key, stable=True), stable=True).reshape(valid.shape)
    top = valid & (rank < k)
    pg_losses = -advantages * ratio + jnp.where(top, ppo_kl_coef * abs_kl, 0)
    return pg_losses, dict(ppo_kl=masked_mean(abs_kl, response_mask))


@register_policy_loss("geo_mean")
@policy_loss_over_columns
def compute_policy_loss_geo_mean(
    columns: PolicyLossColumns,
    *,
    clip: ClipRange = DEFAULT_CLIP_RANGE,
    rollout_is_weights: Array | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[Array, dict]:
    """Geometric-Mean Policy Optimisation, GMPO (Zhao et al. 2025, arXiv:2507.20673), verl's form.

    Token-level clipping in log space, then a geometric mean of the ratios per sequence::

        d_t   = log_prob - old_log_prob;  sgn = sign(A)
        dc_t  = sgn min(sgn d_t, sgn clip(d_t, -eps_low, eps_high))
        r_i   = exp(sum_t dc_t m / (sum_t m + 1e-8))
        A_i   = sum_t A m / (sum_t m + 1e-8)
        L     = mean_i(-A_i r_i w_i)      w_i = exp(sum_t log(w_it + 1e-10) m / (sum_t m + 1e-8))

    ``w`` are the rollout IS weights (1 when absent). ``loss_agg_mode`` is not used: the mean runs
    over all ``B`` rows as in verl, or is ``sum_i(...) / global_batch_size * dp_size`` when a
    ``global_batch_info`` with ``global_batch_size`` is given. Metrics: ``pg_clipfrac =
    mean_m(d != clip(d) and A > 0)``, ``pg_clipfrac_lower`` the same with ``A < 0``, ``ppo_kl``.
    """
    old_log_prob, log_prob, advantages, response_mask = columns
    dtype = log_prob.dtype
    m = jnp.asarray(response_mask).astype(dtype)
    d = log_prob - old_log_prob
    sgn = jnp.sign(advantages)
    d_clip = jnp.clip(d, -clip.low, clip.high)
    d_min = sgn * jnp.minimum(sgn * d, sgn * d_clip)
    m_sum = jnp.sum(m, axis=-1) + 1e-8
    ratio = jnp.exp(masked_sum(d_min, response_mask, axis=-1) / m_sum)
    adv = masked_sum(advantages, response_mask, axis=-1) / m_sum
    pg_losses = -adv * ratio
    if rollout_is_weights is not None:
        log_w = jnp.log(rollout_is_weights + 1e-10)
        pg_losses = pg_losses * jnp.exp(masked_sum(log_w, response_mask, axis=-1) / m_sum)
    info = dict(global_batch_info or {})
    if info.get("global_batch_size") is not None:
        loss = jnp.sum(pg_losses) / jnp.asarray(info["global_batch_size"], dtype) * info.get("dp_size", 1)
    else:
        loss = jnp.mean(pg_losses)
    clipped = d != d_clip
    return loss, _metrics(
        _frac(clipped & (advantages > 0), response_mask, dtype),
        _frac(clipped & (advantages < 0), response_mask, dtype),
        masked_mean(-d, response_mask),
        like=loss,
    )
