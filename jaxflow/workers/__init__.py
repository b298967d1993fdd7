"""Role workers (actor, critic, reference, reward model, rule scorer), worker groups and
transfer protocols. Build the groups of a placement with `build_local_workers`; an algorithm's
iteration (`jaxflow.iterations.ppo_iteration`) runs over the resulting `Workers`."""

from jaxflow.workers.actor import ActorConfig, ActorWorker, RolloutConfig, actor_loss
from jaxflow.workers.base import RoleWorker, resolve_mesh
from jaxflow.workers.critic import CriticConfig, CriticWorker, critic_loss
from jaxflow.workers.forward import ForwardConfig
from jaxflow.workers.generation import GenerationWorker
from jaxflow.workers.group import DP_COMPUTE_REPEAT, DP_TRAIN, LocalWorkerGroup, WorkerGroup, Workers
from jaxflow.workers.local import build_local_workers
from jaxflow.workers.optim import OptimConfig, make_optimizer, make_schedule
from jaxflow.workers.protocols import (
    ALL_TO_ALL,
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    ONE_TO_ALL,
    WorkerGroupInfo,
    reduce_metrics,
    register,
)
from jaxflow.workers.reference import ReferenceWorker
from jaxflow.workers.reward import RewardFn, RewardModelWorker, RuleRewardWorker
from jaxflow.workers.roles import RoleSettings
from jaxflow.workers.train_state import TrainState, abstract_train_state, create_train_state, make_train_step
from jaxflow.workers.trainable import TrainableWorker

__all__ = [
    "ALL_TO_ALL",
    "DP_COMPUTE",
    "DP_COMPUTE_METRIC",
    "DP_COMPUTE_REPEAT",
    "DP_TRAIN",
    "ONE_TO_ALL",
    "ActorConfig",
    "ActorWorker",
    "CriticConfig",
    "CriticWorker",
    "ForwardConfig",
    "GenerationWorker",
    "LocalWorkerGroup",
    "OptimConfig",
    "ReferenceWorker",
    "RewardFn",
    "RewardModelWorker",
    "RoleSettings",
    "RoleWorker",
    "RolloutConfig",
    "RuleRewardWorker",
    "TrainState",
    "TrainableWorker",
    "WorkerGroup",
    "WorkerGroupInfo",
    "Workers",
    "abstract_train_state",
    "actor_loss",
    "build_local_workers",
    "create_train_state",
    "critic_loss",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "reduce_metrics",
    "register",
    "resolve_mesh",
]
