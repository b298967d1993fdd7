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

import inspect

from jaxflow.algos.advantages import get_adv_estimator_fn
from jaxflow.algos.kl import get_kl_controller
from jaxflow.algos.settings import AlgorithmConfig, AlgorithmSettings
from jaxflow.data.batch import Batch
from jaxflow.programs import steps
from jaxflow.programs.batch_ops import compute_data_metrics
from jaxflow.programs.steps import KLController
from jaxflow.workers.group import Workers


def ppo_iteration(
    w: Workers,
    prompts: Batch,
    settings: AlgorithmSettings,
    kl_ctrl: KLController | None = None,
    *,
    step: int | None = None,
    update_actor: bool = True,
) -> dict[str, float]:
    """One rollout + update over the worker groups ``w`` (`jaxflow.workers.Workers`).

    ``prompts``: a prompt `Batch` (``prompt_ids``/``prompt_mask`` left-padded, plus the
    reward's host columns). ``settings.algorithm``: the estimator and the in-reward KL.
    ``step``: the training step (seeds the rollout and the mini-batch shuffle, so a resumed
    run repeats the uninterrupted one; None: the workers count calls). ``update_actor``:
    False during verl's ``trainer.critic_warmup`` steps. ``kl_ctrl``: the in-reward KL controller, kept by the caller across iterations
    (default: a new one from ``cfg.algorithm.kl_ctrl``, i.e. no adaptation carried over).
    Returns the iteration's metrics, with each step's wall-clock seconds (``timing_s/*``,
    `jaxflow.programs.steps`). The registered programs (`jaxflow.programs.registry`: ``ppo``,
    ``grpo``, ``rloo``, ``reinforce_pp``) are this function with an `AlgoState`.
    """
    algo = settings.algorithm
    if algo.use_kl_in_reward and kl_ctrl is None:
        kl_ctrl = get_kl_controller(algo.kl_ctrl)
    timer = steps.StepTimer()
    # gen, old_log_prob (only when the advantages need it: the update gets it itself), ref, values, reward
    batch, metrics = steps.rollout(
        w,
        prompts,
        timer,
        step=step,
        old_log_probs=needs_old_log_probs(algo),
        bypass_mode=algo.rollout_correction.bypass_mode,
    )
    batch, kl = steps.kl_in_reward(batch, algo, kl_ctrl)
    batch = steps.advantages(batch, algo, timer)
    metrics |= kl | steps.update(w, batch, timer, step=step, update_actor=update_actor)
    return metrics | compute_data_metrics(batch) | timer.metrics()


def needs_old_log_probs(algo: AlgorithmConfig) -> bool:
    """Whether the rollout must score ``old_log_probs`` before the advantages: for the
    in-reward KL penalty, or an estimator that reads them. Otherwise the actor's update
    takes them from its own forward (on-policy) or computes them itself."""
    estimator = get_adv_estimator_fn(algo.adv_estimator)
    return bool(algo.use_kl_in_reward) or "old_log_probs" in inspect.signature(estimator).parameters
