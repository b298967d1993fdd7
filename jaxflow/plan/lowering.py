"""The dry run's programs: every compiled program of an RL step, lowered on abstract inputs.

Each role's model is built with ``nnx.eval_shape`` (shapes only), given the shardings its
mesh and rules ask for, and handed to the *same* program builders the workers use
(`jaxflow.workers.trainable.train_step_program`, the padded forwards' `log_probs_program`,
`values_program`, `scores_program`, the packed forwards' `packed_program`, `lower_generate`,
`HybridEngine.lowered`), with the same settings (the `RunSpec`), as ``jax.ShapeDtypeStruct``
leaves carrying those shardings. Nothing is allocated: not the weights, not the optimizer
state, not a batch. Data-dependent shapes take their worst case: with remove padding every
row is full length (`full_length_rows`). ``tests/test_shared_programs.py`` checks that a real
step calls exactly these programs.

:class:`ProgramSpec` is one program: ``lower()`` gives a ``jax.stages.Lowered``, and
:meth:`ProgramSpec.compile` its per-device memory from XLA's buffer assignment
(``compiled.memory_analysis()``) as a :class:`CompiledMemory`.

XLA:CPU compile options (:data:`CPU_COMPILER_OPTIONS`). The programs are compiled, never
run, and only XLA's buffer assignment is read, which happens on the HLO before any machine
code is generated. So on CPU:

- Fusions go through XLA:CPU's classic elemental emitters instead of its MLIR fusion
  emitters, and LLVM runs at ``-O0`` without its expensive passes: the same buffers
  (to a few hundred bytes), compiled 10-20x faster (the 70B train step in ~3 s instead of
  ~50 s on a loaded 2-core machine; the emitters were most of it).
- The CPU backend has no bf16 arithmetic: it rewrites bf16 ops to f32 (float
  normalisation), which puts f32 converts of the weights inside the layer scan and the
  decode loop. Its while-loop-invariant code motion then hoists those converts out of the
  loops, so the program would hold an f32 copy of *every* layer's weights (+37 GiB per
  device in the 70B generate program, +13 GiB in its train step). An accelerator computes
  in bf16 and has no such converts, so that one pass is turned off. What remains is an
  upper bound: activations the CPU keeps in f32 would be bf16 on a GPU or TPU.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.configs import ConfigError
from jaxflow.configs.run_spec import RunSpec
from jaxflow.iterations import Algorithm, algorithm_for, algorithm_names, get_algorithm, rollout_scores_old_log_probs
from jaxflow.mesh import Rules, data_parallel_size, logical_to_spec, state_shardings
from jaxflow.models import ModelConfig, init_model
from jaxflow.models.lora import has_adapters, split_adapters, split_trained, without_adapters
from jaxflow.models.peft_io import graphdef_for
from jaxflow.reshard import HybridEngine, TransitionReport, shard_bytes
from jaxflow.sampling import EngineOptions, engine_shape, lower_generate
from jaxflow.workers.actor import cast_program, generation_dtype
from jaxflow.workers.base import RoleLayout, num_micro_batches, packed_program
from jaxflow.workers.critic import values_fn, values_program
from jaxflow.workers.forward import PROMPT_KEYS, ForwardConfig
from jaxflow.workers.optim import make_optimizer
from jaxflow.workers.packing import pack
from jaxflow.workers.reference import log_probs_fn, log_probs_program
from jaxflow.workers.reward import scores_fn, scores_program
from jaxflow.workers.train_state import TrainState, abstract_train_state, batch_sharding
from jaxflow.workers.trainable import train_step_program as role_train_step

# See the module docstring: cheap machine code (it never runs), and no hoisting of XLA:CPU's
# whole-weight f32 converts out of loops.
CPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_disable_hlo_passes": "while-loop-invariant-code-motion",
}


def compiler_options(mesh: Mesh) -> dict[str, Any]:
    """Compile options for a program on ``mesh`` (:data:`CPU_COMPILER_OPTIONS` on CPU)."""
    platform = mesh.devices.flat[0].platform
    return dict(CPU_COMPILER_OPTIONS) if platform == "cpu" else {}


# --- abstract state -----------------------------------------------------------------------------


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def abstract_model(cfg: ModelConfig, head: str) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, state)`` of a model whose leaves are ``ShapeDtypeStruct`` (no weights)."""
    return nnx.split(nnx.eval_shape(lambda: init_model(cfg, head=head)))


