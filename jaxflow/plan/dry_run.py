"""The dry run: plan a run and compile its programs ahead of time on a simulated mesh,
without allocating a model or a batch.

``python -m jaxflow.run --config=ppo_70b --dry_run`` comes down to::

    report = dry_run(spec)                # prints the plan and the table as it goes
    report.to_json()                      # or dry_run(spec, json_path="plan.json")

(``spec``: the run's `RunSpec` with its placement: `jaxflow.configs.prepare.prepare_run`, and
for ``placement.type=auto`` the auto-mapper's, `jaxflow.automap.auto_place`),
with ``XLA_FLAGS=--xla_force_host_platform_device_count=<jaxflow.num_devices>`` set before
JAX starts, so a 128-device HybridFlow run is planned on one CPU machine.

What it reports, per device (the most loaded device of each mesh):

1. **The plan**: pools (device ranges, roles), each role's meshes per phase (the actor:
   train and generate), its model's shape and parameter count.
2. **Analytic memory** per role: parameters; optimizer state, as the workers create it
   (`jaxflow.workers.abstract_train_state`: Adam's two moments in ``jaxflow.optim.state_dtype``,
   sharded like the parameters); gradients
   (parameter dtype; twice that with micro-batch accumulation: the running sum and the
   micro-batch's); an activation estimate (below); for the actor, the generation copy of
   the weights and the paged KV pool of the rollout engine (`jaxflow.sampling.engine_shape`:
   the prompts' pages plus ``slots x (R / page_size + 1)`` response pages per generation
   replica, x page_size x layers x 2 x kv_heads x head_dim / (their shards) x dtype). A pool's peak is what its roles keep
   (parameters, optimizer state) plus the largest transient of any of its phases; it fits
   when that is at most ``jaxflow.dry_run.device_memory_gib``.
3. **Compiled memory** of every program of an RL step, lowered on ``jax.ShapeDtypeStruct``
   inputs through the workers' own program builders and compiled for the role's mesh
   (:mod:`jaxflow.plan.lowering`): the actor and critic optimizer steps (one
   mini-batch, micro-batched as configured or packed with remove padding; the actor's
   on-policy step when the run takes it), the actor's generate program (chunked prefill +
   continuous decode over ``max_num_seqs`` slots per generation replica, one call; also the
   rollouts the algorithm adds, `jaxflow.iterations.Algorithm.extra_rollouts`: ReMax's greedy
   baseline), its train -> generate reshard, the reference log-probs and
   the reward (and cost) model scores (padded or packed, as the workers run them). From XLA's
   ``memory_analysis()``: argument, output, alias (outputs written over donated inputs),
   temp and generated-code bytes; ``peak = argument + output - alias + temp``. A program
   fits when its peak plus the persistent state of its pool that is *not* among its
   arguments (e.g. the actor's optimizer state and the reference weights while the actor
   generates: its training weights are donated into the generation copy,
   `jaxflow.reshard.HybridEngine.generation_swap`) is within the budget.

Activation estimate (``b`` rows per device, ``T = P + R``, ``D`` width, ``F`` MLP width,
``H``/``N`` query/kv heads of ``K`` dims, ``V`` vocabulary, ``c`` compute bytes, each
divided by the devices that split it)::

    layer  = b T (4 D + 3 F + 2 H K + 2 N K) c + 2 b H T S 4        (S = T)
    train  = L b T D c + layer + 3 b R V 4      (remat; without remat: L * layer + ...)
    infer  = layer + 2 b R V 4
    generate = max(layer(prefill_rows, T = S = prefill_len), layer(slots, T = 1, S = P + R)
                   + 2 slots V 4) + 2 rows R 4

On CPU, XLA computes bf16 in f32: compiled temp bytes are an upper bound of what a GPU or
TPU needs. :mod:`jaxflow.plan.lowering` says which compile options the dry run
uses on CPU and why (one keeps XLA:CPU from hoisting f32 copies of every layer's weights out
of the loops; the others make the 70B programs compile in seconds).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxflow.configs import ConfigError
from jaxflow.configs.run_spec import RunSpec
from jaxflow.mesh import TRAINING_ROLES, Role, Rules, data_parallel_size, logical_to_spec, state_shardings
from jaxflow.models import ModelConfig
from jaxflow.plan import lowering as progs
from jaxflow.reshard import HybridEngine, shard_bytes
from jaxflow.sampling import EngineShape, engine_shape

GiB = 1024**3
# Programs compiled by default (those of roles the config runs), in the order of a step;
# actor/generate_greedy when the algorithm rolls out greedily too (its extra_rollouts).
DEFAULT_PROGRAMS = (
    "actor/generate",
    "actor/generate_greedy",
    "actor/reshard",
    "ref/log_probs",
    "reward/scores",
    "cost/scores",
    "critic/train_step",
    "actor/train_step",
)
# Also available: the actor's old-log-prob forward and the critic's value forward.
OPTIONAL_PROGRAMS = ("actor/log_probs", "critic/values")


@dataclasses.dataclass
class PoolPlan:
    name: str
    device_ids: list[int]
    roles: list[str]
    persistent_bytes: int = 0  # parameters + optimizer state of its roles, per device
    peak_bytes: int = 0  # persistent + the largest transient of any phase on it
    peak_phase: str = ""
    fits: bool = True

    @property
    def devices_text(self) -> str:
        ids = self.device_ids
        return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


@dataclasses.dataclass
class RolePlan:
    """A role's model, meshes and analytic per-device memory (bytes)."""

    role: str
    pool: str
    head: str
    model: dict[str, Any]
    num_params: int
    meshes: dict[str, dict[str, int]]  # phase -> axis sizes
    param_bytes: int
    optimizer_bytes: int = 0
    gradient_bytes: int = 0
    activation_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # phase -> estimate
    generate_param_bytes: int = 0
    generate_copy: bool = False  # the generation weights are a copy beside the training weights
    kv_cache_bytes: int = 0
    micro_batches: dict[str, int] = dataclasses.field(default_factory=dict)  # program -> count

    @property
    def persistent_bytes(self) -> int:
        return self.param_bytes + self.optimizer_bytes

    @property
    def generation_weight_bytes(self) -> int:
        """What the generation weights add while the rollout runs: a copy (narrower, or with
        LoRA adapters merged in) all of it; the training weights donated into it, the difference."""
        return self.generate_param_bytes - (0 if self.generate_copy else self.param_bytes)

    def transient_bytes(self) -> dict[str, int]:
        """Phase -> bytes allocated on top of the persistent state while it runs."""
        out = {}
        for phase, act in self.activation_bytes.items():
            if phase == "train":
                out[phase] = self.gradient_bytes + act
            elif phase == "generate":
                out[phase] = self.generation_weight_bytes + self.kv_cache_bytes + act
            else:
                out[phase] = act
        return out


