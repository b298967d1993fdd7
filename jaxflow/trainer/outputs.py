"""What a run owns in its directory, and how it keeps its hands off everything else.

    lock = RunDirLock(run_dir)                    # one writer per directory, for the run's lifetime
    moved = set_aside_previous_outputs(run_dir)   # a fresh run never overwrites an earlier one's outputs
    write_run_config(run_dir, cfg)                # config.json, never over a file that is not ours

* **One run per directory.** Two runs writing one directory corrupt each other (the start-up
  cleanup of one moves the other's save in progress aside). A writer holds an exclusive
  ``fcntl.flock`` on ``<run_dir>/.jaxflow.lock`` while it runs; a second one is refused with
  :class:`RunDirInUseError`. The kernel drops the lock when the process dies (even SIGKILL), so
  a crashed run never leaves the directory locked.
* **A fresh run keeps the last one's outputs.** The files a run writes beside its checkpoints
  (``RUN_OUTPUTS``: metrics, TensorBoard events, plot, HF export, warm start, config) are moved
  into ``previous-<time>/`` before a run that starts from step 0 writes its own; a run that
  resumes continues them instead.
* **config.json is ours or untouched.** A run directory may be a user's own (``.``); a
  ``config.json`` there that is not a jaxflow run config is never replaced.
* **Absolute paths.** The saved config names every local path absolutely, so the run can be
  exported (``python -m jaxflow.export``) from any working directory.
* **Storage that refuses a write** (full, read-only, no permission) is one line naming the file
  and the cause (`storage_error`), for the run and the export alike.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCK_NAME = ".jaxflow.lock"
CONFIG_NAME = "config.json"
PREVIOUS_PREFIX = "previous-"
# What a run writes beside its checkpoints (the log file is appended to and stays).
RUN_OUTPUTS = (
    "metrics.jsonl",
    "metrics.png",
    "tensorboard",
    "hf_actor",
    "sft_warm_start",
    "sft_warm_start_run",
    "wandb_run_id",
    CONFIG_NAME,
)
# Keys whose values are local paths (comma-separated lists for the data files).
PATH_KEYS = (
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "reward_model.model.path",
    "jaxflow.safe_rlhf.cost_model_path",
    "custom_reward_function.path",
    "trainer.default_local_dir",
    "trainer.resume_from_path",
    "jaxflow.sft.output_dir",
    "jaxflow.data.tokenizer",
)


class RunDirInUseError(RuntimeError):
    """Another process holds the run directory's lock."""


class NotOursError(FileExistsError):
    """A path jaxflow would write holds something jaxflow did not write."""


