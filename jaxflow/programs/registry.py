"""Algorithm programs by name: one uniform signature, a registry, and the choice from a config.

A program is one training iteration over the worker groups::

    fn(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: AlgoState, *,
       step: int | None = None, update_actor: bool = True) -> dict[str, float]   # metrics

``settings`` is the algorithm's typed settings (`jaxflow.algos.AlgorithmSettings`: verl's
``algorithm`` section and ``jaxflow.safe_rlhf``); ``step`` the training step (seeds the
rollout and the shuffle); ``update_actor`` False during ``trainer.critic_warmup``. ``state`` is what an algorithm carries from one iteration to the
next (the in-reward KL coefficient, Safe-RLHF's Lagrange multiplier); the trainer keeps it
and checkpoints ``state.state_dict()``.

=================  ===================================================================
``ppo``            `ppo_iteration`: any estimator, with a critic for ``gae``
``grpo``           the same program, group-normalised outcome advantages
``rloo``           the same program, leave-one-out outcome baseline
``reinforce_pp``   the same program, REINFORCE++ (whitened returns / group baseline)
``remax``          `jaxflow.programs.remax`: greedy-response baseline
``safe_rlhf``      `jaxflow.programs.safe_rlhf`: reward under a cost constraint
=================  ===================================================================

As in verl, GRPO / RLOO / REINFORCE++ differ from PPO only by the advantage estimator (and
by running without a critic: the workers built for them have none); the reference policy is
used when present (in-reward KL penalty or the actor's KL loss). `select_algorithm` maps a
config to a name; `register_algorithm` adds programs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxflow.algos.advantages import ADV_ESTIMATOR_REGISTRY
from jaxflow.algos.registry import Registry, UnknownNameError
from jaxflow.algos.settings import AlgorithmSettings
from jaxflow.data.batch import Batch
from jaxflow.programs.ppo import needs_old_log_probs, ppo_iteration
from jaxflow.programs.remax import remax_iteration
from jaxflow.programs.safe_rlhf import safe_rlhf_iteration
from jaxflow.programs.state import AlgoState
from jaxflow.workers.group import Workers

Program = Callable[..., dict[str, float]]

ALGORITHM_REGISTRY = Registry("algorithm")

# adv_estimator -> program (select_algorithm); other registered estimators run in "ppo".
ESTIMATOR_PROGRAMS: dict[str, str] = {
    "gae": "ppo",
    "grpo": "grpo",
    "grpo_vectorized": "grpo",
    "grpo_passk": "grpo",
    "gpg": "grpo",
    "opo": "grpo",
    "rloo": "rloo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp",
    "remax": "remax",
}


def register_algorithm(name: str, *, override: bool = False) -> Callable[[Program], Program]:
    """Decorator registering ``fn(w, prompts, settings, state, *, step, update_actor) -> metrics``
    as program ``name``."""
    return ALGORITHM_REGISTRY.register(name, override=override)


def get_algorithm(name: str) -> Program:
    """The program ``name``; `UnknownNameError` (listing the names) for an unknown one."""
    return ALGORITHM_REGISTRY.get(name)


def algorithm_names() -> list[str]:
    return ALGORITHM_REGISTRY.names()


def select_algorithm(settings: AlgorithmSettings) -> str:
    """The program of ``settings``: ``safe_rlhf`` when ``safe_rlhf.enable``, else by
    ``algorithm.adv_estimator`` (`ESTIMATOR_PROGRAMS`; another registered estimator: ``ppo``,
    the general program)."""
    if settings.safe_rlhf.enable:
        return "safe_rlhf"
    estimator = settings.algorithm.adv_estimator
    if estimator in ESTIMATOR_PROGRAMS:
        return ESTIMATOR_PROGRAMS[estimator]
    if estimator in ADV_ESTIMATOR_REGISTRY:
        return "ppo"
    raise UnknownNameError(
        f"unknown advantage estimator {estimator!r}; valid names: {', '.join(ADV_ESTIMATOR_REGISTRY.names())}"
    )


def rollout_scores_old_log_probs(settings: AlgorithmSettings) -> bool:
    """Whether the program of ``settings`` (`select_algorithm`) scores ``old_log_probs`` in
    its rollout: the PPO family only when its advantages or in-reward KL read them
    (`needs_old_log_probs`), ReMax and Safe-RLHF always, every program in bypass mode (they
    are the rollout's log-probs). Otherwise the actor's update takes them from its own forward
    when it is on-policy (`jaxflow.workers.ActorConfig.is_on_policy`) or computes them itself.
    Planners read this to lower the train step the run calls."""
    algo = settings.algorithm
    return (
        select_algorithm(settings) in ("remax", "safe_rlhf")
        or needs_old_log_probs(algo)
        or algo.rollout_correction.bypass_mode
    )


def _shared(
    name: str, w: Workers, prompts: Batch, settings: AlgorithmSettings, state: AlgoState, **kwargs: Any
) -> dict[str, float]:
    algo = settings.algorithm
    wanted = ESTIMATOR_PROGRAMS.get(algo.adv_estimator, "ppo")
    if (name != "ppo" and wanted != name) or wanted == "remax":
        raise ValueError(
            f"program {name!r} does not run adv_estimator={algo.adv_estimator!r} (select_algorithm gives {wanted!r})"
        )
    kl_ctrl = state.kl_controller(algo)
    metrics = ppo_iteration(w, prompts, settings, kl_ctrl, **kwargs)
    state.store(kl_ctrl=kl_ctrl)
    return metrics


@register_algorithm("ppo")
def ppo(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: AlgoState, **kwargs: Any) -> dict[str, float]:
    """PPO (Schulman et al. 2017; RLHF as in Ouyang et al. 2022) with GAE:
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = sum_k (gamma lam)^k delta_{t+k}``,
    ``returns = A + V``; the critic regresses ``returns``, the actor minimises the clipped
    surrogate. Also the general program for any registered estimator."""
    return _shared("ppo", w, prompts, settings, state, **kwargs)


@register_algorithm("grpo")
def grpo(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: AlgoState, **kwargs: Any) -> dict[str, float]:
    """GRPO (Shao et al. 2024, DeepSeekMath): per prompt group ``g`` of ``n`` samples,
    ``A_i = (s_i - mean_g s) / (std_g s + eps)`` on every token (``norm_adv_by_std_in_grpo``
    False: Dr.GRPO, no division); no critic. Also ``grpo_passk``, ``gpg``, ``opo``."""
    return _shared("grpo", w, prompts, settings, state, **kwargs)


@register_algorithm("rloo")
def rloo(w: Workers, prompts: Batch, settings: AlgorithmSettings, state: AlgoState, **kwargs: Any) -> dict[str, float]:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline,
    ``A_i = s_i - (1 / (n - 1)) sum_{j != i} s_j`` within the prompt's group; no critic."""
    return _shared("rloo", w, prompts, settings, state, **kwargs)


@register_algorithm("reinforce_pp")
def reinforce_pp(
    w: Workers, prompts: Batch, settings: AlgorithmSettings, state: AlgoState, **kwargs: Any
) -> dict[str, float]:
    """REINFORCE++ (Hu 2025): discounted returns ``G_t = sum_k gamma^k r_{t+k}`` whitened over
    the batch (``reinforce_plus_plus``), or the group-mean-subtracted score whitened over the
    batch (``reinforce_plus_plus_baseline``); no critic."""
    return _shared("reinforce_pp", w, prompts, settings, state, **kwargs)


register_algorithm("remax")(remax_iteration)
register_algorithm("safe_rlhf")(safe_rlhf_iteration)