@dataclasses.dataclass
class ProgramReport:
    """One compiled program's per-device memory (bytes) and whether it fits."""

    name: str
    role: str
    phase: str
    mesh: dict[str, int]
    description: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    analytic_argument_bytes: int
    resident_bytes: int  # persistent state of the pool that is not among its arguments
    total_bytes: int
    fits: bool
    compile_seconds: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DryRunReport:
    """The plan and the numbers; :meth:`format` is what :func:`dry_run` prints."""

    config: str
    num_devices: int
    platform: str
    device_memory_bytes: int
    placement: str
    pools: list[PoolPlan]
    roles: list[RolePlan]
    programs: list[ProgramReport] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0
    max_rss_bytes: int = 0

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.pools) and all(p.fits for p in self.programs)

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    def program(self, name: str) -> ProgramReport:
        return next(p for p in self.programs if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def format(self) -> str:
        parts = [format_plan(self), format_program_header(self)]
        parts += [format_program(self, p) for p in self.programs]
        parts.append(format_summary(self))
        return "\n".join(parts)


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)


# --- analytic plan -----------------------------------------------------------------------------


def _unit(r: DryRunReport) -> tuple[str, int]:
    """GiB, or MiB when every pool's analytic peak is below a GiB (tiny configs). Fixed by the
    plan, so the table printed as programs compile keeps one unit."""
    return ("GiB", GiB) if max((p.peak_bytes for p in r.pools), default=0) >= GiB else ("MiB", 1024**2)


def _b(n: float, unit: int) -> str:
    return f"{n / unit:7.2f}"


def _axes(spec_entry: Any) -> tuple[str, ...]:
    return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def _shards(rules: Rules, mesh: Mesh, *names: str) -> int:
    """Devices that split the logical dims ``names`` of an activation whose rows are split
    over the batch axes (an axis serves one dimension only)."""
    spec = logical_to_spec(("batch",) + names, rules, mesh)
    return math.prod(mesh.shape[a] for entry in spec[1:] for a in _axes(entry))


