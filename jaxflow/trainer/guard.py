"""The non-finite rule: NaN or Inf in a loss, gradient, reward or in the updated weights
refuses that optimizer step (its params unchanged); after K bad steps in a row the run stops,
leaving the last good checkpoint intact.

The jitted update steps refuse an optimizer step themselves and report
``<role>/update_skipped`` (1 per refused step; the trainer's metric is the mean over the PPO
mini-batches, so 0.25 means one of four refused and three applied). The guard reads a step's
metrics, says what went wrong and how much of the update was refused, counts bad steps in a
row and raises ``NonFiniteError`` at the K-th. While ``guard.healthy`` is False the trainer does
not save a checkpoint (and so prunes none), so the last good one stays the latest::

    guard = NonFiniteGuard(max_consecutive=3)
    for step in ...:
        metrics = ppo_iteration(...)
        if guard.check(metrics, step) and ckpt.should_save(step):
            ckpt.save(step, ...)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxflow.trainer.metrics import to_float

log = logging.getLogger(__name__)

# A metric is watched for NaN/Inf when one of these occurs in its name.
DEFAULT_WATCH = ("loss", "grad_norm", "reward", "score", "advantage")
SKIP_SUFFIX = "update_skipped"


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with non-finite losses, gradients or rewards."""


def non_finite_keys(metrics: Mapping[str, Any], watch: Sequence[str] = DEFAULT_WATCH) -> list[str]:
    """Watched metrics whose value is NaN or +-Inf, sorted."""
    bad = []
    for key, value in metrics.items():
        if any(w in key for w in watch):
            f = to_float(value)
            if f is not None and not math.isfinite(f):
                bad.append(key)
    return sorted(bad)


def skipped_keys(metrics: Mapping[str, Any]) -> list[str]:
    """``*/update_skipped`` metrics that are set (the worker refused its update)."""
    out = []
    for key, value in metrics.items():
        if key.rsplit("/", 1)[-1] == SKIP_SUFFIX:
            flags = np.asarray(value, dtype=np.float64)
            if np.any(flags != 0):  # NaN counts as set
                out.append(key)
    return sorted(out)


def refused_fraction(value: Any) -> float:
    """The share of refused optimizer steps in an ``update_skipped`` metric (per-step flags or
    their mean); NaN counts as refused."""
    flags = np.asarray(value, dtype=np.float64)
    return float(np.mean(np.where(np.isnan(flags), 1.0, flags))) if flags.size else 0.0


class NonFiniteGuard:
    """Counts consecutive bad steps; ``check`` returns True for a good step."""

    def __init__(self, max_consecutive: int = 3, *, watch: Sequence[str] = DEFAULT_WATCH):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.watch = tuple(watch)
        self.consecutive = 0
        self.total_bad = 0
        self.bad_steps: list[int] = []  # of the current run of bad steps

    @property
    def healthy(self) -> bool:
        return self.consecutive == 0

    def check(self, metrics: Mapping[str, Any], step: int) -> bool:
        nonfinite = non_finite_keys(metrics, self.watch)
        skipped = skipped_keys(metrics)
        if not nonfinite and not skipped:
            if self.consecutive:
                log.info("step %d: finite again after %d refused update(s)", step, self.consecutive)
            self.consecutive = 0
            self.bad_steps = []
            return True
        self.consecutive += 1
        self.total_bad += 1
        self.bad_steps.append(step)
        what = []
        if nonfinite:
            what.append("non-finite " + ", ".join(f"{k}={to_float(metrics[k])}" for k in nonfinite))
        refused = [refused_fraction(metrics[k]) for k in skipped]
        for key, frac in zip(skipped, refused):
            role = key.rsplit("/", 1)[0]
            what.append(
                f"{role} refused every optimizer step, its params unchanged"
                if frac >= 1
                else f"{role} refused {frac:.0%} of its optimizer steps (the others applied)"
            )
        msg = (
            f"step {step}: {'; '.join(what)}; not saving checkpoints until a good step; "
            f"{self.consecutive} bad step(s) in a row, the run stops at {self.max_consecutive}"
        )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{msg}. Stopping: {self.consecutive} consecutive steps ({self.bad_steps}) had "
                "non-finite losses, gradients or rewards; the last good checkpoint is left intact"
            )
        log.warning(msg)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "total_bad": self.total_bad, "bad_steps": list(self.bad_steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total_bad = int(state.get("total_bad", 0))
        self.bad_steps = list(state.get("bad_steps", []))
