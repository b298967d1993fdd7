"""What the auto-mapper plans: the roles' models and the dataflow of one RL iteration, read
from the run's typed description (`RunSpec`, without a placement: the mapper is what places
it; `jaxflow.configs.prepare.prepare_run` with ``with_placement=False`` describes any run so).

The dataflow (HybridFlow's PPO; the other algorithms drop roles they do not run)::

    actor/reshard -> actor/generate -> {actor/log_probs, ref/log_probs, critic/values,
                                        reward/scores, cost/scores, actor/generate_<mode>}
                  -> {critic/train, actor/train}

What the algorithm adds or drops is read from its registration
(`jaxflow.iterations.Algorithm`): ``actor/log_probs`` runs when its rollout scores the old
log-probs (``scores_old_log_probs``) or the actor's update is not on-policy (more than one
optimizer step per rollout; otherwise the update's own forward gives them), never in verl's
bypass mode (the rollout's own log-probs are the old ones);
``actor/generate_<mode>`` is each of its ``extra_rollouts`` (ReMax's greedy baseline), one
response per prompt. The stages of one pool run one after another;
:func:`jaxflow.automap.search.schedule` says when stages on disjoint pools overlap. Not
modelled: the extra rollouts' reward-model scores, packed (remove-padding) batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.configs.run_spec import RunSpec
from jaxflow.mesh import TRAINING_ROLES, Role, logical_axes_tree
from jaxflow.models import ModelConfig, init_model
from jaxflow.models.lora import trained_mask
from jaxflow.plan.lowering import forward_of, run_algorithm

# Each role's forward program over the rollout (the dry run's names; `forward_of` gives its
# builder and micro-batch setting).
FORWARD_PROGRAM = {
    "actor": "actor/log_probs",
    "ref": "ref/log_probs",
    "critic": "critic/values",
    "reward": "reward/scores",
    "cost": "cost/scores",
}


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]
    adapter: bool = False  # trained under LoRA: an adapter or a value head (`lora.split_trained`)


@dataclasses.dataclass(frozen=True)
class RoleModel:
    """One role's model: shapes of its parameters (with logical axes), and the counts the
    simulators need.

    ``body_params``: the decoder's parameters (every layer, final norm), each used once per
    token. ``head_params``: the output head's matmul (the LM head ``V x D``, also when tied
    to the embedding; a value / reward head ``D``). ``embed_params``: the embedding table,
    which a token only looks up (a row), never multiplies, unless tied to the LM head."""

    role: str
    head: str
    config: ModelConfig
    leaves: tuple[Leaf, ...]
    num_params: int
    body_params: int
    head_params: int
    embed_params: int

    @property
    def param_itemsize(self) -> int:
        return jnp.dtype(self.config.param_dtype).itemsize

    @property
    def adapter_itemsize(self) -> int:
        """Bytes per LoRA adapter parameter (float32, whatever the base weights)."""
        lora = self.config.lora
        return 0 if lora is None else jnp.dtype(lora.param_dtype).itemsize

    @property
    def compute_itemsize(self) -> int:
        return jnp.dtype(self.config.dtype).itemsize

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter (what a copy of the model holds)."""
        return self.num_params * self.param_itemsize

    @property
    def matmul_weight_bytes(self) -> int:
        """Bytes a forward pass multiplies with (reads): the body and the head, not the
        embedding table's unused rows."""
        return (self.body_params + self.head_params) * self.param_itemsize


@functools.lru_cache(maxsize=64)
def role_model(role: str, head: str, mc: ModelConfig) -> RoleModel:
    """Shapes only (``nnx.eval_shape``): nothing is allocated."""
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(mc, head=head)))
    axes = logical_axes_tree(state)
    shapes = [tuple(v.shape) for v in jax.tree.leaves(state)]
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    adapters = trained_mask(state)
    leaves = tuple(Leaf(s, tuple(a), lora) for s, a, lora in zip(shapes, names, adapters))
    total = sum(math.prod(s) for s in shapes)
    embed = mc.vocab_size * mc.hidden_size
    # Parameters outside the decoder (`model`): the untied LM head, or the score head.
    outside = sum(
        math.prod(v.shape)
        for path, v in jax.tree_util.tree_leaves_with_path(state)
        if getattr(path[0], "key", None) != "model"
    )
    head_matmul = embed if head == "lm" else mc.hidden_size
    return RoleModel(role, head, mc, leaves, total, total - embed - outside, head_matmul, embed)


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
    train_micro: dict[str, int | None]  # training role -> micro-batch per device
    epochs: dict[str, int]
    forward_micro: dict[str, int | None]  # role -> forward micro-batch per device
    max_num_seqs: int
    state_itemsize: int
    stages: tuple[Stage, ...]
    lora_merge: bool = True  # with LoRA, the rollout reads a copy with the adapters merged in

    @property
    def rows(self) -> int:
        return self.prompts * self.n

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.models)


