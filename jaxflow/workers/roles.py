"""One role worker from a placement: the mesh, rules and settings each role class takes.

Both backends call `make_role_worker`: the local backend once on the driver with the
placement's pools of local devices; the Ray backend in every process of a worker group, with
the placement's pool rebuilt over that group's `jax.distributed` devices (`pool_placement`).
So a role is built the same way, from the same arguments, whatever runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxflow.mesh import ROLES, Placement, ResourcePool, Role
from jaxflow.workers.actor import ActorConfig, ActorWorker, RolloutConfig
from jaxflow.workers.base import ModelLike
from jaxflow.workers.critic import CriticConfig, CriticWorker
from jaxflow.workers.forward import ForwardConfig
from jaxflow.workers.reference import ReferenceWorker
from jaxflow.workers.reward import RewardModelWorker


@dataclasses.dataclass(frozen=True)
class RoleSettings:
    """What the role classes take besides their model and placement: each role's settings
    whole (the inference roles' `ForwardConfig`)."""

    actor_config: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    critic_config: CriticConfig = CriticConfig()
    strategy: str = "hybrid"
    ref: ForwardConfig = ForwardConfig()
    reward: ForwardConfig = ForwardConfig()
    cost: ForwardConfig = ForwardConfig()
    ref_in_actor: bool = False  # LoRA: the reference is the actor's base model, served by the actor

    def reference_settings(self) -> dict[str, Any]:
        """The `ReferenceWorker` settings of the reference policy (a role, or the actor's base)."""
        return dict(temperature=self.rollout.temperature, forward=self.ref)


def role_class(role: str) -> type:
    """The worker class of a model role."""
    classes = {
        "actor": ActorWorker,
        "ref": ReferenceWorker,
        "critic": CriticWorker,
        "reward": RewardModelWorker,
        "cost": RewardModelWorker,
    }
    if role not in classes:
        raise KeyError(f"unknown model role {role!r}; roles are {ROLES}")
    return classes[role]


def make_role_worker(role: str, placement: Placement, model: ModelLike, settings: RoleSettings) -> Any:
    """The worker of ``role`` on its placement mesh, with the training rules for a role that
    trains and the inference rules otherwise (the actor: also the hybrid engine towards the
    placement's generation layout)."""
    if role not in placement.roles:
        raise ValueError(f"a model was given for role {role!r} but the placement has no such role: {placement}")
    cls = role_class(role)
    rules = placement.rules(role, "train" if Role(role).trains else "infer")
    return cls(model, placement.mesh(role), rules, **_role_options(role, placement, settings))


def _role_options(role: str, placement: Placement, settings: RoleSettings) -> dict[str, Any]:
    """What the class of ``role`` takes besides its model, mesh and rules."""
    if role == "actor":
        gen_tp = placement.roles["actor"].gen_tp
        return dict(
            config=settings.actor_config,
            rollout=settings.rollout,
            gen_tp=gen_tp,
            gen_rules=placement.rules("actor", "generate") if gen_tp is not None else None,
            strategy=settings.strategy,
            reference=settings.reference_settings() if settings.ref_in_actor else None,
        )
    if role == "critic":
        return dict(config=settings.critic_config)
    if role == "ref":
        return settings.reference_settings()
    output_key = "token_level_cost" if role == "cost" else "token_level_scores"
    return dict(output_key=output_key, forward=getattr(settings, role))  # the reward or the cost model's


def pool_placement(placement: Placement, pool: str, devices: tuple[Any, ...]) -> Placement:
    """The roles of ``pool`` placed on ``devices`` instead (same mesh specs and rules, in the
    same device order): how a process of a multi-process group sees its pool, ``devices``
    being its world's global devices."""
    if len(devices) != placement.pools[pool].size:
        raise ValueError(f"pool {pool!r} has {placement.pools[pool].size} devices, the process world {len(devices)}")
    roles = {r: s for r, s in placement.roles.items() if s.pool == pool}
    return Placement({pool: ResourcePool(pool, tuple(devices))}, roles)