def with_shardings(shardings: Any, abstract: Any, float_dtype: Any = None) -> Any:
    """``abstract`` (Variables or ShapeDtypeStructs) as ShapeDtypeStructs carrying the
    matching leaves of ``shardings`` (a prefix tree of NamedShardings); floating leaves are
    cast to ``float_dtype`` when given."""

    def attach(s: NamedSharding, x: Any) -> Any:
        v = x.get_value() if _is_variable(x) else x
        dtype = float_dtype if float_dtype is not None and jnp.issubdtype(v.dtype, jnp.floating) else v.dtype
        leaf = jax.ShapeDtypeStruct(v.shape, dtype, sharding=s)
        return x.replace(leaf) if _is_variable(x) else leaf

    return jax.tree.map(attach, shardings, abstract, is_leaf=lambda x: isinstance(x, NamedSharding))


def abstract_params(state: Any, rules: Rules, mesh: Mesh) -> Any:
    """The model state with its shardings under ``rules`` on ``mesh``."""
    return with_shardings(state_shardings(state, rules, mesh), state)


def abstract_role_state(state: Any, rules: Rules, mesh: Mesh, tx: Any) -> tuple[TrainState, TrainState]:
    """``(abstract TrainState, its shardings)`` of a training role, from the workers' own
    `abstract_train_state` (the optimizer's moments in ``tx``'s dtype)."""
    return abstract_train_state(state, state_shardings(state, rules, mesh), tx, mesh)


