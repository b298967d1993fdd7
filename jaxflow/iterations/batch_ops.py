"""Batch-level glue on the driver: the pure functions of `jaxflow.algos` applied to a rollout
`Batch` by column name.

These run on the single controller between worker-group calls. Columns may live on
different pools (the critic's values, the actor's log-probs): each function first brings the
columns it reads to the host, computes, and returns host (NumPy) columns, so the next role
moves only what it reads onto its own devices.

* `apply_kl_penalty_to_batch`: ``token_level_rewards = token_level_scores - beta *
  kl(old_log_probs, ref_log_prob)`` (verl's in-reward KL penalty).
* `compute_advantage`: ``advantages`` and ``returns`` from the estimator registered under
  ``adv_estimator`` (``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ``remax``, ...),
  fed with the batch's columns; group ids come from the ``uid`` column (the ``n`` samples of
  one prompt share it); ``gdpo``'s reward dimensions from the reward function's named values
  (``reward_extra/<key>`` columns).
* `estimator_reads`: whether an estimator reads a column (``values``, ``old_log_probs``).
* `batch_from_prompts`: a prompt `Batch` from a `jaxflow.data.dataset.PromptBatch`.
* `compute_data_metrics`: verl's rollout statistics (scores, rewards, advantages, lengths).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxflow.algos.advantages import get_adv_estimator_fn
from jaxflow.algos.kl import apply_kl_penalty
from jaxflow.data.batch import Batch
from jaxflow.rewards import EXTRA_COLUMN_PREFIX

# Columns an estimator may take, by its parameter names (see jaxflow.algos.advantages).
_ESTIMATOR_COLUMNS = (
    "token_level_rewards",
    "response_mask",
    "values",
    "reward_baselines",
    "old_log_probs",
    "ref_log_prob",
    "sum_pi_squared",
    "rollout_is_weights",
)


def _host(batch: Batch, key: str) -> np.ndarray:
    return np.asarray(jax.device_get(batch[key]))


def estimator_reads(adv_estimator: str, column: str) -> bool:
    """Whether the estimator registered as ``adv_estimator`` takes the column ``column`` (its
    parameter names are the columns it reads; `compute_advantage` passes them)."""
    return column in inspect.signature(get_adv_estimator_fn(adv_estimator)).parameters


def group_ids_from_uid(uid: Any) -> np.ndarray:
    """Dense int32 group ids ``[B]`` from any hashable per-row ids (samples of a prompt share
    one)."""
    uid = np.asarray(uid)
    keys = uid.astype(str) if uid.dtype == object else uid
    _, inverse = np.unique(keys, return_inverse=True)
    return inverse.reshape(-1).astype(np.int32)


def apply_kl_penalty_to_batch(batch: Batch, beta: float, kind: str = "kl") -> tuple[Batch, dict[str, float]]:
    """Adds ``token_level_rewards`` (see the module docstring). Needs ``token_level_scores``,
    ``old_log_probs``, ``ref_log_prob``, ``response_mask``; where the batch has a ``loss_mask``
    (multi-turn rollouts) the penalty and the current KL cover only its tokens (the model's
    own: a tool's tokens are not the policy's to pay for). Returns the batch and the metrics
    ``actor/reward_kl_penalty`` (the current KL, to feed a KL controller) and
    ``actor/reward_kl_penalty_coeff`` (beta)."""
    rewards, current_kl = apply_kl_penalty(
        _host(batch, "token_level_scores").astype(np.float32),
        _host(batch, "old_log_probs").astype(np.float32),
        _host(batch, "ref_log_prob").astype(np.float32),
        _host(batch, "loss_mask" if "loss_mask" in batch else "response_mask"),
        np.float32(beta),
        kind,
    )
    out = batch.update(tensors={"token_level_rewards": np.asarray(rewards)})
    return out, {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_penalty_coeff": float(beta)}


def gdpo_scores(batch: Batch, keys: Sequence[str]) -> np.ndarray:
    """``[K, B]`` float32: the reward function's named values ``keys`` (its dict's keys, in
    the ``reward_extra/<key>`` columns); a key it did not return, or returned for only some
    samples, is an error naming it."""
    available = sorted(k[len(EXTRA_COLUMN_PREFIX) :] for k in batch.keys() if k.startswith(EXTRA_COLUMN_PREFIX))
    rows = []
    for key in keys:
        column = EXTRA_COLUMN_PREFIX + key
        if column not in batch:
            raise KeyError(
                f"gdpo reward key {key!r}: the reward function returned no such value (its dict's keys besides "
                f"'score': {available or 'none'}); algorithm.gdpo_reward_keys must name keys of that dict"
            )
        values = np.asarray(batch[column], np.float32)
        if np.isnan(values).any():
            raise ValueError(
                f"gdpo reward key {key!r}: the reward function returned it for only "
                f"{int((~np.isnan(values)).sum())} of {len(values)} samples"
            )
        rows.append(values)
    return np.stack(rows)


def compute_advantage(
    batch: Batch,
    adv_estimator: str = "gae",
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    gdpo_reward_keys: Sequence[str] = (),
    gdpo_reward_weights: Sequence[float] | None = None,
    **estimator_kwargs: Any,
) -> Batch:
    """Adds ``advantages`` and ``returns`` [B, R] with the estimator ``adv_estimator``.

    ``token_level_rewards`` is used when present, else ``token_level_scores`` (no in-reward
    KL). ``values``, ``reward_baselines``, the log-prob columns, ``sum_pi_squared`` and
    ``rollout_is_weights`` are passed when the batch has them; ``group_ids`` come from the
    ``uid`` non-tensor column; with ``gdpo_reward_keys``, an estimator that takes
    ``gdpo_scores`` gets the reward function's named values (`gdpo_scores`) and their
    ``gdpo_reward_weights``. Extra keyword arguments reach the estimator (those it does not
    take are ignored). A multi-turn batch's ``loss_mask`` is the estimator's ``response_mask``
    (as verl's agent loop's response mask: the model's own tokens), so GAE steps over tool
    tokens as if they were not there and whitening and baselines count the model's tokens."""
    columns: dict[str, Any] = {k: _host(batch, k) for k in _ESTIMATOR_COLUMNS if k in batch}
    if "loss_mask" in batch:
        columns["response_mask"] = _host(batch, "loss_mask")
    if "token_level_rewards" not in columns:
        columns["token_level_rewards"] = _host(batch, "token_level_scores")
    columns["token_level_rewards"] = columns["token_level_rewards"].astype(np.float32)
    if "values" in columns:
        columns["values"] = columns["values"].astype(np.float32)
    if "uid" in batch:
        columns["group_ids"] = group_ids_from_uid(batch["uid"])
    fn = get_adv_estimator_fn(adv_estimator)
    if gdpo_reward_keys and estimator_reads(adv_estimator, "gdpo_scores"):
        columns["gdpo_scores"] = gdpo_scores(batch, gdpo_reward_keys)
        columns["gdpo_reward_weights"] = gdpo_reward_weights
    advantages, returns = fn(
        **columns,
        gamma=np.float32(gamma),
        lam=np.float32(lam),
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        **estimator_kwargs,
    )
    return batch.update(
        tensors={
            "advantages": np.asarray(advantages, np.float32),
            "returns": np.asarray(returns, np.float32),
        }
    )


def batch_from_prompts(prompts: Any) -> Batch:
    """A prompt `Batch` (``prompt_ids``, ``prompt_mask``; ``data_source``, ``ground_truth``,
    ``extra_info``, ``raw_prompt``, ``index`` as non-tensors) from a `PromptBatch` or a
    mapping with the same fields."""
    get = (lambda k: prompts.get(k)) if isinstance(prompts, Mapping) else (lambda k: getattr(prompts, k, None))
    non_tensors = {
        k: get(k) for k in ("data_source", "ground_truth", "extra_info", "raw_prompt", "index") if get(k) is not None
    }
    return Batch.from_dict(
        {
            "prompt_ids": np.asarray(get("prompt_ids"), np.int32),
            "prompt_mask": np.asarray(get("prompt_mask"), np.int32),
        },
        non_tensors,
    )


def _masked_row_mean(x: np.ndarray, mask: np.ndarray) -> float:
    m = mask > 0
    return float(x[m].mean()) if m.any() else 0.0


def compute_data_metrics(batch: Batch) -> dict[str, float]:
    """verl's rollout statistics: ``critic/score/{mean,max,min}`` (per-sequence sums of
    ``token_level_scores``), ``critic/rewards/mean``, ``critic/advantages/mean``,
    ``critic/returns/mean``, ``critic/values/mean`` (token means over the response mask),
    ``response_length/{mean,max,min}``; with both the rollout's and the trainer's log-probs,
    their agreement (`rollout_agreement_metrics`). (The rule scorer's ``reward/...`` metrics come from
    the rollout, `jaxflow.iterations.steps.rollout`.)"""
    mask = _host(batch, "response_mask")
    out: dict[str, float] = {}
    if "token_level_scores" in batch:
        seq = (_host(batch, "token_level_scores") * (mask > 0)).sum(-1)
        out.update(
            {
                "critic/score/mean": float(seq.mean()),
                "critic/score/max": float(seq.max()),
                "critic/score/min": float(seq.min()),
            }
        )
    if "token_level_rewards" in batch:
        out["critic/rewards/mean"] = float((_host(batch, "token_level_rewards") * (mask > 0)).sum(-1).mean())
    for key in ("advantages", "returns", "values"):
        if key in batch:
            out[f"critic/{key}/mean"] = _masked_row_mean(_host(batch, key), mask)
    if "rollout_log_probs" in batch and "old_log_probs" in batch:
        out |= rollout_agreement_metrics(_host(batch, "old_log_probs"), _host(batch, "rollout_log_probs"), mask)
    lengths = (mask > 0).sum(-1)
    out.update(
        {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
        }
    )
    return out


def rollout_agreement_metrics(
    old_log_probs: np.ndarray, rollout_log_probs: np.ndarray, mask: np.ndarray
) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens (``old_log_probs``, ``lp_t``)
    are from the rollout engine's (``rollout_log_probs``, ``lp_r``), over the response
    tokens, in float64: verl's ``training/rollout_probs_diff_{max,mean,std}`` of
    ``|exp(lp_r) - exp(lp_t)|`` (std with Bessel's correction, as ``torch.std``), the same
    of the log-probs, ``training/rollout_log_probs_diff_{max,mean}`` of ``|lp_r - lp_t|``,
    and ``training/rollout_kl = mean(lp_r - lp_t)`` (verl's ``rollout_corr/kl``, the
    sampled tokens' estimate of ``KL(pi_rollout || pi_train)``)."""
    valid = np.asarray(mask) > 0
    lp_t = np.asarray(old_log_probs, np.float64)[valid]
    lp_r = np.asarray(rollout_log_probs, np.float64)[valid]
    if lp_t.size == 0:
        return {}
    probs_diff, log_probs_diff = np.abs(np.exp(lp_r) - np.exp(lp_t)), np.abs(lp_r - lp_t)
    return {
        "training/rollout_probs_diff_max": float(probs_diff.max()),
        "training/rollout_probs_diff_mean": float(probs_diff.mean()),
        "training/rollout_probs_diff_std": float(probs_diff.std(ddof=1)) if probs_diff.size > 1 else 0.0,
        "training/rollout_log_probs_diff_max": float(log_probs_diff.max()),
        "training/rollout_log_probs_diff_mean": float(log_probs_diff.mean()),
        "training/rollout_kl": float(np.mean(lp_r - lp_t)),
    }
