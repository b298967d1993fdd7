"""The objects a run needs besides its typed description (`jaxflow.configs.run_spec`):
tokenizer, prompt datasets, and each role's model in its layout."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

import jaxflow.models as models
from jaxflow.configs.overrides import ConfigError
from jaxflow.configs.run_spec import ModelSpec, RunSpec
from jaxflow.data.dataset import PromptDataset
from jaxflow.data.tasks import Task, get_task, make_mixed_examples
from jaxflow.mesh import Rules, state_shardings


def builtin_task(cfg: ConfigDict) -> Task:
    """The built-in task ``jaxflow.data.builtin_task`` with its configured parameters."""
    name = cfg.jaxflow.data.builtin_task
    params = {"digits": cfg.jaxflow.data.addition_digits} if name in ("addition", "jaxflow/addition") else {}
    return get_task(name, **params)


@dataclasses.dataclass(frozen=True)
class BuiltinSplit:
    """A split of the built-in task, generated in memory (no file is written or read)."""

    task: Task
    split: str  # "train" or "test"
    num_examples: int
    seed: int

    def rows(self) -> list[dict[str, Any]]:
        return make_mixed_examples([self.task], self.num_examples, seed=self.seed, split=self.split)


DataSource = list[str] | BuiltinSplit


def dataset_sources(cfg: ConfigDict) -> tuple[DataSource, DataSource]:
    """``(train, val)``: the configured files, or for an empty key the built-in task's split
    (``jaxflow.data.builtin_task``), generated deterministically in memory."""
    train = [f for f in cfg.data.train_files.split(",") if f]
    val = [f for f in cfg.data.val_files.split(",") if f]
    d = cfg.jaxflow.data
    if not train:
        train = BuiltinSplit(builtin_task(cfg), "train", d.num_train_examples, cfg.data.seed)
    if not val:
        val = BuiltinSplit(builtin_task(cfg), "test", d.num_val_examples, cfg.data.seed)
    return train, val


def build_dataset(cfg: ConfigDict, source: DataSource, tokenizer: Any) -> PromptDataset:
    kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                  truncation=cfg.data.truncation)
    if isinstance(source, BuiltinSplit):
        return PromptDataset(f"built-in {source.task.name} {source.split} split", tokenizer, rows=source.rows(),
                             **kwargs)
    return PromptDataset(source, tokenizer, **kwargs)


def describe_source(source: DataSource, dataset: PromptDataset) -> str:
    """For the console: where a split's prompts come from, and how many were kept."""
    if isinstance(source, BuiltinSplit):
        key = "data.train_files" if source.split == "train" else "data.val_files"
        return f"BUILT-IN task {source.task.name!r} ({source.split} split, {len(dataset)} prompts; {key} is empty)"
    return f"{', '.join(source)} ({len(dataset)} prompts)"


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


def check_vocab(spec: RunSpec, tokenizer: Any) -> None:
    """Every model's vocabulary (a preset's, or a checkpoint's ``config.json``) must hold every
    tokenizer id: an id past the embedding table is garbage (NaN at best)."""
    for role, m in spec.models.items():
        if m.config is None or m.config.vocab_size >= tokenizer.vocab_size:
            continue
        if m.is_preset:
            raise ConfigError("jaxflow.model.vocab_size", f"{m.config.vocab_size} is smaller than the tokenizer's "
                                                          f"{tokenizer.vocab_size} ids")
        raise ConfigError("jaxflow.data.tokenizer", f"the tokenizer has {tokenizer.vocab_size} ids but the {role} "
                          f"model {m.path} has {m.config.vocab_size} vocabulary rows: ids past them have no "
                          "embedding; use the model's own tokenizer (jaxflow.data.tokenizer=model)")
