"""Metric sinks: console line, JSONL file, TensorBoard events, Weights & Biases; progress bar.

The metric names are verl's (``critic/score/mean``, ``actor/pg_loss``, ``timing_s/step``, ...)
and are produced elsewhere; a ``MetricsLogger`` only fans a step's dict out to its backends::

    logger = MetricsLogger(run_dir, backends=("console", "jsonl", "tensorboard"),
                           resume_step=restored.step if restored else None, total_steps=1000)
    logger.log(metrics, step)
    logger.close()

``resume_step`` keeps the outputs consistent with restored state: ``metrics.jsonl`` loses its
lines with step > ``resume_step`` and TensorBoard is told to hide those steps. ``None`` means
a fresh run: an old ``metrics.jsonl`` and old event files in the run directory are replaced
(the trainers first move an earlier run's outputs aside,
`jaxflow.trainer.outputs.set_aside_previous_outputs`). ``config`` is written to
``config.json`` (`jaxflow.trainer.outputs.write_run_config`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from jaxflow.trainer.outputs import ClosedOnExit, write_run_config

log = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# key -> short label for the console line (verl's names)
DEFAULT_CONSOLE_KEYS: dict[str, str] = {
    "critic/score/mean": "score",
    "critic/rewards/mean": "reward",
    "actor/pg_loss": "pg_loss",
    "actor/ppo_kl": "ppo_kl",
    "actor/entropy": "entropy",
    "critic/vf_loss": "vf_loss",
    "response_length/mean": "resp_len",
    "timing_s/step": "step_s",
    "perf/throughput": "tok/s",
}


def to_float(value: Any) -> float | None:
    """A Python float for a scalar (Python, numpy or jax, any size-1 array), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 (anything not array-like is "not a scalar")
        return None
    if arr.size != 1 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        return None
    return float(arr.reshape(()))


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        f = to_float(v)
        if f is None:
            warnings.warn(f"metric {k!r} is not a scalar ({type(v).__name__}); not logged", stacklevel=3)
            continue
        out[k] = f
    return out


def fmt4(value: float) -> str:
    """Four significant digits; whole numbers and values in [1e3, 1e6) print without exponent
    (rounded to an integer)."""
    if math.isfinite(value) and abs(value) < 1e6 and (value == int(value) or abs(value) >= 1e3):
        return str(int(round(value)))
    return f"{value:.4g}"


# ----------------------------------------------------------------------------- progress


