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
int32 aligned with ``responses``): all tokens of a rollout generated in one call share its
version; a partial rollout (``trainer.partial_rollout``, on a rollout pool) interrupted by a
sync and resumed under the new weights carries its ``token_versions`` column instead. The staleness of a consumed token is ``v - u`` for the version ``v`` at
the update that consumes it and the token's version ``u``; `GenerateAhead.step` computes it
from the per-token versions of the rollout it hands out (``fully_async/staleness/token_mean|max``
and the version spans, `jaxflow.trainer.rollout_buffer.consumed_token_metrics`) and raises
`StalenessError` if a valid token (``response_mask = 1``) has ``v - u > lookahead`` or
``v - u < 0``; the last consumed rollout's versions stay readable (`GenerateAhead.consumed`).

Partial rollouts stay within the bound by the schedule (the check enforces it anyway): step
``j``'s rollout is submitted at step ``max(1, j - s)`` with the weights of that step's version
``w0 = max(0, j - s - 1)``, and the pool's version only grows, so each token has ``u >= w0``;
it is consumed at step ``j`` (version ``j - 1``) only once finished, and the pool is synced to
``j - 1`` at the latest at step ``j`` before the wait, so ``u <= j - 1``: the staleness
``j - 1 - u`` lies in ``[0, s]`` (a rollout started at ``v`` and resumed at ``v + 1`` consumed
at ``w``: ``w - v`` and ``w - v - 1``, never more than a whole rollout of ``v``'s).
``fully_async/partial/older_token_ratio``: the consumed valid tokens of an older version than
their row's last.

Where the rollouts run:

* on the actor's devices, one after the other with the updates (either backend; on Ray, the
  actor's worker group generates and trains, the controller keeps the pending rollouts);
* on a rollout pool of their own (``jaxflow.placement.rollout_devices``:
  `jaxflow.trainer.rollouter`; on Ray a worker group of its own hosts,
  `jaxflow.workers.ray.RayRolloutPool`), overlapping the updates: the missing rollouts are handed to
  a `Rollouter` thread that generates them on the pool while this thread runs the update on
  the training devices, and step ``k`` waits only for its own rollout. The pool's weights are
  synced to version ``v`` (``weight_sync/bytes``, ``timing_s/weight_sync``) before the first
  rollout of version ``v`` is submitted, after every rollout in flight has finished (a sync
  replaces the weights they read). The schedule is the same (the same prompts, seeds and
  versions per step), so the overlap changes the timing only; with ``trainer.mode=sync`` the
  pool generates each step's rollout right after the sync, the update waiting for it. With
  ``trainer.partial_rollout`` (and rollouts ahead: ``lookahead >= 1``) the sync interrupts
  the rollout in flight instead of waiting for it (`jaxflow.trainer.rollouter`); its tokens
  after the sync are of the new version, so the rollouts' tokens depend on the timing.

Each step also reports the idle fractions (`GenerateAhead.idle_ratios`):
``fully_async/trainer/idle_ratio`` (the step's share spent waiting for rollouts, or generating
them on the actor's devices) and ``fully_async/rollouter/idle_ratio`` (its share in which
nothing generated).

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

TOKEN_VERSIONS = "token_versions"  # a partial rollout's column: each token's policy version
OLDER_TOKEN_RATIO = "fully_async/partial/older_token_ratio"


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


def older_token_ratio(token_versions_BxR: np.ndarray, response_mask_BxR: np.ndarray) -> float:
    """The share of the valid tokens sampled by an older policy version than their row's
    last token: ``sum_bt m_bt [u_bt < max_t' u_bt'] / sum_bt m_bt`` (0 for rollouts of one
    version; a partial rollout's tokens before its row's last resume)."""
    mask_BxR = response_mask_BxR.astype(bool)
    if not mask_BxR.any():
        return 0.0
    newest_B = np.where(mask_BxR, token_versions_BxR, np.iinfo(np.int32).min).max(axis=1)
    return float((mask_BxR & (token_versions_BxR < newest_B[:, None])).sum() / mask_BxR.sum())


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


def generate_rollout(step: int, prompts: Batch, version: int, actor: Any) -> Rollout:
    """Step ``step``'s rollout of ``prompts`` by ``actor`` (the actor's worker group, or a
    rollout pool seen as one: `jaxflow.trainer.rollouter.PoolGroup`) holding the weights of
    policy ``version``, timed, with its parts, its probe and its per-token versions: the
    batch's ``token_versions`` column where the rollout has one (a partial rollout, resumed
    under newer weights), else ``version`` for every token."""
    t0 = time.perf_counter()
    batch = ready(actor.generate(prompts, step=step))
    seconds = time.perf_counter() - t0
    probe = actor.rollout_metrics()[0]
    if TOKEN_VERSIONS in batch:  # a partial rollout: each token's own (the column leaves the batch)
        token_versions_BxR = np.asarray(batch.pop(TOKEN_VERSIONS)[TOKEN_VERSIONS], np.int32)
    else:  # one call: one version
        token_versions_BxR = np.full(np.shape(batch[RESPONSES]), version, np.int32)
    return Rollout(step, prompts, batch, version, seconds, gen_parts(Workers(actor=actor)), probe, token_versions_BxR)


class GenerateAhead:
    """The rollouts of steps ``k .. k + lookahead`` (none past ``last_step``), generated before
    step ``k``'s update (see the module docstring). ``loader``: the prompt loader (``next``,
    ``state_dict``); ``to_batch``: its items to a prompt `Batch`. ``rollouter``: a
    `jaxflow.trainer.rollouter.Rollouter` generating them on a rollout pool, overlapping the
    updates (None: on the actor's devices, one after the other). ``pending`` holds the
    `Rollout` of each pending step, or its `jaxflow.trainer.rollouter.RolloutFuture` (``step``,
    ``version``) while the rollouter has it."""

    def __init__(
        self, lookahead: int, last_step: int, loader: Any, to_batch: Callable[[Any], Batch], rollouter: Any = None
    ):
        self.lookahead, self.last_step = lookahead, last_step
        self.loader, self.to_batch = loader, to_batch
        self.rollouter = rollouter
        self.pending: collections.deque[Any] = collections.deque()
        self.consumed: ConsumedTokens | None = None  # the tokens of the last rollout handed out
        self._loader_before: collections.deque[Any] = collections.deque()  # the loader's state before each pending pull
        self._waited_s = self._generated_s = 0.0  # this step's: waiting for rollouts; generating on the actor

    def step(self, step: int, workers: Workers, version: int) -> tuple[Batch, Workers, dict[str, float]]:
        """Step ``step``'s prompts, the workers its iteration runs over, and the metrics of
        generating ahead (``timing_s/gen_ahead``: the step's seconds spent on rollouts,
        generating them on the actor's devices or waiting for the rollout pool's; with a pool,
        the sync's ``weight_sync/bytes`` and ``timing_s/weight_sync``, 0 without one; the
        staleness of the rollout consumed, in policy versions, at ``version``, from its
        per-token versions: `check_staleness`, which raises past ``lookahead``)."""
        if self.pending and self.pending[0].step != step:
            raise RuntimeError(f"the rollout of step {self.pending[0].step} is pending, but step {step} runs")
        self._waited_s = self._generated_s = 0.0
        first = self.pending[-1].step + 1 if self.pending else step
        missing = range(first, min(step + self.lookahead, self.last_step) + 1)
        if self.rollouter is None:
            metrics = self._generate(missing, workers, version)
        else:
            metrics = self._submit(missing, version)
        rollout = self._take()
        mask_BxR = np.asarray(rollout.batch[RESPONSE_MASK])
        self.consumed = ConsumedTokens(step, version, rollout.token_versions_BxR, mask_BxR)
        if getattr(self.rollouter, "partial_segment", None) is not None:
            metrics.update(self.rollouter.partial_counts())
            metrics[OLDER_TOKEN_RATIO] = older_token_ratio(rollout.token_versions_BxR, mask_BxR)
        metrics.update(
            {
                "timing_s/gen_ahead": self._waited_s,
                **check_staleness(self.consumed, self.lookahead),
                "fully_async/count/current_param_version": float(version),
                "fully_async/pending_rollouts": float(len(self.pending)),
            }
        )
        return rollout.prompts, dataclasses.replace(workers, actor=AheadActor(workers.actor, rollout)), metrics

    def _generate(self, steps: range, workers: Workers, version: int) -> dict[str, float]:
        """The rollouts of ``steps`` generated now, in order, on the actor's devices."""
        for k in steps:
            before = self.loader.state_dict()
            rollout = generate_rollout(k, self.to_batch(next(self.loader)), version, workers.actor)
            self._loader_before.append(before)
            self.pending.append(rollout)
            self._generated_s += rollout.seconds
        self._waited_s = self._generated_s
        return {}

    def _submit(self, steps: range, version: int) -> dict[str, float]:
        """The rollouts of ``steps`` handed to the rollouter, in order, from the pool's weights
        synced to ``version`` first (after the rollouts in flight: the sync replaces them)."""
        metrics = {"weight_sync/bytes": 0.0, "timing_s/weight_sync": 0.0}
        t0 = time.perf_counter()
        if steps and self.rollouter.version != version:
            metrics = self.rollouter.sync(version)  # waits for the rollouts in flight, or parks them
            self._waited_s += max(0.0, time.perf_counter() - t0 - metrics["timing_s/weight_sync"])
        t1 = time.perf_counter()
        for k in steps:
            before = self.loader.state_dict()
            self.pending.append(self.rollouter.submit(k, self.to_batch(next(self.loader)), version))
            self._loader_before.append(before)
        self._waited_s += time.perf_counter() - t1  # without overlap, the submit generates
        return metrics

    def _take(self) -> Rollout:
        """The first pending rollout, removed (with the rollouter: once generated)."""
        if not isinstance(self.pending[0], Rollout):
            t0 = time.perf_counter()
            self.pending[0] = self.rollouter.wait(self.pending[0])
            self._waited_s += time.perf_counter() - t0
        self._loader_before.popleft()
        return self.pending.popleft()

    def idle_ratios(self, t0: float, t1: float) -> dict[str, float]:
        """The idle fractions of the step that ran from ``t0`` to ``t1`` (``time.perf_counter``):
        the trainer's (its seconds waiting for rollouts, or generating them on its own devices,
        over the step's) and the rollouter's (the step's seconds in which nothing generated:
        on the actor's devices, all but the generation's)."""
        wall = max(t1 - t0, 1e-12)
        busy = self._generated_s if self.rollouter is None else self.rollouter.busy_seconds(t0, t1)
        return {
            "fully_async/trainer/idle_ratio": self._waited_s / wall,
            "fully_async/rollouter/idle_ratio": max(0.0, 1.0 - busy / wall),
        }

    def discard_pending(self) -> None:
        """Forgets the rollouts generated ahead and not yet consumed, as a restart must: it
        rewinds the loader to a checkpoint's position (`loader_state`, before the first of
        them) or to the start, so the steps after it generate them again from the same prompts
        (on the Ray backend, by the fresh worker processes). Those in flight are waited for
        (their errors ignored) and the rollouter's error forgotten (`Rollouter.discard`): the
        next sync replaces the pool's weights."""
        if self.rollouter is not None:
            self.rollouter.discard()
        self.pending.clear()
        self._loader_before.clear()
        self.consumed = None

    def loader_state(self) -> Any:
        """The loader's position for a checkpoint: before the first pending rollout's prompts
        (a resumed run generates the pending rollouts again), else where it is."""
        return self._loader_before[0] if self._loader_before else self.loader.state_dict()

    def close(self) -> None:
        """Stops the rollouter (`jaxflow.trainer.rollouter.Rollouter.close`), if any."""
        if self.rollouter is not None:
            self.rollouter.close()
