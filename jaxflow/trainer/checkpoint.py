"""Training checkpoints: sharded array trees with orbax, host state as JSON, verl's resume modes.

Layout of ``directory``::

    step_10/
      actor_params/ actor_opt_state/ critic_params/ ...   one orbax item per array tree
      host/                                               JSON: step, data-loader position, RNG, ...
      _CHECKPOINT_METADATA                                orbax's step metadata
      jaxflow_checkpoint.json                             our commit marker (written last): the items, the
                                                          run's experiment record and config
      hf_actor/                                           optional HF export (trainer.save_hf, written by
                                                          jaxflow.trainer.hf_export after the step is complete)

Crash safety. Orbax writes a step to ``step_N.orbax-checkpoint-tmp-<t>/`` and renames it to
``step_N`` once every item is on disk (on object stores without atomic rename it writes
``commit_success.txt`` instead). A save killed before that leaves only the tmp directory, which
orbax never lists. On top of that we write ``jaxflow_checkpoint.json`` (tmp file + ``os.replace``)
after orbax reports the step finished: a checkpoint is *complete* only with that marker, so a
step directory that a non-atomic rename or copy left half-written is never resumed from. A
writer removes orbax's tmp directories when it opens the directory and moves marker-less
``step_N`` directories aside (``step_N.incomplete-<time>``); a reader ignores both.

Nothing a user has is deleted except by the retention rule (``max_to_keep``, applied only after
a newer step is complete): a fresh run (``resume_mode="disable"``) in a directory that holds
checkpoints is refused, and steps that a run resumed from an earlier step would overwrite are
moved aside (``step_N.abandoned-<time>``), never removed.

One writer at a time: a writing manager holds the directory's lock (`RunDirLock`) from its
start-up cleanup until ``close()``; a second writer is refused (``RunDirInUseError``), since its
cleanup would move the first one's save in progress aside.

Restoring reads each array straight into the sharding of its target
(``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``): every device reads only its shard, so a
sharded run restores sharded without a full copy anywhere. A target leaf ``SKIP`` is not read
(e.g. the optimizer moments when only the parameters are wanted).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxflow.models.hf_io import CheckpointError
from jaxflow.trainer.outputs import ClosedOnExit, RunDirLock
from jaxflow.workers.checkpoint_io import as_restore_target, flatten_tree, save_item
from jaxflow.workers.train_state import tree_all_finite

log = logging.getLogger(__name__)

PyTree = Any
MARKER = "jaxflow_checkpoint.json"
HOST_ITEM = "host"
HF_ACTOR_DIR = "hf_actor"
STEP_PREFIX = "step"
RESUME_MODES = ("disable", "auto", "resume_path")
_STEP_RE = re.compile(rf"^{STEP_PREFIX}_(0|[1-9]\d*)$")
_TMP_MARK = "orbax-checkpoint-tmp"  # orbax's name for a step not yet committed; ours (`ItemIO`) too
_TMP_RE = re.compile(rf"^{STEP_PREFIX}_\d+\.{_TMP_MARK}")
_ITEM_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_FORMAT_VERSION = 1
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's step metadata file (it reads one in every step)
_ARRAY_HANDLER, _JSON_HANDLER = (
    f"{h.__module__}.{h.__qualname__}" for h in (ocp.StandardCheckpointHandler, ocp.JsonCheckpointHandler)
)
SKIP = ocp.PLACEHOLDER  # a restore target leaf that is not read (comes back as SKIP)


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tree structure or shapes differ from the restore targets."""


class ExperimentMismatchError(CheckpointError):
    """The checkpoint to resume records another experiment (`CheckpointManager`'s
    ``experiment``); ``differences`` names each field that differs."""

    def __init__(self, message: str, *, path: Path, differences: list[str]):
        super().__init__(message)
        self.path, self.differences = path, differences


class DamagedCheckpointError(CheckpointError):
    """A complete checkpoint's files cannot be read (truncated, corrupted); names step and item."""

    def __init__(self, message: str, *, step: int | None, item: str, reason: str):
        super().__init__(message)
        self.step, self.item, self.reason = step, item, reason


