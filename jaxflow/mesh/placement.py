"""Placement: which roles share a pool (colocated, time-shared) and which have their own, and
each role's mesh and logical-axis rules per phase.

Phases: ``train`` (update step), ``infer`` (forward-only: log-probs, values, rewards) and
``generate`` (the actor's rollout; its mesh is derived from the training mesh by
:func:`jaxflow.mesh.specs.generation_mesh`, so the 3D-HybridEngine can switch in place).

Presets (``make_placement(name, ...)``):

- ``colocated``: every role on one pool of all devices (HybridFlow's default for small
  clusters; roles take turns on the devices);
- ``split``: actor+ref on the first half of the devices, critic+reward(+cost) on the rest;
- ``standalone``: each role on its own pool, sizes given per role.

Or any grouping with :meth:`Placement.from_groups`::

    placement = Placement.from_groups(
        [("actor", 4, ("actor", "ref")), ("critic", 2, ("critic",)), ("reward", 2, ("reward", "cost"))],
        meshes={"actor": "fsdp=2,tp=2"}, gen_tp={"actor": 2})
    placement.mesh("actor", "generate")   # Mesh('tp': 2, 'dp': 2) on devices 0..3
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxflow.mesh.pools import ResourcePool, split_pools
from jaxflow.mesh.roles import ROLES, TRAINING_ROLES
from jaxflow.mesh.rules import Rules, get_rules, hybrid_rules, state_shardings
from jaxflow.mesh.specs import MeshSpec, check_model_fits, generation_mesh, weight_axes

PHASES = ("train", "infer", "generate")

# Default rule-set names per role and phase. The actor trains with the hybrid rules so that
# its generation layout is a coarsening of its training layout (jaxflow.reshard); the
# others use the classic fsdp x tp rules.
DEFAULT_ROLE_RULES: dict[str, dict[str, str]] = {
    "actor": {"train": "hybrid_train", "infer": "hybrid_train", "generate": "hybrid_generate"},
    "critic": {"train": "train", "infer": "train"},
    "ref": {"infer": "train"},
    "reward": {"infer": "train"},
    "cost": {"infer": "train"},
}


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """Where one role runs: its pool, its (training / inference) mesh shape, the tensor
    parallelism of its generation mesh (generating roles only), and its rules per phase."""

    pool: str
    mesh: MeshSpec = MeshSpec(fsdp=-1)
    gen_tp: int | None = None
    rules: Mapping[str, str | Rules] = dataclasses.field(default_factory=dict)


class Placement:
    """Roles -> pools -> meshes. Build it with a preset or :meth:`from_groups`."""

    def __init__(
        self,
        pools: Mapping[str, ResourcePool],
        roles: Mapping[str, RoleSpec],
        models: Mapping[str, Any] | None = None,
    ):
        self.pools = dict(pools)
        self.roles = dict(roles)
        self.models = dict(models or {})
        if not self.roles:
            raise ValueError("a placement needs at least one role")
        used: dict[int, str] = {}
        for pool in self.pools.values():
            for d in pool.device_ids:
                if d in used:
                    raise ValueError(f"device {d} is in both pool {used[d]!r} and pool {pool.name!r}")
                used[d] = pool.name
        for role, spec in self.roles.items():
            if spec.pool not in self.pools:
                raise ValueError(f"role {role!r} is placed on unknown pool {spec.pool!r}; pools: {sorted(self.pools)}")
            try:
                spec.mesh.resolve(self.pools[spec.pool].size)
            except ValueError as e:
                raise ValueError(f"role {role!r} on pool {spec.pool!r}: {e}") from None
            for phase in spec.rules:
                if phase not in PHASES:
                    raise ValueError(f"role {role!r}: unknown phase {phase!r}; phases are {PHASES}")
            if (spec.gen_tp is None) != ("generate" not in spec.rules):
                raise ValueError(f"role {role!r}: a generating role needs both gen_tp and 'generate' rules")
        for role, model in self.models.items():
            self._fit_model(role, model)
        self._meshes: dict[tuple[str, str], Mesh] = {}

    def _fit_model(self, role: str, model: Any) -> None:
        """Pick the hybrid rules' k/v variant for ``model`` and check every mesh fits it."""
        spec = self._spec(role)
        sizes = spec.mesh.resolve(self.pools[spec.pool].size)
        n = sizes["fsdp"] * sizes["tp"]
        phase = "train"
        try:
            rules = dict(spec.rules)
            if rules.get("train") == "hybrid_train":
                train, gen = hybrid_rules(model, n, tp=sizes["tp"])
                rules.update({p: train for p, r in rules.items() if r == "hybrid_train"})
                rules.update({p: gen for p, r in rules.items() if r == "hybrid_generate"})
                self.roles[role] = spec = dataclasses.replace(spec, rules=rules)
            for phase in spec.rules:
                if phase == "generate":
                    # The weight axes: (fsdp, tp), or tp alone under the *_embed rules.
                    heads_axes = dict(get_rules(spec.rules.get("train", "hybrid_train"))).get("heads") or ()
                    heads_axes = (heads_axes,) if isinstance(heads_axes, str) else heads_axes
                    w = math.prod(sizes[a] for a in heads_axes if a in sizes) if "tp" in heads_axes else n
                    what = "fsdp*tp" if w == n else "tp"
                    if w % spec.gen_tp:
                        raise ValueError(f"generation tp={spec.gen_tp} does not divide {what}={w}")
                    gen_sizes = {"replica": sizes["dp"] * n // w, "tp": spec.gen_tp, "dp": w // spec.gen_tp}
                    check_model_fits(model, gen_sizes, get_rules(spec.rules[phase]))
                else:
                    check_model_fits(model, sizes, get_rules(spec.rules[phase]))
        except ValueError as e:
            raise ValueError(f"role {role!r} ({phase}, mesh {spec.mesh} on {sizes}): {e}") from None

    # --- constructors ------------------------------------------------------------------

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[tuple[str, int, Sequence[str]]],
        devices: Sequence[Any] | None = None,
        meshes: Mapping[str, MeshSpec | str] | None = None,
        gen_tp: Mapping[str, int] | None = None,
        rules: Mapping[str, Mapping[str, str | Rules]] | None = None,
        models: Mapping[str, Any] | None = None,
    ) -> Placement:
        """``groups``: ``(pool name, size, roles on it)`` in device order; sizes must add up
        to the device count (one may be -1). ``meshes``: role -> mesh spec (default
        ``fsdp=-1``, i.e. FSDP over the whole pool). ``gen_tp``: role -> generation tp (the
        actor defaults to 1). ``rules``: role -> phase -> rule set (name or tuple), over
        :data:`DEFAULT_ROLE_RULES`. ``models``: role -> ModelConfig, to check that the
        meshes fit each model and to pick the k/v variant of the hybrid rules."""
        meshes, gen_tp, rules = dict(meshes or {}), dict(gen_tp or {}), dict(rules or {})
        pools = split_pools([(name, size) for name, size, _ in groups], devices)
        specs: dict[str, RoleSpec] = {}
        for pool_name, _, roles in groups:
            for role in roles:
                if role in specs:
                    raise ValueError(f"role {role!r} is placed twice (pools {specs[role].pool!r} and {pool_name!r})")
                role_rules = {
                    **DEFAULT_ROLE_RULES.get(role, {"train": "train", "infer": "train"}),
                    **rules.get(role, {}),
                }
                tp_g = gen_tp.get(role, 1 if role == "actor" else None)
                specs[role] = RoleSpec(pool_name, MeshSpec.parse(meshes.get(role, MeshSpec(fsdp=-1))), tp_g, role_rules)
        unknown = sorted((set(meshes) | set(gen_tp) | set(rules) | set(models or {})) - set(specs))
        if unknown:
            raise ValueError(f"settings given for roles {unknown} that no pool hosts")
        return cls(pools, specs, models)

    @classmethod
    def colocated(cls, roles: Sequence[str] | None = None, devices: Sequence[Any] | None = None, **kw) -> Placement:
        """Every role on one pool of all devices (default: all roles, the training ones first)."""
        if roles is None:
            roles = TRAINING_ROLES + tuple(r for r in ROLES if r not in TRAINING_ROLES)
        return cls.from_groups([("global", -1, tuple(roles))], devices, **kw)

    @classmethod
    def split(
        cls,
        devices: Sequence[Any] | None = None,
        groups: Sequence[Sequence[str]] = (("actor", "ref"), ("critic", "reward", "cost")),
        sizes: Sequence[int] | None = None,
        **kw,
    ) -> Placement:
        """Roles split over pools, one per group (default: actor+ref / critic+reward+cost on
        equal halves)."""
        n = len(jax.devices() if devices is None else devices)
        if sizes is None:
            if n % len(groups):
                raise ValueError(f"{n} devices do not split evenly into {len(groups)} pools; pass sizes")
            sizes = [n // len(groups)] * len(groups)
        if len(sizes) != len(groups):
            raise ValueError(f"{len(groups)} role groups but {len(sizes)} pool sizes")
        named = [(g[0], size, tuple(g)) for g, size in zip(groups, sizes)]
        return cls.from_groups(named, devices, **kw)

    @classmethod
    def standalone(cls, sizes: Mapping[str, int], devices: Sequence[Any] | None = None, **kw) -> Placement:
        """Each role on its own pool: ``sizes`` maps role -> pool size."""
        return cls.from_groups([(role, size, (role,)) for role, size in sizes.items()], devices, **kw)

    def on(self, devices: Sequence[Any]) -> Placement:
        """The same pools (sizes, order), meshes and rules over other devices: e.g. a Ray run's
        host stand-ins (`jaxflow.mesh.devices.HostSlot`) for the plan planned on local ones."""
        pools = split_pools([(name, pool.size) for name, pool in self.pools.items()], devices)
        return Placement(pools, self.roles, self.models)

    # --- queries -------------------------------------------------------------------------

    def _spec(self, role: str) -> RoleSpec:
        if role not in self.roles:
            raise KeyError(f"role {role!r} is not placed; roles: {sorted(self.roles)}")
        return self.roles[role]

    def pool(self, role: str) -> ResourcePool:
        return self.pools[self._spec(role).pool]

    def colocated_with(self, role: str) -> tuple[str, ...]:
        """Roles that share ``role``'s pool (itself included), in placement order."""
        pool = self._spec(role).pool
        return tuple(r for r, s in self.roles.items() if s.pool == pool)

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Pool name -> the roles on it."""
        return {name: tuple(r for r, s in self.roles.items() if s.pool == name) for name in self.pools}

    def rules(self, role: str, phase: str = "train") -> Rules:
        spec = self._spec(role)
        if phase not in spec.rules:
            raise KeyError(f"role {role!r} has no {phase!r} phase; it has {sorted(spec.rules)}")
        return get_rules(spec.rules[phase])

    def mesh(self, role: str, phase: str = "train") -> Mesh:
        """The role's mesh for a phase: train and infer share the mesh spec's mesh; generate
        is the hybrid regrouping of the training mesh with the role's ``gen_tp``."""
        key = (role, "generate" if phase == "generate" else "train")
        if key not in self._meshes:
            spec = self._spec(role)
            train = spec.mesh.build(self.pool(role))
            if key[1] == "train":
                self._meshes[key] = train
            else:
                if spec.gen_tp is None:
                    raise KeyError(f"role {role!r} does not generate (no gen_tp)")
                axes = weight_axes(self.rules(role, "train"), train)
                self._meshes[key] = generation_mesh(train, spec.gen_tp, axes, "hybrid")
        return self._meshes[key]

    def shardings(self, role: str, state: Any, phase: str = "train") -> Any:
        """NamedShardings of a role's (abstract or concrete) ``nnx.State`` for a phase."""
        return state_shardings(state, self.rules(role, phase), self.mesh(role, phase))

    def place(self, role: str, state: Any, phase: str = "train") -> Any:
        """``state`` put on the role's devices with its phase's shardings."""
        return jax.device_put(state, self.shardings(role, state, phase))

    def describe(self) -> str:
        lines = []
        for name, roles in self.groups().items():
            ids = self.pools[name].device_ids
            lines.append(f"pool {name!r} devices {list(ids)}:")
            for role in roles:
                spec = self.roles[role]
                gen = f", generate tp={spec.gen_tp}" if spec.gen_tp else ""
                lines.append(f"  {role}: mesh {dict(self.mesh(role).shape)}{gen}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Placement({self.groups()})"


PLACEMENTS = {
    "colocated": Placement.colocated,
    "split": Placement.split,
    "standalone": Placement.standalone,
}


def make_placement(name: str, **kwargs: Any) -> Placement:
    """A preset by name: ``colocated``, ``split`` or ``standalone``."""
    if name not in PLACEMENTS:
        raise KeyError(f"unknown placement {name!r}; presets: {sorted(PLACEMENTS)}")
    return PLACEMENTS[name](**kwargs)