def _layer_bytes(mc: ModelConfig, b: float, L: int, S: int, rules: Rules, mesh: Mesh) -> float:
    """One decoder layer's working set for ``b`` rows per device of ``L`` queries over ``S`` keys."""
    c = jnp.dtype(mc.dtype).itemsize
    D, F, H, N, K = mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    sh, sf = _shards(rules, mesh, "heads"), _shards(rules, mesh, "mlp")
    skv = _shards(rules, mesh, "kv_heads", "head_dim")
    per_token = 4 * D + 3 * F / sf + 2 * H * K / sh + 2 * N * K / skv
    return b * L * per_token * c + 2 * b * (H / sh) * L * S * 4


def activation_bytes(mc: ModelConfig, phase: str, b: float, P: int, R: int, rules: Rules, mesh: Mesh) -> int:
    """The module docstring's activation estimate for ``b`` rows per device."""
    T = P + R
    sv = _shards(rules, mesh, "vocab")
    c = jnp.dtype(mc.dtype).itemsize
    if phase == "train":
        layer = _layer_bytes(mc, b, T, T, rules, mesh)
        logits = 3 * b * R * mc.vocab_size / sv * 4
        kept = mc.num_layers * b * T * mc.hidden_size * c if mc.remat_policy != "none" else mc.num_layers * layer
        return int(kept + layer + logits)
    if phase == "infer":
        return int(_layer_bytes(mc, b, T, T, rules, mesh) + 2 * b * R * mc.vocab_size / sv * 4)
    raise ValueError(phase)


def kv_pool_bytes(mc: ModelConfig, shape: EngineShape, rules: Rules, mesh: Mesh) -> int:
    """Per-device bytes of the rollout engine's page pool (keys and values): one replica's
    pool, split over kv heads and head_dim as the engine constrains it (a dimension the rules'
    axes do not divide is not split)."""
    n_heads, n_dim = _shards(rules, mesh, "kv_heads"), _shards(rules, mesh, "head_dim")
    split = (n_heads if mc.num_kv_heads % n_heads == 0 else 1) * (n_dim if mc.head_dim % n_dim == 0 else 1)
    return shape.pool_bytes // split


def generate_activation_bytes(mc: ModelConfig, shape: EngineShape, rules: Rules, mesh: Mesh) -> int:
    """The rollout's working set per device: the larger of one prefill chunk (prefill_rows x
    prefill_len queries over a block of keys as long as the chunk) and one decode step (slots
    queries, logits over the vocabulary), plus the response buffers (tokens, log-probs)."""
    sv = _shards(rules, mesh, "vocab")
    C = shape.prefill_len
    prefill = _layer_bytes(mc, shape.prefill_rows, C, C, rules, mesh)
    decode = _layer_bytes(mc, shape.slots, 1, shape.prompt_len + shape.response_len, rules, mesh) + (
        2 * shape.slots * mc.vocab_size / sv * 4
    )
    return int(max(prefill, decode) + 2 * shape.rows * shape.response_len * 4)


def _params_bytes(state: Any, rules: Rules, mesh: Mesh) -> int:
    leaves = jax.tree.leaves(state)
    shardings = jax.tree.leaves(state_shardings(state, rules, mesh), is_leaf=lambda x: isinstance(x, NamedSharding))
    return shard_bytes(leaves, shardings)


