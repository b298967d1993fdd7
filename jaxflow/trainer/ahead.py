"""Rollouts generated ahead of the updates that consume them: the trainer's ``one_step_off`` and
``async`` modes (``trainer.mode``), on the local and the Ray backends.

With ``max_staleness = s`` the rollout of step ``k`` may be produced by weights up to ``s``
policy versions older than those that update on it (a version is one actor update). The
trainer keeps the rollouts of steps ``k .. k + s`` generated: before step ``k``'s update it
generates whatever of them is missing, with the weights it has then, in step order (each from
the next prompt batch of the loader and seeded by its own step, as the synchronous run seeds
it). Step ``k``'s iteration then runs unchanged on its rollout: the workers it sees answer
``actor.generate`` with that batch (`AheadActor`), and everything after generation (old
log-probs of the current weights as PPO's proximal policy, the reference, values, rewards,
advantages, the update) runs on the current weights.

* ``s = 0`` (``async`` with ``max_staleness=0``): step ``k``'s rollout is generated right
  before its update, from the same prompts with the same seed and weights: the synchronous
  run, bit for bit.
* ``s = 1`` (``one_step_off``, verl's one-step-off policy): from step 2 on, each update
  consumes a rollout of the previous weights.

Every generated token records the policy version that produced it (`Rollout.token_versions_BxR`,
int32 aligned with ``responses``; here all tokens of a rollout share its version, as it is
generated in one call). The staleness of a consumed token is ``v - u`` for the version ``v`` at
the update that consumes it and the token's version ``u``; `GenerateAhead.step` computes it
from the per-token versions of the rollout it hands out (``fully_async/staleness/token_mean|max``
and the version spans, `jaxflow.trainer.rollout_buffer.consumed_token_metrics`) and raises
`StalenessError` if a valid token (``response_mask = 1``) has ``v - u > lookahead`` or
``v - u < 0``; the last consumed rollout's versions stay readable (`GenerateAhead.consumed`). On
either backend the rollout and the update run on the actor's devices, one after the other
(on Ray, the actor's worker group generates and trains; the controller keeps the pending
rollouts): the schedule and the off-policy data are those of the asynchronous modes, not their
overlap (which needs the rollout on its own devices with the weights streamed to it,
`jaxflow.reshard.WeightSync`).

Checkpoints: the loader's position saved is the one before the first rollout still pending, so
a resumed run generates those rollouts again (same prompts, same seeds; with the checkpoint's
weights, which are at most as stale) and neither skips nor repeats a prompt batch. A Ray
run's restart (``jaxflow.ray.max_restarts``) discards the pending rollouts
(`GenerateAhead.discard_pending`) before it resumes, for the same reason.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxflow.configs.validate import TRAINER_MODES
from jaxflow.data.batch import RESPONSE_MASK, RESPONSES, Batch
from jaxflow.iterations.steps import gen_parts, ready
from jaxflow.trainer.rollout_buffer import consumed_token_metrics
from jaxflow.workers.group import Workers


class StalenessError(RuntimeError):
    """A consumed token's staleness is outside ``[0, bound]`` (a scheduling bug, never data)."""


def lookahead(mode: str, max_staleness: int) -> int | None:
    """Rollouts generated ahead of the current step's: None for ``sync``, 1 for
    ``one_step_off``, ``max_staleness`` for ``async``."""
    if mode not in TRAINER_MODES:
        raise ValueError(f"unknown trainer.mode {mode!r}; choose from {TRAINER_MODES}")
    if max_staleness < 0:
        raise ValueError(f"trainer.max_staleness must be >= 0, got {max_staleness}")
    return {"sync": None, "one_step_off": 1, "async": max_staleness}[mode]


@dataclasses.dataclass
class Rollout:
    """One step's rollout, generated ahead: its prompts, its batch, the policy version that
    generated it, the wall seconds it took, the actor's report of it (the generation's parts,
    the rollout probe) and the policy version of each response token (int32[B, R], aligned
    with ``batch["responses"]``), recorded when it was generated."""

    step: int
    prompts: Batch
    batch: Batch
    version: int
    seconds: float
    parts: dict[str, float]
    probe: dict[str, float]
    token_versions_BxR: np.ndarray


@dataclasses.dataclass(frozen=True)
class ConsumedTokens:
    """The tokens an update consumed: its step, the policy version ``version`` of the weights
    it updates, each response token's version (int32[B, R]) and ``response_mask`` (host
    arrays; padding, ``mask = 0``, carries no token)."""

    step: int
    version: int
    token_versions_BxR: np.ndarray
    response_mask_BxR: np.ndarray

    def staleness(self) -> np.ndarray:
        """``version - u`` over the valid tokens (int64[num valid tokens])."""
        return self.version - self.token_versions_BxR[self.response_mask_BxR.astype(bool)].astype(np.int64)


