"""One role worker from a placement: the mesh, rules and settings each role class takes.

Both backends call `make_role_worker`: the local backend once on the driver with the
placement's pools of local devices; the Ray backend in every process of a worker group, with
the placement's pool rebuilt over that group's `jax.distributed` devices (`pool_placement`).
So a role is built the same way, from the same arguments, whatever runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxflow.mesh import ROLES, Placement, ResourcePool
from jaxflow.workers.actor import ActorConfig, ActorWorker, RolloutConfig
from jaxflow.workers.base import ModelLike
from jaxflow.workers.critic import CriticConfig, CriticWorker
from jaxflow.workers.reference import ReferenceWorker
from jaxflow.workers.reward import RewardModelWorker


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """An inference role's forward over the rollout (the reference's log-probs, the reward and
    cost models' scores): ``micro_batch_size_per_device`` rows per data-parallel rank per pass
    (None: one pass); ``use_remove_padding``: over packed real tokens (no padding, the same
    values), then in micro-batches of at most ``max_token_len_per_device`` tokens per device
    (None: by rows; verl's ``log_prob_use_dynamic_bsz``)."""

    micro_batch_size_per_device: int | None = None
    use_remove_padding: bool = False
    max_token_len_per_device: int | None = None


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
        return dict(
            temperature=self.rollout.temperature,
            micro_batch_size_per_device=self.ref.micro_batch_size_per_device,
            use_remove_padding=self.ref.use_remove_padding,
            max_token_len_per_device=self.ref.max_token_len_per_device,
        )


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
    """The worker of ``role`` on its placement mesh (the actor: its training mesh and rules,
    and the hybrid engine towards the placement's generation layout)."""
    if role not in placement.roles:
        raise ValueError(f"a model was given for role {role!r} but the placement has no such role: {placement}")
    if role == "actor":
        spec = placement.roles["actor"]
        gen_rules: Any = placement.rules("actor", "generate") if spec.gen_tp is not None else None
        return ActorWorker(
            model=model,
            mesh=placement.mesh("actor", "train"),
            rules=placement.rules("actor", "train"),
            config=settings.actor_config,
            rollout=settings.rollout,
            gen_tp=spec.gen_tp,
            gen_rules=gen_rules,
            strategy=settings.strategy,
            reference=settings.reference_settings() if settings.ref_in_actor else None,
        )
    if role == "ref":
        return ReferenceWorker(
            model=model,
            mesh=placement.mesh("ref"),
            rules=placement.rules("ref", "infer"),
            **settings.reference_settings(),
        )
    if role == "critic":
        return CriticWorker(
            model=model,
            mesh=placement.mesh("critic"),
            rules=placement.rules("critic", "train"),
            config=settings.critic_config,
        )
    extra = {"output_key": "token_level_cost"} if role == "cost" else {}
    forward: ForwardConfig = getattr(settings, role)  # the reward or the cost model's
    return role_class(role)(
        model=model,
        mesh=placement.mesh(role),
        rules=placement.rules(role, "infer"),
        micro_batch_size_per_device=forward.micro_batch_size_per_device,
        use_remove_padding=forward.use_remove_padding,
        **extra,
    )


def pool_placement(placement: Placement, pool: str, devices: tuple[Any, ...]) -> Placement:
    """The roles of ``pool`` placed on ``devices`` instead (same mesh specs and rules, in the
    same device order): how a process of a multi-process group sees its pool, ``devices``
    being its world's global devices."""
    if len(devices) != placement.pools[pool].size:
        raise ValueError(f"pool {pool!r} has {placement.pools[pool].size} devices, the process world {len(devices)}")
    roles = {r: s for r, s in placement.roles.items() if s.pool == pool}
    return Placement({pool: ResourcePool(pool, tuple(devices))}, roles)
