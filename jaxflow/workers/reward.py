"""Rewards: a reward-model worker (also the Safe-RLHF cost model), a host-side rule scorer
worker, and `RewardFn`, which combines them into the ``w.reward(batch)`` of an algorithm.

Every source puts one score per response on its last valid token (verl's convention), in a
``[B, R]`` column: ``token_level_scores`` by default, ``token_level_cost`` for a cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflow.data.batch import Batch
from jaxflow.data.tasks import TASKS, task_reward
from jaxflow.mesh import MeshSpec, Role, Rules
from jaxflow.rewards import (
    EXTRA_COLUMN_PREFIX,
    OverlongBuffer,
    RewardScorer,
    extra_columns,
    register_reward,
    token_level_scores,
)
from jaxflow.workers.base import ModelLike, RoleLayout, RoleWorker, num_micro_batches, row_program
from jaxflow.workers.forward import ForwardConfig, scores_on_last_token, sequence_scores
from jaxflow.workers.protocols import DP_COMPUTE, ONE_TO_ALL, register

# The built-in tasks' rule reward by data_source, registered here, above both the tasks
# (jaxflow.data) and the reward registry (jaxflow.rewards): the rule scorer scores their rows
# (the code task's rows go to the sandboxed code reward, registered for its data_source).
register_reward(*(t.data_source for t in TASKS.values() if t.rule_reward))(task_reward)


def scores_program(layout: RoleLayout, num_micro: int, output_key: str = "token_level_scores"):
    """``jit(params, tensors, {}) -> {output_key: [B, R]}``: each row's score on its last
    response token, in ``num_micro`` micro-batches."""

    return row_program(layout, scores_fn(output_key), num_micro, name=output_key)


def scores_fn(output_key: str = "token_level_scores"):
    """``fn(model, tensors, {}) -> {output_key: [B, R]}`` from padded rows or a packed micro-batch."""

    def fn(model, t, _):
        return {output_key: scores_on_last_token(sequence_scores(model, t), t["response_mask"])}

    return fn


class RewardModelWorker(RoleWorker):
    """A scalar-head model scoring ``[prompt | response]``: `scores` -> ``output_key``.

    The same class serves the Safe-RLHF cost model (``output_key="token_level_cost"``).

    Args:
      model: a reward model (``head="reward"``: the score is read at the last real token).
      mesh, rules: its mesh and (inference) rules.
      output_key: the ``[B, R]`` column written.
      forward: how the scoring forward runs (micro-batches, remove padding, token budget).
    """

    role = Role.REWARD  # the cost model's head too

    def __init__(
        self,
        model: ModelLike,
        mesh: Mesh | MeshSpec | str,
        rules: Rules | str,
        *,
        output_key: str = "token_level_scores",
        forward: ForwardConfig = ForwardConfig(),
    ):
        super().__init__(model, mesh, rules)
        self.output_key = output_key
        self.forward = forward

    @register(DP_COMPUTE)
    def scores(self, batch: Batch) -> Batch:
        """``output_key`` [B, R]: each row's score on its last response token."""
        return self.run_forward(
            batch, self.forward, self.output_key, scores_fn(self.output_key), {}, self.scores_program
        )

    def scores_program(self, rows: int):
        """The jitted scoring forward of ``rows`` responses (`scores_program`)."""
        k = num_micro_batches(rows, self.forward.micro_batch_size_per_device, self.dp_size, "reward scores")
        return self._compiled(("scores", k), lambda: scores_program(self.layout, k, self.output_key))