class ClosedOnExit(contextlib.AbstractContextManager):
    """A writer of run outputs that a ``with`` block closes: ``__enter__`` returns it,
    ``__exit__`` calls its :meth:`close` (whether the block raised or not)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finishes what the writer has in flight and releases what it holds."""

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunDirLock:
    """An exclusive lock on ``directory`` (``<directory>/.jaxflow.lock``, ``fcntl.flock``) until
    ``release()`` or the process ends. Raises :class:`RunDirInUseError` naming the directory
    and the holder's pid when another process holds it."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_NAME
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            self._fd = None
            raise RunDirInUseError(
                f"{self.directory} is in use by another jaxflow run (pid {holder}); wait for it to end, or give "
                "this run another directory (trainer.default_local_dir)"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:  # an owner dropped without release (e.g. a trainer never fitted)
        self.release()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_run_config(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a run config jaxflow wrote (a JSON object with the base config's
    top-level sections)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size > 1 << 24:  # a device (/dev/full), a directory, a huge file
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"data", "actor_rollout_ref", "trainer", "jaxflow"} <= set(data)


def check_run_config_target(run_dir: str | os.PathLike) -> None:
    """Raise :class:`NotOursError` when ``<run_dir>/config.json`` exists and is not a jaxflow
    run config (the run would replace it)."""
    path = Path(run_dir) / CONFIG_NAME
    if path.exists() and not is_run_config(path):
        raise NotOursError(
            f"{path.absolute()} exists and is not a jaxflow run config; jaxflow writes its run "
            "config there and never replaces a file of yours: move it, or give the run another "
            "directory (trainer.default_local_dir)"
        )


def set_aside_previous_outputs(run_dir: str | os.PathLike, names: tuple[str, ...] = RUN_OUTPUTS) -> Path | None:
    """Move the outputs of an earlier run (``names`` present in ``run_dir``) into
    ``<run_dir>/previous-<time>/``, with one console line; the new directory, or None when
    there was nothing to move. A ``config.json`` that is not ours is refused (never moved)."""
    run_dir = Path(run_dir).absolute()
    check_run_config_target(run_dir)
    present = [name for name in names if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir / f"{PREVIOUS_PREFIX}{stamp}"
    n = 1
    while target.exists():
        target = run_dir / f"{PREVIOUS_PREFIX}{stamp}-{n}"
        n += 1
    target.mkdir()
    for name in present:
        os.replace(run_dir / name, target / name)
    print(
        f"jaxflow: a fresh run in {run_dir}: moved the previous run's {', '.join(present)} to {target} "
        "(nothing was deleted)",
        flush=True,
    )
    return target


def _absolute(value: str, always: bool) -> str:
    """``value`` (comma-separated paths) with each local path made absolute; a name that is not
    a local path (``preset:NAME``, a hub id, ``char``) is kept."""
    parts = []
    for part in value.split(","):
        p = part.strip()
        parts.append(os.path.abspath(p) if p and (always or os.path.exists(p)) else part)
    return ",".join(parts)


def absolute_paths(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the config dict ``cfg`` with the local paths of ``PATH_KEYS`` absolute (the
    outputs always, inputs when they exist here)."""
    out = json.loads(json.dumps(cfg, default=str))
    outputs = ("trainer.default_local_dir", "jaxflow.sft.output_dir")
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = out
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf]:
            node[leaf] = _absolute(node[leaf], always=key in outputs)
    return out


def write_run_config(run_dir: str | os.PathLike, cfg: Any) -> Path:
    """Write the run's config (a ``ConfigDict`` or dict) to ``<run_dir>/config.json`` with
    absolute paths, atomically; never over a file that is not a jaxflow run config."""
    run_dir = Path(run_dir)
    check_run_config_target(run_dir)
    data = absolute_paths(cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg))
    path = run_dir / CONFIG_NAME
    tmp = run_dir / f".{CONFIG_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
    return path


# errno values that mean "the user's storage refused the write", not a bug.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_FULL = " (is the disk full?)"
# The same, as libraries that are not Python's OSError say it (tensorstore, safetensors), with a hint.
_STORAGE_TEXTS = {
    "No space left on device": _FULL,
    "Disk quota exceeded": _FULL,
    "File too large": _FULL,
    "Read-only file system": "",
    "Permission denied": "",
}
_QUOTED_PATH = re.compile(r"""["'](/[^"']+)["']""")


def _chain(e: BaseException) -> list[BaseException]:
    out = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def storage_error(e: BaseException) -> str | None:
    """One line for an exception caused by the storage (disk full, read-only, no permission),
    or None: what ``python -m jaxflow.run`` and ``python -m jaxflow.export`` say for it."""
    for cause in _chain(e):
        if isinstance(cause, OSError) and cause.errno in _STORAGE_ERRNOS:
            where = f" {cause.filename}" if cause.filename else ""
            hint = _FULL if cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
            return f"cannot write{where}: {cause.strerror}{hint}"
        text = str(cause)
        for known, hint in _STORAGE_TEXTS.items():
            if known in text:  # the file: the last absolute path the message quotes
                paths = _QUOTED_PATH.findall(text)
                return f"cannot write{f' {paths[-1]}' if paths else ''}: {known}{hint}"
    return None
