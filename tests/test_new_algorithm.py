"""Adding an algorithm touches one file: this one. It registers an advantage estimator and an
algorithm with its own state and an extra greedy rollout, and runs it through the trainer (two
steps of a tiny config), the dry run and the auto-mapper, each of which reads what to do from
the registered record (`jaxflow.iterations.Algorithm`), with no edit anywhere else.

The algorithm: REINFORCE with an exponential-moving-average baseline carried across
iterations (its state) and the greedy answers' score as a metric (its extra rollout)::

    A_{i,t} = (s_i - b) m_{i,t},   s_i = sum_t r_{i,t} m_{i,t}
    b <- DECAY b + (1 - DECAY) mean_i s_i          (after the update; b starts at B0)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.algos import AlgorithmSettings
from jaxflow.algos.advantages import ADV_ESTIMATOR_REGISTRY, register_adv_est
from jaxflow.automap import Mapper, get_profile, workload_from_spec
from jaxflow.configs import ConfigError, load_config
from jaxflow.configs.prepare import prepare_run
from jaxflow.configs.run_spec import algorithm_settings
from jaxflow.iterations import (
    ALGORITHM_REGISTRY,
    AlgoState,
    algorithm_for,
    compute_data_metrics,
    greedy_baseline,
    register_algorithm,
    steps,
)
from jaxflow.plan.dry_run import DEFAULT_PROGRAMS, OPTIONAL_PROGRAMS, plan
from jaxflow.trainer.checkpoint import CheckpointManager
from jaxflow.trainer.rl import RLTrainer

NAME, ESTIMATOR = "ema_reinforce", "ema_baseline"
DECAY, B0 = 0.9, 0.5


def ema_baseline_advantage(token_level_rewards, response_mask, reward_baselines):
    """``A = R = (s - b) m`` per token (the module docstring)."""
    scores = jnp.sum(token_level_rewards * response_mask, axis=-1)
    advantages = (scores - reward_baselines)[:, None] * response_mask
    return advantages, advantages


@dataclasses.dataclass
class EMABaselineState(AlgoState):
    baseline: float | None = None

    @classmethod
    def initial(cls, settings: AlgorithmSettings) -> EMABaselineState:
        return cls(baseline=B0)


def ema_reinforce(w, prompts, settings, state, *, step=None, update_actor=True):
    timer = steps.StepTimer()
    batch, metrics = steps.rollout(w, prompts, timer, step=step)
    with timer("gen_greedy"):  # the extra rollout: one greedy response per prompt, scored
        greedy_scores, _ = greedy_baseline(w, prompts, step)
    mask = np.asarray(batch["response_mask"]) > 0
    scores = (np.asarray(batch["token_level_scores"]) * mask).sum(-1)
    b = state.baseline
    batch = batch.update(tensors={"reward_baselines": np.full(len(batch), b, np.float32)})
    batch, _ = steps.kl_in_reward(batch, settings.algorithm, None)
    batch = steps.advantages(batch, settings.algorithm, timer)
    metrics |= steps.update(w, batch, timer, step=step, update_actor=update_actor)
    state.baseline = DECAY * b + (1 - DECAY) * float(scores.mean())
    metrics |= {"ema/baseline": b, "ema/greedy_score": float(greedy_scores.mean())}
    return metrics | compute_data_metrics(batch) | timer.metrics()


@pytest.fixture(scope="module")
def algorithm():
    """The estimator and the algorithm, registered for this module only."""
    register_adv_est(ESTIMATOR)(ema_baseline_advantage)
    record = register_algorithm(
        NAME,
        estimators=(ESTIMATOR,),
        uses_critic=False,
        scores_old_log_probs=True,
        extra_rollouts=("greedy",),
        state=EMABaselineState,
    )(ema_reinforce)
    yield record
    ALGORITHM_REGISTRY.unregister(NAME)
    ADV_ESTIMATOR_REGISTRY.unregister(ESTIMATOR)


def tiny_config(tmp_path, *extra):
    return load_config(
        "grpo_tiny",
        [
            f"algorithm.adv_estimator={ESTIMATOR}",
            "jaxflow.placement.type=colocated",
            "jaxflow.model.num_layers=1",
            "jaxflow.model.hidden_size=64",
            "jaxflow.model.intermediate_size=128",
            "jaxflow.sft.warm_start_steps=0",
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=False",
            "trainer.logger=['console']",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "jaxflow.data.num_train_examples=64",
            "jaxflow.data.num_val_examples=8",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_selected_by_its_estimator(algorithm, tmp_path):
    settings = algorithm_settings(tiny_config(tmp_path))
    assert algorithm_for(settings) is algorithm
    assert not algorithm.uses_critic(settings) and algorithm.scores_old_log_probs(settings)
    with pytest.raises(ValueError, match=f"estimator.*{ESTIMATOR}.*{NAME}"):
        register_algorithm("another", estimators=(ESTIMATOR,))(ema_reinforce)
    needs_critic = dataclasses.replace(algorithm, uses_critic=lambda s: True)
    with pytest.raises(ValueError, match="critic.enable"):
        needs_critic.check_roles(settings, ("actor", "ref"))


def test_trainer_runs_it_and_keeps_its_state(algorithm, tmp_path):
    trainer = RLTrainer(tiny_config(tmp_path))
    assert trainer.algorithm is algorithm and type(trainer.algo_state) is EMABaselineState
    history = trainer.fit()
    assert len(history) == 2
    b = B0
    for metrics in history:
        assert metrics["ema/baseline"] == pytest.approx(b)
        assert 0 <= metrics["ema/greedy_score"] <= 1 and metrics["timing_s/gen_greedy"] > 0
        b = DECAY * b + (1 - DECAY) * metrics["critic/score/mean"]
    assert trainer.algo_state.state_dict() == {"baseline": pytest.approx(b)}
    saved = CheckpointManager(trainer.run_dir, read_only=True)
    assert saved.all_steps() == [1, 2]
    assert saved.restore(targets={}).host.extra["algo_state"] == {"baseline": pytest.approx(b)}


def test_dry_run_plans_its_rollouts(algorithm, tmp_path):
    spec = prepare_run(tiny_config(tmp_path), with_datasets=False).spec
    _, programs = plan(spec, DEFAULT_PROGRAMS + OPTIONAL_PROGRAMS)
    planned = {p.name: p for p in programs}
    assert "actor/generate_greedy" in planned and "n=1" in planned["actor/generate_greedy"].description
    assert "on-policy" not in planned["actor/train_step"].description  # the rollout scores old log-probs
    assert not any(name.startswith("critic/") for name in planned)
    planned["actor/generate_greedy"].lower()
    # What it runs on is checked: the same algorithm, had it registered a critic, needs one.
    ALGORITHM_REGISTRY.register(NAME, override=True)(dataclasses.replace(algorithm, uses_critic=lambda s: True))
    try:
        with pytest.raises(ConfigError, match="critic.enable"):
            plan(spec, ["actor/generate"])
    finally:
        ALGORITHM_REGISTRY.register(NAME, override=True)(algorithm)


def test_auto_mapper_schedules_its_stages(algorithm, tmp_path):
    w = workload_from_spec(prepare_run(tiny_config(tmp_path), with_placement=False, with_datasets=False).spec)
    phases = {s.name: s.phase for s in w.stages}
    assert phases["actor/generate_greedy"] == "generate_one"
    assert "actor/log_probs" in phases  # scored in the rollout although the update is on-policy
    assert not any(s.role == "critic" for s in w.stages)
    best = Mapper(w, 8, get_profile("h100")).search(top=1)[0]
    spans = best.stage_spans
    greedy, sampled = (spans[f"actor/{s}"][1] - spans[f"actor/{s}"][0] for s in ("generate_greedy", "generate"))
    assert 0 < greedy < sampled  # one response per prompt against n = 4
    train = spans["actor/train"]
    assert train[0] >= spans["actor/generate_greedy"][1]