class RuleRewardWorker:
    """Host-side rule-based scorer: decodes each response's valid tokens and scores it with
    `jaxflow.rewards.RewardScorer` by ``data_source`` (or a user function), as verl's DAPO
    reward manager: the function's score, plus DAPO's overlong penalty when ``overlong``
    (`jaxflow.rewards.shaping.OverlongBuffer`) is given; the function's own score is also kept
    as the named value ``acc`` when it did not return one (what ``algorithm.filter_groups``'s
    ``metric=acc`` reads).

    Reads the non-tensor columns ``data_source``, ``ground_truth`` and (optionally)
    ``extra_info`` that prompt batches carry (`jaxflow.iterations.batch_from_prompts`).

    Args:
      tokenizer: decodes responses (``batch_decode``; special tokens are skipped, as verl).
      scorer: a `RewardScorer` (default: the built-in functions, inline).
      output_key: the ``[B, R]`` column written.
      overlong: DAPO's overlong reward shaping (None: none).
    """

    def __init__(
        self,
        tokenizer: Any,
        scorer: RewardScorer | None = None,
        *,
        output_key: str = "token_level_scores",
        overlong: OverlongBuffer | None = None,
    ):
        self.tokenizer = tokenizer
        self.scorer = scorer if scorer is not None else RewardScorer()
        self.output_key = output_key
        self.overlong = overlong

    def decode(self, responses: np.ndarray, response_mask: np.ndarray) -> list[str]:
        rows = [r[m > 0].tolist() for r, m in zip(responses, response_mask)]
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    @register(ONE_TO_ALL)
    def scores(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``(scores, metrics)``: ``output_key`` [B, R] (host) with the decoded
        ``response_text`` and the function's other named values (``reward_extra/<key>``,
        `jaxflow.rewards.extra_columns`, with ``acc`` and, when ``overlong.log``,
        ``overlong_reward`` and ``overlong``), and the scorer's metrics (``reward/mean``,
        ``reward/num_errors``, ...; `jaxflow.rewards.RewardResult`: the function's scores,
        before shaping). A host-side group of one rank: the group call returns a list holding
        this one pair."""
        responses = np.asarray(jax.device_get(batch["responses"]))
        mask = np.asarray(jax.device_get(batch["response_mask"]))
        texts = self.decode(responses, mask)
        extra = batch.non_tensors.get("extra_info")
        result = self.scorer.score(
            list(batch["data_source"]),
            texts,
            list(batch["ground_truth"]),
            None if extra is None else list(extra),
        )
        named = extra_columns(result)
        named.setdefault(EXTRA_COLUMN_PREFIX + "acc", result.scores.astype(np.float32))
        scores = result.scores
        if self.overlong is not None:
            penalty = self.overlong.penalty((mask > 0).sum(axis=1))
            scores = scores + penalty
            if self.overlong.log:
                named[EXTRA_COLUMN_PREFIX + "overlong_reward"] = penalty
                named[EXTRA_COLUMN_PREFIX + "overlong"] = (penalty < 0).astype(np.float32)
        out = Batch.from_dict({self.output_key: token_level_scores(scores, mask)}, {"response_text": texts, **named})
        return out, dict(result.metrics)


class RewardFn:
    """``w.reward``: ``Batch -> Batch`` with ``token_level_scores`` from a reward-model group
    and/or a rule scorer group; when both are given their scores add up (each weighted).
    `score` also returns the rule scorer's metrics.

    Args:
      model: a worker group of a `RewardModelWorker` (or None).
      rule: a worker group of a `RuleRewardWorker` (or None).
      weights: ``(model_weight, rule_weight)``.
    """

    def __init__(self, model: Any = None, rule: Any = None, weights: Sequence[float] = (1.0, 1.0)):
        if model is None and rule is None:
            raise ValueError("RewardFn needs a reward model and/or a rule scorer")
        self.model, self.rule = model, rule
        self.weights = tuple(float(w) for w in weights)

    def __call__(self, batch: Batch) -> Batch:
        return self.score(batch)[0]

    def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``(token_level_scores [B, R] (+ the rule scorer's response_text), its metrics)``."""
        parts, non_tensors, metrics = [], {}, {}
        if self.model is not None:
            out = self.model.scores(batch)
            parts.append(self.weights[0] * np.asarray(jax.device_get(out["token_level_scores"])))
        if self.rule is not None:
            [(out, metrics)] = self.rule.scores(batch)
            parts.append(self.weights[1] * np.asarray(jax.device_get(out["token_level_scores"])))
            non_tensors = out.non_tensors
        scores = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return Batch.from_dict({"token_level_scores": scores.astype(np.float32)}, non_tensors), metrics


def score_batch(reward: Any, batch: Batch) -> tuple[Batch, dict[str, float]]:
    """``(scores, metrics)`` from ``w.reward``: a `RewardFn` reports its rule scorer's
    metrics; any other ``Batch -> Batch`` callable none."""
    if isinstance(reward, RewardFn):
        return reward.score(batch)
    return reward(batch), {}
