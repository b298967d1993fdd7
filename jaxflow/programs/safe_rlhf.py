"""The Safe-RLHF program (Dai et al. 2023, arXiv:2310.12773; HybridFlow's third algorithm):
maximise reward subject to an expected-cost constraint, through a Lagrange multiplier.

::

    batch = rollout(w, prompts)                   # responses, old/ref log-probs, values, scores
    batch |= cost(batch)                          # token_level_cost: w.cost model or a rule
    A_R, R = estimator(token_level_rewards)       # reward advantages (KL-penalised rewards)
    A_C, C = estimator(token_level_cost)          # cost advantages, the same estimator
    advantages = (A_R - lambda A_C) / (1 + lambda)
    w.critic.update(batch); w.actor.update(batch)
    lambda <- max(0, lambda + eta (J_C - d))      # or on the log scale; J_C = mean episode cost

Symbols: ``lambda`` the multiplier (`AlgoState.lagrange_multiplier`, carried across
iterations), ``eta`` = ``lambda_lr``, ``d`` = ``cost_threshold``, ``J_C = mean_i sum_t
c_{i,t} m_{i,t}`` the batch's mean episode cost. The advantages of an iteration use the
multiplier *before* that iteration's update, which then sees the same batch's ``J_C``.

Costs, one per response on its last valid token (as scores):

* a cost model: ``w.cost`` (a `RewardModelWorker` with ``output_key="token_level_cost"``);
* else the rule ``cost_rule``: ``forbidden_chars`` -> 1 if the decoded response contains any
  of ``forbidden_chars`` else 0; ``length`` -> its number of response tokens (EOS included).
  The text is the rule scorer's ``response_text`` column (`RuleRewardWorker`: each
  response's valid tokens, decoded without special tokens).

Cost advantages use ``algorithm.adv_estimator`` on the costs (group estimators group by
``uid``). There is no cost critic among the worker groups: with ``gae`` the cost values are
0, so ``A_C`` is the (gamma lambda)-discounted cost-to-go. The in-reward KL penalty (verl's
``use_kl_in_reward``) applies to the reward only, so in the surrogate it weighs
``beta / (1 + lambda)``; the actor's KL loss (``use_kl_loss``) is unaffected by lambda.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxflow.algos.safe_rlhf import compute_episode_cost, compute_lagrangian_advantages
from jaxflow.algos.settings import AlgorithmConfig, AlgorithmSettings, SafeRLHFConfig
from jaxflow.data.batch import Batch
from jaxflow.programs import steps
from jaxflow.programs.batch_ops import compute_advantage, compute_data_metrics
from jaxflow.programs.state import AlgoState
from jaxflow.rewards import token_level_scores
from jaxflow.workers.group import Workers

COST_RULES = ("forbidden_chars", "length")


def rule_costs(
    rule: str, response_mask: np.ndarray, texts: Sequence[str] | None = None, forbidden_chars: str = ""
) -> np.ndarray:
    """Sequence costs ``[B]`` float32 of the rule ``rule`` (see the module docstring).

    ``texts`` are the decoded responses (valid tokens only, special tokens skipped); needed
    by ``forbidden_chars``."""
    mask = np.asarray(response_mask) > 0
    if rule == "length":
        return mask.sum(-1).astype(np.float32)
    if rule == "forbidden_chars":
        if texts is None:
            raise ValueError("cost_rule 'forbidden_chars' needs the decoded responses")
        if len(texts) != mask.shape[0]:
            raise ValueError(f"{len(texts)} texts for {mask.shape[0]} responses")
        chars = set(forbidden_chars)
        return np.asarray([float(any(c in chars for c in t)) for t in texts], np.float32)
    raise ValueError(f"unknown cost_rule {rule!r}; valid: {', '.join(COST_RULES)}")


def _response_texts(batch: Batch) -> list[str]:
    if "response_text" not in batch:
        raise ValueError(
            "cost_rule 'forbidden_chars' reads the decoded responses (response_text) that a rule "
            "scorer in w.reward provides; this reward gave none"
        )
    return [str(t) for t in batch["response_text"]]


def compute_costs(w: Workers, batch: Batch, settings: SafeRLHFConfig) -> Batch:
    """``token_level_cost`` [B, R]: from the cost model ``w.cost`` when there is one, else from
    ``settings.cost_rule`` on the host."""
    if w.cost is not None:
        return steps.ready(w.cost.scores(batch)).select(["token_level_cost"], [], [])
    if settings.cost_model_path:
        raise ValueError(
            f"jaxflow.safe_rlhf.cost_model_path={settings.cost_model_path!r} but the workers have no "
            "cost model group (w.cost)"
        )
    mask = np.asarray(jax.device_get(batch["response_mask"]))
    texts = _response_texts(batch) if settings.cost_rule == "forbidden_chars" else None
    costs_B = rule_costs(settings.cost_rule, mask, texts, settings.forbidden_chars)
    return Batch.from_dict({"token_level_cost": token_level_scores(costs_B, mask)})


def compute_cost_advantages(batch: Batch, algo: AlgorithmConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(cost_advantages, cost_returns)`` [B, R]: ``algo.adv_estimator`` on
    ``token_level_cost`` (group ids from ``uid``; zero values for ``gae``)."""
    mask = np.asarray(jax.device_get(batch["response_mask"]))
    tensors = {
        "token_level_rewards": np.asarray(jax.device_get(batch["token_level_cost"]), np.float32),
        "response_mask": mask,
    }
    for key in ("old_log_probs", "ref_log_prob"):
        if key in batch:
            tensors[key] = batch[key]
    if algo.adv_estimator == "gae":
        tensors["values"] = np.zeros(mask.shape, np.float32)
    non_tensors = {"uid": batch["uid"]} if "uid" in batch else {}
    out = compute_advantage(
        Batch.from_dict(tensors, non_tensors),
        algo.adv_estimator,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
    )
    return np.asarray(out["advantages"]), np.asarray(out["returns"])


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    m = mask > 0
    return float(x[m].mean()) if m.any() else 0.0


