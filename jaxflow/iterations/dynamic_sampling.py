"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv 2503.14476, section 3.2), as verl's DAPO trainer runs it
(``algorithm.filter_groups``).

A prompt group whose ``n`` samples all score alike (all right, all wrong) gives every sample
a group-normalised advantage of 0: no gradient, only a smaller effective batch. Dynamic
sampling drops such groups and samples more prompt batches until ``B`` groups with signal
fill the training batch::

    kept, gen_batches = [], 0
    loop:
        gen_batches += 1
        batch = generate(prompts) (+ old / ref log-probs when the reward's KL needs them)
        batch = reward(batch), in-reward KL
        keep groups g with std(metric over g) > 0 or |g| == 1; kept += them
        if len(kept) >= B: break
        if 0 < max_num_gen_batches <= gen_batches: error (verl's)
        prompts = the next prompt batch
    batch = the first B kept groups (+ old / ref log-probs, values)

``metric`` per sample: ``seq_reward`` (sum of ``token_level_scores``), ``seq_final_reward``
(sum of ``token_level_rewards``) or a named value of the reward (``reward_extra/<name>``:
``acc``, or the reward function's own keys). Metrics: verl's recipe's
``train/num_gen_batches`` and verl's sampler's ``training/filter_groups/evicted_samples``
(groups dropped for want of signal) and ``training/filter_groups/discarded_surplus_samples``
(groups with signal beyond the training batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxflow.algos.settings import AlgorithmSettings
from jaxflow.data.batch import Batch
from jaxflow.iterations import steps
from jaxflow.iterations.batch_ops import group_ids_from_uid
from jaxflow.rewards import EXTRA_COLUMN_PREFIX
from jaxflow.workers.group import Workers

SUMMED_METRICS = {"seq_reward": "token_level_scores", "seq_final_reward": "token_level_rewards"}


def group_metric(batch: Batch, metric: str) -> np.ndarray:
    """Each sample's filter metric ``[B]`` float64 (see the module docstring); a named value
    the reward did not report is a `KeyError` listing those it did."""
    if metric in SUMMED_METRICS:
        column = np.asarray(jax.device_get(batch[SUMMED_METRICS[metric]]), np.float64)
        return column.sum(axis=-1)
    key = EXTRA_COLUMN_PREFIX + metric
    if key not in batch:
        named = sorted(k[len(EXTRA_COLUMN_PREFIX) :] for k in batch.keys() if k.startswith(EXTRA_COLUMN_PREFIX))
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: the reward reported no such value; it reported "
            f"{named or 'none'} besides seq_reward and seq_final_reward"
        )
    return np.asarray(batch[key], np.float64)


def kept_rows(uid: Sequence[Any], values: np.ndarray) -> np.ndarray:
    """``[B]`` bool: the samples of the groups (samples sharing a ``uid``) whose ``values``
    vary (population std > 0, as verl's ``np.std``) or that hold one sample."""
    groups = group_ids_from_uid(uid)
    kept = np.array([np.std(values[groups == g]) > 0 or np.sum(groups == g) == 1 for g in range(groups.max() + 1)])
    return kept[groups]


def merge_reward_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The rule scorer's ``reward/*`` metrics of several equal-sized generation batches: counts
    (``num_*``) add up, ``min`` / ``max`` take the extreme, means average."""
    out: dict[str, float] = {}
    for key in parts[0]:
        values = [p[key] for p in parts if key in p]
        leaf = key.rsplit("/", 1)[-1]
        if leaf.startswith("num_"):
            out[key] = float(np.sum(values))
        elif leaf in ("min", "max"):
            out[key] = float(np.min(values) if leaf == "min" else np.max(values))
        else:
            out[key] = float(np.mean(values))
    return out


def sample_groups(
    w: Workers,
    prompts: Batch,
    next_prompts: Callable[[], Batch],
    settings: AlgorithmSettings,
    kl_ctrl: Any,
    timer: steps.StepTimer,
    *,
    step: int | None = None,
    old_log_probs: bool = True,
) -> tuple[Batch, dict[str, float]]:
    """The training batch of ``len(prompts)`` prompt groups with signal (see the module
    docstring), scored as `steps.rollout` scores one: ``old_log_probs`` (when
    ``old_log_probs``, or in bypass mode the rollout's own), ``ref_log_prob``, ``values``,
    ``token_level_scores`` and ``token_level_rewards``. ``next_prompts`` gives the next
    prompt batch (of the same size); ``kl_ctrl`` the in-reward KL's controller (updated per
    generation batch, as verl). Returns the batch and the metrics: the rule scorer's
    ``reward/*`` over every generation batch, the in-reward KL's of the last one, and the
    counts of the module docstring."""
    algo = settings.algorithm
    fg, bypass = algo.filter_groups, algo.rollout_correction.bypass_mode
    target, n = len(prompts), None
    log_probs_first = algo.use_kl_in_reward  # the in-reward KL reads them before the filter
    parts, reward_metrics, kl = [], [], {}
    kept_groups = evicted = gen_batches = offset = 0
    while True:
        gen_batches += 1
        batch = steps.generate(w, prompts, timer, step=step, prompt_offset=offset)
        n = len(batch) // len(prompts)
        if log_probs_first:
            batch = steps.log_probs(w, batch, timer, old_log_probs=True, bypass_mode=bypass)
        batch, metrics = steps.reward(w, batch, timer)
        reward_metrics.append(metrics)
        batch, kl = steps.kl_in_reward(batch, algo, kl_ctrl)
        keep = kept_rows(batch["uid"], group_metric(batch, fg.metric))
        groups, kept = len(prompts), int(keep.sum()) // n
        kept_groups, evicted = kept_groups + kept, evicted + groups - kept
        parts.append(batch.to_host()[keep])
        if kept_groups >= target:
            break
        if 0 < fg.max_num_gen_batches <= gen_batches:
            raise ValueError(
                f"{gen_batches=} >= max_num_gen_batches={fg.max_num_gen_batches}: {kept_groups} of the {target} prompt "
                f"groups with signal ({fg.metric} varying across a group's samples) after {gen_batches} generation "
                "batches. Generated too many; the data may be too difficult (or too easy) for the policy. Raise "
                "algorithm.filter_groups.max_num_gen_batches (<= 0: no limit)"
            )
        offset += len(prompts)
        prompts = next_prompts()
    batch = Batch.concat(parts)[: target * n]
    if not log_probs_first:
        batch = steps.log_probs(w, batch, timer, old_log_probs=old_log_probs, bypass_mode=bypass)
    batch = steps.values(w, batch, timer)
    counts = {
        "train/num_gen_batches": float(gen_batches),
        "training/filter_groups/evicted_samples": float(evicted),
        "training/filter_groups/discarded_surplus_samples": float(kept_groups - target),
    }
    return batch, merge_reward_metrics(reward_metrics) | kl | counts