def tree_bytes_per_device(tree: Any) -> int:
    """Bytes the most loaded device holds of a tree of sharded ShapeDtypeStructs."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.ShapeDtypeStruct)]
    return shard_bytes(leaves, [x.sharding for x in leaves])


def batch_axes(rules: Rules, mesh: Mesh) -> Any:
    """The mesh axes the ``batch`` rule splits rows over (a PartitionSpec entry)."""
    return logical_to_spec(("batch",), rules, mesh)[0]


def abstract_columns(
    columns: Mapping[str, tuple[tuple[int, ...], Any]], rules: Rules, mesh: Mesh, presplit: bool = False
) -> dict:
    """Batch columns ``name -> (shape, dtype)`` as ShapeDtypeStructs, rows over the batch axes
    (``presplit``: columns cut into micro-batches ``[k, rows, ...]``, dimension 1 over them)."""
    ba = batch_axes(rules, mesh)
    return {
        n: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, ba, len(shape), leading=int(presplit)))
        for n, (shape, dtype) in columns.items()
    }


def shapes_of(host: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {name: (x.shape, x.dtype) for name, x in host.items()}


def full_length_rows(
    rows: int, prompt_len: int, response_len: int, floats: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """Host columns of ``rows`` rows whose every prompt and response token is real (the
    `PROMPT_KEYS`, int32, plus float32 ``floats``): the packed layouts' worst case (one row
    per bin of ``P + R`` slots; packing shorter rows takes fewer bins)."""
    out = {
        name: np.ones((rows, prompt_len if name.startswith("prompt") else response_len), np.int32)
        for name in PROMPT_KEYS
    }
    return out | {name: np.zeros((rows, response_len), np.float32) for name in floats}


# --- compiled programs -------------------------------------------------------------------------


@dataclasses.dataclass
class CompiledMemory:
    """Per-device bytes of one compiled program (XLA's buffer assignment)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    compile_seconds: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """Live at once while the program runs: inputs, outputs not written in place over a
        donated input, and scratch."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass
class ProgramSpec:
    """One program of the step, ready to lower on abstract inputs.

    ``analytic_argument_bytes``: per-device bytes of its inputs computed from their shapes
    and shardings (checked against XLA's argument size). ``args_hold``: which persistent
    components of its own role (``params``, ``optim``) are among its inputs; the rest of the
    pool's persistent state stays resident beside it.
    """

    name: str
    role: str
    phase: str
    mesh: Mesh
    description: str
    analytic_argument_bytes: int
    args_hold: tuple[str, ...]
    lower: Callable[[], Any] | None = None
    measure: Callable[[], CompiledMemory] | None = None  # for programs that are not one jit
    lowered_parts: Callable[[], list[Any]] | None = None  # ... and their distinct jitted programs, lowered

    def lowered(self) -> list[Any]:
        """The distinct jitted programs this step runs, lowered (``jax.stages.Lowered``)."""
        return self.lowered_parts() if self.lowered_parts is not None else [self.lower()]

    def compile(self) -> CompiledMemory:
        if self.measure is not None:
            return self.measure()
        t0 = time.perf_counter()
        compiled = self.lower().compile(compiler_options=compiler_options(self.mesh))
        seconds = time.perf_counter() - t0
        m = compiled.memory_analysis()
        return CompiledMemory(
            argument_bytes=int(m.argument_size_in_bytes),
            output_bytes=int(m.output_size_in_bytes),
            alias_bytes=int(m.alias_size_in_bytes),
            temp_bytes=int(m.temp_size_in_bytes),
            generated_code_bytes=int(m.generated_code_size_in_bytes),
            compile_seconds=seconds,
        )


def optimizer(spec: RunSpec, role: str) -> Any:
    """``(tx, schedule)`` of a training role, exactly as its worker builds it."""
    conf = spec.actor if role == "actor" else spec.critic
    return make_optimizer(conf.optim)


def layout(graphdef: nnx.GraphDef, state: Any, mesh: Mesh, rules: Rules) -> RoleLayout:
    """The `RoleLayout` of an abstract model on ``mesh`` under ``rules``."""
    return RoleLayout(graphdef, mesh, rules, state_shardings(state, rules, mesh))


def train_micro_batches(spec: RunSpec, role: str, rules: Rules, mesh: Mesh) -> tuple[int, int]:
    """``(rows, micro-batches)`` of one PPO mini-batch of the actor or the critic, as the
    worker compiles it (remove padding: 1, the packed mini-batch carries its micro-batches)."""
    conf = spec.actor if role == "actor" else spec.critic
    rows = conf.ppo_mini_batch_size
    if conf.use_remove_padding:
        return rows, 1
    k = num_micro_batches(
        rows, conf.ppo_micro_batch_size_per_device, data_parallel_size(rules, mesh), f"{role} mini-batch"
    )
    return rows, k


def run_algorithm(spec: RunSpec) -> Algorithm:
    """The run's algorithm (`jaxflow.iterations.algorithm_for`: the record the run, the dry run
    and the auto-mapper read), checked against the run's roles (`Algorithm.check_roles`; a
    `ConfigError` naming ``critic.enable``) and against DAPO's dynamic sampling (an algorithm
    that samples more prompt batches: `Algorithm.dynamic_sampling`)."""
    algorithm = algorithm_for(spec.algorithm)
    try:
        algorithm.check_roles(spec.algorithm, spec.roles)
    except ValueError as e:
        raise ConfigError("critic.enable", str(e)) from None
    if spec.algorithm.algorithm.filter_groups.enable and not algorithm.dynamic_sampling:
        raise ConfigError(
            "algorithm.filter_groups.enable",
            f"algorithm {algorithm.name!r} does not sample more prompt batches; dynamic sampling runs with "
            f"{', '.join(n for n in algorithm_names() if get_algorithm(n).dynamic_sampling)}",
        )
    return algorithm


def actor_on_policy(spec: RunSpec) -> bool:
    """Whether the actor's update runs on-policy (no ``old_log_probs`` column: the step's own
    forward, detached): the algorithm's rollout does not score them
    (`jaxflow.iterations.rollout_scores_old_log_probs`) and one optimizer step covers the
    rollout (`ActorConfig.is_on_policy`), exactly as `ActorWorker.update` decides."""
    run_algorithm(spec)  # checked against the roles
    return not rollout_scores_old_log_probs(spec.algorithm) and spec.actor.is_on_policy(spec.rollout_rows)


def trained_and_frozen(state: Any) -> tuple[Any, Any]:
    """``(trained, frozen)`` parts of a training role's model state: with LoRA adapters the
    adapters (and a value head) and the base weights (`jaxflow.models.lora.split_trained`),
    else everything and None."""
    if not has_adapters(state):
        return state, None
    frozen, trained = split_trained(state)
    return trained, frozen


def train_step_program(
    spec: RunSpec, role: str, graphdef: nnx.GraphDef, state: Any, mesh: Mesh, rules: Rules
) -> tuple[ProgramSpec, int]:
    """The actor's or critic's optimizer step on one PPO mini-batch, micro-batched as
    configured (remove padding: packed micro-batches of the all-full-length worst case,
    `full_length_rows`), from the workers' own builder
    (`jaxflow.workers.trainable.train_step_program`); the actor's on-policy step when the run
    takes it (`actor_on_policy`); with LoRA the adapters' step, the frozen base its fourth
    argument. Returns the spec and the number of micro-batches."""
    P, R = spec.prompt_length, spec.response_length
    tx, schedule = optimizer(spec, role)
    rows, k = train_micro_batches(spec, role, rules, mesh)
    trained, frozen = trained_and_frozen(state)
    abstract_state, shardings = abstract_role_state(trained, rules, mesh, tx)
    frozen_args = () if frozen is None else (abstract_params(frozen, rules, mesh),)
    role_layout = layout(graphdef, state, mesh, rules)
    conf, on_policy = (spec.actor, actor_on_policy(spec)) if role == "actor" else (spec.critic, False)
    frozen_shardings = None if frozen is None else state_shardings(frozen, rules, mesh)
    step = role_train_step(
        role_layout, tx, schedule, conf, shardings, k, on_policy=on_policy, frozen_shardings=frozen_shardings
    )
    keys, scalar_names = conf.update_keys(on_policy), conf.SCALAR_NAMES
    host = full_length_rows(rows, P, R, tuple(c for c in keys if c not in PROMPT_KEYS))
    if conf.use_remove_padding:
        packed, _ = pack(
            host,
            ranks=data_parallel_size(rules, mesh),
            max_token_len=conf.ppo_max_token_len_per_device if conf.use_dynamic_bsz else None,
            rows_per_micro=conf.ppo_micro_batch_size_per_device,
        )
        batch = abstract_columns(shapes_of(packed), rules, mesh, presplit=True)
        k = next(iter(packed.values())).shape[0]
        what = f"packed into {k} micro-batch{'es' if k > 1 else ''} (all rows full length)"
    else:
        batch = abstract_columns(shapes_of(host), rules, mesh)
        what = f"{k} micro-batch{'es' if k > 1 else ''} of {rows // k}"
    replicated = NamedSharding(mesh, PartitionSpec())
    scalars = {s: jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated) for s in scalar_names}
    program = ProgramSpec(
        name=f"{role}/train_step",
        role=role,
        phase="train",
        mesh=mesh,
        description=f"1 mini-batch of {rows} x {P}+{R} tokens{', on-policy' if on_policy else ''}, {what}",
        analytic_argument_bytes=tree_bytes_per_device((abstract_state, batch, scalars, frozen_args)),
        args_hold=("params", "optim"),
        lower=lambda: step.lower(abstract_state, batch, scalars, *frozen_args),
    )
    return program, k


