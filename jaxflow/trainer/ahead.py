"""Rollouts generated ahead of the updates that consume them: the trainer's ``one_step_off`` and
``async`` modes (``trainer.mode``) on the local backend.

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

The staleness of every consumed token is ``version at update - version at generation``
(``fully_async/staleness/token_mean|max``; here all tokens of a rollout share its version). On
the local backend both run on the same devices, one after the other: the schedule and the
off-policy data are those of the asynchronous modes, not their overlap (which needs the
rollout on its own devices with the weights streamed to it, `jaxflow.reshard.WeightSync`).

Checkpoints: the loader's position saved is the one before the first rollout still pending, so
a resumed run generates those rollouts again (same prompts, same seeds; with the checkpoint's
weights, which are at most as stale) and neither skips nor repeats a prompt batch.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from jaxflow.configs.validate import TRAINER_MODES
from jaxflow.data.batch import Batch
from jaxflow.iterations.steps import gen_parts, ready
from jaxflow.workers.group import Workers


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
    generated it, the wall seconds it took and the actor's report of it (the generation's
    parts, the rollout probe)."""

    step: int
    prompts: Batch
    batch: Batch
    version: int
    seconds: float
    parts: dict[str, float]
    probe: dict[str, float]


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
        self._loader_before: collections.deque[Any] = collections.deque()  # the loader's state before each pending pull

    def step(self, step: int, workers: Workers, version: int) -> tuple[Batch, Workers, dict[str, float]]:
        """Step ``step``'s prompts, the workers its iteration runs over, and the metrics of
        generating ahead (``timing_s/gen_ahead``: the rollouts generated now; the staleness of
        the rollout consumed, in policy versions, at ``version``)."""
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
        staleness = float(version - rollout.version)
        metrics = {
            "timing_s/gen_ahead": seconds,
            "fully_async/staleness/token_mean": staleness,
            "fully_async/staleness/token_max": staleness,
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
        return Rollout(step, prompts, batch, version, seconds, gen_parts(workers), probe)

    def loader_state(self) -> Any:
        """The loader's position for a checkpoint: before the first pending rollout's prompts
        (a resumed run generates the pending rollouts again), else where it is."""
        return self._loader_before[0] if self._loader_before else self.loader.state_dict()
