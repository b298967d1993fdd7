"""The steps every algorithm's iteration is made of, each timed (verl's ``timing_s/*`` metrics).

An iteration of any algorithm in :mod:`jaxflow.iterations` reads::

    timer = StepTimer()
    batch, metrics = rollout(w, prompts, timer, step=step)   # gen, old_log_prob, ref, values, reward
    #   (generate, log_probs, values, reward: DAPO's dynamic sampling runs them in its own order)
    batch, kl = kl_in_reward(batch, settings.algorithm, kl_ctrl)
    batch = advantages(batch, settings.algorithm, timer)  # adv
    metrics |= kl | update(w, batch, timer, step=step, update_actor=update_actor)
    return metrics | compute_data_metrics(batch) | timer.metrics()

plus each algorithm's own steps (ReMax's greedy baseline, Safe-RLHF's costs and multiplier).

Worker-group calls return as soon as JAX has *dispatched* their programs; a step's clock
stops only after :func:`ready` has waited for the returned columns, so ``timing_s/gen``
is the rollout, not its dispatch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import jax
import numpy as np

from jaxflow.algos.kl import AdaptiveKLController, FixedKLController
from jaxflow.algos.settings import AlgorithmConfig
from jaxflow.data.batch import Batch
from jaxflow.iterations.batch_ops import apply_kl_penalty_to_batch, compute_advantage
from jaxflow.workers.group import Workers
from jaxflow.workers.reward import score_batch

KLController = FixedKLController | AdaptiveKLController


class StepTimer:
    """Wall-clock seconds per named step (``time.perf_counter``), reported by `metrics` as
    ``timing_s/<name>`` plus ``timing_s/step`` (since the timer was made). A step entered
    twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out["timing_s/step"] = time.perf_counter() - self._start
        return out


def ready(batch: Batch) -> Batch:
    """``batch`` once every tensor column has been computed (``jax.block_until_ready``)."""
    jax.block_until_ready(list(batch.tensors.values()))
    return batch


def gen_parts(w: Workers) -> dict[str, float]:
    """The last rollout's parts on the actor's workers (`ActorWorker.generation_seconds`):
    ``reshard``, ``engine``, ``post``, each the slowest rank's; whatever ``timing_s/gen``
    holds beyond their sum is the controller's dispatch and the transfer of the rows."""
    ranks = w.actor.generation_seconds()
    return {k: max(r[k] for r in ranks) for k in ranks[0]} if ranks and ranks[0] else {}


def generate(w: Workers, prompts: Batch, timer: StepTimer, *, step: int | None = None, prompt_offset: int = 0) -> Batch:
    """``responses`` of the prompts (``gen``; its parts ``gen_reshard``, ``gen_engine``,
    ``gen_post``: `gen_parts`, adding up over the step's generation batches). ``step`` and
    ``prompt_offset`` seed the rollout (`jaxflow.workers.ActorWorker.generate`)."""
    with timer("gen"):
        batch = ready(w.actor.generate(prompts, step=step, prompt_offset=prompt_offset))
    for part, seconds in gen_parts(w).items():  # the slowest rank's, so the gap between them and gen is visible
        timer.seconds[f"gen_{part}"] = timer.seconds.get(f"gen_{part}", 0.0) + seconds
    return batch


def log_probs(
    w: Workers,
    batch: Batch,
    timer: StepTimer,
    *,
    old_log_probs: bool = True,
    bypass_mode: bool = False,
) -> Batch:
    """The log-probs of the responses: ``old_log_probs`` (``old_log_prob``; skipped when
    ``old_log_probs`` is False: the actor's update then takes them from its own forward when
    on-policy, or computes them itself; with ``bypass_mode`` they are the rollout's
    ``rollout_log_probs``, verl's bypass mode) and ``ref_log_prob`` when ``w.ref`` (``ref``)."""
    with timer("old_log_prob"):  # reported as ~0 s when skipped, as the phase ran no program
        if bypass_mode:
            batch = batch.update(tensors={"old_log_probs": batch["rollout_log_probs"]})
        elif old_log_probs:
            batch |= ready(w.actor.log_probs(batch))
    if w.ref is not None:
        with timer("ref"):
            batch |= ready(w.ref.log_probs(batch))
    return batch


