"""One PPO iteration as a short program over worker groups (DESIGN.md's target user code).

::

    batch = w.actor.generate(prompts)                          # rollout, generation layout
    batch |= w.actor.log_probs(batch) | w.ref.log_probs(batch) | w.critic.values(batch)
    batch |= w.reward(batch)                                   # reward model and/or rules
    batch, kl = apply_kl_penalty_to_batch(batch, beta, kind)   # if use_kl_in_reward
    batch = compute_advantage(batch, adv_estimator, ...)       # gae / grpo / rloo / ...
    return w.critic.update(batch) | w.actor.update(batch)      # metrics

The same program runs PPO (``adv_estimator="gae"`` with a critic), GRPO / RLOO /
REINFORCE++ (an outcome estimator, no critic: ``w.critic`` is None), with or without a
reference (needed for the in-reward KL penalty or the actor's KL loss). Everything else
(placement, meshes, sharding, transfers between pools) is the worker groups' business.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from jaxflow.algos import steps
from jaxflow.algos.advantages import get_advantage_estimator
from jaxflow.algos.batch_ops import compute_data_metrics
from jaxflow.algos.kl import AdaptiveKLController, FixedKLController, get_kl_controller
from jaxflow.data.batch import Batch


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
    """verl's ``algorithm.kl_ctrl``: the in-reward KL coefficient's controller
    (`jaxflow.algos.get_kl_controller`): ``fixed`` or ``adaptive`` (towards ``target_kl``
    over ``horizon`` responses)."""

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: float = 10000.0
    target_kl: float = 0.1


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """verl's ``algorithm`` section (an ml_collections ``cfg.algorithm`` with the same fields
    works as well).

    Attributes:
      adv_estimator: a registered advantage estimator (``gae``, ``grpo``, ``rloo``, ...).
      gamma, lam: discount and GAE lambda.
      norm_adv_by_std_in_grpo: GRPO's std normalisation (False: Dr.GRPO).
      use_kl_in_reward: subtract ``beta * kl(old_log_probs, ref_log_prob)`` from the scores.
      kl_penalty: the KL estimator of that penalty (``kl``, ``abs``, ``mse``, ``low_var_kl``).
      kl_ctrl: its coefficient's controller.
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = KLControlConfig()


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """What `ppo_iteration` reads (the rest of an experiment config configures the workers)."""

    algorithm: AlgorithmConfig = AlgorithmConfig()
    balance_batch: bool = False


def ppo_iteration(w: Any, prompts: Batch, cfg: Any,
                  kl_ctrl: FixedKLController | AdaptiveKLController | None = None) -> dict[str, float]:
    """One rollout + update over the worker groups ``w`` (`jaxflow.workers.Workers`).

    ``prompts``: a prompt `Batch` (``prompt_ids``/``prompt_mask`` left-padded, plus the
    reward's host columns). ``cfg.algorithm``: an `AlgorithmConfig` (or any object with its
    fields). ``kl_ctrl``: the in-reward KL controller, kept by the caller across iterations
    (default: a new one from ``cfg.algorithm.kl_ctrl``, i.e. no adaptation carried over).
    Returns the iteration's metrics, with each step's wall-clock seconds (``timing_s/*``,
    `jaxflow.algos.steps`). The registered programs (`jaxflow.algos.programs`: ``ppo``,
    ``grpo``, ``rloo``, ``reinforce_pp``) are this function with an `AlgoState`.
    """
    algo = cfg.algorithm
    if algo.use_kl_in_reward and kl_ctrl is None:
        kl_ctrl = get_kl_controller(algo.kl_ctrl)
    timer = steps.StepTimer()
    # gen, old_log_prob (only when the advantages need it: the update gets it itself), ref, values, reward
    batch = steps.rollout(w, prompts, timer, old_log_probs=needs_old_log_probs(algo),
                          balance=balance_enabled(cfg))
    batch, metrics = steps.kl_in_reward(batch, algo, kl_ctrl)
    batch = steps.advantages(batch, algo, timer)
    metrics |= steps.update(w, batch, timer)
    metrics |= batch.meta.get("balance_metrics", {})
    return metrics | compute_data_metrics(batch) | timer.metrics()


def needs_old_log_probs(algo: Any) -> bool:
    """Whether the rollout must score ``old_log_probs`` before the advantages: for the
    in-reward KL penalty, or an estimator that reads them. Otherwise the actor's update
    takes them from its own forward (on-policy) or computes them itself."""
    estimator = get_advantage_estimator(algo.adv_estimator)
    return bool(algo.use_kl_in_reward) or "old_log_probs" in inspect.signature(estimator).parameters


def balance_enabled(cfg: Any) -> bool:
    """verl's ``trainer.balance_batch`` (an experiment config) or `PPOConfig.balance_batch`."""
    trainer = getattr(cfg, "trainer", None)
    return bool(getattr(cfg, "balance_batch", False) or getattr(trainer, "balance_batch", False))
