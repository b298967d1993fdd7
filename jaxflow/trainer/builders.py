"""The objects a run needs besides its typed description (`jaxflow.configs.run_spec`):
tokenizer, prompt datasets, and each role's model in its layout."""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

import jaxflow.models as models
from jaxflow.configs.overrides import ConfigError
from jaxflow.configs.run_spec import ModelSpec, RunSpec
from jaxflow.data.dataset import PromptDataset, write_builtin_datasets
from jaxflow.data.tasks import Task, get_task
from jaxflow.mesh import Rules, state_shardings


def builtin_task(cfg: ConfigDict) -> Task:
    """The built-in task ``jaxflow.data.builtin_task`` with its configured parameters."""
    name = cfg.jaxflow.data.builtin_task
    params = {"digits": cfg.jaxflow.data.addition_digits} if name in ("addition", "jaxflow/addition") else {}
    return get_task(name, **params)


def dataset_files(cfg: ConfigDict, run_dir: str) -> tuple[list[str], list[str]]:
    """``(train files, val files)``: the configured ones, or the built-in task written (once,
    deterministically) under ``run_dir/data`` in verl's parquet schema."""
    train = [f for f in cfg.data.train_files.split(",") if f]
    val = [f for f in cfg.data.val_files.split(",") if f]
    if not train or not val:
        d = cfg.jaxflow.data
        written = write_builtin_datasets(os.path.join(run_dir, "data"), tasks=(builtin_task(cfg),),
                                         n_train=d.num_train_examples, n_test=d.num_val_examples,
                                         seed=cfg.data.seed)
        train = train or [written["train"]]
        val = val or [written["test"]]
    return train, val


def build_dataset(cfg: ConfigDict, files: list[str], tokenizer: Any) -> PromptDataset:
    return PromptDataset(files, tokenizer, prompt_key=cfg.data.prompt_key,
                         max_prompt_length=cfg.data.max_prompt_length, truncation=cfg.data.truncation)


def load_model(spec: ModelSpec, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, params)`` of a role's model, in its layout on ``mesh``: a checkpoint
    directory read straight into it (shard by shard), or a preset initialised from
    ``spec.seed`` directly in its shardings (`init_sharded`). A value head on an actor
    checkpoint starts at zero."""
    if not spec.is_preset:
        c = spec.config
        options = {} if c is None else dict(dtype=c.param_dtype, compute_dtype=c.dtype, scan_layers=c.scan_layers,
                                             remat_policy=c.remat_policy)
        model = models.from_pretrained(os.path.expanduser(spec.path), mesh=mesh, rules=rules, head=spec.head, **options)
        return nnx.split(model)
    return init_sharded(spec.config, spec.head, spec.seed, mesh, rules)


def init_sharded(config: models.ModelConfig, head: str, seed: int, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, Any]:
    """A preset model initialised directly in its shardings: one jitted init whose output
    shardings come from the abstract model (``nnx.eval_shape``) under ``rules``, so no device
    (and not the host) ever holds the whole model."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.init_model(config, head=head, seed=seed)))
    shardings = state_shardings(abstract, rules, mesh)
    init = jax.jit(lambda: nnx.split(models.init_model(config, head=head, seed=seed))[1], out_shardings=shardings)
    return graphdef, init()


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves with the arrays' shardings (checkpoint restore targets);
    host (NumPy) leaves stay as they are (they restore as host arrays)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def check_vocab(spec: RunSpec, tokenizer: Any) -> None:
    """A preset's vocabulary must hold every tokenizer id."""
    for m in spec.models.values():
        if m.is_preset and m.config.vocab_size < tokenizer.vocab_size:
            raise ConfigError("jaxflow.model.vocab_size", f"{m.config.vocab_size} is smaller than the tokenizer's "
                                                          f"{tokenizer.vocab_size} ids")
