"""End-of-run line plots of chosen metrics over steps (matplotlib, Agg canvas, no pyplot state).

One panel per entry of ``panels``; an entry is a metric key or a tuple of keys drawn together
(told apart by colour, with a legend). Each series is drawn raw (faint) and smoothed (solid):
the smoothed line (for series of at least ``MIN_POINTS_TO_SMOOTH`` points; sparser ones, such
as validation scores, are drawn raw with markers) is an exponential moving average with
TensorBoard's debiasing,

    s_t = a s_{t-1} + (1 - a) x_t,   shown as s_t / (1 - a^t)     (a = ``smoothing``),

over the finite points only. Non-finite points break the raw line.

    plot_run(run_dir)                       # metrics.jsonl -> <run_dir>/metrics.png
    plot_metrics(history, [("critic/score/mean", "val/score/mean"), "actor/ppo_kl"], path)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxflow.trainer.metrics import JSONL_NAME, read_jsonl, to_float

DEFAULT_PANELS: tuple[tuple[str, ...], ...] = (
    ("critic/score/mean", "val/score/mean", "critic/rewards/mean"),
    ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss"),
)
# matplotlib's tab10 colours, in order: the n-th series of a panel gets the n-th.
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))
DPI = 100
MIN_POINTS_TO_SMOOTH = 20


def smooth(values_T: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average of the finite entries (NaN where the input is not
    finite); see the module docstring."""
    out = np.full(values_T.shape, np.nan)
    acc, norm = 0.0, 0.0
    for t, x in enumerate(values_T):
        if not np.isfinite(x):
            continue
        acc = weight * acc + (1 - weight) * x
        norm = weight * norm + (1 - weight)
        out[t] = acc / norm
    return out


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((r["step"], to_float(r[key])) for r in history if key in r and "step" in r)
    steps = np.array([s for s, _ in pts], dtype=float)
    values = np.array([np.nan if v is None else v for _, v in pts], dtype=float)
    return steps, values


def render(
    history: Sequence[Mapping[str, Any]],
    panels: Sequence[str | Sequence[str]],
    *,
    width: int = 960,
    panel_height: int = 300,
    smoothing: float = 0.6,
):
    """A matplotlib ``Figure`` of the metric ``panels`` over ``history`` (dicts with a ``step``),
    ``width`` x ``panel_height`` pixels per panel. Keys absent from every record are left out;
    so are panels left empty."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = set().union(*(r.keys() for r in history)) if history else set()
    groups = [keys for p in panels if (keys := [k for k in ((p,) if isinstance(p, str) else p) if k in present])]
    if not groups:
        raise ValueError(f"none of the metrics {list(panels)} is in the history")
    fig = Figure(figsize=(width / DPI, panel_height * len(groups) / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 1, squeeze=False)[:, 0]
    for ax, keys in zip(axes, groups):
        for i, key in enumerate(keys):
            color = tuple(c / 255 for c in COLORS[i % len(COLORS)])
            steps, values = _series(history, key)
            z = 2 + len(keys) - i  # the first key on top (e.g. the score over an equal reward)
            if np.isfinite(values).sum() < MIN_POINTS_TO_SMOOTH:
                ax.plot(steps, values, "o-", color=color, linewidth=2, markersize=4, label=key, zorder=z)
                continue
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1, zorder=z)
            ok = np.isfinite(values)
            ax.plot(steps[ok], smooth(values, smoothing)[ok], color=color, linewidth=2, label=key, zorder=z)
        ax.grid(True, color="0.9")
        ax.set_xlabel("step")
        ax.legend(loc="best", fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    return fig


def plot_metrics(
    history: Sequence[Mapping[str, Any]], panels: Sequence[str | Sequence[str]], path: str | os.PathLike, **kwargs: Any
) -> Path:
    """Render ``panels`` of ``history`` and write the PNG to ``path`` (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    render(history, panels, **kwargs).savefig(tmp, dpi=DPI)
    os.replace(tmp, path)
    return path


def plot_run(
    run_dir: str | os.PathLike,
    panels: Sequence[str | Sequence[str]] = DEFAULT_PANELS,
    filename: str = "metrics.png",
    **kwargs: Any,
) -> Path:
    """Plot ``<run_dir>/metrics.jsonl`` (default: training and validation score, KL) to
    ``<run_dir>/<filename>``."""
    run_dir = Path(run_dir)
    return plot_metrics(read_jsonl(run_dir / JSONL_NAME), panels, run_dir / filename, **kwargs)
