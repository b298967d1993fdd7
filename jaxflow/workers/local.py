"""Building every role of a `Placement` as local worker groups (one process, all devices).

::

    placement = Placement.from_groups(
        [("actor", 4, ("actor", "ref")), ("critic", 4, ("critic", "reward"))],
        meshes={"actor": "fsdp=2,tp=2"}, gen_tp={"actor": 2}, models={"actor": cfg, "ref": cfg})
    w = build_local_workers(placement, actor=policy, ref=policy, critic=value_model,
                            rule_reward=RuleRewardWorker(tokenizer),
                            actor_config=ActorConfig(...), rollout=RolloutConfig(n=4, ...))
    metrics = jaxflow.algos.ppo_iteration(w, prompts, cfg)

Each role gets its placement mesh and rules (the actor its training mesh and rules, and the
hybrid engine towards the placement's generation layout); roles sharing a pool take turns
on its devices. Models may be ``nnx.Module``s, ``(graphdef, state)`` pairs or checkpoint
directories.
"""

from __future__ import annotations

from typing import Any

from jaxflow.mesh import Placement
from jaxflow.workers.actor import ActorConfig, ActorWorker, RolloutConfig
from jaxflow.workers.base import ModelLike
from jaxflow.workers.critic import CriticConfig, CriticWorker
from jaxflow.workers.group import LocalWorkerGroup, Workers
from jaxflow.workers.reference import ReferenceWorker
from jaxflow.workers.reward import RewardFn, RewardModelWorker, RuleRewardWorker


def _needs(placement: Placement, role: str) -> None:
    if role not in placement.roles:
        raise ValueError(f"a model was given for role {role!r} but the placement has no such role: {placement}")


def build_local_workers(
    placement: Placement,
    *,
    actor: ModelLike,
    actor_config: ActorConfig = ActorConfig(),
    rollout: RolloutConfig = RolloutConfig(),
    ref: ModelLike | None = None,
    critic: ModelLike | None = None,
    critic_config: CriticConfig = CriticConfig(),
    reward_model: ModelLike | None = None,
    rule_reward: RuleRewardWorker | None = None,
    cost_model: ModelLike | None = None,
    reward_weights: tuple[float, float] = (1.0, 1.0),
    strategy: str = "hybrid",
    ref_options: dict[str, Any] | None = None,
) -> Workers:
    """`Workers` with a `LocalWorkerGroup` per given role, placed as ``placement`` says
    (``ref_options``: `ReferenceWorker` keyword arguments)."""
    _needs(placement, "actor")
    spec = placement.roles["actor"]
    gen_rules: Any = placement.rules("actor", "generate") if spec.gen_tp is not None else None
    w = Workers(actor=LocalWorkerGroup(
        ActorWorker, name="actor", model=actor, mesh=placement.mesh("actor", "train"),
        rules=placement.rules("actor", "train"), config=actor_config, rollout=rollout,
        gen_tp=spec.gen_tp, gen_rules=gen_rules, strategy=strategy))
    if ref is not None:
        _needs(placement, "ref")
        w.ref = LocalWorkerGroup(ReferenceWorker, name="ref", model=ref, mesh=placement.mesh("ref"),
                                 rules=placement.rules("ref", "infer"), temperature=rollout.temperature,
                                 **(ref_options or {}))
    if critic is not None:
        _needs(placement, "critic")
        w.critic = LocalWorkerGroup(CriticWorker, name="critic", model=critic, mesh=placement.mesh("critic"),
                                    rules=placement.rules("critic", "train"), config=critic_config)
    reward_group = None
    if reward_model is not None:
        _needs(placement, "reward")
        reward_group = LocalWorkerGroup(RewardModelWorker, name="reward", model=reward_model,
                                        mesh=placement.mesh("reward"), rules=placement.rules("reward", "infer"))
    if reward_group is not None or rule_reward is not None:
        rule_group = None if rule_reward is None else LocalWorkerGroup(rule_reward, name="rule_reward")
        w.reward = RewardFn(model=reward_group, rule=rule_group, weights=reward_weights)
    if cost_model is not None:
        _needs(placement, "cost")
        w.cost = LocalWorkerGroup(RewardModelWorker, name="cost", model=cost_model, mesh=placement.mesh("cost"),
                                  rules=placement.rules("cost", "infer"), output_key="token_level_cost")
    return w
