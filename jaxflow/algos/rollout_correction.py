"""Rollout correction (verl 0.9.1's ``rollout_corr_helper``) and the ``bypass_mode`` policy loss.

The rollout engine samples with ``pi_rollout`` (its log-probs: ``rollout_log_probs``); the
trainer differentiates ``pi_train``. With ``log_ratio = log pi_train - log pi_rollout`` per
token ("When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch", https://richardli.xyz/rl-collapse; off-policy RL background,
https://fengyao.notion.site/off-policy-rl; both as verl cites them):

* importance weights (`compute_rollout_correction_weights`): ``w = exp(log_ratio)`` per token,
  or ``exp(sum_t log_ratio)`` per sequence (broadcast over it), exponents clamped to
  ``[-20, 20]``, zero on padding; then truncated at ``upper`` (TIS) or, for a ``"lower_upper"``
  threshold, zeroed outside ``[lower, upper]`` (IcePop); optionally rescaled to mean 1.
* rejection sampling (`compute_rollout_rejection_mask`): a token (``token_*``) or a whole
  sequence (``seq_*``) leaves the response mask when a divergence estimate leaves its bound:
  ``k1 = -log_ratio`` (bounds ``[log lower, log upper]``), ``k2 = log_ratio^2 / 2``, ``k3 =
  exp(log_ratio) - 1 - log_ratio`` (bound ``upper``), per token or summed / averaged /
  maximised over the sequence. Several criteria (comma-separated) must all pass.
* diagnostics (`compute_offpolicy_metrics`): KL, perplexities, chi-squared divergences.

Every metric carries verl's name, prefixed ``rollout_corr/`` by
`compute_rollout_correction_and_rejection_mask`. All of it jits: the options and thresholds
are static Python values, the metrics are 0-d arrays. Reductions over "valid sequences" (at
least one response token) and over all rows are as verl's; verl raises for a batch without a
response token, which a jitted function cannot: its metrics are then 0 (an empty
micro-batch adds nothing to the mini-batch's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxflow.algos.advantages import masked_mean, masked_sum
from jaxflow.algos.policy_losses import (
    DEFAULT_CLIP_RANGE,
    SAFETY_BOUND,
    ClipRange,
    PolicyLossColumns,
    compute_policy_loss_vanilla,
    policy_loss_over_columns,
    register_policy_loss,
    token_policy_loss,
)
from jaxflow.algos.settings import RolloutCorrectionConfig

Array = jax.Array

ROLLOUT_IS_LEVELS = ("token", "sequence")
TOKEN_RS_OPTIONS = ("token_k1", "token_k2", "token_k3")
ROLLOUT_RS_OPTIONS = TOKEN_RS_OPTIONS + tuple(
    f"seq_{agg}_k{k}" for agg, ks in (("sum", "123"), ("mean", "123"), ("max", "23")) for k in ks
)
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


# ----------------------------------------------------------------------------- thresholds


def _positive_float(text: Any, what: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"invalid {what} {text!r}: not a number") from None
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def parse_rollout_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``(upper, lower or None)`` from a number (truncation) or ``"lower_upper"`` (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    if not text:
        raise ValueError("rollout_is_threshold must not be empty")
    if "_" not in text:
        return _positive_float(text, "rollout_is_threshold"), None
    lower_text, upper_text = text.split("_", 1)
    lower = _positive_float(lower_text, "rollout_is_threshold lower bound")
    upper = _positive_float(upper_text, "rollout_is_threshold upper bound")
    if lower > upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: the lower bound exceeds the upper bound")
    return upper, lower


def parse_rollout_rs(rollout_rs: str) -> list[str]:
    """The criteria of a comma-separated ``rollout_rs``, in order, each once."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of criteria, got {rollout_rs!r}")
    options = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"invalid rollout_rs option {opt!r}; valid: {', '.join(ROLLOUT_RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("rollout_rs must name at least one criterion")
    return options