def safe_rlhf_iteration(
    w: Workers,
    prompts: Batch,
    settings: AlgorithmSettings,
    state: AlgoState,
    *,
    step: int | None = None,
    update_actor: bool = True,
) -> dict[str, float]:
    """One Safe-RLHF iteration (see the module docstring); moves ``state``'s multiplier (and
    KL coefficient). Metrics: the shared program's, plus ``safe_rlhf/episode_cost`` (J_C),
    ``safe_rlhf/cost_violation`` (J_C - d), ``safe_rlhf/lambda`` (used for this batch),
    ``safe_rlhf/lambda_next`` (after the update), ``safe_rlhf/reward_advantages/mean``,
    ``safe_rlhf/cost_advantages/mean``, ``safe_rlhf/cost/{max,min}``, ``timing_s/cost``."""
    algo, safe = settings.algorithm, settings.safe_rlhf
    if algo.adv_estimator == "remax":
        raise ValueError("safe_rlhf does not support adv_estimator='remax' (no greedy cost baseline)")
    kl_ctrl = state.kl_controller(algo)
    multiplier = state.lagrange(safe)
    timer = steps.StepTimer()
    batch, metrics = steps.rollout(w, prompts, timer, step=step, bypass_mode=algo.rollout_correction.bypass_mode)
    with timer("cost"):
        batch |= compute_costs(w, batch, safe)
    batch, kl = steps.kl_in_reward(batch, algo, kl_ctrl)
    metrics |= kl
    batch = steps.advantages(batch, algo, timer)
    lam = multiplier.value
    with timer("adv"):
        cost_adv, cost_ret = compute_cost_advantages(batch, algo)
        reward_adv = np.asarray(batch["advantages"])
        adv = np.asarray(compute_lagrangian_advantages(reward_adv, cost_adv, np.float32(lam)), np.float32)
        batch = batch.update(
            tensors={
                "reward_advantages": reward_adv,
                "cost_advantages": cost_adv,
                "cost_returns": cost_ret,
                "advantages": adv,
            }
        )
    metrics |= steps.update(w, batch, timer, step=step, update_actor=update_actor)
    mask = np.asarray(jax.device_get(batch["response_mask"]))
    cost_BxR = np.asarray(jax.device_get(batch["token_level_cost"]), np.float32)
    costs_B = (cost_BxR * (mask > 0)).sum(-1)
    episode_cost = float(compute_episode_cost(cost_BxR, mask))
    multiplier.update(episode_cost)
    state.store(kl_ctrl=kl_ctrl, multiplier=multiplier)
    metrics |= {
        "safe_rlhf/episode_cost": episode_cost,
        "safe_rlhf/cost_violation": episode_cost - float(safe.cost_threshold),
        "safe_rlhf/lambda": float(lam),
        "safe_rlhf/lambda_next": float(multiplier.value),
        "safe_rlhf/reward_advantages/mean": _masked_mean(reward_adv, mask),
        "safe_rlhf/cost_advantages/mean": _masked_mean(cost_adv, mask),
        "safe_rlhf/cost/max": float(costs_B.max()),
        "safe_rlhf/cost/min": float(costs_B.min()),
    }
    return metrics | compute_data_metrics(batch) | timer.metrics()
