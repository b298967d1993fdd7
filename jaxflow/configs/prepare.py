"""The edge between a config and everything that runs or plans it: :func:`prepare_run` reads a
validated experiment config once and returns a :class:`PreparedRun`, the run's typed
description (`RunSpec`), its tokenizer and its prompts. The trainer, the dry run, the SFT
job and the auto-mapper start from it; below it nothing reads the ``ConfigDict``::

    prepared = prepare_run(cfg)               # spec, tokenizer, train / validation prompts
    prepared.spec.placement                   # None while placement.type is auto
    # jaxflow.automap.auto_place(prepared.spec, prepared.devices) places such a run.

The prompts: the configured files, or for an empty ``data.train_files`` / ``data.val_files``
the built-in task's split (``jaxflow.data.builtin_task``), generated deterministically in
memory; the training set's size sizes the learning-rate schedules when
``trainer.total_training_steps`` is unset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ml_collections import ConfigDict

from jaxflow.configs.overrides import ConfigError
from jaxflow.configs.resolve import run_devices
from jaxflow.configs.run_spec import DataSpec, RunSpec, build_tokenizer, data_spec, describe_run
from jaxflow.data.dataset import PromptDataset
from jaxflow.data.tasks import Task, get_task, make_mixed_examples


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


def count_train_prompts(cfg: ConfigDict, data: DataSpec, tokenizer: Any) -> int | None:
    """The training prompts that size the schedules when ``trainer.total_training_steps`` is
    unset: those of the training files the run keeps (after ``data.truncation=filter``), read
    only then; None otherwise (the built-in task: ``jaxflow.data.num_train_examples``)."""
    train, _ = dataset_sources(data)
    if cfg.trainer.total_training_steps or isinstance(train, BuiltinSplit):
        return None
    return len(build_dataset(data, train, tokenizer))


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A run read from its config: ``spec`` (its placement None while the auto-mapper has to
    choose it), the ``tokenizer``, the ``devices`` its placement is built over, and (unless
    prepared without them) the prompts: ``train_data`` / ``val_data`` and where they come
    from (``sources``, as `dataset_sources` gives them)."""

    spec: RunSpec
    tokenizer: Any
    devices: tuple[Any, ...] | None
    train_data: PromptDataset | None = None
    val_data: PromptDataset | None = None
    sources: tuple[DataSource, DataSource] | None = None


def prepare_run(
    cfg: ConfigDict,
    *,
    devices: Sequence[Any] | None = None,
    with_datasets: bool = True,
    with_placement: bool = True,
) -> PreparedRun:
    """The `PreparedRun` of a validated config.

    ``devices``: those of the placement (default `jaxflow.configs.resolve.run_devices`: the
    first ``jaxflow.num_devices``, or a Ray run's host stand-ins). ``with_datasets=False``:
    no prompts (the SFT job draws its own demonstrations; the dry run, the auto-mapper and an
    export need none); the schedules are sized as the run's all the same
    (`count_train_prompts`).
    ``with_placement=False``: no placement and no devices (the auto-mapper plans the run for
    a cluster of its own). Every model's vocabulary is checked against the tokenizer
    (`check_vocab`)."""
    tokenizer = build_tokenizer(cfg)
    data = data_spec(cfg)
    train = val = sources = None
    if with_datasets:
        sources = dataset_sources(data)
        train, val = (build_dataset(data, source, tokenizer) for source in sources)
        num_train_prompts = len(train)
    else:
        num_train_prompts = count_train_prompts(cfg, data, tokenizer)
    if with_placement and devices is None:
        devices = run_devices(cfg)
    spec = describe_run(
        cfg, tokenizer=tokenizer, devices=devices, num_train_prompts=num_train_prompts, with_placement=with_placement
    )
    check_vocab(spec, tokenizer)
    return PreparedRun(spec, tokenizer, tuple(devices) if with_placement else None, train, val, sources)


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
