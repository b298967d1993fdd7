"""Per-model parallel layouts in jaxflow's mesh axes (HybridFlow's Algorithm 2 candidates),
and each layout's memory per device.

A :class:`Layout` is a role's training / inference mesh ``(dp, fsdp, tp)`` on ``n`` devices
and, for the actor, its generation tensor parallelism ``gen_tp`` (dividing the training
weight-parallel degree, as the 3D-HybridEngine requires; the rest is generation dp).

Only layouts whose axes divide the model's dimensions under the rules the run itself picks
(:func:`jaxflow.mesh.hybrid_rules` for the actor, ``TRAIN_RULES`` for the others) and whose
batches split over the data-parallel ranks are proposed; tensor parallelism stays inside a
host (``tp, gen_tp <= devices_per_host``), as in the paper.

Memory per device (analytic; the dry run's formulas, :mod:`jaxflow.plan.dry_run`):
parameters in their dtype, sharded as the rules say; Adam's two moments in
``jaxflow.optim.state_dtype``; gradients (twice with micro-batch accumulation); activations
per micro-batch with the remat policy; for the actor the generation copy of the weights and
the KV cache of one generation call.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jax.sharding import AbstractMesh

from jaxflow.automap.workload import RoleModel, Workload
from jaxflow.mesh import TRAIN_RULES, Rules, check_model_fits, hybrid_rules, logical_to_spec
from jaxflow.plan.dry_run import RolePlan, activation_bytes, generate_activation_bytes, kv_pool_bytes
from jaxflow.sampling import EngineShape, engine_shape
from jaxflow.workers.base import num_micro_batches


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    fsdp: int
    tp: int
    gen_tp: int | None = None
    # Sequences per generation replica per generate call (rollout.max_num_seqs); None = the
    # config's. The search lowers it only when the configured rollout batch does not fit.
    max_num_seqs: int | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.fsdp * self.tp

    @property
    def train_sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}

    def text(self) -> str:
        gen = f" gen_tp={self.gen_tp}" if self.gen_tp else ""
        seqs = f" max_num_seqs={self.max_num_seqs}" if self.max_num_seqs else ""
        return f"dp={self.dp} fsdp={self.fsdp} tp={self.tp}{gen}{seqs}"


@dataclasses.dataclass(frozen=True)
class RoleLayout:
    """A feasible layout of one role with its rules, meshes and analytic memory."""

    role: str
    layout: Layout
    rules: Rules
    mesh: AbstractMesh
    gen_rules: Rules | None
    gen_mesh: AbstractMesh | None
    plan: RolePlan  # analytic bytes per device (param, optimizer, gradient, activations, KV)
    micro_batches: dict[str, int]
    weight_degree: int  # devices that split the weights' Megatron dimension (fsdp*tp or tp)
    engine: EngineShape | None = None  # the actor's rollout engine, per generation replica

    @property
    def persistent_bytes(self) -> int:
        return self.plan.persistent_bytes

    @property
    def peak_transient_bytes(self) -> int:
        return max(self.plan.transient_bytes().values(), default=0)

    @property
    def meshes(self) -> dict[str, dict[str, int]]:
        out = {"train" if self.role in ("actor", "critic") else "infer": dict(self.mesh.shape)}
        if self.gen_mesh is not None:
            out["generate"] = dict(self.gen_mesh.shape)
        return out


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def sharded_bytes(rm: RoleModel, rules: Rules, mesh: AbstractMesh, itemsize: int, which: str = "all") -> int:
    """Per-device bytes of the role's parameters under ``rules`` at ``itemsize`` bytes each
    (ValueError if a sharded dimension does not divide its mesh axes, as
    :func:`jaxflow.mesh.state_shardings`); ``which``: ``all``, or an adapted model's ``base``
    weights or its LoRA ``adapters``."""
    return _sharded_elements(rm, rules, tuple(mesh.shape.items()), which) * itemsize


def weight_bytes(rm: RoleModel, rules: Rules, mesh: AbstractMesh) -> tuple[int, int]:
    """``(all weights, trained weights)`` per device in their dtypes: with LoRA the base in its
    dtype plus the adapters (float32), and the adapters; else every parameter, twice."""
    if rm.config.lora is None:
        every = sharded_bytes(rm, rules, mesh, rm.param_itemsize)
        return every, every
    adapters = sharded_bytes(rm, rules, mesh, rm.adapter_itemsize, "adapters")
    return sharded_bytes(rm, rules, mesh, rm.param_itemsize, "base") + adapters, adapters


@functools.lru_cache(maxsize=4096)
def _sharded_elements(rm: RoleModel, rules: Rules, sizes: tuple[tuple[str, int], ...], which: str = "all") -> int:
    mesh = abstract_mesh(dict(sizes))
    total = 0
    for leaf in rm.leaves:
        if which != "all" and leaf.adapter != (which == "adapters"):
            continue
        spec = logical_to_spec(leaf.logical_axes, rules, mesh)
        n = 1
        for size, entry in zip(leaf.shape, spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            k = math.prod(mesh.shape[a] for a in axes)
            if size % k:
                raise ValueError(f"dimension {size} of {leaf.logical_axes} does not split {k} ways")
            n *= size // k
        total += n
    return total


def _gen_sizes(layout: Layout, weight_degree: int) -> dict[str, int]:
    replica = layout.devices // weight_degree
    sizes = {"tp": layout.gen_tp, "dp": weight_degree // layout.gen_tp}
    return {"replica": replica, **sizes} if replica > 1 else sizes


def role_layout(w: Workload, role: str, layout: Layout) -> RoleLayout:
    """The layout's rules, meshes and memory; ValueError when it does not fit the model or
    the batches."""
    rm = w.models[role]
    mc = rm.config
    P, R = w.prompt_len, w.response_len
    sizes = layout.train_sizes
    if role == "actor":
        rules, gen_rules = hybrid_rules(mc, layout.fsdp * layout.tp, tp=layout.tp)
    else:
        rules, gen_rules = TRAIN_RULES, None
    check_model_fits(mc, sizes, rules)
    mesh = abstract_mesh(sizes)
    heads_axes = dict(rules)["heads"]
    heads_axes = (heads_axes,) if isinstance(heads_axes, str) else tuple(heads_axes)
    weight_degree = math.prod(sizes[a] for a in heads_axes)
    param_bytes, trained_bytes = weight_bytes(rm, rules, mesh)  # LoRA: only the adapters train
    trained = "adapters" if mc.lora is not None else "all"
    plan = RolePlan(
        role=role, pool="", head=rm.head, model={}, num_params=rm.num_params, meshes={}, param_bytes=param_bytes
    )
    dp_ranks = layout.dp * layout.fsdp
    micro: dict[str, int] = {}
    if role in w.mini_batch_rows:
        rows = w.mini_batch_rows[role]
        k = num_micro_batches(rows, w.train_micro[role], dp_ranks, f"{role} mini-batch")
        micro["train"] = k
        plan.optimizer_bytes = 2 * sharded_bytes(rm, rules, mesh, w.state_itemsize, trained)
        plan.gradient_bytes = trained_bytes * (2 if k > 1 else 1)
        plan.activation_bytes["train"] = activation_bytes(mc, "train", rows / k / dp_ranks, P, R, rules, mesh)
    k = num_micro_batches(w.rows, w.forward_micro[role], dp_ranks, f"{role} forward")
    micro["infer"] = k
    plan.activation_bytes["infer"] = activation_bytes(mc, "infer", w.rows / k / dp_ranks, P, R, rules, mesh)
    gen_mesh, shape = None, None
    if role == "actor":
        if not layout.gen_tp or weight_degree % layout.gen_tp:
            raise ValueError(f"generation tp={layout.gen_tp} does not divide the weight degree {weight_degree}")
        gsizes = _gen_sizes(layout, weight_degree)
        check_model_fits(mc, gsizes, gen_rules)
        gen_mesh = abstract_mesh(gsizes)
        gen_dp = layout.devices // layout.gen_tp
        # the rollout engine: the whole rollout in one call, max_num_seqs decode slots per replica
        shape = engine_shape(
            mc,
            max(1, w.rows // w.n),
            P,
            R,
            n=w.n,
            replicas=gen_dp,
            slots=(layout.max_num_seqs or w.max_num_seqs) or None,
        )
        plan.generate_param_bytes, plan.generate_copy = generation_weight_bytes(w, rm, gen_rules, gen_mesh)
        plan.kv_cache_bytes = kv_pool_bytes(mc, shape, gen_rules, gen_mesh)
        plan.activation_bytes["generate"] = generate_activation_bytes(mc, shape, gen_rules, gen_mesh)
    return RoleLayout(role, layout, rules, mesh, gen_rules, gen_mesh, plan, micro, weight_degree, shape)


def generation_weight_bytes(w: Workload, rm: RoleModel, rules: Rules, mesh: AbstractMesh) -> tuple[int, bool]:
    """``(bytes per device, copy)`` of the weights the actor's rollout reads, as
    `jaxflow.plan.lowering.generation_weights` says: a copy in the compute dtype when it is
    narrower than the weights' or (LoRA, merged) the base with the adapters merged in; else
    the training weights themselves."""
    narrower = rm.compute_itemsize < rm.param_itemsize
    itemsize = rm.compute_itemsize if narrower else rm.param_itemsize
    if rm.config.lora is not None and w.lora_merge:
        return sharded_bytes(rm, rules, mesh, itemsize, "base"), True
    if rm.config.lora is not None:  # the adapter path: the base and the adapters
        adapters = sharded_bytes(rm, rules, mesh, itemsize if narrower else rm.adapter_itemsize, "adapters")
        return sharded_bytes(rm, rules, mesh, itemsize, "base") + adapters, narrower
    return sharded_bytes(rm, rules, mesh, itemsize), narrower


def candidate_layouts(n: int, devices_per_host: int, generating: bool) -> list[Layout]:
    """Every (dp, fsdp, tp[, gen_tp]) on ``n`` devices with tp and gen_tp inside a host
    (gen_tp's divisibility by the weight degree is checked by :func:`role_layout`)."""
    out = []
    for tp in divisors(n):
        if tp > devices_per_host:
            continue
        for fsdp in divisors(n // tp):
            dp = n // (tp * fsdp)
            if not generating:
                out.append(Layout(dp, fsdp, tp))
                continue
            for g in divisors(fsdp * tp):
                if g <= devices_per_host:
                    out.append(Layout(dp, fsdp, tp, g))
    return out


def feasible_layouts(w: Workload, role: str, n: int, devices_per_host: int) -> list[RoleLayout]:
    """The role's layouts on ``n`` devices that fit its model and batches (memory is checked
    by the search: it depends on what shares the pool). For the actor, each layout also with
    fewer decode slots per generation replica (``max_num_seqs`` halved, down to ``n``: one
    prompt's responses): slower decoding for a smaller KV cache, which the search takes when
    memory is short."""
    out = []
    for layout in candidate_layouts(n, devices_per_host, role == "actor"):
        try:
            rl = role_layout(w, role, layout)
        except ValueError:
            continue
        out.append(rl)
        seqs = rl.engine.slots if rl.engine is not None else 0
        while seqs > w.n:
            seqs = max(w.n, seqs // 2)
            out.append(role_layout(w, role, dataclasses.replace(layout, max_num_seqs=seqs)))
    return out
