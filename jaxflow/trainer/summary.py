"""The end-of-run summary: what a run did and where its outputs are.

    print(run_summary(history, wall_s=412.0, outputs={"metrics": "run/metrics.jsonl", ...}))

    done in 6m52s: 300 steps (1 -> 300)
      training score (critic/score/mean): 0.103 (first) -> 0.850 (last)
      held-out score (val/score/mean):   0.160 (first, step 0) -> 0.914 (best, step 250) -> 0.902 (last, step 300)
      step time: median 0.742 s (measured, 300 steps) vs 0.520 s predicted (auto-mapper, cpu profile; analytic)
      metrics    run/metrics.jsonl
      HF export  run/hf_actor

The step-time line is there when the auto-mapper chose the placement (``predicted``): its
analytic iteration time beside the median of the measured ``timing_s/step``. Scores are read from the history the loop logged (``step`` plus verl's metric names); a
metric the run never logged is left out. An SFT run's summary shows its loss and held-out
greedy accuracy instead (``train=``, ``val=``). The wall time is the whole run's, from the
start of its build (warm start included), measured with ``time.perf_counter``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

TRAIN_KEY = "critic/score/mean"
VAL_KEY = "val/score/mean"
STEP_KEY = "timing_s/step"


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"6m52s"``, ``"1h03m"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _points(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[key])) for r in history if key in r and "step" in r and math.isfinite(float(r[key]))
    ]


def score_trajectory(history: Sequence[Mapping[str, Any]], key: str) -> dict[str, tuple[int, float]] | None:
    """``{"first": (step, value), "best": ..., "last": ...}`` of ``key`` (best = highest, the
    earliest step on ties), or None when it was never logged."""
    pts = _points(history, key)
    if not pts:
        return None
    best = max(pts, key=lambda p: (p[1], -p[0]))
    return {"first": pts[0], "best": best, "last": pts[-1]}


def run_summary(
    history: Sequence[Mapping[str, Any]],
    *,
    wall_s: float,
    outputs: Mapping[str, str | None] = (),
    train: tuple[str, str] = ("training score", TRAIN_KEY),
    val: tuple[str, str] = ("held-out score", VAL_KEY),
    predicted: tuple[str, float] | None = None,
) -> str:
    """The summary text (see the module docstring); ``outputs`` maps a label to a path (None or
    empty: not written, left out). ``train`` and ``val`` are ``(label, metric)`` of the training
    and held-out lines (an SFT run: its loss and greedy accuracy). ``predicted``: ``(by whom,
    seconds)`` of an analytic step time to set beside the measured median."""
    steps = sorted({int(r["step"]) for r in history if "step" in r and int(r["step"]) > 0})
    span = f"{len(steps)} steps ({steps[0]} -> {steps[-1]})" if steps else "no training steps"
    lines = [f"done in {format_duration(wall_s)}: {span}"]
    heads = {name: f"{label} ({key}):" for name, (label, key) in (("train", train), ("val", val))}
    width = max(map(len, heads.values()))
    first_last = score_trajectory(history, train[1])
    if first_last:
        lines.append(
            f"  {heads['train']:<{width}} {first_last['first'][1]:.3f} (first) -> {first_last['last'][1]:.3f} (last)"
        )
    held_out = score_trajectory(history, val[1])
    if held_out:
        lines.append(
            f"  {heads['val']:<{width}} {held_out['first'][1]:.3f} (first, step {held_out['first'][0]}) -> "
            f"{held_out['best'][1]:.3f} (best, step {held_out['best'][0]}) -> "
            f"{held_out['last'][1]:.3f} (last, step {held_out['last'][0]})"
        )
    measured = [s for _, s in _points(history, STEP_KEY)]
    if predicted is not None and measured:
        by, seconds = predicted
        lines.append(
            f"  step time: median {statistics.median(measured):.3f} s (measured, {len(measured)} "
            f"step{'s' * (len(measured) != 1)}) vs "
            f"{seconds:.3f} s predicted ({by}; analytic)"
        )
    width = max((len(k) for k, v in dict(outputs).items() if v), default=0)
    lines += [f"  {label:<{width}}  {path}" for label, path in dict(outputs).items() if path]
    return "\n".join(lines)