MODEL_KEYS = ("model_type", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")


def _model_dict(mc: ModelConfig) -> dict[str, Any]:
    """The model's shape and numerics as the report lists them."""
    return {
        **{k: getattr(mc, k) for k in (*MODEL_KEYS, "vocab_size")},
        "param_dtype": jnp.dtype(mc.param_dtype).name,
        "dtype": jnp.dtype(mc.dtype).name,
        "scan_layers": mc.scan_layers,
        "remat_policy": mc.remat_policy,
    }


def _model_text(m: dict[str, Any]) -> str:
    return (
        f"{m['model_type']} L{m['num_layers']} D{m['hidden_size']} F{m['intermediate_size']} "
        f"H{m['num_heads']}/{m['num_kv_heads']}x{m['head_dim']} V{m['vocab_size']} {m['param_dtype']}"
    )


def _mesh_text(shape: dict[str, int]) -> str:
    return " ".join(f"{a}={n}" for a, n in shape.items())


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


# --- printing --------------------------------------------------------------------------------------


def format_program_header(r: DryRunReport) -> str:
    name, _ = _unit(r)
    return (
        f"compiled programs, per device ({name}; XLA memory_analysis of the AOT compile on the simulated mesh):\n"
        f"  {'program':<18} {'args':>7} {'out':>7} {'alias':>7} {'temp':>7} {'code':>7} {'peak':>7} "
        f"{'+resid':>7} {'total':>7}  fits  compile  mesh / what"
    )


def format_plan(r: DryRunReport) -> str:
    lines = [
        f"jaxflow dry run: {r.config} on {r.num_devices} {r.platform} devices, "
        f"budget {r.device_memory_bytes / GiB:.1f} GiB per device",
        f"placement {r.placement}:",
    ]
    for p in r.pools:
        lines.append(f"  pool {p.name:<8} devices {p.devices_text:<10} roles {', '.join(p.roles)}")
    lines.append("roles:")
    for rp in r.roles:
        meshes = "; ".join(f"{ph} {_mesh_text(s)}" for ph, s in rp.meshes.items())
        lines.append(f"  {rp.role:<7} {rp.head:<7} {_model_text(rp.model)}  {_count(rp.num_params)} params  [{meshes}]")
    name, u = _unit(r)
    lines.append(f"analytic memory per device ({name}):")
    lines.append(
        f"  {'role':<7} {'params':>7} {'optim':>7} {'grads':>7} {'act:tr':>7} {'act:inf':>7} "
        f"{'gen-w':>7} {'kv':>7} {'act:gen':>7}"
    )
    for rp in r.roles:
        a = rp.activation_bytes
        lines.append(
            f"  {rp.role:<7} {_b(rp.param_bytes, u)} {_b(rp.optimizer_bytes, u)} {_b(rp.gradient_bytes, u)} "
            f"{_b(a.get('train', 0), u)} {_b(a.get('infer', 0), u)} {_b(rp.generate_param_bytes, u)} "
            f"{_b(rp.kv_cache_bytes, u)} {_b(a.get('generate', 0), u)}"
        )
    for p in r.pools:
        lines.append(
            f"  pool {p.name}: kept {p.persistent_bytes / u:.2f} + largest transient ({p.peak_phase}) "
            f"= {p.peak_bytes / u:.2f} {name} -> {'fits' if p.fits else 'DOES NOT FIT'}"
        )
    return "\n".join(lines)


def format_program(r: DryRunReport, p: ProgramReport) -> str:
    _, u = _unit(r)
    return (
        f"  {p.name:<18} {_b(p.argument_bytes, u)} {_b(p.output_bytes, u)} {_b(p.alias_bytes, u)} "
        f"{_b(p.temp_bytes, u)} {_b(p.generated_code_bytes, u)} {_b(p.peak_bytes, u)} {_b(p.resident_bytes, u)} "
        f"{_b(p.total_bytes, u)}  {'yes ' if p.fits else 'NO  '} {p.compile_seconds:6.1f}s  "
        f"{_mesh_text(p.mesh)}: {p.description}"
    )


def format_summary(r: DryRunReport) -> str:
    name, u = _unit(r)
    lines = [
        "  (+resid: the pool's parameters / optimizer state not among the program's arguments; total = peak + resid)"
    ]
    for p in r.programs:
        if p.name == "actor/reshard" and p.extra:
            e = p.extra
            lines.append(
                f"  actor/reshard: {e['programs']} programs / {e['calls']} calls, receives (ring model of the HLO's collectives) "
                f"{e['ring_received_bytes'] / u:.2f} {name} per device "
                f"(Table 2: {e['table2_comm_bytes'] / u:.2f}), redundancy {e['redundancy_bytes'] / u:.2f} {name}"
            )
    lines += [f"note: {n}" for n in r.notes]
    verdict = (
        "everything fits"
        if r.fits
        else "DOES NOT FIT: "
        + ", ".join([p.name for p in r.programs if not p.fits] + [f"pool {p.name}" for p in r.pools if not p.fits])
    )
    lines.append(
        f"{verdict} in {r.device_memory_bytes / GiB:.1f} GiB per device; wall time {r.wall_seconds:.1f} s, "
        f"host peak RSS {r.max_rss_bytes / GiB:.2f} GiB"
    )
    return "\n".join(lines)


# --- the dry run -------------------------------------------------------------------------------------


def _max_rss_bytes() -> int:
    """This process's peak resident memory: Linux's ``VmHWM`` (of this program's address space
    only; ``getrusage``'s ``ru_maxrss`` survives ``exec`` and so counts the peak of the
    process that forked this one, e.g. a large test runner), else ``ru_maxrss``; 0 off POSIX."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def simulated_devices(n: int, name: str) -> tuple[Any, ...]:
    """The first ``n`` devices the dry run of ``name`` compiles for; a RuntimeError saying how
    to simulate them when JAX has fewer."""
    have = jax.device_count()
    if have < n:
        raise RuntimeError(
            f"the dry run of {name} needs {n} devices but JAX has {have}: start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (set before jax is imported)"
        )
    return tuple(jax.devices()[:n])


def _plan_training(
    run: RunSpec,
    role: str,
    rp: RolePlan,
    mc: ModelConfig,
    state: Any,
    graphdef: Any,
    wanted: Sequence[str],
    specs: dict[str, progs.ProgramSpec],
) -> None:
    """A training role's optimizer state, gradients and training activations into ``rp``; its
    train step (and with LoRA the reference served by the actor's base) into ``specs``."""
    spec = run.placement.roles[role]
    main = "train" if "train" in spec.rules else "infer"
    mesh, rules = run.placement.mesh(role, main), run.placement.rules(role, main)
    dp = data_parallel_size(rules, mesh)
    P, R = run.prompt_length, run.response_length
    tx, _ = progs.optimizer(run, role)
    trained, frozen = progs.trained_and_frozen(state)  # LoRA: the adapters train, the base does not
    rp.optimizer_bytes = progs.tree_bytes_per_device(progs.abstract_role_state(trained, rules, mesh, tx)[0].opt_state)
    rows, k = progs.train_micro_batches(run, role, rules, mesh)
    if f"{role}/train_step" in wanted:
        specs[f"{role}/train_step"], _ = progs.train_step_program(run, role, graphdef, state, mesh, rules)
    rp.micro_batches[f"{role}/train_step"] = k
    rp.gradient_bytes = _params_bytes(trained, rules, mesh) * (2 if k > 1 else 1)
    rp.activation_bytes["train"] = activation_bytes(mc, "train", rows / k / dp, P, R, rules, mesh)
    if role == "actor" and run.ref_in_actor and "ref/log_probs" in wanted:  # the reference: the base alone
        ref, _ = progs.forward_program(run, "ref/log_probs", progs.base_graphdef(mc), frozen, mesh, rules)
        specs["ref/log_probs"] = dataclasses.replace(ref, role="actor", description=ref.description + ", the base")


def _role_plan(
    run: RunSpec,
    role: str,
    mc: ModelConfig,
    state: Any,
    graphdef: Any,
    wanted: Sequence[str],
    specs: dict[str, progs.ProgramSpec],
    notes: list[str],
) -> RolePlan:
    """A role's analytic plan; adds the role's wanted programs to ``specs``."""
    placement = run.placement
    P, R = run.prompt_length, run.response_length
    n = run.n
    head, spec = Role(role).head, placement.roles[role]
    main = "train" if "train" in spec.rules else "infer"
    mesh, rules = placement.mesh(role, main), placement.rules(role, main)
    rp = RolePlan(
        role=role,
        pool=spec.pool,
        head=head,
        model=_model_dict(mc),
        num_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)),
        meshes={main: dict(mesh.shape)},
        param_bytes=_params_bytes(state, rules, mesh),
    )
    dp = data_parallel_size(rules, mesh)
    if role in TRAINING_ROLES:
        _plan_training(run, role, rp, mc, state, graphdef, wanted, specs)
    forward = f"{role}/values" if role == "critic" else f"{role}/scores" if head == "reward" else f"{role}/log_probs"
    rows, k = progs.forward_micro_batches(run, forward, rules, mesh)
    if forward in wanted:
        specs[forward], _ = progs.forward_program(run, forward, graphdef, state, mesh, rules)
    rp.micro_batches[forward] = k
    rp.activation_bytes["infer"] = activation_bytes(mc, "infer", rows / k / dp, P, R, rules, mesh)
    if role != "actor":
        return rp
    # The actor also generates, in the 3D-HybridEngine's generation layout.
    engine = HybridEngine(mesh, rules, spec.gen_tp, gen_rules=placement.rules(role, "generate"))  # as the worker's
    gmesh, grules = engine.gen_mesh, engine.gen_rules
    if dict(gmesh.shape) != dict(placement.mesh(role, "generate").shape):
        notes.append(
            f"the hybrid engine's generation mesh {dict(gmesh.shape)} differs from the placement's "
            f"{dict(placement.mesh(role, 'generate').shape)}"
        )
    rp.meshes["generate"] = dict(gmesh.shape)
    gen_dp = data_parallel_size(grules, gmesh)
    shape = engine_shape(
        mc,
        run.train_batch_size,
        P,
        R,
        n=n,
        replicas=gen_dp,
        slots=progs.generation_slots(run),
        kv_tokens=progs.generation_kv_tokens(run),
    )
    gw = progs.generation_weights(run, mc, graphdef, state)
    rp.generate_param_bytes = _params_bytes(progs.cast_floats(gw.state, gw.dtype), grules, gmesh)
    rp.generate_copy = gw.copy
    rp.kv_cache_bytes = kv_pool_bytes(mc, shape, grules, gmesh)
    rp.activation_bytes["generate"] = generate_activation_bytes(mc, shape, grules, gmesh)
    if "actor/generate" in wanted:
        specs["actor/generate"], _ = progs.generate_program(run, mc, graphdef, state, engine)
    for mode in progs.run_algorithm(run).extra_rollouts:  # e.g. ReMax's greedy baseline rollout
        if f"actor/generate_{mode}" in wanted:
            specs[f"actor/generate_{mode}"], _ = progs.generate_program(run, mc, graphdef, state, engine, mode)
    if "actor/reshard" in wanted:
        specs["actor/reshard"] = progs.reshard_program(engine, gw)
    return rp


