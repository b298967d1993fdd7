"""HF export of a run's models: the trained actor (or critic) as a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` (``AutoModelForTokenClassification`` for
a critic) loads, with the run's tokenizer beside it.

Two ways in:

    write_hf(graphdef, params, tokenizer, out_dir)          # live, sharded params (end of a run)
    write_hf_with(group.export_hf, tokenizer, out_dir)     # written by a role's worker processes
    export_checkpoint(run_dir, out_dir, step=None, role="actor")   # any saved step

All three write from the sharded arrays: ``save_pretrained`` fetches one tensor at a time to the
host and keeps at most one safetensors file's tensors there (``max_shard_bytes``), so no device
and no host ever holds the whole model. ``export_checkpoint`` restores the parameters of the
role's saved `TrainState` (not its optimizer moments) straight into the role's training
shardings (each device reads its own shard), built from the run's ``config.json`` without
allocating a model first.

An export never destroys what a user has: it writes only a new or empty directory or an earlier
jaxflow export (each carries ``jaxflow_export.json``, the list of its files), and replaces an
earlier export so that an interruption at any point leaves it, or the new one, in place
(`write_hf_with`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from ml_collections import ConfigDict

import jaxflow.models as models
from jaxflow.configs.prepare import prepare_run
from jaxflow.configs.run_spec import RunSpec
from jaxflow.mesh import TRAINING_ROLES, Role, state_shardings
from jaxflow.models import peft_io
from jaxflow.models.lora import join, split_adapters
from jaxflow.trainer.builders import load_model
from jaxflow.trainer.checkpoint import SKIP, STEP_PREFIX, CheckpointManager, complete_steps, read_marker
from jaxflow.trainer.outputs import CONFIG_NAME, NotOursError, is_run_config
from jaxflow.workers import TrainState, make_optimizer, train_state

_DEFERRED = (signal.SIGINT, signal.SIGTERM)  # held back over the renames that replace an export
HF_DIR = "hf_actor"  # <run_dir>/hf_actor: the actor at the end of the run
EXPORT_MARKER = "jaxflow_export.json"  # in every export: the files it wrote (so a later export may replace them)


class ExportError(RuntimeError):
    """Writing an HF export failed (names the export's directory)."""


class NoSuchRoleError(ValueError):
    """The run (or the step) has no such role."""


def _exported_files(out: Path) -> set[str] | None:
    """The files a jaxflow export at ``out`` wrote (from its marker), or None when ``out`` is
    not one."""
    try:
        marker = json.loads((out / EXPORT_MARKER).read_text())
        return set(marker["files"]) | {EXPORT_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_export_target(out_dir: str | os.PathLike, *, protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """The absolute ``out_dir`` if an HF export may be written there: it does not exist, is an
    empty directory, or is an earlier jaxflow export holding nothing else. Anything else
    (``.``, ``~``, a run directory, a directory with files of yours) raises ``NotOursError``
    before any work is done; so does a target equal to or containing a path of ``protect``
    (e.g. the run directory being exported)."""
    out = Path(out_dir).expanduser().absolute()
    real = Path(os.path.realpath(out))
    for path in protect:
        inside = Path(os.path.realpath(path))
        if real == inside or real in inside.parents:
            raise NotOursError(
                f"{out} holds the run directory {path}; an export there would replace it: write "
                "the export to a new directory"
            )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise NotOursError(f"{out} exists and is not a directory; move it away, or write the export to a new directory")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    ours = _exported_files(out)
    if ours is None:  # (decided before walking it: "~" may hold a great many files)
        raise NotOursError(
            f"{out} is not empty and is not a jaxflow HF export (no {EXPORT_MARKER}); jaxflow "
            "never replaces a directory it did not write: move it away, or write the export to a new "
            "directory"
        )
    present = {str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir()}
    foreign = sorted(present - ours)
    if foreign:
        raise NotOursError(
            f"{out} is a jaxflow HF export but also holds files it did not write "
            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); move them, or write the "
            "export to a new directory"
        )
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recover(out: Path) -> None:
    """Clean up after an export that was cut short: when ``out`` is gone but the export it was
    replacing was moved aside (``.<name>.old-<pid>``), put that back; remove the temporary
    directories of dead writers."""
    for aside in sorted(out.parent.glob(f".{out.name}.old-*")):
        pid = aside.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid():
            continue
        if not out.exists() and _exported_files(aside) is not None:
            os.replace(aside, out)
        else:
            shutil.rmtree(aside, ignore_errors=True)
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid()):
            shutil.rmtree(tmp, ignore_errors=True)


def write_hf(
    graphdef: nnx.GraphDef,
    params: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    protect: tuple[str | os.PathLike, ...] = (),
) -> Path:
    """Write the model ``(graphdef, params)`` and ``tokenizer`` as an HF directory ``out_dir``
    (`write_hf_with`)."""
    return write_hf_with(
        lambda tmp: models.save_pretrained(nnx.merge(graphdef, params), tmp), tokenizer, out_dir, protect=protect
    )


def write_hf_with(
    write_model: Callable[[str], Any],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    protect: tuple[str | os.PathLike, ...] = (),
) -> Path:
    """Write an HF directory ``out_dir``: the model by ``write_model(directory)`` (e.g. a Ray
    worker group's ``export_hf``: its processes write from their shards, so this process never
    holds the model), then ``tokenizer`` and a marker listing its files (``jaxflow_export.json``).

    Only a new or empty directory, or an earlier jaxflow export, is written (see
    `check_export_target`). The replacement never loses the previous export, wherever it is
    interrupted: the new one is written beside it (``.<name>.tmp-<pid>``), the old one is moved
    aside (``.<name>.old-<pid>``), the new one renamed in, and only then is the old one removed;
    the next export puts a moved-aside export back if the new one never arrived, and removes the
    leftovers."""
    out = check_export_target(out_dir, protect=protect)
    out.parent.mkdir(parents=True, exist_ok=True)
    _recover(out)
    out = check_export_target(out, protect=protect)  # what _recover put back
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_model(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not p.is_dir())
        (tmp / EXPORT_MARKER).write_text(json.dumps({"format": 1, "files": files}))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, OSError):  # e.g. safetensors' errors name no file
            raise ExportError(f'writing the HF export "{out}" failed: {" ".join(str(e).split())}') from e
        raise
    swapped = False
    try:
        with _ctrl_c_deferred():  # the two renames: never out missing with Ctrl-C between them
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
            swapped = True
    finally:
        if swapped:
            shutil.rmtree(old, ignore_errors=True)
        elif old.exists() and not out.exists():  # the new one could not be renamed in: the old one goes back
            os.replace(old, out)
    return out


