"""What the auto-mapper plans: the roles' models and the dataflow of one RL iteration, read
from an experiment config.

The dataflow (HybridFlow's PPO; the other algorithms drop roles they do not run)::

    actor/reshard -> actor/generate -> {actor/log_probs, ref/log_probs, critic/values,
                                        reward/scores, cost/scores} -> {critic/train, actor/train}

Stages on one pool run one after another; stages on disjoint pools overlap when their
inputs are ready (:func:`jaxflow.automap.search.schedule`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.configs import active_roles, model_config
from jaxflow.mesh import logical_axes_tree
from jaxflow.models import ModelConfig, init_model

HEADS = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "reward", "cost": "reward"}
TRAINING_ROLES = ("actor", "critic")
# Forward program per role and the config key of its micro-batch per device.
FORWARD_STAGES = {
    "actor": ("actor/log_probs", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device"),
    "ref": ("ref/log_probs", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device"),
    "critic": ("critic/values", "critic.forward_micro_batch_size_per_device"),
    "reward": ("reward/scores", "reward_model.micro_batch_size_per_device"),
    "cost": ("cost/scores", "reward_model.micro_batch_size_per_device"),
}


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class RoleModel:
    """One role's model: shapes of its parameters (with logical axes), and the counts the
    simulators need."""

    role: str
    head: str
    config: ModelConfig
    leaves: tuple[Leaf, ...]
    num_params: int
    matmul_params: int  # parameters multiplied per token (no embedding lookup; LM head if any)

    @property
    def param_itemsize(self) -> int:
        return jnp.dtype(self.config.param_dtype).itemsize

    @property
    def compute_itemsize(self) -> int:
        return jnp.dtype(self.config.dtype).itemsize


@functools.lru_cache(maxsize=64)
def role_model(role: str, head: str, mc: ModelConfig) -> RoleModel:
    """Shapes only (``nnx.eval_shape``): nothing is allocated."""
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(mc, head=head)))
    axes = logical_axes_tree(state)
    shapes = [tuple(v.shape) for v in jax.tree.leaves(state)]
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = tuple(Leaf(s, tuple(a)) for s, a in zip(shapes, names))
    total = sum(math.prod(s) for s in shapes)
    embed = mc.vocab_size * mc.hidden_size
    lm_head = embed if (head == "lm" and mc.tie_word_embeddings) else 0
    return RoleModel(role, head, mc, leaves, total, total - embed + lm_head)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str  # "role/what"
    role: str
    phase: str  # reshard | generate | infer | train
    deps: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The sizes of one RL iteration (see :mod:`jaxflow.configs.base` for the keys)."""

    name: str
    models: dict[str, RoleModel]
    prompts: int  # data.train_batch_size
    n: int  # rollout.n
    prompt_len: int
    response_len: int
    mini_batch_rows: dict[str, int]  # training role -> responses per optimizer step
    train_micro: dict[str, int]  # training role -> micro-batch per device
    epochs: dict[str, int]
    forward_micro: dict[str, int]  # role -> forward micro-batch per device
    max_num_seqs: int
    state_itemsize: int
    stages: tuple[Stage, ...]
    cfg: Any = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def rows(self) -> int:
        return self.prompts * self.n

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.models)


def dataflow(roles: tuple[str, ...]) -> tuple[Stage, ...]:
    """The stages of one iteration over ``roles`` (HybridFlow's PPO dataflow)."""
    stages = [Stage("actor/reshard", "actor", "reshard", ()),
              Stage("actor/generate", "actor", "generate", ("actor/reshard",))]
    forwards = [FORWARD_STAGES[r][0] for r in roles]
    stages += [Stage(FORWARD_STAGES[r][0], r, "infer", ("actor/generate",)) for r in roles]
    stages += [Stage(f"{r}/train", r, "train", tuple(forwards)) for r in TRAINING_ROLES if r in roles]
    return tuple(stages)


def workload_from_config(cfg: Any) -> Workload:
    """The workload of an RL experiment config (its roles' models from their presets or
    checkpoint ``config.json`` files: shapes only)."""
    from jaxflow.configs.overrides import get_value

    if cfg.jaxflow.job != "rl":
        raise ValueError(f"the auto-mapper plans RL jobs; jaxflow.job is {cfg.jaxflow.job!r}")
    roles = active_roles(cfg)
    models = {}
    for role in roles:
        mc = model_config(cfg, role)
        if mc is None:
            raise ValueError(f"cannot plan {role!r}: its model path has no config.json to read the shapes from")
        models[role] = role_model(role, HEADS[role], mc)
    n = cfg.actor_rollout_ref.rollout.n
    sections = {"actor": cfg.actor_rollout_ref.actor, "critic": cfg.critic}
    train = {r: sections[r] for r in TRAINING_ROLES if r in roles}
    return Workload(
        name=cfg.trainer.experiment_name, models=models, prompts=cfg.data.train_batch_size, n=n,
        prompt_len=cfg.data.max_prompt_length, response_len=cfg.data.max_response_length,
        mini_batch_rows={r: s.ppo_mini_batch_size * n for r, s in train.items()},
        train_micro={r: s.ppo_micro_batch_size_per_device for r, s in train.items()},
        epochs={r: s.ppo_epochs for r, s in train.items()},
        forward_micro={r: get_value(cfg, FORWARD_STAGES[r][1]) for r in roles},
        max_num_seqs=cfg.actor_rollout_ref.rollout.max_num_seqs,
        state_itemsize=jnp.dtype(cfg.jaxflow.optim.state_dtype).itemsize,
        stages=dataflow(roles), cfg=cfg)