def dataflow(
    roles: tuple[str, ...],
    old_log_probs: bool = True,
    extra_rollouts: tuple[str, ...] = (),
    ref_in_actor: bool = False,
) -> tuple[Stage, ...]:
    """The stages of one iteration over ``roles`` (HybridFlow's PPO dataflow);
    ``old_log_probs``: whether the actor scores the rollout before its update;
    ``extra_rollouts``: the sampling modes of the actor's further rollouts, one response per
    prompt each (phase ``generate_one``); ``ref_in_actor``: the reference's log-probs run on
    the actor (LoRA: its base model), a forward of the actor's."""
    stages = [
        Stage("actor/reshard", "actor", "reshard", ()),
        Stage("actor/generate", "actor", "generate", ("actor/reshard",)),
    ]
    scored = [r for r in roles if r != "actor" or old_log_probs]
    before_train = [FORWARD_PROGRAM[r] for r in scored] + [f"actor/generate_{m}" for m in extra_rollouts]
    stages += [Stage(FORWARD_PROGRAM[r], r, "infer", ("actor/generate",)) for r in scored]
    if ref_in_actor:
        stages.append(Stage(FORWARD_PROGRAM["ref"], "actor", "infer", ("actor/generate",)))
        before_train.append(FORWARD_PROGRAM["ref"])
    stages += [Stage(f"actor/generate_{m}", "actor", "generate_one", ("actor/generate",)) for m in extra_rollouts]
    stages += [
        Stage(f"{r}/train", r, "train", tuple(before_train) or ("actor/generate",))
        for r in TRAINING_ROLES
        if r in roles
    ]
    return tuple(stages)


def workload_from_spec(spec: RunSpec) -> Workload:
    """The workload of a described RL run (shapes only: nothing is allocated)."""
    if spec.job != "rl":
        raise ValueError(f"the auto-mapper plans RL jobs; jaxflow.job is {spec.job!r}")
    models = {}
    for role in spec.roles:
        mc = spec.models[role].config
        if mc is None:
            raise ValueError(f"cannot plan {role!r}: its model path has no config.json to read the shapes from")
        models[role] = role_model(role, Role(role).head, mc)
    train = {r: c for r, c in spec.roles.items() if r in TRAINING_ROLES}
    algorithm = run_algorithm(spec)
    # The actor's log-prob forward: the rollout scores them, or the update is not on-policy;
    # never in bypass mode (the rollout's own log-probs are the old ones).
    scored = algorithm.scores_old_log_probs(spec.algorithm)
    bypass = spec.algorithm.algorithm.rollout_correction.bypass_mode
    old_log_probs = not bypass and (scored or not spec.actor.is_on_policy(spec.rollout_rows))
    return Workload(
        name=spec.name,
        models=models,
        prompts=spec.train_batch_size,
        n=spec.n,
        prompt_len=spec.prompt_length,
        response_len=spec.response_length,
        mini_batch_rows={r: c.ppo_mini_batch_size for r, c in train.items()},
        train_micro={r: c.ppo_micro_batch_size_per_device for r, c in train.items()},
        epochs={r: c.ppo_epochs for r, c in train.items()},
        forward_micro={r: forward_of(spec, FORWARD_PROGRAM[r]).config.micro_batch_size_per_device for r in spec.roles},
        max_num_seqs=spec.rollout.max_num_seqs,
        state_itemsize=jnp.dtype(spec.actor.optim.state_dtype).itemsize,
        stages=dataflow(tuple(spec.roles), old_log_probs, algorithm.extra_rollouts, spec.ref_in_actor),
        lora_merge=spec.rollout.lora_merge,
    )
