"""Building every role of a `Placement` as local worker groups (one process, all devices).

::

    placement = Placement.from_groups(
        [("actor", 4, ("actor", "ref")), ("critic", 4, ("critic", "reward"))],
        meshes={"actor": "fsdp=2,tp=2"}, gen_tp={"actor": 2}, models={"actor": cfg, "ref": cfg})
    w = build_local_workers(placement, actor=policy, ref=policy, critic=value_model,
                            rule_reward=RuleRewardWorker(tokenizer),
                            settings=RoleSettings(actor_config=ActorConfig(...),
                                                  rollout=RolloutConfig(train=SamplingParams(n=4))))
    metrics = jaxflow.iterations.ppo_iteration(w, prompts, settings)

Each role gets its placement mesh and rules (the actor its training mesh and rules, and the
hybrid engine towards the placement's generation layout); roles sharing a pool take turns
on its devices. Models may be ``nnx.Module``s, ``(graphdef, state)`` pairs or checkpoint
directories.
"""

from __future__ import annotations

from jaxflow.mesh import Placement
from jaxflow.workers.base import ModelLike
from jaxflow.workers.group import LocalWorkerGroup, MethodView, WorkerGroup, Workers
from jaxflow.workers.reference import ReferenceWorker
from jaxflow.workers.reward import RewardFn, RuleRewardWorker
from jaxflow.workers.roles import RoleSettings, make_role_worker


def build_local_workers(
    placement: Placement,
    *,
    actor: ModelLike,
    ref: ModelLike | None = None,
    critic: ModelLike | None = None,
    reward_model: ModelLike | None = None,
    rule_reward: RuleRewardWorker | None = None,
    cost_model: ModelLike | None = None,
    settings: RoleSettings = RoleSettings(),
    reward_weights: tuple[float, float] = (1.0, 1.0),
) -> Workers:
    """`Workers` with a `LocalWorkerGroup` per given role, placed as ``placement`` says, each
    built with its ``settings`` (`RoleSettings`: the updates, the rollout, the forwards'
    micro-batches)."""
    models = {"actor": actor, "ref": ref, "critic": critic, "reward": reward_model, "cost": cost_model}
    groups = {
        role: LocalWorkerGroup(make_role_worker(role, placement, model, settings), name=role)
        for role, model in models.items()
        if model is not None
    }
    return workers_from_groups(
        groups,
        rule_reward=None if rule_reward is None else LocalWorkerGroup(rule_reward, name="rule_reward"),
        reward_weights=reward_weights,
        ref_in_actor=settings.ref_in_actor,
    )


def workers_from_groups(
    groups: dict[str, WorkerGroup],
    *,
    rule_reward: WorkerGroup | None = None,
    reward_weights: tuple[float, float] = (1.0, 1.0),
    ref_in_actor: bool = False,
) -> Workers:
    """`Workers` from one group per model role (``reward``: the reward model) and the rule
    scorer; ``ref_in_actor``: the reference is the actor's base model (LoRA), served by the
    actor group (`MethodView`)."""
    if ref_in_actor:
        groups = {
            **groups,
            "ref": MethodView(groups["actor"], ReferenceWorker, {"log_probs": "ref_log_probs"}, name="ref"),
        }
    reward_group = groups.get("reward")
    reward = None
    if reward_group is not None or rule_reward is not None:
        reward = RewardFn(model=reward_group, rule=rule_reward, weights=reward_weights)
    return Workers(
        actor=groups["actor"],
        ref=groups.get("ref"),
        critic=groups.get("critic"),
        reward=reward,
        cost=groups.get("cost"),
    )
