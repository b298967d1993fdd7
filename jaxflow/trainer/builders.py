"""The objects a run needs besides its typed description (`jaxflow.configs.run_spec`):
tokenizer, prompt datasets, and each role's model in its layout."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

import jaxflow.models as models
from jaxflow.configs.overrides import ConfigError
from jaxflow.configs.run_spec import DataSpec, ModelSpec, RunSpec
from jaxflow.data.dataset import PromptDataLoader, PromptDataset
from jaxflow.data.tasks import Task, get_task, make_mixed_examples
from jaxflow.mesh import Rules, state_shardings


def builtin_task(data: DataSpec) -> Task:
    """The built-in task ``jaxflow.data.builtin_task`` with its configured parameters."""
    return get_task(data.builtin_task, **dict(data.task_params))


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


def dataset_sources(data: DataSpec) -> tuple[DataSource, DataSource]:
    """``(train, val)``: the configured files, or for an empty key the built-in task's split
    (``jaxflow.data.builtin_task``), generated deterministically in memory."""
    train: DataSource = list(data.train_files)
    val: DataSource = list(data.val_files)
    if not train:
        train = BuiltinSplit(builtin_task(data), "train", data.num_train_examples, data.seed)
    if not val:
        val = BuiltinSplit(builtin_task(data), "test", data.num_val_examples, data.seed)
    return train, val


def build_dataset(data: DataSpec, source: DataSource, tokenizer: Any) -> PromptDataset:
    kwargs = dict(prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length, truncation=data.truncation)
    if isinstance(source, BuiltinSplit):
        return PromptDataset(
            f"built-in {source.task.name} {source.split} split", tokenizer, rows=source.rows(), **kwargs
        )
    return PromptDataset(source, tokenizer, **kwargs)


def train_loader(spec: RunSpec, dataset: PromptDataset) -> PromptDataLoader:
    """The training prompts in batches of ``data.train_batch_size`` (the last partial batch of
    an epoch dropped), shuffled per epoch as ``data.shuffle`` / ``data.seed`` say."""
    return PromptDataLoader(
        dataset, spec.train_batch_size, shuffle=spec.data.shuffle, seed=spec.data.seed, drop_last=True
    )


def count_train_prompts(data: DataSpec, tokenizer: Any) -> int | None:
    """Prompts of the configured training files that the run keeps (after
    ``data.truncation=filter``), which size an epoch-mode run's schedules; None for the
    built-in task (its size is ``jaxflow.data.num_train_examples``)."""
    train, _ = dataset_sources(data)
    return None if isinstance(train, BuiltinSplit) else len(build_dataset(data, train, tokenizer))


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
        options = (
            {}
            if c is None
            else dict(
                dtype=c.param_dtype,
                compute_dtype=c.dtype,
                scan_layers=c.scan_layers,
                remat_policy=c.remat_policy,
                attention_impl=c.attention_impl,
            )
        )
        model = models.from_pretrained(os.path.expanduser(spec.path), mesh=mesh, rules=rules, head=spec.head, **options)
        return nnx.split(model)
    return init_sharded(spec.config, spec.head, spec.seed, mesh, rules)


def init_program(
    config: models.ModelConfig, head: str, seed: int, mesh: Mesh, rules: Rules
) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, jitted init)``: the preset model's initialisation as one jitted program
    (no arguments) whose output shardings come from the abstract model (``nnx.eval_shape``)
    under ``rules`` on ``mesh``, so each device computes only its own shard."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.init_model(config, head=head, seed=seed)))
    shardings = state_shardings(abstract, rules, mesh)
    return graphdef, jax.jit(
        lambda: nnx.split(models.init_model(config, head=head, seed=seed))[1], out_shardings=shardings
    )


def init_sharded(
    config: models.ModelConfig, head: str, seed: int, mesh: Mesh, rules: Rules
) -> tuple[nnx.GraphDef, Any]:
    """A preset model initialised directly in its shardings (`init_program`, run once): no
    device (and not the host) ever holds the whole model."""
    graphdef, init = init_program(config, head, seed, mesh, rules)
    return graphdef, init()


def check_vocab(spec: RunSpec, tokenizer: Any) -> None:
    """Every model's vocabulary (a preset's, or a checkpoint's ``config.json``) must hold every
    tokenizer id: an id past the embedding table is garbage (NaN at best)."""
    for role, m in spec.models.items():
        if m.config is None or m.config.vocab_size >= tokenizer.vocab_size:
            continue
        if m.is_preset:
            raise ConfigError(
                "jaxflow.model.vocab_size",
                f"{m.config.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids",
            )
        raise ConfigError(
            "jaxflow.data.tokenizer",
            f"the tokenizer has {tokenizer.vocab_size} ids but the {role} "
            f"model {m.path} has {m.config.vocab_size} vocabulary rows: ids past them have no "
            "embedding; use the model's own tokenizer (jaxflow.data.tokenizer=model)",
        )