@dataclasses.dataclass(frozen=True)
class Forward:
    """A role's forward over the whole rollout as its worker runs it: ``padded(layout, k)``
    builds the padded-rows program (``k`` micro-batches), ``fn`` is the body of the packed
    one (`packed_program`); ``scalars`` its runtime scalars; ``config`` the worker's
    `ForwardConfig` (micro-batches, remove padding, token budget); ``packed_name``: the name
    the worker gives its packed program (`jaxflow.workers.base.RoleWorker.run_forward`)."""

    role: str
    padded: Callable[[RoleLayout, int], Any]
    fn: Callable[[Any, dict, dict], dict]
    scalars: tuple[str, ...]
    config: ForwardConfig
    packed_name: str


FORWARD_PROGRAMS = ("actor/log_probs", "ref/log_probs", "critic/values", "reward/scores", "cost/scores")


def forward_of(spec: RunSpec, name: str) -> Forward:
    """The `Forward` of program ``name`` (one of `FORWARD_PROGRAMS`), from the workers' own
    builders and bodies and the `RunSpec` settings the workers are built with."""
    if name == "actor/log_probs":
        a = spec.actor
        return Forward(
            "actor",
            lambda lo, k: log_probs_program(lo, k, with_entropy=a.log_prob_entropy),
            log_probs_fn(with_entropy=a.log_prob_entropy),
            ("temperature",),
            a.log_prob_forward,
            "old_log_probs",
        )
    if name == "ref/log_probs":
        ref = spec.role_settings.ref  # a role, or LoRA: the actor's base
        return Forward(
            "ref",
            lambda lo, k: log_probs_program(lo, k, output_key="ref_log_prob"),
            log_probs_fn("ref_log_prob"),
            ("temperature",),
            ref,
            "ref_log_prob",
        )
    if name == "critic/values":
        c = spec.critic
        return Forward(
            "critic",
            values_program,
            values_fn,
            (),
            c.values_forward,
            "values",
        )
    if name in ("reward/scores", "cost/scores"):
        role = name.split("/")[0]
        key = "token_level_cost" if role == "cost" else "token_level_scores"
        return Forward(
            role,
            lambda lo, k: scores_program(lo, k, key),
            scores_fn(key),
            (),
            spec.roles[role],  # the reward or the cost model's
            key,
        )
    raise KeyError(f"unknown forward program {name!r}; forwards: {FORWARD_PROGRAMS}")