def parse_rollout_rs_thresholds(options: list[str], spec: float | str | None) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower or None, upper)}``: one threshold per option (comma-separated) or one
    shared by all; ``*_k1`` options take ``"lower_upper"`` ratio bounds (``u`` alone: ``1/u``
    and ``u``), the others a single upper bound."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold {spec!r}: give one threshold for all or one per rollout_rs option ({len(options)})"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    out = {}
    for option, text in zip(options, specs):
        if option.endswith("k1"):
            lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
            upper = _positive_float(upper_text, f"rollout_rs_threshold of {option}")
            lower = (
                1.0 / upper if lower_text is None else _positive_float(lower_text, f"rollout_rs_threshold of {option}")
            )
            if lower > upper:
                raise ValueError(f"rollout_rs_threshold of {option} {text!r}: lower bound exceeds the upper bound")
            out[option] = (lower, upper)
        else:
            if "_" in text:
                raise ValueError(f"rollout_rs_threshold of {option} takes a single upper bound, got {text!r}")
            out[option] = (None, _positive_float(text, f"rollout_rs_threshold of {option}"))
    return out


# ----------------------------------------------------------------------------- reductions


def _valid_rows(x: Array, valid: Array) -> dict[str, Array]:
    """``mean, std (unbiased, 0 for one row), max, min`` of ``x [B]`` over the rows ``valid``."""
    n = jnp.sum(valid)
    mean = jnp.sum(jnp.where(valid, x, 0)) / n
    var = jnp.sum(jnp.where(valid, (x - mean) ** 2, 0)) / jnp.maximum(n - 1, 1)
    return {
        "mean": mean,
        "std": jnp.where(n > 1, jnp.sqrt(var), 0.0),
        "max": jnp.max(jnp.where(valid, x, -jnp.inf)),
        "min": jnp.min(jnp.where(valid, x, jnp.inf)),
    }


def _token_max_min(x: Array, mask_bool: Array) -> tuple[Array, Array]:
    return jnp.max(jnp.where(mask_bool, x, -jnp.inf)), jnp.min(jnp.where(mask_bool, x, jnp.inf))


def _clamped_std(x: Array, m: Array, lo: float, hi: float) -> Array:
    """``sqrt(max(0, mean_m(c^2) - mean_m(c)^2))`` of ``c = clip(x, lo, hi)``; 0 for <= 1 token."""
    c = jnp.clip(x, lo, hi)
    mean = masked_mean(c, m)
    var = masked_mean(c * c, m) - mean * mean
    return jnp.where(jnp.sum(m) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _fraction(cond: Array) -> Array:
    return jnp.mean(cond.astype(jnp.result_type(float)))


# ----------------------------------------------------------------------------- IS weights


def compute_is_metrics(
    weights: Array,
    raw_weights: Array,
    log_ratio_for_metrics: Array,
    m: Array,
    rollout_is: str,
    upper: float,
    lower: float | None,
) -> dict[str, Array]:
    """verl's ``rollout_is_*`` metrics of the applied ``weights`` and the ``raw_weights``
    (before truncation); ``log_ratio_for_metrics``: ``[B, T]`` per token, ``[B, 1]`` per
    sequence (over every row, as verl)."""
    lower = 1.0 / upper if lower is None else lower
    out = {}
    if rollout_is == "sequence":
        out["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(log_ratio_for_metrics), SAFETY_BOUND))
        out["rollout_is_min"] = jnp.exp(jnp.min(log_ratio_for_metrics))
        out["rollout_is_mean"] = masked_mean(weights, m)
        out["rollout_is_ratio_fraction_high"] = _fraction(log_ratio_for_metrics > math.log(upper))
        out["rollout_is_ratio_fraction_low"] = _fraction(log_ratio_for_metrics < math.log(lower))
    else:
        out["rollout_is_mean"] = masked_mean(weights, m)
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw_weights > upper).astype(m.dtype), m)
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw_weights < lower).astype(m.dtype), m)
        out["rollout_is_max"], out["rollout_is_min"] = _token_max_min(weights, m != 0)
    out["rollout_is_std"] = _clamped_std(weights, m, 0.0, upper)
    clamped = jnp.clip(weights, 0.0, upper)
    normalized = clamped / (masked_mean(clamped, m) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized * normalized, m)
    seq_mean = masked_mean(weights, m, axis=-1)
    every_row = jnp.ones(seq_mean.shape, bool)
    stats = _valid_rows(seq_mean, every_row)
    for key in ("mean", "std", "max", "min"):
        out[f"rollout_is_seq_{key}"] = stats[key]
    out["rollout_is_seq_max_deviation"] = jnp.max(jnp.abs(seq_mean - 1.0))
    raw_seq_mean = masked_mean(raw_weights, m, axis=-1)
    out["rollout_is_seq_fraction_high"] = _fraction(raw_seq_mean > upper)
    out["rollout_is_seq_fraction_low"] = _fraction(raw_seq_mean < lower)
    return out


