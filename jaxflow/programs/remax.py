"""The ReMax program (Li et al. 2023, arXiv:2310.10505): REINFORCE whose baseline is the
reward of the policy's own greedy response, no critic.

::

    batch = rollout(w, prompts)                         # n sampled responses per prompt, scored
    greedy = w.actor.generate(prompts, sampling="greedy")  # one argmax response per prompt
    b_i = sum_t score(greedy_i)_t                       # its sequence reward (w.reward)
    reward_baselines = repeat(b, n)                     # [B*n], the same b_i for prompt i's samples
    A_{j,t} = G_{j,t} - b_i m_{j,t},  G_{j,t} = sum_{t' >= t} r_{j,t'} m_{j,t'}
    w.actor.update(batch)

as verl's ``RayPPOTrainer.fit`` (its ``adv_estimator == REMAX`` branch: ``do_sample=False``
baseline generation, timed as ``gen_max``, scored with the reward function and summed).
``r`` are the token-level rewards: the scores, minus the in-reward KL penalty when
``algorithm.use_kl_in_reward`` (the baseline is the greedy response's *score*, as verl's).
The greedy responses are scored only, never trained on.
"""

from __future__ import annotations

import uuid

import jax
import numpy as np

from jaxflow.algos.settings import AlgorithmSettings
from jaxflow.data.batch import Batch
from jaxflow.programs import steps
from jaxflow.programs.batch_ops import compute_data_metrics
from jaxflow.programs.state import AlgoState
from jaxflow.workers.group import Workers


def with_uid(prompts: Batch) -> Batch:
    """``prompts`` with a ``uid`` per row (kept when present), so that the greedy and the
    sampled rollouts of a prompt carry the same id."""
    if "uid" in prompts:
        return prompts
    return prompts.update(non_tensors={"uid": [str(uuid.uuid4()) for _ in range(len(prompts))]})


def greedy_baseline(w: Workers, prompts: Batch, step: int | None = None) -> tuple[np.ndarray, Batch]:
    """``(b [B], greedy batch)``: one greedy response per prompt (verl's ``do_sample=False``
    request: the actor's training sampling parameters, greedy, ``n = 1``) and its sequence
    reward ``b_i = sum_t token_level_scores``."""
    greedy = steps.ready(w.actor.generate(prompts, sampling="greedy", step=step))
    if len(greedy) != len(prompts):
        raise ValueError(
            f"the greedy rollout returned {len(greedy)} rows for {len(prompts)} prompts; the actor must "
            "honour sampling='greedy' with one response per prompt"
        )
    scores = np.asarray(jax.device_get(steps.ready(w.reward(greedy))["token_level_scores"]), np.float32)
    mask = np.asarray(jax.device_get(greedy["response_mask"])) > 0
    return (scores * mask).sum(-1), greedy


def remax_iteration(
    w: Workers,
    prompts: Batch,
    settings: AlgorithmSettings,
    state: AlgoState,
    *,
    step: int | None = None,
    update_actor: bool = True,
) -> dict[str, float]:
    """One ReMax iteration (see the module docstring). Metrics: the shared program's, plus
    ``critic/reward_baseline/{mean,max,min}`` (the greedy responses' scores),
    ``response_length/greedy_mean`` and ``timing_s/gen_max`` (greedy rollout and its reward)."""
    algo = settings.algorithm
    if algo.adv_estimator != "remax":
        raise ValueError(f"the remax program needs algorithm.adv_estimator='remax', got {algo.adv_estimator!r}")
    kl_ctrl = state.kl_controller(algo)
    prompts = with_uid(prompts)
    timer = steps.StepTimer()
    batch, metrics = steps.rollout(w, prompts, timer, step=step, bypass_mode=algo.rollout_correction.bypass_mode)
    with timer("gen_max"):
        baseline_B, greedy = greedy_baseline(w, prompts, step)
    n, rest = divmod(len(batch), len(prompts))
    if rest or not np.array_equal(np.asarray(batch["uid"])[::n], np.asarray(greedy["uid"])):
        raise ValueError("the sampled rollout is not n interleaved responses per prompt in prompt order")
    batch = batch.update(tensors={"reward_baselines": np.repeat(baseline_B, n).astype(np.float32)})
    batch, kl = steps.kl_in_reward(batch, algo, kl_ctrl)
    metrics |= kl
    batch = steps.advantages(batch, algo, timer)
    metrics |= steps.update(w, batch, timer, step=step, update_actor=update_actor)
    state.store(kl_ctrl=kl_ctrl)
    greedy_len = (np.asarray(jax.device_get(greedy["response_mask"])) > 0).sum(-1)
    metrics |= {
        "critic/reward_baseline/mean": float(baseline_B.mean()),
        "critic/reward_baseline/max": float(baseline_B.max()),
        "critic/reward_baseline/min": float(baseline_B.min()),
        "response_length/greedy_mean": float(greedy_len.mean()),
    }
    return metrics | compute_data_metrics(batch) | timer.metrics()