def forward_micro_batches(spec: RunSpec, name: str, rules: Rules, mesh: Mesh) -> tuple[int, int]:
    """``(rows, micro-batches)`` of a forward over the whole rollout (remove padding: those of
    the all-full-length packed layout)."""
    f, rows = forward_of(spec, name), spec.rollout_rows
    if f.config.use_remove_padding:
        return rows, packed_forward_inputs(spec, f, rules, mesh)[1].num_micro
    return rows, num_micro_batches(rows, f.config.micro_batch_size_per_device, data_parallel_size(rules, mesh), name)


def packed_forward_inputs(spec: RunSpec, f: Forward, rules: Rules, mesh: Mesh) -> tuple[dict[str, np.ndarray], Any]:
    """``(host inputs, layout)`` of a packed forward over the rollout's rows at full length
    (`full_length_rows`), as `jaxflow.workers.base.packed_forward` packs them."""
    host = full_length_rows(spec.rollout_rows, spec.prompt_length, spec.response_length)
    return pack(
        host,
        ranks=data_parallel_size(rules, mesh),
        max_token_len=f.config.max_token_len_per_device,
        rows_per_micro=f.config.micro_batch_size_per_device,
    )


def forward_program(
    spec: RunSpec, name: str, graphdef: nnx.GraphDef, state: Any, mesh: Mesh, rules: Rules
) -> tuple[ProgramSpec, int]:
    """A forward over the whole rollout (``train_batch_size * n`` rows) as the worker runs it
    (`forward_of`): padded rows in micro-batches, or packed micro-batches of the
    all-full-length worst case."""
    f = forward_of(spec, name)
    P, R = spec.prompt_length, spec.response_length
    rows, k = forward_micro_batches(spec, name, rules, mesh)
    params = abstract_params(state, rules, mesh)
    role_layout = layout(graphdef, state, mesh, rules)
    if f.config.use_remove_padding:
        tensors = abstract_columns(
            shapes_of(packed_forward_inputs(spec, f, rules, mesh)[0]), rules, mesh, presplit=True
        )
        program = packed_program(role_layout, f.fn, f.packed_name)
        what = f"packed into {k} micro-batch{'es' if k > 1 else ''} (all rows full length)"
    else:
        tensors = abstract_columns(shapes_of(full_length_rows(rows, P, R)), rules, mesh)
        program = f.padded(role_layout, k)
        what = f"{k} micro-batch{'es' if k > 1 else ''} of {rows // k}"
    replicated = NamedSharding(mesh, PartitionSpec())
    scalars = {s: jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated) for s in f.scalars}
    out = ProgramSpec(
        name=name,
        role=f.role,
        phase="infer",
        mesh=mesh,
        description=f"{rows} x {P}+{R} tokens, {what}",
        analytic_argument_bytes=tree_bytes_per_device((params, tensors, scalars)),
        args_hold=("params",),
        lower=lambda: program.lower(params, tensors, scalars),
    )
    return out, k


