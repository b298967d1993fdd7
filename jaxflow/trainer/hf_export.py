"""HF export of a run's models: the trained actor (or critic) as a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` (``AutoModelForTokenClassification`` for
a critic) loads, with the run's tokenizer beside it.

Two ways in:

    write_hf(graphdef, params, tokenizer, out_dir)          # live, sharded params (end of a run)
    write_hf_with(group.export_hf, tokenizer, out_dir)     # written by a role's worker processes
    export_checkpoint(run_dir, out_dir, step=None, role="actor")   # any saved step

Both write from the sharded arrays: ``save_pretrained`` fetches one tensor at a time to the
host and keeps at most one safetensors file's tensors there (``max_shard_bytes``), so no device
and no host ever holds the whole model. ``export_checkpoint`` restores the role's saved
`TrainState` straight into the role's training shardings (each device reads its own shard),
built from the run's ``config.json`` without allocating a model first.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

import jaxflow.models as models
from jaxflow.configs.run_spec import build_tokenizer, describe_run
from jaxflow.mesh import state_shardings
from jaxflow.trainer.checkpoint import CheckpointManager
from jaxflow.workers import TrainState, make_optimizer
from jaxflow.workers.train_state import train_state_shardings

ROLES = {"actor": "lm", "critic": "value"}
HF_DIR = "hf_actor"  # <run_dir>/hf_actor: the actor at the end of the run


def write_hf(graphdef: nnx.GraphDef, params: Any, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """Write the model ``(graphdef, params)`` and ``tokenizer`` as an HF directory, atomically
    (into a sibling temporary directory, then renamed over ``out_dir``)."""
    return write_hf_with(lambda tmp: models.save_pretrained(nnx.merge(graphdef, params), tmp), tokenizer, out_dir)


def write_hf_with(write_model: Callable[[str], Any], tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """`write_hf` with the model written by ``write_model(directory)`` (e.g. a worker group's
    ``export_hf``: its processes write from their shards, so this process never holds it)."""
    out = Path(out_dir).absolute()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_model(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def run_config(run_dir: str | os.PathLike) -> ConfigDict:
    """The experiment config a run wrote to ``<run_dir>/config.json``."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a jaxflow run directory?")
    return ConfigDict(json.loads(path.read_text()))


def abstract_train_state(cfg: ConfigDict, role: str, tokenizer: Any) -> tuple[nnx.GraphDef, TrainState]:
    """``(graphdef, TrainState of jax.ShapeDtypeStruct)`` of ``role`` exactly as the RL trainer
    builds it (from the run's `RunSpec`), each leaf carrying its sharding on the role's
    training mesh; nothing allocated."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    spec = describe_run(cfg, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if role not in spec.roles:
        raise ValueError(f"the run has no {role} (its roles: {', '.join(spec.roles)})")
    mcfg = spec.models[role].config
    if mcfg is None:
        raise FileNotFoundError(f"the {role}'s model config is unknown: no config.json in {spec.models[role].path}")
    mesh, rules = spec.placement.mesh(role, "train"), spec.placement.rules(role, "train")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: models.HEADS[ROLES[role]](mcfg, rngs=nnx.Rngs(0))))
    tx, _ = make_optimizer((spec.actor if role == "actor" else spec.critic).optim)
    shardings = train_state_shardings(params, state_shardings(params, rules, mesh), tx, mesh)
    init = jax.jit(lambda p: TrainState(params=p, opt_state=tx.init(p), step=jnp.zeros((), jnp.int32)),
                   out_shardings=shardings)
    return graphdef, init.eval_shape(params)  # leaves: jax.ShapeDtypeStruct with their shardings


def export_checkpoint(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
                      role: str = "actor") -> Path:
    """Write ``role`` of the saved ``step`` (default: the latest complete one) of the run in
    ``run_dir`` as an HF directory ``out_dir``, with the run's tokenizer."""
    cfg = run_config(run_dir)
    tokenizer = build_tokenizer(cfg)
    graphdef, abstract = abstract_train_state(cfg, role, tokenizer)
    ckpt = CheckpointManager(run_dir, read_only=True)
    restored = ckpt.restore(step, targets={role: abstract})
    return write_hf(graphdef, restored.arrays[role].params, tokenizer, out_dir)
