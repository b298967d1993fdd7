"""Algorithms by name: each one a record (`Algorithm`) of its iteration and of what the trainer,
the dry run and the auto-mapper need to know about it.

An iteration is one training step over the worker groups::

    fn(w: Workers, prompts: Batch, settings: AlgorithmSettings, state, *,
       step: int | None = None, update_actor: bool = True) -> dict[str, float]   # metrics

``settings`` is the algorithm's typed settings (`jaxflow.algos.AlgorithmSettings`: verl's
``algorithm`` section and ``jaxflow.safe_rlhf``); ``step`` the training step (seeds the
rollout and the shuffle); ``update_actor`` False during ``trainer.critic_warmup``; ``state``
what the algorithm carries from one iteration to the next (its `AlgoState` subclass), which
the trainer makes with ``algorithm.state.initial(settings)`` and checkpoints.

Adding an algorithm is one decorated function in one file::

    @register_algorithm("my_algo", estimators=("my_estimator",), uses_critic=False,
                        scores_old_log_probs=True, extra_rollouts=("greedy",), state=MyState)
    def my_algo(w, prompts, settings, state, *, step=None, update_actor=True): ...

=================  ===================================================================
``ppo``            `jaxflow.iterations.ppo`: GAE with a critic; any unclaimed estimator
``grpo``           the same iteration, group-normalised outcome advantages
``rloo``           the same iteration, leave-one-out outcome baseline
``reinforce_pp``   the same iteration, REINFORCE++ (whitened returns / group baseline)
``remax``          `jaxflow.iterations.remax`: greedy-response baseline
``safe_rlhf``      `jaxflow.iterations.safe_rlhf`: reward under a cost constraint
=================  ===================================================================

`select_algorithm` picks one from the settings: an algorithm whose ``enabled_by`` switch is
on (Safe-RLHF: ``jaxflow.safe_rlhf.enable``), else the one listing ``algorithm.adv_estimator``
among its ``estimators``, else ``ppo`` for any other registered estimator. As in verl,
GRPO / RLOO / REINFORCE++ differ from PPO only by the estimator (and by running without a
critic); the reference policy is used when present.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxflow.algos.advantages import ADV_ESTIMATOR_REGISTRY
from jaxflow.algos.registry import Registry, UnknownNameError
from jaxflow.algos.settings import AlgorithmSettings
from jaxflow.iterations.batch_ops import estimator_reads
from jaxflow.iterations.state import AlgoState

Iteration = Callable[..., dict[str, float]]
SettingsFlag = Callable[[AlgorithmSettings], bool]
GENERAL = "ppo"  # the algorithm of a registered estimator that no algorithm lists

ALGORITHM_REGISTRY = Registry("algorithm")


def estimator_reads_values(settings: AlgorithmSettings) -> bool:
    """Whether ``algorithm.adv_estimator`` reads the critic's ``values`` (GAE does)."""
    return estimator_reads(settings.algorithm.adv_estimator, "values")


def _always(value: bool, settings: AlgorithmSettings) -> bool:
    del settings
    return value