def generation_slots(spec: RunSpec) -> int | None:
    """Decode slots per generation replica: ``max_num_seqs`` when set (None: the engine's
    default). One generate call covers the whole rollout."""
    m = spec.rollout.max_num_seqs
    return m if m > 0 else None


def generation_kv_tokens(spec: RunSpec) -> int | None:
    """The KV-cache budget per generation replica: ``max_total_tokens`` when set (None: the
    engine's default)."""
    return spec.rollout.max_total_tokens or None


@dataclasses.dataclass(frozen=True)
class GenerationWeights:
    """What the actor's rollout reads, as `ActorWorker._generation_weights` makes it: the
    graph, the (abstract) state, the dtype its floating weights are cast to (None: their own)
    and whether they are a copy made beside the training weights (``copy``) or the training
    weights themselves, donated into the generation layout; ``merged``: the copy has the LoRA
    adapters merged in (`merge_program`), else it is a cast (`cast_program`)."""

    graphdef: nnx.GraphDef
    state: Any
    dtype: Any
    copy: bool
    merged: bool = False


def base_graphdef(mc: ModelConfig) -> nnx.GraphDef:
    """The graph of an adapted LM's base (its model without adapters)."""
    return graphdef_for(without_adapters(mc), "lm")


def cast_floats(state: Any, dtype: Any) -> Any:
    """An abstract state with its floating leaves in ``dtype`` (None: as they are)."""
    if dtype is None:
        return state
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        state,
    )


def generation_weights(spec: RunSpec, mc: ModelConfig, graphdef: nnx.GraphDef, state: Any) -> GenerationWeights:
    """The rollout's `GenerationWeights`: with LoRA merged (``rollout.lora_merge``) the base
    graph and its weights (a copy with the adapters merged in, in `generation_dtype` or the
    base's dtype); otherwise the model's own graph and weights (a copy when `generation_dtype`
    narrows them)."""
    cast = generation_dtype(mc)
    if mc.lora is not None and spec.rollout.lora_merge:
        base = split_adapters(state)[0]
        return GenerationWeights(base_graphdef(mc), base, cast, True, merged=True)
    return GenerationWeights(graphdef, state, cast, cast is not None)


def generate_program(
    spec: RunSpec, mc: ModelConfig, graphdef: nnx.GraphDef, state: Any, engine: HybridEngine, sampling: str = "train"
) -> tuple[ProgramSpec, int]:
    """The actor's rollout program (chunked prefill + continuous decode over
    :func:`generation_slots` slots per replica) in the generation layout, for the whole
    rollout in one call, with the ``sampling`` parameters (`RolloutConfig.resolve`:
    ``"train"``, or ``"greedy"``, ReMax's baseline rollout, ``actor/generate_greedy``), on the
    weights `generation_weights` says. Returns the spec and the prompts per call."""
    mesh, rules = engine.gen_mesh, engine.gen_rules
    sp = spec.rollout.resolve(sampling)
    n, P = sp.n, spec.prompt_length
    gen_dp = data_parallel_size(rules, mesh)
    prompts = spec.train_batch_size
    slots, kv_tokens = generation_slots(spec), generation_kv_tokens(spec)
    gw = generation_weights(spec, mc, graphdef, state)
    graphdef, state = gw.graphdef, gw.state
    params = with_shardings(state_shardings(state, rules, mesh), state, float_dtype=gw.dtype)
    ids = np.ones((prompts, P), np.int32)  # host-side shape carrier; lower_generate places nothing
    shape = engine_shape(mc, prompts, P, sp.max_new_tokens, n=n, replicas=gen_dp, slots=slots, kv_tokens=kv_tokens)
    out = ProgramSpec(
        name="actor/generate" if sampling == "train" else f"actor/generate_{sampling}",
        role="actor",
        phase="generate",
        mesh=mesh,
        description=(
            f"{prompts} prompts x n={n} -> {prompts * n} sequences of {P}+{sp.max_new_tokens} tokens "
            f"({shape.rows} per generation replica through {shape.slots} decode slots, "
            f"prefill chunks of {shape.prefill_rows}x{shape.prefill_len})"
        ),
        # + each replica's prompts (ids [prompts, P], lengths) and row limits, int32
        analytic_argument_bytes=tree_bytes_per_device(params)
        + 4 * (shape.prompts * (shape.prompt_len + 1) + shape.rows + 2),
        # The training weights are donated into this generation copy (`HybridEngine.generation_swap`):
        # the actor's optimizer state stays resident, its training weights do not; a copy (narrower,
        # `generation_dtype`, or LoRA-merged) is made beside them, so they stay resident too.
        args_hold=() if gw.copy else ("params",),
        lower=lambda: lower_generate(
            graphdef,
            params,
            ids,
            ids,
            sp,
            mesh=mesh,
            rules=rules,
            options=EngineOptions(slots=slots, kv_tokens=kv_tokens),
        ),
    )
    return out, prompts