def compute_rollout_correction_weights(
    log_ratio: Array,
    response_mask: Array,
    rollout_is: str = "token",
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """``(weights [B, T], metrics)``: truncated (or IcePop-masked) IS weights, detached, zero
    on padding (see the module docstring), and verl's ``rollout_is_*`` metrics (computed
    before the optional rescaling to mean 1 over the tokens, or over the valid sequences'
    mean weights; ``rollout_is_batch_norm_factor`` is that mean, or 1 when it is ~0)."""
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"invalid rollout_is {rollout_is!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}")
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    m = jnp.asarray(response_mask).astype(log_ratio.dtype)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_ratio_for_metrics = masked_sum(log_ratio, m, axis=-1)[:, None]
        raw = jnp.broadcast_to(jnp.exp(jnp.clip(log_ratio_for_metrics, -SAFETY_BOUND, SAFETY_BOUND)), log_ratio.shape)
    raw = raw * m
    if lower is None:
        weights = jnp.minimum(raw, upper)
    else:
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = compute_is_metrics(weights, raw, log_ratio_for_metrics, m, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).astype(m.dtype), m)
    weights = lax.stop_gradient(weights)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, m)
        else:
            seq_valid = (jnp.sum(m, axis=-1) > 0).astype(m.dtype)
            mean = jnp.sum(masked_mean(weights, m, axis=-1) * seq_valid) / jnp.maximum(jnp.sum(seq_valid), 1e-8)
        ok = mean > 1e-8
        weights = jnp.where(ok, weights / jnp.where(ok, mean, 1.0), weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return weights, metrics


# ----------------------------------------------------------------------------- rejection


def _rs_statistic(option: str, k: dict[str, Array], m: Array) -> tuple[Array, Array | None]:
    """``(per-token statistic [B, T], per-sequence statistic [B] or None)`` of an option."""
    kind = k[option[-2:]]
    if option in TOKEN_RS_OPTIONS:
        return kind, None
    if option.startswith("seq_sum"):
        seq = masked_sum(kind, m, axis=-1)
    elif option.startswith("seq_mean"):
        seq = masked_mean(kind, m, axis=-1)
    else:
        seq = jnp.max(jnp.where(m != 0, kind, -jnp.inf), axis=-1)
        seq = jnp.where(seq == -jnp.inf, 0.0, seq)
    return jnp.broadcast_to(seq[:, None], m.shape), seq


def compute_rs_metrics(
    option: str,
    stat: Array,
    m: Array,
    seq_valid: Array,
    seq_stat: Array | None,
    upper: float,
    lower: float,
    apply_lower: bool,
) -> dict[str, Array]:
    """verl's ``rollout_rs_<option>_*`` metrics of one criterion (thresholds in the
    statistic's units: log-ratios for ``*_k1``)."""
    p = f"rollout_rs_{option}"
    seq_values = masked_mean(stat, m, axis=-1) if seq_stat is None else seq_stat
    seq = _valid_rows(seq_values, seq_valid)
    n_seq = jnp.sum(seq_valid)

    def seq_fraction(cond: Array) -> Array:
        return jnp.sum(cond & seq_valid) / n_seq

    out = {f"{p}_mean": masked_mean(stat, m)}
    if seq_stat is not None:  # sequence level: max, min and fractions over the valid sequences
        out[f"{p}_max"], out[f"{p}_min"] = seq["max"], seq["min"]
        out[f"{p}_fraction_high"] = seq_fraction(seq_values > upper)
        out[f"{p}_fraction_low"] = seq_fraction(seq_values < lower) if apply_lower else jnp.zeros(())
    else:
        out[f"{p}_max"], out[f"{p}_min"] = _token_max_min(stat, m != 0)
        out[f"{p}_fraction_high"] = masked_mean((stat > upper).astype(m.dtype), m)
        out[f"{p}_fraction_low"] = masked_mean((stat < lower).astype(m.dtype), m) if apply_lower else jnp.zeros(())
    out[f"{p}_std"] = _clamped_std(stat, m, lower if apply_lower else 0.0, upper)
    for key in ("mean", "std", "max", "min"):
        out[f"{p}_seq_{key}"] = seq[key]
    out[f"{p}_seq_max_deviation"] = jnp.max(jnp.where(seq_valid, jnp.abs(seq_values), -jnp.inf))
    out[f"{p}_seq_fraction_high"] = seq_fraction(seq_values > upper)
    if apply_lower:
        out[f"{p}_seq_fraction_low"] = seq_fraction(seq_values < lower)
    return out


def compute_rollout_rejection_mask(
    log_ratio: Array,
    response_mask: Array,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: float | str | None = None,
) -> tuple[Array, dict[str, Array]]:
    """``(response_mask with rejected tokens zeroed, metrics)``: every criterion of
    ``rollout_rs`` must pass (see the module docstring); per criterion its statistics and
    ``rollout_rs_<option>_masked_fraction`` / ``_seq_masked_fraction``, overall
    ``rollout_rs_masked_fraction`` (tokens) and ``rollout_rs_seq_masked_fraction`` (rows
    with a rejected token, over all rows)."""
    options = parse_rollout_rs(rollout_rs)
    thresholds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    m = jnp.asarray(response_mask).astype(log_ratio.dtype)
    mask_bool = m != 0
    seq_valid = jnp.sum(m, axis=-1) > 0
    lr = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    k = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": jnp.exp(lr) - 1.0 - lr}
    combined = jnp.ones_like(m)
    metrics: dict[str, Array] = {}
    for option in options:
        lower, upper = thresholds[option]
        is_k1 = option.endswith("k1")
        if is_k1:
            lower, upper = math.log(lower), math.log(upper)
        stat, seq_stat = _rs_statistic(option, k, m)
        keep = (stat <= upper) & ((stat >= lower) if is_k1 else True)
        combined = combined * keep.astype(m.dtype)
        metrics |= compute_rs_metrics(option, stat, m, seq_valid, seq_stat, upper, lower if is_k1 else 0.0, is_k1)
        seq_keep = jnp.all(keep | ~mask_bool, axis=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1.0 - keep.astype(m.dtype), m)
        n_seq = jnp.sum(seq_valid)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = jnp.where(
            n_seq > 0, jnp.sum(~seq_keep & seq_valid) / jnp.maximum(n_seq, 1), 0.0
        )
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - combined, m)
    kept = (combined > 0.5) & mask_bool
    metrics["rollout_rs_seq_masked_fraction"] = _fraction(jnp.any(~kept & mask_bool, axis=-1))
    return (m * combined).astype(jnp.asarray(response_mask).dtype), metrics