def _root_cause(e: BaseException) -> str:
    """The innermost cause of an exception chain, as one line (orbax wraps the real error)."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


@dataclasses.dataclass
class HostState:
    """Host-side (JSON) state saved beside the arrays.

    ``rng`` may be a jax key array (typed or raw ``uint32``), a numpy ``Generator`` state dict
    (``gen.bit_generator.state``), a legacy ``RandomState.get_state()`` tuple, or any JSON-able
    value; it comes back as the same kind of object. ``metrics_tail`` holds the last few metric
    dicts; ``extra`` anything else JSON-able.
    """

    data_loader: dict[str, Any] = dataclasses.field(default_factory=dict)
    rng: Any = None
    metrics_tail: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ItemIO:
    """An array item that is written and read where its arrays live, e.g. by the processes of a
    worker group, each its own shards (`jaxflow.workers.checkpoint_io`), so that whoever saves
    the step never holds them. ``write(path)`` writes the item as the orbax item directory
    ``path``; ``read(path)`` restores it in place; ``abstract`` is its tree of shapes and
    dtypes (what `CheckpointManager.restore` checks the stored item against). An exception of
    ``not_damage`` raised by ``read`` is not the checkpoint's fault (e.g. a worker died) and
    is re-raised as it is."""

    write: Callable[[str], Any]
    read: Callable[[str], Any]
    abstract: Any
    not_damage: tuple[type[BaseException], ...] = ()


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore`` returns: the step, the array trees by item name, the host state."""

    step: int
    arrays: dict[str, PyTree]
    host: HostState
    path: Path


# ----------------------------------------------------------------------------- JSON host state


def encode_json(obj: Any) -> Any:
    """JSON-able form of ``obj``; jax keys, numpy arrays and tuples are tagged so that
    ``decode_json`` gives them back exactly."""
    if isinstance(obj, jax.Array) and jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.device_get(jax.random.key_data(obj)))
        return {"__jax_key__": str(jax.random.key_impl(obj)), "data": encode_json(data)}
    if isinstance(obj, (jax.Array, np.ndarray)):
        arr = np.asarray(jax.device_get(obj))
        return {"__ndarray__": arr.dtype.str, "shape": list(arr.shape), "data": arr.ravel().tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_json(x) for x in obj]}
    if isinstance(obj, list):
        return [encode_json(x) for x in obj]
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"host state keys must be strings, got {k!r}")
            out[k] = encode_json(v)
        return out
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot save {type(obj).__name__} in the host state (not JSON-able): {obj!r}")


def decode_json(obj: Any) -> Any:
    """Inverse of ``encode_json``."""
    if isinstance(obj, list):
        return [decode_json(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__jax_key__" in obj:
        data = decode_json(obj["data"])
        return jax.random.wrap_key_data(data, impl=obj["__jax_key__"])
    if "__ndarray__" in obj:
        return np.asarray(obj["data"], dtype=np.dtype(obj["__ndarray__"])).reshape(obj["shape"])
    if "__tuple__" in obj:
        return tuple(decode_json(x) for x in obj["__tuple__"])
    return {k: decode_json(v) for k, v in obj.items()}


# ----------------------------------------------------------------------------- tree checks


def _key_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _target_shape(leaf: Any) -> tuple[int, ...] | None:
    """Stored shape of a restore target leaf (typed keys are stored as their key data)."""
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return None
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)).shape)
    return tuple(leaf.shape)