def _pool_plans(placement: Any, role_plans: dict[str, RolePlan], budget: int) -> list[PoolPlan]:
    pools = []
    for name, pool_roles in placement.groups().items():
        here = [role_plans[r] for r in pool_roles if r in role_plans]
        pp = PoolPlan(name=name, device_ids=list(placement.pools[name].device_ids), roles=[r.role for r in here])
        pp.persistent_bytes = sum(r.persistent_bytes for r in here)
        transients = [(t, f"{r.role} {ph}") for r in here for ph, t in r.transient_bytes().items()]
        worst, pp.peak_phase = max(transients, default=(0, "-"))
        pp.peak_bytes = pp.persistent_bytes + worst
        pp.fits = pp.peak_bytes <= budget
        pools.append(pp)
    return pools


def _platform_notes(platform: str, role_plans: dict[str, RolePlan]) -> list[str]:
    notes = []
    low = sorted({r.model["dtype"] for r in role_plans.values() if r.model["dtype"] in ("bfloat16", "float16")})
    if platform == "cpu" and low:
        notes.append(
            f"XLA:CPU computes {'/'.join(low)} in float32, so compiled temp bytes are an upper bound "
            "of a GPU's or TPU's; compiled with "
            + ", ".join(f"{k}={v}" for k, v in progs.CPU_COMPILER_OPTIONS.items())
            + " (see jaxflow.plan.lowering)"
        )
        if "actor" in role_plans and role_plans["actor"].model["param_dtype"] in ("bfloat16", "float16"):
            notes.append(
                "XLA:CPU all-gathers bf16 as f32 (convert, gather, convert back): the reshard's received "
                "bytes are twice an accelerator's"
            )
    return notes