def check_staleness(consumed: ConsumedTokens, bound: int) -> dict[str, float]:
    """The consumed tokens' staleness and span statistics (`consumed_token_metrics`); raises
    `StalenessError` when a valid token's staleness ``v - u`` is above ``bound`` or negative
    (a token of weights newer than the update's)."""
    staleness = consumed.staleness()
    if staleness.size and (staleness.max() > bound or staleness.min() < 0):
        raise StalenessError(
            f"step {consumed.step}'s update at policy version {consumed.version} consumes tokens of versions "
            f"{int(consumed.version - staleness.max())}..{int(consumed.version - staleness.min())}: staleness "
            f"{int(staleness.min())}..{int(staleness.max())}, outside [0, {bound}]"
        )
    return consumed_token_metrics(consumed.token_versions_BxR, consumed.response_mask_BxR, consumed.version)


class AheadActor:
    """The actor group as step ``rollout.step``'s iteration sees it: ``generate`` of that step
    returns the rollout generated ahead; every other call goes to the actor."""

    def __init__(self, actor: Any, rollout: Rollout):
        self._actor, self._rollout = actor, rollout

    def generate(self, prompts: Batch, *, sampling: Any = "train", step: int | None = None, prompt_offset: int = 0):
        r = self._rollout
        if sampling != "train" or step != r.step or prompt_offset != 0 or len(prompts) != len(r.prompts):
            raise ValueError(
                f"step {r.step}'s rollout was generated ahead for its own prompts; the iteration asked for "
                f"sampling={sampling!r}, step={step}, prompt_offset={prompt_offset} ({len(prompts)} prompts)"
            )
        return r.batch

    def generation_seconds(self) -> list[dict[str, float]]:
        return [dict(self._rollout.parts)]

    def rollout_metrics(self) -> list[dict[str, float]]:
        return [dict(self._rollout.probe)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor, name)


class GenerateAhead:
    """The rollouts of steps ``k .. k + lookahead`` (none past ``last_step``), generated before
    step ``k``'s update (see the module docstring). ``loader``: the prompt loader (``next``,
    ``state_dict``); ``to_batch``: its items to a prompt `Batch`."""

    def __init__(self, lookahead: int, last_step: int, loader: Any, to_batch: Callable[[Any], Batch]):
        self.lookahead, self.last_step = lookahead, last_step
        self.loader, self.to_batch = loader, to_batch
        self.pending: collections.deque[Rollout] = collections.deque()
        self.consumed: ConsumedTokens | None = None  # the tokens of the last rollout handed out
        self._loader_before: collections.deque[Any] = collections.deque()  # the loader's state before each pending pull

    def step(self, step: int, workers: Workers, version: int) -> tuple[Batch, Workers, dict[str, float]]:
        """Step ``step``'s prompts, the workers its iteration runs over, and the metrics of
        generating ahead (``timing_s/gen_ahead``: the rollouts generated now; the staleness of
        the rollout consumed, in policy versions, at ``version``, from its per-token versions:
        `check_staleness`, which raises past ``lookahead``)."""
        if self.pending and self.pending[0].step != step:
            raise RuntimeError(f"the rollout of step {self.pending[0].step} is pending, but step {step} runs")
        seconds = 0.0
        while True:
            k = self.pending[-1].step + 1 if self.pending else step
            if k > min(step + self.lookahead, self.last_step):
                break
            before = self.loader.state_dict()
            rollout = self._generate(k, workers, version)
            self._loader_before.append(before)
            self.pending.append(rollout)
            seconds += rollout.seconds
        rollout = self.pending.popleft()
        self._loader_before.popleft()
        mask_BxR = np.asarray(rollout.batch[RESPONSE_MASK])
        self.consumed = ConsumedTokens(step, version, rollout.token_versions_BxR, mask_BxR)
        metrics = {
            "timing_s/gen_ahead": seconds,
            **check_staleness(self.consumed, self.lookahead),
            "fully_async/count/current_param_version": float(version),
            "fully_async/pending_rollouts": float(len(self.pending)),
        }
        return rollout.prompts, dataclasses.replace(workers, actor=AheadActor(workers.actor, rollout)), metrics

    def _generate(self, step: int, workers: Workers, version: int) -> Rollout:
        prompts = self.to_batch(next(self.loader))
        t0 = time.perf_counter()
        batch = ready(workers.actor.generate(prompts, step=step))
        seconds = time.perf_counter() - t0
        probe = workers.actor.rollout_metrics()[0]
        token_versions_BxR = np.full(np.shape(batch[RESPONSES]), version, np.int32)  # one call: one version
        return Rollout(step, prompts, batch, version, seconds, gen_parts(workers), probe, token_versions_BxR)

    def discard_pending(self) -> None:
        """Forgets the rollouts generated ahead and not yet consumed, as a restart must: it
        rewinds the loader to a checkpoint's position (`loader_state`, before the first of
        them) or to the start, so the steps after it generate them again from the same prompts
        (on the Ray backend, by the fresh worker processes)."""
        self.pending.clear()
        self._loader_before.clear()
        self.consumed = None

    def loader_state(self) -> Any:
        """The loader's position for a checkpoint: before the first pending rollout's prompts
        (a resumed run generates the pending rollouts again), else where it is."""
        return self._loader_before[0] if self._loader_before else self.loader.state_dict()