def check_tree_matches(stored: PyTree, target: PyTree, *, item: str, where: str) -> None:
    """Raise ``CheckpointMismatchError`` naming the first key whose presence or shape differs."""
    flat_stored = ocp.tree.to_flat_dict(stored)
    flat_target = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(target, keep_empty_nodes=False))
    for key in sorted(set(flat_stored) | set(flat_target), key=_key_str):
        if key not in flat_target:
            raise CheckpointMismatchError(
                f"{where}: item {item!r} has key {_key_str(key)!r} (shape "
                f"{tuple(flat_stored[key].shape)}) that the restore target lacks"
            )
        if key not in flat_stored:
            raise CheckpointMismatchError(
                f"{where}: restore target for item {item!r} has key {_key_str(key)!r} (shape "
                f"{_target_shape(flat_target[key])}) that the checkpoint lacks"
            )
        got, want = getattr(flat_stored[key], "shape", None), _target_shape(flat_target[key])
        if got is not None and want is not None and tuple(got) != want:
            raise CheckpointMismatchError(
                f"{where}: item {item!r} key {_key_str(key)!r} has shape {tuple(got)} in the "
                f"checkpoint but the target expects {want}"
            )


_tree_all_finite = jax.jit(tree_all_finite)


def all_finite(tree: PyTree) -> bool:
    """True when no floating-point leaf of ``tree`` holds NaN or Inf (reduced on the devices)."""
    return bool(_tree_all_finite(tree))


def _restore_args(flat_target: dict[str, Any]) -> Any:
    """Orbax's restore arguments for one item (a flat dict of abstract leaves); ``SKIP`` leaves
    are left out of a partial restore, so their bytes are never read."""
    if not any(leaf is SKIP for leaf in flat_target.values()):
        return ocp.args.StandardRestore(flat_target)
    kept = {key: leaf for key, leaf in flat_target.items() if leaf is not SKIP}
    return ocp.args.PyTreeRestore(
        item=kept, restore_args=ocp.checkpoint_utils.construct_restore_args(kept), partial_restore=True
    )


def _restore_items(path: Path, args: dict[str, Any]) -> dict[str, Any]:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        return ckptr.restore(path, args=ocp.args.Composite(**args))


def _readable(path: Path, name: str, arg: Any) -> bool:
    """Whether item ``name`` of the step directory ``path`` restores on its own."""
    try:
        _restore_items(path, {name: arg})
        return True
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------- step directories