@contextlib.contextmanager
def _ctrl_c_deferred():
    """A Ctrl-C (SIGINT) or SIGTERM inside the block is handed to the handler it would have met
    (Python's for SIGINT: ``KeyboardInterrupt``; jaxflow.run's for both) when the block ends
    (main thread only; a SIGKILL in between is what `_recover` is for)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {signum: signal.signal(signum, lambda *a: caught.append(a)) for signum in _DEFERRED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    if caught:
        signum, frame = caught[0]
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:  # the signal's default: Python's KeyboardInterrupt, or the end
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)


def run_config(run_dir: str | os.PathLike) -> ConfigDict:
    """The experiment config a run wrote to ``<run_dir>/config.json``."""
    path = Path(run_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a jaxflow run directory?")
    if not is_run_config(path):
        raise ValueError(f"{path} is not a jaxflow run config: is {run_dir} a jaxflow run directory?")
    return ConfigDict(json.loads(path.read_text()))


def abstract_train_state(spec: RunSpec, role: str) -> tuple[nnx.GraphDef, TrainState]:
    """``(graphdef, TrainState of jax.ShapeDtypeStruct)`` of ``role`` exactly as the RL trainer
    builds it (from the run's `RunSpec`), each leaf carrying its sharding on the role's
    training mesh; nothing allocated. With LoRA the state holds the adapters only."""
    if role not in TRAINING_ROLES:
        raise ValueError(f"role must be one of {sorted(TRAINING_ROLES)}, got {role!r}")
    if role not in spec.roles:
        raise NoSuchRoleError(f"the run has no {role} (its roles: {', '.join(spec.roles)})")
    mcfg = spec.models[role].config
    if mcfg is None:
        raise FileNotFoundError(f"the {role}'s model config is unknown: no config.json in {spec.models[role].path}")
    mesh, rules = spec.placement.mesh(role, "train"), spec.placement.rules(role, "train")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: models.HEADS[Role(role).head](mcfg, rngs=nnx.Rngs(0))))
    if mcfg.lora is not None:
        params = split_adapters(params)[1]
    tx, _ = make_optimizer((spec.actor if role == "actor" else spec.critic).optim)
    state, _ = train_state.abstract_train_state(params, state_shardings(params, rules, mesh), tx, mesh)
    return graphdef, state  # leaves: jax.ShapeDtypeStruct with their shardings


def step_config(run_dir: str | os.PathLike, step: int | None = None) -> tuple[int, ConfigDict]:
    """``(step, config)``: the saved ``step`` of the run in ``run_dir`` (default: the latest
    complete one) and the config it was saved with (recorded in the step's marker; a step saved
    before jaxflow recorded it: the run's ``config.json``). A directory may hold steps of runs
    with other settings (``jaxflow.trainer.resume_other_experiment``): each is read with its own."""
    steps = complete_steps(run_dir)  # (before the devices are simulated: nothing here touches one)
    if not steps:
        run_config(run_dir)  # not a run directory at all: says so
        raise FileNotFoundError(f"no complete checkpoint in {Path(run_dir).absolute()}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no complete checkpoint for step {step} in {Path(run_dir).absolute()} (have {steps})")
    recorded = read_marker(Path(run_dir) / f"{STEP_PREFIX}_{step}").get("config")
    return step, ConfigDict(recorded) if isinstance(recorded, dict) else run_config(run_dir)


def base_pointer(spec: Any) -> str:
    """Where the actor's base model lives (a LoRA adapter's ``base_model_name_or_path``): its
    checkpoint directory, or for a preset ``preset (trainer.seed=N)`` (initialised from the
    run's seed)."""
    m = spec.models["actor"]
    return m.path if m.path else f"preset (trainer.seed={m.seed})"


def export_checkpoint(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    role: str = "actor",
    merged: bool = False,
) -> Path:
    """Write ``role`` of the saved ``step`` (default: the latest complete one) of the run in
    ``run_dir`` as an HF directory ``out_dir``, with the run's tokenizer, as the step's own
    config describes it (`step_config`). Only the parameters are read (the optimizer state's
    leaves are skipped). A LoRA run's actor is written as a PEFT adapter directory, or with
    ``merged`` as the HF model with the adapters merged in (its base read from where the run
    read it)."""
    check_export_target(out_dir, protect=(run_dir,))
    step, cfg = step_config(run_dir, step)
    # on this process's devices (a Ray run's too), without its prompts
    prepared = prepare_run(cfg, devices=jax.devices()[: cfg.jaxflow.num_devices], with_datasets=False)
    tokenizer = prepared.tokenizer
    try:
        graphdef, abstract = abstract_train_state(prepared.spec, role)
    except NoSuchRoleError as e:
        raise NoSuchRoleError(f"step {step} of {Path(run_dir).absolute()}: {e}") from None
    abstract = dataclasses.replace(abstract, opt_state=jax.tree.map(lambda _: SKIP, abstract.opt_state), step=SKIP)
    ckpt = CheckpointManager(run_dir, read_only=True)
    params = ckpt.restore(step, targets={role: abstract}).arrays[role].params
    spec = prepared.spec
    lora = spec.models[role].config.lora
    if lora is None:
        if merged:
            raise ValueError(f"--merged: the {role} of {Path(run_dir).absolute()} has no LoRA adapters to merge")
        return write_hf(graphdef, params, tokenizer, out_dir, protect=(run_dir,))
    if not merged:
        write = functools.partial(peft_io.save_adapter, spec.models[role].config, params, base_model=base_pointer(spec))
        return write_hf_with(write, tokenizer, out_dir, protect=(run_dir,))
    mesh, rules = spec.placement.mesh(role, "train"), spec.placement.rules(role, "train")
    base = split_adapters(load_model(spec.models[role], mesh, rules)[1])[0]
    model = peft_io.merged_model(graphdef, join(base, params))
    return write_hf_with(lambda tmp: models.save_pretrained(model, tmp), tokenizer, out_dir, protect=(run_dir,))
