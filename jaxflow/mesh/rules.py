"""Logical axis names -> mesh axes.

Models annotate every parameter (Variable metadata ``logical_axes``) and key activations
(:func:`constrain`) with *logical* names such as ``embed`` or ``heads``; they never name a
mesh axis. A rule set maps each logical name to zero, one or several mesh axes, per role and
per phase (training vs generation). This module is the only place where that mapping lives.

Logical names used by jaxflow's models:

=============  ==========================================================
``vocab``      vocabulary rows of the embedding / columns of the LM head
``embed``      the model (hidden) dimension
``heads``      query heads;  ``kv_heads``: key/value heads (GQA)
``head_dim``   the per-head feature dimension
``mlp``        the feed-forward intermediate dimension
``layers``     the stacked-layer dimension when layers are scanned
``norm``       norm scales (always replicated by the shipped rules)
``batch``      the batch dimension of activations;  ``length``: sequence
``cache_length``  the KV cache's key dimension
=============  ==========================================================
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Training: weights sharded over fsdp (one dimension) and tp (the Megatron dimension); the
# batch over every data-parallel axis.
TRAIN_RULES: Rules = (
    ("batch", ("dp", "fsdp")),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("head_dim", None),
    ("length", None),
    ("cache_length", None),
    ("layers", None),
    ("norm", None),
)


def _with(rules: Rules, **changes: MeshAxes) -> Rules:
    """``rules`` with the mesh axes of the logical names in ``changes`` replaced (each must be
    one of its names)."""
    unknown = sorted(set(changes) - {name for name, _ in rules})
    if unknown:
        raise KeyError(f"no rule for logical axis(es) {unknown} to change")
    return tuple((name, changes.get(name, axes)) for name, axes in rules)


# Generation: no fsdp on weights (each dp replica holds whole tp shards); batch over dp.
GENERATE_RULES: Rules = _with(TRAIN_RULES, batch="dp", embed=None)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """Turn logical names into a PartitionSpec.

    A mesh axis is used at most once per spec (the first dimension that asks for it wins),
    and axes the mesh does not have are dropped, so one rule set serves meshes with and
    without e.g. an ``fsdp`` axis.
    """
    table = dict(rules)
    used: set[str] = set()
    spec: list[Any] = []
    for name in logical_axes:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"no sharding rule for logical axis {name!r}; rules cover {sorted(table)}")
        axes = [a for a in _as_tuple(table[name]) if a not in used]
        if mesh is not None:
            axes = [a for a in axes if a in mesh.shape]
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def data_parallel_size(rules: Rules, mesh: Mesh | Mapping[str, int]) -> int:
    """The data-parallel ranks of ``mesh`` (a Mesh, or its axis sizes) under ``rules``: the
    product of the mesh axes the ``batch`` rule splits rows over (those the mesh has)."""
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return math.prod(shape[a] for a in _as_tuple(dict(rules)["batch"]) if a in shape)


def _check_divisible(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        n = math.prod(mesh.shape[a] for a in _as_tuple(axes))
        if size % n:
            raise ValueError(
                f"parameter {path}: dimension {dim} of size {size} cannot be split over mesh "
                f"axes {_as_tuple(axes)} of total size {n} (shape {shape}, spec {spec})"
            )


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes_tree(state: Any) -> Any:
    """The logical names of every Variable in an ``nnx.State`` (same tree structure)."""

    def names(path, v):
        axes = v.get_metadata().get("logical_axes")
        if axes is None or len(axes) != len(v.get_value().shape):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} has logical axes {axes} for shape {v.get_value().shape}"
            )
        return tuple(axes)

    return jax.tree_util.tree_map_with_path(names, state, is_leaf=_is_variable)


def state_shardings(state: Any, rules: Rules, mesh: Mesh) -> Any:
    """NamedShardings for an (abstract or concrete) ``nnx.State``, from the Variables' logical
    axes and a rule set. Raises a clear error if a dimension does not divide its mesh axes."""

    def sharding(path, v):
        axes = v.get_metadata().get("logical_axes")
        shape = tuple(v.get_value().shape)
        if axes is None or len(axes) != len(shape):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} has logical axes {axes} for shape {shape}")
        spec = logical_to_spec(axes, rules, mesh)
        _check_divisible(jax.tree_util.keystr(path), shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, state, is_leaf=_is_variable)


# --- activation constraints -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ShardingContext:
    rules: Rules
    mesh: Mesh


_CONTEXT: contextvars.ContextVar[_ShardingContext | None] = contextvars.ContextVar(
    "jaxflow_sharding_context", default=None
)


@contextlib.contextmanager
def sharding_rules(rules: Rules, mesh: Mesh) -> Iterator[None]:
    """Within this context (at trace time), :func:`constrain` pins activations to the mesh."""
    token = _CONTEXT.set(_ShardingContext(tuple(rules), mesh))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; a no-op outside :func:`sharding_rules`."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    spec = logical_to_spec(logical_axes, ctx.rules, ctx.mesh)
    # Drop axes that do not divide this activation (e.g. a batch of 1 during a probe).
    spec = PartitionSpec(
        *(
            axes if x.shape[d] % math.prod(ctx.mesh.shape[a] for a in _as_tuple(axes)) == 0 else None
            for d, axes in enumerate(spec)
        )
    )
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


# --- rule sets for the 3D-HybridEngine ------------------------------------------------------
#
# HybridFlow's actor trains in one layout and generates in another on the same devices. The
# switch moves the fewest bytes, and never needs a device to hold more than its generation
# shard, when every generation shard is a *union of whole training shards* (a coarsening).
#
# HYBRID_TRAIN_RULES get that for every generation tp that divides fsdp*tp: each weight is
# split along its Megatron dimension only (heads / kv_heads / mlp / vocab), jointly over
# ('fsdp', 'tp') with fsdp major. On a mesh (dp, fsdp, tp) chunk c = f*tp + t of the Megatron
# dimension then lives on the c-th device of each weight-parallel block. The generation mesh
# reuses that device array reshaped to ('tp', 'dp') = (gen_tp, n/gen_tp)
# (:func:`jaxflow.mesh.specs.generation_mesh`), and the generation rules split the same
# dimension over 'tp' only: generation shard r is chunks [r*m, (r+1)*m) with m = n/gen_tp,
# held by the m consecutive devices r*m..(r+1)*m-1 (a micro-DP group). So the transition is
# an all-gather inside each micro-DP group and nothing else (the paper's grouping: micro-DP
# groups contiguous, generation TP groups strided). ``embed`` is never split, so no weight is
# split twice, and norms stay replicated (they need no transfer).
#
# Activations under the training rules: batch over (dp, fsdp), heads/mlp/vocab over tp (the
# fsdp axis is already taken by the batch), i.e. the usual FSDP x TP activations; XLA
# all-gathers each weight over fsdp before use, as FSDP does.
#
# k/v projections: with GQA the kv_heads count is often below fsdp*tp (2 kv heads on 8
# devices). The *_KV_HEAD_DIM variants then split k/v (and their biases, and q/k norms) along
# head_dim instead, jointly over ('fsdp', 'tp') in training and 'tp' in generation: still a
# coarsening, so zero redundancy and the Table 2 volume hold. In generation the KV cache is
# then split over head_dim too (attention adds one all-reduce of the scores per layer).
# :func:`hybrid_rules` picks the variant for a model.

HYBRID_TRAIN_RULES: Rules = _with(
    TRAIN_RULES, vocab=("fsdp", "tp"), embed=None, heads=("fsdp", "tp"), kv_heads=("fsdp", "tp"), mlp=("fsdp", "tp")
)

# Generation on the mesh of generation_mesh(): batch over every replica axis, the Megatron
# dimensions over tp (GENERATE_RULES, plus the 'replica' axis when training had dp > 1).
HYBRID_GENERATE_RULES: Rules = _with(GENERATE_RULES, batch=("replica", "dp"))

HYBRID_TRAIN_RULES_KV_HEAD_DIM: Rules = _with(HYBRID_TRAIN_RULES, kv_heads=None, head_dim=("fsdp", "tp"))
HYBRID_GENERATE_RULES_KV_HEAD_DIM: Rules = _with(HYBRID_GENERATE_RULES, kv_heads=None, head_dim="tp")

# Head counts that do not divide fsdp*tp (Qwen2.5-0.5B: 14 heads, 2 kv heads, on 8 devices):
# the *_EMBED variants split the Megatron dimensions over 'tp' only and the embedding
# dimension over 'fsdp' (no weight is split twice along one dimension: a q kernel [D, H, K]
# is [D/fsdp, H/tp, K]). The weight axes are then ('tp',), so the generation mesh regroups
# the tp axis only and (dp, fsdp) become the generation 'replica' axis: a device's training
# shard [D/fsdp, H/tp] still lies inside its generation shard [D, H/gen_tp] (a coarsening),
# and the transition all-gathers over fsdp and inside the micro-DP groups. Generation uses
# the HYBRID_GENERATE_RULES* unchanged (embed is never split in generation).
HYBRID_TRAIN_RULES_EMBED: Rules = _with(
    HYBRID_TRAIN_RULES, vocab="tp", embed="fsdp", heads="tp", kv_heads="tp", mlp="tp"
)
HYBRID_TRAIN_RULES_EMBED_KV_HEAD_DIM: Rules = _with(HYBRID_TRAIN_RULES_EMBED, kv_heads=None, head_dim="tp")

RULE_SETS: dict[str, Rules] = {
    "train": TRAIN_RULES,
    "generate": GENERATE_RULES,
    "hybrid_train": HYBRID_TRAIN_RULES,
    "hybrid_generate": HYBRID_GENERATE_RULES,
    "hybrid_train_kv_head_dim": HYBRID_TRAIN_RULES_KV_HEAD_DIM,
    "hybrid_generate_kv_head_dim": HYBRID_GENERATE_RULES_KV_HEAD_DIM,
    "hybrid_train_embed": HYBRID_TRAIN_RULES_EMBED,
    "hybrid_train_embed_kv_head_dim": HYBRID_TRAIN_RULES_EMBED_KV_HEAD_DIM,
}


def get_rules(rules: str | Rules) -> Rules:
    """A rule set by name (see ``RULE_SETS``), or a rule tuple passed through."""
    if isinstance(rules, str):
        if rules not in RULE_SETS:
            raise KeyError(f"unknown rule set {rules!r}; available: {sorted(RULE_SETS)}")
        return RULE_SETS[rules]
    return tuple(tuple(r) for r in rules)  # type: ignore[return-value]


def _megatron_dims_divide(model: Any, n: int) -> bool:
    return all(getattr(model, f) % n == 0 for f in ("num_heads", "intermediate_size", "vocab_size"))


def _kv_variant(model: Any, n: int, heads_rules: Rules, head_dim_rules: Rules) -> tuple[Rules, Rules] | None:
    if model.num_kv_heads % n == 0:
        return heads_rules, HYBRID_GENERATE_RULES
    if model.head_dim % n == 0:
        return head_dim_rules, HYBRID_GENERATE_RULES_KV_HEAD_DIM
    return None


def hybrid_rules(model: Any, num_shards: int, tp: int | None = None) -> tuple[Rules, Rules]:
    """(train, generate) hybrid rule sets for a model whose weights are split ``num_shards``
    (= fsdp * tp) ways.

    The Megatron dimensions (heads, mlp, vocab) split jointly over (fsdp, tp); k/v over
    kv_heads when the kv-head count allows it, else over head_dim. When the Megatron
    dimensions do not divide ``num_shards`` but do divide ``tp`` (given), and the hidden size
    divides fsdp = ``num_shards / tp``, the ``*_EMBED`` variants split them over tp only and
    the embedding over fsdp. Raises if k/v fit no variant (the other dimensions are checked
    when the shardings are built, which names the one that does not divide)."""
    joint = _kv_variant(model, num_shards, HYBRID_TRAIN_RULES, HYBRID_TRAIN_RULES_KV_HEAD_DIM)
    if joint is not None and _megatron_dims_divide(model, num_shards):
        return joint
    if tp and num_shards % tp == 0 and model.hidden_size % (num_shards // tp) == 0 and _megatron_dims_divide(model, tp):
        embed = _kv_variant(model, tp, HYBRID_TRAIN_RULES_EMBED, HYBRID_TRAIN_RULES_EMBED_KV_HEAD_DIM)
        if embed is not None:
            return embed
    if joint is not None:
        return joint
    raise ValueError(
        f"neither num_kv_heads={model.num_kv_heads} nor head_dim={model.head_dim} splits "
        f"{num_shards} ways; lower fsdp*tp for this model"
    )
