"""The objects a run needs besides its prepared description (`jaxflow.configs.prepare`): the
data loader, the console's words about the prompts, each role's model in its layout, and the
Ray backend's settings."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

import jaxflow.models as models
from jaxflow.automap import AutoPlacement, auto_place
from jaxflow.configs.overrides import with_values
from jaxflow.configs.prepare import BuiltinSplit, DataSource, PreparedRun
from jaxflow.configs.run_spec import ModelSpec, RunSpec
from jaxflow.configs.validate import validate, warn_ignored_under_auto
from jaxflow.data.dataset import PromptDataLoader, PromptDataset
from jaxflow.mesh import Rules, state_shardings
from jaxflow.workers.ray import RayConfig


def place_run(
    prepared: PreparedRun, cfg: ConfigDict, *, verify: bool = False, log: Callable[[str], None] | None = print
) -> tuple[RunSpec, AutoPlacement | None, ConfigDict]:
    """The run placed, and the config it records: ``prepared.spec`` and ``cfg`` as they are,
    or for ``placement.type=auto`` the auto-mapper's placement on ``prepared.devices``
    (`jaxflow.automap.auto_place`; ``verify``: its programs also compile and fit, for a dry
    run; ``log``: its one line) with the keys that reproduce it set in the recorded config
    (validated, as a command line setting them would be), and the user's own meshes it
    replaced said in one warning. The run and its dry run start the same way."""
    if prepared.spec.placement is not None:
        return prepared.spec, None, cfg
    auto = auto_place(prepared.spec, prepared.devices, verify=verify, log=log)
    record = with_values(cfg, auto.overrides())
    warn_ignored_under_auto(cfg, record)
    validate(record)
    return auto.spec, auto, record


def train_loader(spec: RunSpec, dataset: PromptDataset) -> PromptDataLoader:
    """The training prompts in batches of ``data.train_batch_size`` (the last partial batch of
    an epoch dropped), shuffled per epoch as ``data.shuffle`` / ``data.seed`` say."""
    return PromptDataLoader(
        dataset, spec.train_batch_size, shuffle=spec.data.shuffle, seed=spec.data.seed, drop_last=True
    )


CUT_WARNING_FRACTION = 0.05  # more of a split's prompts truncated or dropped than this is said loudly


def _cuts(dataset: PromptDataset) -> str:
    """``", 3 truncated to 16 tokens (data.truncation=left)"``, or the dropped count, or ``""``."""
    stats, limit = dataset.stats, dataset.max_prompt_length
    if stats["num_truncated"]:
        return f", {stats['num_truncated']} truncated to {limit} tokens (data.truncation={dataset.truncation})"
    if stats["num_filtered"]:
        return f", {stats['num_filtered']} longer than {limit} tokens dropped (data.truncation=filter)"
    return ""


def describe_source(source: DataSource, dataset: PromptDataset) -> str:
    """For the console: where a split's prompts come from, how many were kept, and how many
    were truncated or dropped as longer than ``data.max_prompt_length``."""
    if isinstance(source, BuiltinSplit):
        key = "data.train_files" if source.split == "train" else "data.val_files"
        return (
            f"BUILT-IN task {source.task.name!r} ({source.split} split, {len(dataset)} prompts{_cuts(dataset)}; "
            f"{key} is empty)"
        )
    return f"{', '.join(source)} ({len(dataset)} prompts{_cuts(dataset)})"


def cut_prompts_warning(split: str, dataset: PromptDataset) -> str | None:
    """A warning when more than `CUT_WARNING_FRACTION` of a split's prompts were truncated or
    dropped as longer than ``data.max_prompt_length`` (the model then trains on, or is scored
    on, something else than the data says), or None."""
    stats = dataset.stats
    cut = stats["num_truncated"] + stats["num_filtered"]
    if cut <= CUT_WARNING_FRACTION * stats["num_rows"]:
        return None
    done = "truncated" if stats["num_truncated"] else "dropped"
    return (
        f"{cut} of the {stats['num_rows']} {split} prompts ({cut / stats['num_rows']:.0%}) are longer than "
        f"data.max_prompt_length={dataset.max_prompt_length} tokens and were {done} (data.truncation="
        f"{dataset.truncation}); raise data.max_prompt_length if that is not what you want"
    )


RUN_OPTIONS = ("scan_layers", "remat_policy", "attention_impl", "batch_invariant")


def load_model(spec: ModelSpec, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, params)`` of a role's model, in its layout on ``mesh``: a checkpoint
    directory read straight into it (shard by shard), or a preset initialised from
    ``spec.seed`` directly in its shardings (`init_sharded`). A value head on an actor
    checkpoint starts at zero."""
    if not spec.is_preset:
        c = spec.config
        options = {}
        if c is not None:  # the run's options, which the checkpoint's config.json does not hold
            options = dict(dtype=c.param_dtype, compute_dtype=c.dtype, **{k: getattr(c, k) for k in RUN_OPTIONS})
        model = models.from_pretrained(os.path.expanduser(spec.path), mesh=mesh, rules=rules, head=spec.head, **options)
        return nnx.split(model)
    return init_sharded(spec.config, spec.head, spec.seed, mesh, rules)


def as_role(model: tuple[nnx.GraphDef, Any], spec: ModelSpec) -> tuple[nnx.GraphDef, Any]:
    """``model``'s weights as the role of ``spec`` holds them when its parameter dtype differs:
    its graph (its `ModelConfig`) and the weights cast in one program, in their shardings;
    else ``model`` itself (no copy). How the reference starts from the actor's weights: on an
    accelerator in bfloat16 beside the actor's float32 masters (`resolve_dtypes`), the dtype
    its programs were compiled ahead for."""
    graphdef, params = model
    config = spec.config
    if config is None or nnx.merge(graphdef, params).cfg.param_dtype == config.param_dtype:
        return model
    role_graphdef = nnx.split(nnx.eval_shape(lambda: models.init_model(config, head=spec.head)))[0]

    def cast(tree):
        return jax.tree.map(
            lambda x: x.astype(config.param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
        )

    return role_graphdef, jax.jit(cast)(params)


def as_role_recipe(recipe: Callable[[Mesh, Rules], Any], spec: ModelSpec, mesh: Mesh, rules: Rules) -> Any:
    """`as_role` of what ``recipe`` (a worker process's model recipe) builds on ``mesh``."""
    return as_role(recipe(mesh, rules), spec)


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


def ray_config(spec: RunSpec) -> RayConfig:
    """The Ray backend's settings (``jaxflow.ray.*``), with a local Ray instance's CPUs sized
    for the run's hosts."""
    r = spec.ray
    hosts = spec.num_devices // r.devices_per_host
    return RayConfig(**dataclasses.asdict(r), local_num_cpus=math.ceil(hosts * r.cpus_per_host))