def step_of(path: str | os.PathLike) -> int | None:
    """The step of a ``step_N`` directory name, or None."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_complete(path: str | os.PathLike) -> bool:
    """True for a finished ``step_N`` checkpoint directory (orbax finalised it and our marker is
    there)."""
    path = Path(path)
    return step_of(path) is not None and path.is_dir() and (path / MARKER).is_file()


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in ``directory``, ascending (touches no device)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(step_of(p) for p in directory.iterdir() if is_complete(p))


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The commit marker of the step directory ``path`` (``{}`` when absent or unreadable):
    ``step``, ``items``, and for steps saved since it was recorded, the run's ``experiment``
    and ``config``."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def experiment_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"field: recorded (there) vs current (here)"`` for each field of two experiment
    records that differs (fields missing on one side count as differences)."""
    return [
        f"{key} {recorded.get(key, 'none')} there, {current.get(key, 'none')} here"
        for key in sorted(set(recorded) | set(current))
        if recorded.get(key) != current.get(key)
    ]


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager(ClosedOnExit):
    """Saves and restores training state under ``directory`` (``step_N`` subdirectories).

    ``resume_mode`` follows verl: ``"disable"`` starts fresh (a directory that already holds
    checkpoints is an error: ``FileExistsError``; nothing is deleted), ``"auto"`` continues
    from the latest complete checkpoint if there is one, ``"resume_path"`` from the step
    directory ``resume_path`` (any directory; later saves still go to ``directory``).

    ``experiment``: what identifies the run (e.g. algorithm, task, roles, model shapes; a JSON
    object of one-line values), recorded in every step's marker with ``run_config`` (the run's
    whole config, set once it is known). A writer refuses, before it touches the directory, to
    resume a step whose recorded experiment differs (`ExperimentMismatchError`, naming each
    difference) unless ``other_experiment_ok``; steps that record none are resumed.

    ``save`` writes a step when ``step % save_interval_steps == 0`` or ``force=True`` and keeps
    the latest ``max_to_keep`` complete steps (None: all). A save at step N first moves any
    complete steps >= N in ``directory`` aside to ``step_M.abandoned-<time>``: they belong to a
    run that was abandoned by resuming from an earlier step. One process (group) writes a
    directory at a time; open it with
    ``read_only=True`` to read while another run writes.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        resume_mode: str = "auto",
        resume_path: str | os.PathLike | None = None,
        async_save: bool = False,
        read_only: bool = False,
        experiment: Mapping[str, Any] | None = None,
        other_experiment_ok: bool = False,
    ):
        if resume_mode not in RESUME_MODES:
            raise ValueError(f"resume_mode must be one of {RESUME_MODES}, got {resume_mode!r}")
        if resume_mode == "resume_path" and resume_path is None:
            raise ValueError('resume_mode="resume_path" needs resume_path (a step_N directory)')
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        self.directory = Path(directory).absolute()
        self.resume_mode = resume_mode
        self.resume_path = Path(resume_path).absolute() if resume_path is not None else None
        self.read_only = read_only
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self._async = async_save
        self._pending: list[tuple[int, list[str]]] = []  # saved by orbax, marker not yet written
        self._broken = False  # a save was cut short
        self._primary = jax.process_index() == 0
        self._lock: RunDirLock | None = None
        self._mgr = None
        self.experiment = dict(experiment) if experiment is not None else None
        self.run_config: dict[str, Any] | None = None  # recorded in each step's marker

        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self._primary:
                self._lock = RunDirLock(self.directory)  # before the clean-up: another writer's save is not debris
            try:
                if self.experiment is not None and not other_experiment_ok:
                    self._check_experiment()  # before the clean-up: a refused run changes nothing
                if self._primary:
                    self._remove_incomplete()
                if resume_mode == "disable" and self.all_steps():
                    raise FileExistsError(
                        f'resume_mode="disable" (a fresh run) but {self.directory} already holds checkpoints '
                        f'(steps {self.all_steps()}); nothing was deleted. Continue them with resume_mode="auto" '
                        "or start the fresh run in another directory"
                    )
            except BaseException:
                self._release()
                raise

            self._mgr = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    step_prefix=STEP_PREFIX,
                    # We delete old steps ourselves, after the new step's marker is down: orbax
                    # would delete them as soon as it renamed the new one, before that is complete.
                    preservation_policy=ocp.checkpoint_managers.preservation_policy.PreserveAll(),
                    enable_async_checkpointing=async_save,
                ),
            )

    def _check_experiment(self) -> None:
        """Raises `ExperimentMismatchError` when the step to resume records another experiment."""
        path = self.resume_dir()
        recorded = read_marker(path).get("experiment") if path is not None else None
        if not isinstance(recorded, dict):
            return
        differences = experiment_differences(recorded, self.experiment)
        if differences:
            raise ExperimentMismatchError(
                f"{path} is a checkpoint of another experiment ({'; '.join(differences)}); nothing was changed",
                path=path,
                differences=differences,
            )

    # ------------------------------------------------------------------ listing

    def step_dir(self, step: int) -> Path:
        return self.directory / f"{STEP_PREFIX}_{step}"

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints in ``directory``, ascending."""
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        """The latest complete step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` writes (every ``save_interval_steps`` steps)."""
        return not self.read_only and step % self.save_interval_steps == 0

    def resume_dir(self) -> Path | None:
        """The step directory that ``resume_mode`` says to continue from, or None to start fresh.
        Raises ``FileNotFoundError`` for a ``resume_path`` that is missing or incomplete."""
        if self.resume_mode == "disable":
            return None
        if self.resume_mode == "auto":
            step = self.latest_step()
            return None if step is None else self.step_dir(step)
        path = self.resume_path
        assert path is not None
        if not path.is_dir():
            raise FileNotFoundError(
                f"resume_path {path} does not exist (expected a {STEP_PREFIX}_N checkpoint directory)"
            )
        if not is_complete(path):
            why = (
                f"its name is not {STEP_PREFIX}_N"
                if step_of(path) is None
                else f"it has no {MARKER}: an interrupted save?"
            )
            raise FileNotFoundError(f"resume_path {path} is not a complete checkpoint ({why})")
        return path

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        arrays: Mapping[str, PyTree],
        host: HostState | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save ``arrays`` (item name -> pytree of jax arrays, e.g. ``actor_params``,
        ``actor_opt_state``) and ``host`` at ``step``. Returns whether a checkpoint was written
        (False between save intervals unless ``force``). With ``async_save`` the arrays are
        copied off the devices before this returns and written in the background; the step is
        complete after ``wait()`` (or the next ``save``/``close``)."""
        if self.read_only or self._mgr is None:
            raise RuntimeError(f"checkpoint manager for {self.directory} is read-only")
        for name in arrays:
            if not _ITEM_RE.match(name) or name == HOST_ITEM:
                raise ValueError(f"bad item name {name!r}: use identifiers other than {HOST_ITEM!r}")
        if not force and not self.should_save(step):
            return False
        self.wait()
        superseded = [s for s in self.all_steps() if s >= step]
        if superseded:
            for s in superseded:
                moved = self._move_aside(self.step_dir(s), "abandoned")
                log.warning(
                    "saving step %d: moved checkpoint step %d of an abandoned run to %s (delete it "
                    "when no longer needed)",
                    step,
                    s,
                    moved,
                )
            self._mgr.reload()
        host = host if host is not None else HostState()
        host_json = {
            "format": _FORMAT_VERSION,
            "step": int(step),
            "data_loader": encode_json(host.data_loader),
            "rng": encode_json(host.rng),
            "metrics_tail": encode_json(list(host.metrics_tail)),
            "extra": encode_json(host.extra),
        }
        if any(isinstance(tree, ItemIO) for tree in arrays.values()):
            self._save_by_items(step, arrays, host_json)
            return True
        items = {name: ocp.args.StandardSave(flatten_tree(tree)[0]) for name, tree in arrays.items()}
        items[HOST_ITEM] = ocp.args.JsonSave(host_json)
        try:
            saved = self._mgr.save(step, args=ocp.args.Composite(**items), force=True)
        except BaseException:  # Ctrl-C, disk full, ...: the step stays incomplete (no marker)
            self._broken = True
            raise
        if not saved:
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
        self._pending.append((step, sorted(arrays)))
        if not self._async:
            self.wait()
        return True

    def _save_by_items(self, step: int, arrays: Mapping[str, Any], host_json: dict[str, Any]) -> None:
        """`save` with items written where their arrays live (`ItemIO`): every item into a
        temporary step directory (the processes holding an item write its shards, orbax's
        primary writes its metadata), then the host state; the directory is renamed to
        ``step_N`` once all is down, then the marker. A save cut short leaves the temporary
        directory, which the next writer removes, or a marker-less step it moves aside."""
        started = time.time_ns()
        tmp = self.directory / f"{STEP_PREFIX}_{step}.{_TMP_MARK}-jaxflow-{started}"
        try:
            tmp.mkdir()
            for name, tree in arrays.items():
                if isinstance(tree, ItemIO):
                    tree.write(str(tmp / name))
                else:
                    save_item(tmp / name, tree)
            with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
                checkpointer.save(tmp / HOST_ITEM, args=ocp.args.JsonSave(host_json))
            if self._primary:  # what orbax writes for a step it saves itself (else it warns on every read)
                handlers = {name: _ARRAY_HANDLER for name in arrays} | {HOST_ITEM: _JSON_HANDLER}
                _write_json_atomic(
                    tmp / ORBAX_STEP_METADATA,
                    {
                        "item_handlers": handlers,
                        "metrics": {},
                        "performance_metrics": {},
                        "init_timestamp_nsecs": started,
                        "commit_timestamp_nsecs": time.time_ns(),
                        "custom_metadata": {},
                    },
                )
            os.replace(tmp, self.step_dir(step))
        finally:
            self._mgr.reload()
        self._pending.append((step, sorted(arrays)))
        self.wait()

    def wait(self) -> None:
        """Block until background saves are on disk, then mark them complete."""
        if self._mgr is None:
            return
        try:
            self._mgr.wait_until_finished()
        except BaseException:
            self._broken = True
            raise
        pending, self._pending = self._pending, []
        for step, names in pending:
            path = self.step_dir(step)
            if self._primary and path.is_dir():
                marker = {"format": _FORMAT_VERSION, "step": step, "items": names, "time": time.time()}
                if self.experiment is not None:
                    marker["experiment"] = self.experiment
                if self.run_config is not None:
                    marker["config"] = self.run_config
                _write_json_atomic(path / MARKER, marker)
        if pending:
            self._prune()

    def _prune(self) -> None:
        """Keep the latest ``max_to_keep`` complete steps."""
        steps = self.all_steps()
        if self.max_to_keep is None or len(steps) <= self.max_to_keep:
            return
        for step in steps[: len(steps) - self.max_to_keep]:
            self._delete(step)
        self._mgr.reload()

    def _delete(self, step: int) -> None:
        if self._primary:
            path = self.step_dir(step)
            # The marker goes first: a deletion cut short leaves an incomplete step, not a
            # complete-looking one with missing files.
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)

    def _move_aside(self, path: Path, why: str) -> Path:
        """Renames ``path`` to ``<path>.<why>-<unix time>`` (never listed as a step); the new path."""
        target = path.with_name(f"{path.name}.{why}-{int(time.time())}")
        n = 1
        while target.exists():
            target = path.with_name(f"{path.name}.{why}-{int(time.time())}-{n}")
            n += 1
        if self._primary:
            os.replace(path, target)
        return target

    def _remove_incomplete(self) -> None:
        """Removes orbax's tmp directories (debris of our own interrupted saves) and moves
        marker-less step directories aside (they may hold data someone wants)."""
        for p in sorted(self.directory.iterdir()) if self.directory.is_dir() else []:
            if _TMP_RE.match(p.name) and p.is_dir():
                log.warning("removing %s left by an interrupted save", p)
                shutil.rmtree(p)
            elif step_of(p) is not None and p.is_dir() and not is_complete(p):
                moved = self._move_aside(p, "incomplete")
                log.warning("moved incomplete checkpoint %s (no %s; an interrupted save) to %s", p, MARKER, moved)
            elif is_complete(p):  # an HF export cut short
                for tmp in p.glob(f".{HF_ACTOR_DIR}.tmp-*"):
                    shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        step: int | None = None,
        *,
        targets: Mapping[str, PyTree],
        path: str | os.PathLike | None = None,
    ) -> Restored:
        """Restore the items named in ``targets`` (a subset of those saved) from ``step`` (default:
        the latest complete one) or from the step directory ``path``. Each target is a pytree of
        ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` (or of arrays, whose sharding is
        used); arrays come back with exactly those shardings, cast to the target dtypes. An
        `ItemIO` target is checked against its ``abstract`` tree and read in place (``read``),
        after the host state; it is not in the returned ``arrays``."""
        self.wait()
        if path is not None:
            path = Path(path).absolute()
            if not path.is_dir():
                raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        else:
            if step is None:
                step = self.latest_step()
                if step is None:
                    raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            path = self.step_dir(step)
            if not path.is_dir():
                raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (have {self.all_steps()})")
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER}: an interrupted save?)")

        remote = {name: item for name, item in targets.items() if isinstance(item, ItemIO)}
        flat = {name: flatten_tree(as_restore_target(tree)) for name, tree in targets.items() if name not in remote}
        targets = {name: leaves for name, (leaves, _) in flat.items()}
        checks = {**targets, **{name: flatten_tree(item.abstract)[0] for name, item in remote.items()}}
        for name, target in checks.items():
            if not (path / name).is_dir():
                have = sorted(
                    p.name
                    for p in path.iterdir()
                    if p.is_dir() and _ITEM_RE.match(p.name) and p.name not in (HOST_ITEM, HF_ACTOR_DIR)
                )
                raise CheckpointMismatchError(f"{path}: no item {name!r} (has {have})")
            try:
                meta = ocp.StandardCheckpointHandler().metadata(path / name)
            except Exception as e:  # noqa: BLE001 - any unreadable metadata is damage
                raise self._damaged(path, name, e) from e
            check_tree_matches(meta.tree, target, item=name, where=str(path))

        args = {name: _restore_args(t) for name, t in targets.items() if any(x is not SKIP for x in t.values())}
        args[HOST_ITEM] = ocp.args.JsonRestore()
        try:
            out = _restore_items(path, args)
            raw = out[HOST_ITEM]
            if not isinstance(raw, Mapping) or "step" not in raw:
                raise ValueError(f"the host state is not a JSON object with a step: {raw!r:.100}")
        except Exception as e:  # noqa: BLE001 - find which item is damaged and say so in one line
            item = next((name for name in args if not _readable(path, name, args[name])), "?")
            raise self._damaged(path, item, e) from e
        for name, item in remote.items():
            try:
                item.read(str(path / name))
            except item.not_damage:
                raise
            except Exception as e:  # the item's files could not be read: damage
                raise self._damaged(path, name, e) from e
        host = HostState(
            data_loader=decode_json(raw.get("data_loader", {})),
            rng=decode_json(raw.get("rng")),
            metrics_tail=decode_json(raw.get("metrics_tail", [])),
            extra=decode_json(raw.get("extra", {})),
        )
        arrays = {
            name: jax.tree_util.tree_unflatten(
                treedef, [SKIP if leaf is SKIP else out[name][key] for key, leaf in leaves.items()]
            )
            for name, (leaves, treedef) in flat.items()
        }
        return Restored(step=int(raw["step"]), arrays=arrays, host=host, path=path)

    def _damaged(self, path: Path, item: str, error: BaseException) -> DamagedCheckpointError:
        step = step_of(path)
        others = [s for s in self.all_steps() if s != step]
        fix = (
            f"resume from an earlier step ({', '.join(str(self.step_dir(s)) for s in others[-1:])}) or delete {path}"
            if others
            else f"delete {path} to start afresh"
        )
        reason = _root_cause(error)
        return DamagedCheckpointError(
            f"checkpoint {path} is damaged: item {item!r} cannot be read ({reason}); {fix}",
            step=step,
            item=item,
            reason=reason,
        )

    def resume(self, targets: Mapping[str, PyTree]) -> Restored | None:
        """Restore as ``resume_mode`` says, or None when the run starts fresh.

        ``"auto"`` skips a damaged checkpoint (files truncated or unreadable): it warns in one
        line naming the step and the item, moves the step aside (``step_N.damaged-<time>``, so
        later resumes do not trip on it again; nothing is deleted) and continues from the
        previous complete step. ``"resume_path"`` raises :class:`DamagedCheckpointError`."""
        path = self.resume_dir()
        while path is not None:
            try:
                restored = self.restore(targets=targets, path=path)
            except DamagedCheckpointError as e:
                if self.resume_mode != "auto" or self.read_only:
                    raise
                moved = self._move_aside(path, "damaged")
                earlier = self.latest_step()
                log.warning(
                    "skipping damaged checkpoint step %s (item %r cannot be read: %s); moved it to %s; %s",
                    e.step,
                    e.item,
                    e.reason,
                    moved,
                    f"resuming from step {earlier}"
                    if earlier is not None
                    else "no earlier checkpoint: starting afresh",
                )
                path = None if earlier is None else self.step_dir(earlier)
                continue
            log.info("resumed from %s (step %d)", path, restored.step)
            return restored
        return None

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Finishes pending saves and stops orbax. After a save that was cut short (Ctrl-C, a
        write error) nothing more is waited for or marked: that step stays incomplete and the
        next writer removes it."""
        if self._mgr is None:
            self._release()
            return
        if self._broken:  # orbax's threads may wait for the write that was cut short: leave them
            self._pending, self._mgr = [], None
            self._release()
            return
        try:
            self.wait()
            self._mgr.close()
        finally:
            self._mgr = None
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