class ProgressBar:
    """A tqdm bar (i/N, rate, ETA) on ``stream`` (default stderr), drawn only when that is a
    terminal: in a log file or a pipe it would be noise between the one-line-per-step logs.
    ``write`` prints a line above the bar."""

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "train",
        unit: str = "step",
        leave: bool = True,
        stream: TextIO | None = None,
    ):
        from tqdm.auto import tqdm

        self.total, self.n = total, initial
        self._stream = stream or sys.stderr
        tty = self._stream.isatty() if hasattr(self._stream, "isatty") else False
        self._tqdm = (
            tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                file=self._stream,
                leave=leave,
                dynamic_ncols=True,
                mininterval=0.5,
            )
            if tty
            else None
        )

    def update_to(self, n: int) -> None:
        if self._tqdm is not None:
            self._tqdm.update(max(0, n - self._tqdm.n))
        self.n = n

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print ``line`` to ``file`` (default: the bar's stream) without breaking the bar."""
        file = file or self._stream
        if self._tqdm is not None:
            self._tqdm.write(line, file=file)
            return
        file.write(line + "\n")
        file.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None


# ----------------------------------------------------------------------------- backends


class ConsoleBackend:
    """One compact line per step: ``step 12 | score 0.5 | pg_loss -0.01234 | ...``."""

    def __init__(
        self,
        keys: Mapping[str, str] | Sequence[str] = DEFAULT_CONSOLE_KEYS,
        stream: TextIO | None = None,
        progress: ProgressBar | None = None,
    ):
        self.keys = dict(keys) if isinstance(keys, Mapping) else {k: k for k in keys}
        self.stream, self.progress = stream, progress

    def format(self, metrics: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}"]
        parts += [f"{label} {fmt4(metrics[k])}" for k, label in self.keys.items() if k in metrics]
        return " | ".join(parts)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        line = self.format(metrics, step)
        stream = self.stream or sys.stdout
        if self.progress is not None:
            self.progress.write(line, file=stream)
        else:
            stream.write(line + "\n")
            stream.flush()

    def close(self) -> None:
        pass


def truncate_jsonl(path: str | os.PathLike, after_step: int) -> int:
    """Drop the lines of a metrics JSONL file with step > ``after_step`` (and any unreadable
    line, e.g. one a crash cut short); the file is rewritten atomically. Returns lines kept."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= after_step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(kept)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file (unreadable lines skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class JsonlBackend:
    """``{"step": N, "time": t, <metric>: value, ...}`` per line. Non-finite values are written
    as ``NaN``/``Infinity`` (Python's ``json`` reads them)."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            truncate_jsonl(self.path, resume_step)
        self._f = open(self.path, "a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        rec = {"step": int(step), "time": round(time.time(), 3), **metrics}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardBackend:
    """Scalars through ``tensorboardX``. A resumed run opens a new event file whose first event
    purges (hides from TensorBoard) the earlier-written steps after ``resume_step``; a fresh
    run deletes old event files."""

    def __init__(self, logdir: str | os.PathLike, resume_step: int | None):
        from tensorboardX import SummaryWriter

        logdir = Path(logdir)
        if resume_step is None and logdir.is_dir():
            for old in logdir.glob("events.out.tfevents.*"):
                old.unlink()
        # The suffix keeps two writers opened within one second apart, in the order opened.
        self.writer = SummaryWriter(
            logdir=str(logdir),
            filename_suffix=f".{time.time_ns()}.{os.getpid()}",
            purge_step=None if resume_step is None else resume_step + 1,
        )
        self.writer.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """Weights & Biases, resuming the same run id (kept in ``<run_dir>/wandb_run_id``)."""

    def __init__(
        self, run_dir: Path, project: str, experiment: str, config: Mapping[str, Any] | None, resume_step: int | None
    ):
        import wandb  # the caller checked it imports

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
        self.run = wandb.init(
            project=project,
            name=experiment,
            config=dict(config or {}),
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
        )
        id_file.write_text(self.run.id)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


# ----------------------------------------------------------------------------- logger


class MetricsLogger(ClosedOnExit):
    """Fans ``log(metrics, step)`` out to the chosen backends (see the module docstring).

    ``wandb`` is used only when the package imports; otherwise a warning. ``total_steps``
    shows a progress bar (with the console lines printed above it)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        backends: Sequence[str] = ("console", "jsonl", "tensorboard"),
        *,
        project: str = "jaxflow",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        console_keys: Mapping[str, str] | Sequence[str] = DEFAULT_CONSOLE_KEYS,
        resume_step: int | None = None,
        total_steps: int | None = None,
        stream: TextIO | None = None,
    ):
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown metrics backends {sorted(unknown)}; choose from {BACKENDS}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.progress = (
            ProgressBar(total_steps, initial=resume_step or 0, stream=stream) if total_steps is not None else None
        )
        self.backends: dict[str, Any] = {}
        if "console" in backends:
            self.backends["console"] = ConsoleBackend(console_keys, stream=stream, progress=self.progress)
        if "jsonl" in backends:
            self.backends["jsonl"] = JsonlBackend(self.run_dir / JSONL_NAME, resume_step)
        if "tensorboard" in backends:
            self.backends["tensorboard"] = TensorBoardBackend(self.run_dir / TENSORBOARD_DIR, resume_step)
        if "wandb" in backends:
            try:
                import wandb  # noqa: F401
            except ImportError:
                warnings.warn(
                    "wandb backend requested but the wandb package is not installed; skipping it (pip install wandb)",
                    stacklevel=2,
                )
            else:
                cfg = config.to_dict() if hasattr(config, "to_dict") else config
                self.backends["wandb"] = WandbBackend(self.run_dir, project, experiment, cfg, resume_step)
        if config is not None:  # absolute paths; never over a config.json that is not ours
            write_run_config(self.run_dir, config)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        scalars = scalar_metrics(metrics)
        for backend in self.backends.values():
            backend.log(scalars, int(step))
        if self.progress is not None:
            self.progress.update_to(int(step))

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception:  # noqa: BLE001 (one sink failing to close must not hide the others)
                log.exception("closing metrics backend %s failed", name)
        self.backends = {}
        if self.progress is not None:
            self.progress.close()
            self.progress = None
