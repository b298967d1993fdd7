"""Mesh specs: named axis sizes -> a ``jax.sharding.Mesh`` over a resource pool.

``MeshSpec(fsdp=4, tp=2)`` on a pool of 8 devices gives ``Mesh('dp': 1, 'fsdp': 4, 'tp': 2)``.
Axes are always ``dp`` (data parallel, weights replicated), ``fsdp`` (data parallel, weights
sharded) and ``tp`` (tensor parallel), in that order, major to minor; size-1 axes are kept so
one rule set fits every mesh. One size may be ``-1``: it takes whatever the pool has left.

The pool's device order is kept: the mesh is ``devices.reshape(dp, fsdp, tp)``, so ``tp``
groups are runs of consecutive devices (one NVLink island / one TPU host on real hardware).

:func:`generation_mesh` builds the actor's generation mesh *from its training mesh* (same
devices, same order, regrouped), which is what lets the 3D-HybridEngine move weights between
the two with all-gathers inside small groups only (see :mod:`jaxflow.reshard`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxflow.mesh.pools import ResourcePool
from jaxflow.mesh.rules import TRAIN_RULES, Rules

MESH_AXES = ("dp", "fsdp", "tp")

# Logical names whose sizes a model config fixes, and the config field that holds each.
_MODEL_DIMS = {
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "mlp": "intermediate_size",
    "vocab": "vocab_size",
    "embed": "hidden_size",
}


def _devices_of(pool: ResourcePool | Sequence[Any]) -> tuple[Any, ...]:
    return tuple(pool.devices if isinstance(pool, ResourcePool) else pool)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the ``dp``, ``fsdp`` and ``tp`` axes; at most one may be ``-1`` (the rest)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    def __post_init__(self):
        sizes = self.as_dict()
        fills = [a for a, n in sizes.items() if n == -1]
        if len(fills) > 1:
            raise ValueError(f"at most one mesh axis may be -1; got {fills} in {sizes}")
        for axis, n in sizes.items():
            if not isinstance(n, (int, np.integer)) or (n <= 0 and n != -1):
                raise ValueError(f"mesh axis {axis}={n!r}: sizes are positive integers, or -1 for the rest")

    @classmethod
    def parse(cls, text: str | Mapping[str, int] | MeshSpec) -> MeshSpec:
        """``"fsdp=4,tp=2"`` (or a dict, or a MeshSpec) -> MeshSpec."""
        if isinstance(text, MeshSpec):
            return text
        if isinstance(text, Mapping):
            items = dict(text)
        else:
            items = {}
            for part in filter(None, (p.strip() for p in text.split(","))):
                if "=" not in part:
                    raise ValueError(f"mesh spec {text!r}: expected axis=size pairs like 'fsdp=4,tp=2'")
                key, value = (s.strip() for s in part.split("=", 1))
                if key in items:
                    raise ValueError(f"mesh spec {text!r} names axis {key!r} twice")
                try:
                    items[key] = int(value)
                except ValueError:
                    raise ValueError(f"mesh spec {text!r}: size of {key!r} is not an integer") from None
        unknown = sorted(set(items) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; jaxflow meshes have axes {MESH_AXES}")
        return cls(**items)

    def as_dict(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with ``-1`` filled in; raises unless the product is ``num_devices``."""
        sizes = self.as_dict()
        known = math.prod(n for n in sizes.values() if n != -1)
        fill = [a for a, n in sizes.items() if n == -1]
        if fill:
            if num_devices % known:
                raise ValueError(
                    f"mesh {self._text(sizes)}: the other axes ({known} devices) do not divide the "
                    f"pool of {num_devices} devices, so {fill[0]}=-1 cannot fill it"
                )
            sizes[fill[0]] = num_devices // known
        elif known != num_devices:
            raise ValueError(f"mesh {self._text(sizes)} has {known} devices but the pool has {num_devices}")
        return sizes

    def build(
        self,
        pool: ResourcePool | Sequence[Any],
        model: Any | None = None,
        rules: Rules = TRAIN_RULES,
    ) -> Mesh:
        """The mesh over ``pool`` (devices in pool order). With a model config, checks that
        every dimension ``rules`` shards divides its mesh axes (e.g. ``tp`` | num_heads)."""
        devices = _devices_of(pool)
        sizes = self.resolve(len(devices))
        if model is not None:
            check_model_fits(model, sizes, rules)
        arr = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
        return Mesh(arr, MESH_AXES)

    @staticmethod
    def _text(sizes: Mapping[str, int]) -> str:
        return ",".join(f"{a}={n}" for a, n in sizes.items())

    def __str__(self) -> str:
        return self._text(self.as_dict())