def _mesh_text(mesh: Mesh) -> str:
    return " ".join(f"{a}={n}" for a, n in mesh.shape.items())


def _cast_lowered(engine: HybridEngine, gw: GenerationWeights) -> list[Any]:
    """The actor's cast of its weights into the generation dtype (`cast_program`), lowered on
    the training layout, when the rollout reads such a cast copy; else nothing."""
    if gw.dtype is None or gw.merged:
        return []
    shardings = engine.train_shardings(gw.state)
    return [cast_program(gw.dtype, shardings).lower(with_shardings(shardings, gw.state))]


def reshard_program(engine: HybridEngine, gw: GenerationWeights) -> ProgramSpec:
    """The actor's train -> generate weight transition (`HybridEngine.report`: its programs
    compiled, their memory summed in the order they run) of what the rollout reads
    (`generation_weights`): the weights in their own dtype, or a copy (narrower, or
    LoRA-merged: the masters stay)."""
    state, cast = gw.state, gw.dtype
    if cast is not None:
        state = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, cast, sharding=x.sharding) if jnp.issubdtype(x.dtype, jnp.floating) else x
            ),
            state,
        )

    def measure() -> CompiledMemory:
        t0 = time.perf_counter()
        rep: TransitionReport = engine.report(state)
        return CompiledMemory(
            argument_bytes=rep.train_shard_bytes,
            output_bytes=rep.output_bytes,
            alias_bytes=0,
            temp_bytes=rep.peak_extra_bytes - rep.output_bytes,
            generated_code_bytes=0,
            compile_seconds=time.perf_counter() - t0,
            extra=dict(
                strategy=rep.strategy,
                programs=rep.programs,
                calls=rep.calls,
                ring_received_bytes=rep.ring_received_bytes,
                table2_comm_bytes=rep.table2.comm_bytes,
                comm_ratio=rep.comm_ratio,
                peak_extra_bytes=rep.peak_extra_bytes,
                redundancy_bytes=rep.redundancy_bytes,
                full_remat=rep.full_remat,
            ),
        )

    train_bytes = shard_bytes(
        jax.tree.leaves(state),
        jax.tree.leaves(engine.train_shardings(state), is_leaf=lambda x: isinstance(x, NamedSharding)),
    )
    return ProgramSpec(
        name="actor/reshard",
        role="actor",
        phase="reshard",
        mesh=engine.train_mesh,
        description=f"-> generate {_mesh_text(engine.gen_mesh)} ({engine.strategy}, {len(engine.micro_dp_groups)} "
        f"micro-DP groups of {len(engine.micro_dp_groups[0])})",
        analytic_argument_bytes=train_bytes,
        args_hold=() if gw.copy else ("params",),
        measure=measure,
        lowered_parts=lambda: _cast_lowered(engine, gw) + engine.lowered(state),
    )