# ----------------------------------------------------------------------------- diagnostics


def compute_offpolicy_metrics(old_log_prob: Array, rollout_log_prob: Array, response_mask: Array) -> dict[str, Array]:
    """verl's off-policy diagnostics of the trained (``old_log_prob``) against the rollout
    policy: ``kl = mean_m(lp_rollout - lp_train)``, ``k3_kl = mean_m(exp(r) - r - 1)`` with
    ``r = lp_train - lp_rollout``, ``training_ppl`` / ``rollout_ppl`` (row mean of
    ``exp(-mean_t lp)``), their logs, ``log_ppl_diff`` (row mean, abs mean, max, min of
    ``mean_t lp_rollout - mean_t lp_train``), ``ppl_ratio``, ``chi2_token = mean_m(rho^2) - 1``
    and ``chi2_seq = mean_i(prod_t rho^2) - 1`` (exponents clamped to ``[-20, 20]``). Row
    means run over every row, as verl."""
    m = response_mask
    train_mean = masked_mean(old_log_prob, m, axis=-1)
    rollout_mean = masked_mean(rollout_log_prob, m, axis=-1)
    log_ratio = old_log_prob - rollout_log_prob
    diff = rollout_mean - train_mean
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = jnp.clip(masked_sum(log_ratio, m, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": jnp.mean(jnp.exp(-train_mean)),
        "training_log_ppl": jnp.mean(-train_mean),
        "kl": masked_mean(rollout_log_prob - old_log_prob, m),
        "k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1, m),
        "rollout_ppl": jnp.mean(jnp.exp(-rollout_mean)),
        "rollout_log_ppl": jnp.mean(-rollout_mean),
        "log_ppl_diff": jnp.mean(diff),
        "log_ppl_abs_diff": jnp.mean(jnp.abs(diff)),
        "log_ppl_diff_max": jnp.max(diff),
        "log_ppl_diff_min": jnp.min(diff),
        "ppl_ratio": jnp.mean(jnp.exp(diff)),
        "chi2_token": masked_mean(rho * rho, m) - 1.0,
        "chi2_seq": jnp.mean(jnp.exp(2.0 * seq_log_ratio)) - 1.0,
    }


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: Array,
    rollout_log_prob: Array,
    response_mask: Array,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[Array | None, Array, dict[str, Array]]:
    """``(IS weights or None, response mask after rejection, metrics)``: the weights when
    ``rollout_is`` (and its threshold) is set, the rejection when ``rollout_rs`` is, the
    off-policy diagnostics always; every metric named ``rollout_corr/<verl's name>`` (all 0
    for a mask without a response token, where verl raises: an empty micro-batch's share)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != jnp.shape(response_mask):
        raise ValueError(
            f"log-prob and mask shapes differ: {old_log_prob.shape}, {rollout_log_prob.shape}, "
            f"{jnp.shape(response_mask)}"
        )
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, Array] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics |= is_metrics
    mask = response_mask
    if rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics |= rs_metrics
    metrics |= compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
    has_tokens = jnp.any(jnp.asarray(response_mask) != 0)  # verl raises without one; an empty micro-batch: 0
    return weights, mask, {f"rollout_corr/{k}": jnp.where(has_tokens, v, 0.0) for k, v in metrics.items()}


# ----------------------------------------------------------------------------- losses


@token_policy_loss("seq-mean-token-sum")
def compute_policy_loss_reinforce(columns: PolicyLossColumns) -> tuple[Array, dict]:
    """REINFORCE with optional (detached) IS weights ``w``: ``L = -A log_prob w``, where
    ``old_log_prob`` are the rollout's log-probs (bypass mode). Metrics: ``ppo_kl =
    mean_m(old_log_prob - log_prob)``; the clip fractions are 0."""
    old_log_prob, log_prob, advantages, response_mask = columns
    return -advantages * log_prob, dict(ppo_kl=masked_mean(old_log_prob - log_prob, response_mask))


def _as_rollout_correction(value: RolloutCorrectionConfig | Mapping[str, Any] | None) -> RolloutCorrectionConfig:
    if value is None:
        return RolloutCorrectionConfig()
    if isinstance(value, RolloutCorrectionConfig):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(RolloutCorrectionConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"unknown rollout_correction key(s) {unknown}; valid: {sorted(known)}")
        return RolloutCorrectionConfig(**value)
    raise TypeError(f"rollout_correction must be a RolloutCorrectionConfig or a mapping, got {type(value).__name__}")


@register_policy_loss("bypass_mode")
@policy_loss_over_columns
def compute_policy_loss_bypass_mode(
    columns: PolicyLossColumns,
    *,
    loss_agg_mode: str = "token-mean",
    clip: ClipRange = DEFAULT_CLIP_RANGE,
    clip_ratio_c: float = 3.0,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_correction: RolloutCorrectionConfig | Mapping[str, Any] | None = None,
) -> tuple[Array, dict]:
    """verl's bypass mode: ``old_log_prob`` *is* the rollout's log-probs (the trainer skips
    the old-policy forward), so two policies remain, ``pi_rollout`` and ``pi_theta``.

    With ``log_ratio = sg(log_prob) - old_log_prob``, the weights ``w`` and the mask ``m'``
    of `compute_rollout_correction_and_rejection_mask` (``rollout_correction``'s
    ``rollout_is*`` and ``rollout_rs*``), then by ``rollout_correction.loss_type``:

    * ``ppo_clip``: the vanilla PPO loss against ``pi_rollout`` on ``m'``; the ratio already
      is the IS correction, so ``w`` is not applied (it is still measured);
    * ``reinforce``: ``L = -A log_prob w`` on ``m'`` (`compute_policy_loss_reinforce`).

    Metrics: the chosen loss's plus every ``rollout_corr/*`` metric.
    """
    rc = _as_rollout_correction(rollout_correction)
    if rc.loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(
            f"invalid rollout_correction.loss_type {rc.loss_type!r}; valid: {', '.join(BYPASS_LOSS_TYPES)}"
        )
    old_log_prob, log_prob, _, response_mask = columns
    weights, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
        lax.stop_gradient(log_prob),
        old_log_prob,
        response_mask,
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
    )
    kept = columns._replace(response_mask=mask)
    shared = dict(loss_agg_mode=loss_agg_mode, global_batch_info=global_batch_info)
    if rc.loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(*kept, rollout_is_weights=weights, **shared)
    else:
        loss, metrics = compute_policy_loss_vanilla(
            *kept, clip_ratio_low=clip.low, clip_ratio_high=clip.high, clip_ratio_c=clip_ratio_c, **shared
        )
    return loss, metrics | corr_metrics