def plan(run: RunSpec, program_names: Sequence[str] | None = None) -> tuple[DryRunReport, list[progs.ProgramSpec]]:
    """The analytic plan of ``run`` (an RL run with its placement) and the programs to compile
    (not compiled yet), in step order."""
    if run.job != "rl":
        raise ValueError(f"the dry run plans RL jobs; jaxflow.job is {run.job!r}")
    unknown = sorted(set(program_names or ()) - set(DEFAULT_PROGRAMS) - set(OPTIONAL_PROGRAMS))
    if unknown:
        raise ValueError(f"unknown programs {unknown}; choose from {DEFAULT_PROGRAMS + OPTIONAL_PROGRAMS}")
    simulated_devices(run.num_devices, run.name)
    if run.placement is None:
        raise ConfigError(
            "jaxflow.placement.type",
            "is 'auto': the dry run plans a placed run; place it first with jaxflow.automap.auto_place "
            "(python -m jaxflow.run --dry_run does)",
        )
    roles = tuple(run.roles)
    progs.run_algorithm(run)  # checked against the roles
    served = ("ref",) if run.ref_in_actor else ()  # LoRA: the reference is the actor's base, planned with it
    wanted = [p for p in (program_names or DEFAULT_PROGRAMS) if p.split("/")[0] in roles + served]
    budget = int(run.dry_run.device_memory_gib * GiB)
    role_plans: dict[str, RolePlan] = {}
    specs: dict[str, progs.ProgramSpec] = {}
    notes: list[str] = []
    for role in roles:
        mc = run.models[role].config
        if mc is None:
            raise ValueError(f"cannot plan {role!r}: its model path has no config.json to read the shapes from")
        graphdef, state = progs.abstract_model(mc, Role(role).head)
        role_plans[role] = _role_plan(run, role, mc, state, graphdef, wanted, specs, notes)
    platform = jax.devices()[0].platform
    report = DryRunReport(
        config=run.name,
        num_devices=run.num_devices,
        platform=platform,
        device_memory_bytes=budget,
        placement=run.mapping.type,
        pools=_pool_plans(run.placement, role_plans, budget),
        roles=[role_plans[r] for r in roles],
        notes=notes + _platform_notes(platform, role_plans),
    )
    return report, [specs[p] for p in wanted if p in specs]