def _flag(value: bool | SettingsFlag) -> SettingsFlag:
    return value if callable(value) else functools.partial(_always, bool(value))


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered algorithm; calling it runs its iteration.

    Attributes:
      name: its name (`get_algorithm`).
      iteration: ``fn(w, prompts, settings, state, *, step, update_actor) -> metrics``.
      estimators: the advantage estimators (``algorithm.adv_estimator``) that select it.
      enabled_by: a switch of the settings that selects it whatever the estimator
        (Safe-RLHF: ``safe_rlhf.enable``); None: selected by its estimators only.
      uses_critic: ``fn(settings) -> bool``: its iteration trains a critic and reads its
        ``values``; the run must then have one (`check_roles`).
      scores_old_log_probs: ``fn(settings) -> bool``: its rollout scores ``old_log_probs``
        before the update (in bypass mode every rollout carries them:
        `rollout_scores_old_log_probs`); otherwise the actor's update takes them from its own forward when
        it is on-policy (`jaxflow.workers.ActorConfig.is_on_policy`). Planners read this to
        lower the train step the run calls.
      extra_rollouts: the sampling modes (`jaxflow.workers.RolloutConfig.resolve`) of the
        actor's rollouts besides the training one, one each per iteration (ReMax:
        ``("greedy",)``, one response per prompt); the dry run compiles them as
        ``actor/generate_<mode>``, the auto-mapper schedules them.
      state: the `AlgoState` subclass it carries across iterations.
      dynamic_sampling: its iteration takes ``next_prompts`` (``() -> Batch``, the next prompt
        batch) and with ``algorithm.filter_groups`` samples from more prompt batches until
        the training batch is full (DAPO's dynamic sampling); the trainer passes it then.
    """

    name: str
    iteration: Iteration
    estimators: tuple[str, ...] = ()
    enabled_by: SettingsFlag | None = None
    uses_critic: SettingsFlag = estimator_reads_values
    scores_old_log_probs: SettingsFlag = functools.partial(_always, True)
    extra_rollouts: tuple[str, ...] = ()
    state: type[AlgoState] = AlgoState
    dynamic_sampling: bool = False

    def __call__(self, w: Any, prompts: Any, settings: AlgorithmSettings, state: AlgoState, **kwargs: Any):
        return self.iteration(w, prompts, settings, state, **kwargs)

    def check_roles(self, settings: AlgorithmSettings, roles: Sequence[str]) -> None:
        """Raises ``ValueError`` when the run's ``roles`` lack what the algorithm runs on."""
        if self.uses_critic(settings) and "critic" not in roles:
            raise ValueError(
                f"algorithm {self.name!r} (adv_estimator={settings.algorithm.adv_estimator!r}) trains a critic, "
                "but the run has none; set critic.enable=true"
            )


def register_algorithm(
    name: str,
    *,
    estimators: Sequence[str] = (),
    enabled_by: SettingsFlag | None = None,
    uses_critic: bool | SettingsFlag = estimator_reads_values,
    scores_old_log_probs: bool | SettingsFlag = True,
    extra_rollouts: Sequence[str] = (),
    state: type[AlgoState] = AlgoState,
    dynamic_sampling: bool = False,
    override: bool = False,
) -> Callable[[Iteration], Algorithm]:
    """Decorator registering an iteration as the `Algorithm` ``name`` (see its attributes;
    the flags may be constants or functions of the settings); returns the record. An
    estimator that another algorithm lists is an error unless ``override``."""

    def decorator(fn: Iteration) -> Algorithm:
        record = Algorithm(
            name,
            fn,
            tuple(estimators),
            enabled_by,
            _flag(uses_critic),
            _flag(scores_old_log_probs),
            tuple(extra_rollouts),
            state,
            dynamic_sampling,
        )
        claimed = {e: a for a in _records() if a.name != name for e in a.estimators}
        taken = sorted(e for e in record.estimators if e in claimed)
        if taken and not override:
            raise ValueError(f"estimator(s) {taken} already select algorithm {claimed[taken[0]].name!r}")
        return ALGORITHM_REGISTRY.register(name, override=override)(record)

    return decorator


def _records() -> list[Algorithm]:
    return [ALGORITHM_REGISTRY.get(n) for n in ALGORITHM_REGISTRY.names()]


def get_algorithm(name: str) -> Algorithm:
    """The algorithm ``name``; `UnknownNameError` (listing the names) for an unknown one."""
    return ALGORITHM_REGISTRY.get(name)


def algorithm_names() -> list[str]:
    return ALGORITHM_REGISTRY.names()


def estimator_algorithm(adv_estimator: str) -> Algorithm:
    """The algorithm that lists ``adv_estimator`` among its estimators, else ``ppo`` for any
    other registered estimator; `UnknownNameError` for an unregistered one."""
    for record in _records():
        if adv_estimator in record.estimators:
            return record
    if adv_estimator in ADV_ESTIMATOR_REGISTRY:
        return get_algorithm(GENERAL)
    raise UnknownNameError(
        f"unknown advantage estimator {adv_estimator!r}; valid names: {', '.join(ADV_ESTIMATOR_REGISTRY.names())}"
    )


def algorithm_for(settings: AlgorithmSettings) -> Algorithm:
    """The algorithm of ``settings``: one whose ``enabled_by`` switch is on, else the
    estimator's (`estimator_algorithm`)."""
    enabled = [a for a in _records() if a.enabled_by is not None and a.enabled_by(settings)]
    if len(enabled) > 1:
        raise ValueError(f"the settings switch on several algorithms: {[a.name for a in enabled]}")
    return enabled[0] if enabled else estimator_algorithm(settings.algorithm.adv_estimator)


def select_algorithm(settings: AlgorithmSettings) -> str:
    """The name of the algorithm of ``settings`` (`algorithm_for`)."""
    return algorithm_for(settings).name


def rollout_scores_old_log_probs(settings: AlgorithmSettings) -> bool:
    """Whether the rollout of the algorithm of ``settings`` carries ``old_log_probs`` into the
    update: its ``scores_old_log_probs``, or verl's bypass mode (any algorithm: they are the
    rollout's own log-probs, no forward). Otherwise the actor's update takes them from its own
    forward when it is on-policy or computes them itself. Planners read this to lower the
    train step the run calls."""
    bypass = settings.algorithm.rollout_correction.bypass_mode
    return bool(bypass) or algorithm_for(settings).scores_old_log_probs(settings)