def _rule_axes(rules: Rules, name: str) -> tuple[str, ...]:
    axes = dict(rules).get(name)
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_model_fits(model: Any, sizes: Mapping[str, int], rules: Rules = TRAIN_RULES) -> None:
    """Raise a clear error if a model dimension that ``rules`` shards does not divide the
    product of its mesh axes (``sizes``: axis -> size). ``model`` is a ModelConfig (any
    object with ``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size``,
    ``vocab_size``, ``hidden_size``)."""
    for name, field in _MODEL_DIMS.items():
        axes = [a for a in _rule_axes(rules, name) if a in sizes]
        degree = math.prod(sizes[a] for a in axes)
        value = getattr(model, field)
        if degree > 1 and value % degree:
            axes_txt = " x ".join(f"{a}={sizes[a]}" for a in axes)
            hint = ""
            if name == "kv_heads":
                hint = (
                    "; lower tp, or use a rule set that splits k/v over head_dim "
                    "(jaxflow.mesh.hybrid_rules picks one for the model)"
                )
            raise ValueError(f"{axes_txt} does not divide {field}={value} (rule {name!r} -> {tuple(axes)}){hint}")


def weight_axes(rules: Rules, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split the Megatron dimension (``heads``) under ``rules``, major to
    minor, restricted to the mesh's axes."""
    return tuple(a for a in _rule_axes(rules, "heads") if a in mesh.shape)


def generation_mesh(train_mesh: Mesh, gen_tp: int, train_weight_axes: Sequence[str], grouping: str = "hybrid") -> Mesh:
    """The generation mesh on the training mesh's devices, *in the same device order*.

    Let the training weights' Megatron dimension be split ``n`` ways over
    ``train_weight_axes`` (e.g. ``('fsdp', 'tp')``: chunk ``c`` lives on the ``c``-th device of
    each weight-parallel block), and ``m = n // gen_tp``.

    - ``grouping="hybrid"`` (HybridFlow): axes ``('tp', 'dp')`` of sizes ``(gen_tp, m)``. The
      micro-DP groups (same ``tp`` index) are ``m`` consecutive devices and hold chunks
      ``[r*m, (r+1)*m)``; generation TP groups are strided by ``m``. Every device's training
      chunk lies inside its generation shard.
    - ``grouping="vanilla"`` (HybridFlow-V): axes ``('dp', 'tp')`` of sizes ``(m, gen_tp)``:
      TP groups are consecutive devices, as a generation engine would lay them out alone.

    Axes of the training mesh that are not weight axes (e.g. a training ``dp`` that replicates
    the weights) become a leading ``replica`` axis (left out when it has size 1). Keeping the
    flat device order is what lets one ``jax.jit`` take training-layout inputs and return
    generation-layout outputs.
    """
    if grouping not in ("hybrid", "vanilla"):
        raise ValueError(f"unknown grouping {grouping!r}; choose 'hybrid' or 'vanilla'")
    wa = tuple(train_weight_axes)
    missing = [a for a in wa if a not in train_mesh.shape]
    if missing:
        raise ValueError(f"weight axes {missing} are not axes of the training mesh {dict(train_mesh.shape)}")
    names = list(train_mesh.axis_names)
    other = [a for a in names if a not in wa]
    order = other + list(wa)
    # Transposing to (other..., weight axes) must not reorder devices: check on the axes
    # that actually have more than one device.
    big = [a for a in names if train_mesh.shape[a] > 1]
    if [a for a in order if train_mesh.shape[a] > 1] != big:
        raise ValueError(
            f"the training mesh's axes {dict(train_mesh.shape)} must list the weight axes {wa} last "
            f"and in that order (the generation mesh keeps the device order)"
        )
    devs = np.transpose(train_mesh.devices, [names.index(a) for a in order])
    n = math.prod(train_mesh.shape[a] for a in wa)
    replicas = devs.size // n
    if gen_tp < 1 or n % gen_tp:
        raise ValueError(
            f"generation tp={gen_tp} must divide the training weight-parallel degree "
            f"{' x '.join(f'{a}={train_mesh.shape[a]}' for a in wa)} = {n}"
        )
    m = n // gen_tp
    if grouping == "hybrid":
        shape, axes = (replicas, gen_tp, m), ("replica", "tp", "dp")
    else:
        shape, axes = (replicas, m, gen_tp), ("replica", "dp", "tp")
    devs = devs.reshape(shape)
    if replicas == 1:
        devs, axes = devs[0], axes[1:]
    return Mesh(devs, axes)