def _resident_bytes(report: DryRunReport, spec: progs.ProgramSpec) -> int:
    """Persistent state of the program's pool that is not among its arguments."""
    pool = next(p for p in report.pools if spec.role in p.roles)
    total = 0
    for r in pool.roles:
        rp = report.role(r)
        parts = {"params": rp.param_bytes, "optim": rp.optimizer_bytes}
        total += sum(v for k, v in parts.items() if r != spec.role or k not in spec.args_hold)
    return total


def compile_program(report: DryRunReport, spec: progs.ProgramSpec) -> ProgramReport:
    """Compile one program and judge it against the report's budget."""
    m = spec.compile()
    resident = _resident_bytes(report, spec)
    return ProgramReport(
        name=spec.name,
        role=spec.role,
        phase=spec.phase,
        mesh=dict(spec.mesh.shape),
        description=spec.description,
        **{f.name: getattr(m, f.name) for f in dataclasses.fields(progs.CompiledMemory)},
        peak_bytes=m.peak_bytes,
        analytic_argument_bytes=spec.analytic_argument_bytes,
        resident_bytes=resident,
        total_bytes=m.peak_bytes + resident,
        fits=m.peak_bytes + resident <= report.device_memory_bytes,
    )


def dry_run(
    run: RunSpec,
    *,
    out: TextIO | None = sys.stdout,
    json_path: str | None = None,
    programs: Sequence[str] | None = None,
) -> DryRunReport:
    """Plan ``run`` (an RL run with its placement) and compile its programs ahead of time on
    ``jaxflow.num_devices`` devices (simulated on CPU), printing the plan, then each program
    as it compiles, then the verdict, to ``out`` (None: silent). ``json_path``: also write
    :meth:`DryRunReport.to_json` there. ``programs``: which to compile (default
    :data:`DEFAULT_PROGRAMS`; :data:`OPTIONAL_PROGRAMS` adds the actor's and the critic's
    forwards). Allocates no model, optimizer state or batch."""
    t0 = time.perf_counter()

    def say(text: str) -> None:
        if out is not None:
            print(text, file=out, flush=True)

    report, specs = plan(run, programs)
    say(format_plan(report))
    say(format_program_header(report))
    for spec in specs:
        p = compile_program(report, spec)
        report.programs.append(p)
        say(format_program(report, p))
    report.wall_seconds = time.perf_counter() - t0
    report.max_rss_bytes = _max_rss_bytes()
    say(format_summary(report))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(report.to_json())
    return report


__all__ = [
    "DEFAULT_PROGRAMS",
    "OPTIONAL_PROGRAMS",
    "DryRunReport",
    "PoolPlan",
    "ProgramReport",
    "RolePlan",
    "activation_bytes",
    "compile_program",
    "dry_run",
    "format_plan",
    "generate_activation_bytes",
    "kv_pool_bytes",
    "plan",
    "simulated_devices",
]
