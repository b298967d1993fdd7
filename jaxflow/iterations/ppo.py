"""One PPO iteration as a short function over worker groups (DESIGN.md's target user code), and
the algorithms that run it: ``ppo``, ``grpo``, ``rloo``, ``reinforce_pp``.

::

    batch = w.actor.generate(prompts)                          # rollout, generation layout
    batch |= w.actor.log_probs(batch) | w.ref.log_probs(batch) | w.critic.values(batch)
    batch |= w.reward(batch)                                   # reward model and/or rules
    batch, kl = apply_kl_penalty_to_batch(batch, beta, kind)   # if use_kl_in_reward
    batch = compute_advantage(batch, adv_estimator, ...)       # gae / grpo / rloo / ...
    return w.critic.update(batch) | w.actor.update(batch)      # metrics

The same iteration runs PPO (``adv_estimator="gae"`` with a critic), GRPO / RLOO /
REINFORCE++ (an outcome estimator, no critic: ``w.critic`` is None), with or without a
reference (needed for the in-reward KL penalty or the actor's KL loss). Everything else
(placement, meshes, sharding, transfers between pools) is the worker groups' business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxflow.algos.kl import get_kl_controller
from jaxflow.algos.settings import AlgorithmConfig, AlgorithmSettings
from jaxflow.data.batch import Batch
from jaxflow.iterations import dynamic_sampling, steps
from jaxflow.iterations.batch_ops import compute_data_metrics, estimator_reads
from jaxflow.iterations.registry import GENERAL, estimator_algorithm, register_algorithm
from jaxflow.iterations.state import KLState
from jaxflow.iterations.steps import KLController
from jaxflow.workers.group import Workers

PPO_FAMILY = ("ppo", "grpo", "rloo", "reinforce_pp")  # registered below, each running ppo_iteration


def ppo_iteration(
    w: Workers,
    prompts: Batch,
    settings: AlgorithmSettings,
    kl_ctrl: KLController | None = None,
    *,
    step: int | None = None,
    update_actor: bool = True,
    next_prompts: Callable[[], Batch] | None = None,
) -> dict[str, float]:
    """One rollout + update over the worker groups ``w`` (`jaxflow.workers.Workers`).

    ``prompts``: a prompt `Batch` (``prompt_ids``/``prompt_mask`` left-padded, plus the
    reward's host columns). ``settings.algorithm``: the estimator and the in-reward KL.
    ``step``: the training step (seeds the rollout and the mini-batch shuffle, so a resumed
    run repeats the uninterrupted one; None: the workers count calls). ``update_actor``:
    False during verl's ``trainer.critic_warmup`` steps. ``kl_ctrl``: the in-reward KL
    controller, kept by the caller across iterations (default: a new one from
    ``settings.algorithm.kl_ctrl``, i.e. no adaptation carried over). ``next_prompts``:
    the next prompt batch, for DAPO's dynamic sampling (``settings.algorithm.filter_groups``,
    `jaxflow.iterations.dynamic_sampling`: generation batches until the training batch holds
    ``len(prompts)`` groups with signal). Returns the
    iteration's metrics, with each step's wall-clock seconds (``timing_s/*``,
    `jaxflow.iterations.steps`). The registered algorithms ``ppo``, ``grpo``, ``rloo`` and
    ``reinforce_pp`` are this function with a `KLState`.
    """
    algo = settings.algorithm
    if algo.use_kl_in_reward and kl_ctrl is None:
        kl_ctrl = get_kl_controller(algo.kl_ctrl)
    timer = steps.StepTimer()
    if algo.filter_groups.enable:
        if next_prompts is None:
            raise ValueError("algorithm.filter_groups needs next_prompts (the next prompt batch)")
        batch, metrics = dynamic_sampling.sample_groups(
            w, prompts, next_prompts, settings, kl_ctrl, timer, step=step, old_log_probs=_scores_old_log_probs(settings)
        )
        kl = {}
    else:
        # gen, old_log_prob (only when the advantages need it: the update gets it itself), ref, values, reward
        batch, metrics = steps.rollout(
            w,
            prompts,
            timer,
            step=step,
            old_log_probs=_scores_old_log_probs(settings),
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
    return bool(algo.use_kl_in_reward) or estimator_reads(algo.adv_estimator, "old_log_probs")


def _scores_old_log_probs(settings: AlgorithmSettings) -> bool:
    """`needs_old_log_probs`, or always in the agreement mode (``settings.rollout_agreement``)."""
    return settings.rollout_agreement or needs_old_log_probs(settings.algorithm)


def _shared(
    name: str, w: Workers, prompts: Batch, settings: AlgorithmSettings, state: KLState, **kwargs: Any
) -> dict[str, float]:
    """`ppo_iteration` as algorithm ``name``, which runs its own estimators (``ppo``: also any
    estimator the other algorithms of this family list, the general one)."""
    algo = settings.algorithm
    wanted = estimator_algorithm(algo.adv_estimator).name
    if wanted not in PPO_FAMILY or (name != GENERAL and wanted != name):
        raise ValueError(
            f"algorithm {name!r} does not run adv_estimator={algo.adv_estimator!r} (its algorithm is {wanted!r})"
        )
    kl_ctrl = state.kl_controller(algo)
    metrics = ppo_iteration(w, prompts, settings, kl_ctrl, **kwargs)
    state.store(kl_ctrl=kl_ctrl)
    return metrics


def _family(**options: Any):
    """`register_algorithm` for an algorithm running `ppo_iteration`."""
    return register_algorithm(
        scores_old_log_probs=_scores_old_log_probs, state=KLState, dynamic_sampling=True, **options
    )


@_family(name="ppo", estimators=("gae",))
def ppo(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: KLState, **kwargs: Any) -> dict[str, float]:
    """PPO (Schulman et al. 2017; RLHF as in Ouyang et al. 2022) with GAE:
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = sum_k (gamma lam)^k delta_{t+k}``,
    ``returns = A + V``; the critic regresses ``returns``, the actor minimises the clipped
    surrogate. Also the general algorithm for any registered estimator."""
    return _shared("ppo", w, prompts, settings, state, **kwargs)


@_family(name="grpo", estimators=("grpo", "grpo_vectorized", "grpo_passk", "gpg", "opo"))
def grpo(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: KLState, **kwargs: Any) -> dict[str, float]:
    """GRPO (Shao et al. 2024, DeepSeekMath): per prompt group ``g`` of ``n`` samples,
    ``A_i = (s_i - mean_g s) / (std_g s + eps)`` on every token (``norm_adv_by_std_in_grpo``
    False: Dr.GRPO, no division); no critic. Also ``grpo_passk``, ``gpg``, ``opo``."""
    return _shared("grpo", w, prompts, settings, state, **kwargs)


@_family(name="rloo", estimators=("rloo", "rloo_vectorized"))
def rloo(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: KLState, **kwargs: Any) -> dict[str, float]:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline,
    ``A_i = s_i - (1 / (n - 1)) sum_{j != i} s_j`` within the prompt's group; no critic."""
    return _shared("rloo", w, prompts, settings, state, **kwargs)


@_family(name="reinforce_pp", estimators=("reinforce_plus_plus", "reinforce_plus_plus_baseline"))
def reinforce_pp(
    w: Workers, prompts: Batch, settings: AlgorithmSettings, state: KLState, **kwargs: Any
) -> dict[str, float]:
    """REINFORCE++ (Hu 2025): discounted returns ``G_t = sum_k gamma^k r_{t+k}`` whitened over
    the batch (``reinforce_plus_plus``), or the group-mean-subtracted score whitened over the
    batch (``reinforce_plus_plus_baseline``); no critic."""
    return _shared("reinforce_pp", w, prompts, settings, state, **kwargs)