def values(w: Workers, batch: Batch, timer: StepTimer) -> Batch:
    """The critic's ``values`` when ``w.critic`` (``values``)."""
    if w.critic is not None:
        with timer("values"):
            batch |= ready(w.critic.values(batch))
    return batch


def reward(w: Workers, batch: Batch, timer: StepTimer) -> tuple[Batch, dict[str, float]]:
    """``token_level_scores`` (``reward``) and the rule scorer's ``reward/*`` metrics; a
    multi-turn rollout's environment rewards (``token_rewards``) add to the scores."""
    if w.reward is None:
        raise ValueError("the iteration needs a reward (w.reward: a reward model and/or a rule scorer)")
    with timer("reward"):
        scores, reward_metrics = score_batch(w.reward, batch)
        if "token_rewards" in batch:  # a multi-turn rollout's environment rewards, turn by turn
            total = np.asarray(scores["token_level_scores"]) + np.asarray(jax.device_get(batch["token_rewards"]))
            scores = scores.update(tensors={"token_level_scores": total.astype(np.float32)})
        return batch | ready(scores), reward_metrics


def rollout(
    w: Workers,
    prompts: Batch,
    timer: StepTimer,
    *,
    step: int | None = None,
    old_log_probs: bool = True,
    bypass_mode: bool = False,
) -> tuple[Batch, dict[str, float]]:
    """Generation and everything scored on it: `generate`, `log_probs`, `values`, `reward`. No
    reordering for data-parallel balance here: every packed pass deals its rows to its own
    mesh's data-parallel ranks balanced by tokens (`jaxflow.workers.packing`). Returns the
    batch and the rule scorer's ``reward/*`` metrics, with the rollout probe's
    ``rollout/probe_tv`` when the actor has one (`jaxflow.workers.rollout_probe`)."""
    batch = generate(w, prompts, timer, step=step)
    probe = w.actor.rollout_metrics()[0]
    batch = log_probs(w, batch, timer, old_log_probs=old_log_probs, bypass_mode=bypass_mode)
    batch, reward_metrics = reward(w, values(w, batch, timer), timer)
    return batch, reward_metrics | probe


def kl_in_reward(batch: Batch, algo: AlgorithmConfig, kl_ctrl: KLController | None) -> tuple[Batch, dict[str, float]]:
    """verl's in-reward KL penalty when ``algo.use_kl_in_reward``: ``token_level_rewards =
    token_level_scores - beta kl(old_log_probs, ref_log_prob)`` with ``beta = kl_ctrl.value``,
    then ``kl_ctrl.update(current_kl, batch size)``. Otherwise ``token_level_rewards =
    token_level_scores`` (as verl)."""
    if not algo.use_kl_in_reward:
        return batch.update(tensors={"token_level_rewards": batch["token_level_scores"]}), {}
    if kl_ctrl is None:
        raise ValueError("algorithm.use_kl_in_reward needs a KL controller")
    if "ref_log_prob" not in batch:
        raise ValueError("algorithm.use_kl_in_reward needs a reference policy (w.ref)")
    batch, metrics = apply_kl_penalty_to_batch(batch, kl_ctrl.value, algo.kl_penalty)
    kl_ctrl.update(metrics["actor/reward_kl_penalty"], len(batch))
    return batch, metrics


def advantages(batch: Batch, algo: AlgorithmConfig, timer: StepTimer) -> Batch:
    """``advantages`` and ``returns`` with ``algo.adv_estimator`` (``adv``)."""
    with timer("adv"):
        return compute_advantage(
            batch,
            algo.adv_estimator,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
            gdpo_reward_keys=algo.gdpo_reward_keys,
            gdpo_reward_weights=algo.gdpo_reward_weights,
        )


def update(
    w: Workers, batch: Batch, timer: StepTimer, *, step: int | None = None, update_actor: bool = True
) -> dict[str, float]:
    """The critic's (when ``w.critic``) and the actor's updates; their metrics. The actor waits
    while ``update_actor`` is False (verl's ``trainer.critic_warmup`` steps). ``step`` seeds
    the mini-batch shuffle."""
    metrics: dict[str, float] = {}
    if w.critic is not None:
        with timer("update_critic"):
            metrics |= w.critic.update(batch, step=step)
    if update_actor:
        with timer("update_actor"):
            metrics |= w.actor.update(batch, step=step)
    return metrics
