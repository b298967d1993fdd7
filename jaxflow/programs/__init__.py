"""jaxflow.programs: the algorithm iterations as short programs over worker groups.

An iteration is ``fn(w, prompts, settings, state, *, step, update_actor) -> metrics`` over
the `jaxflow.workers.Workers` ``w`` with the algorithm's typed settings
(`jaxflow.algos.AlgorithmSettings`): `ppo_iteration` (PPO, GRPO, RLOO, REINFORCE++ by the
advantage estimator), `remax_iteration`, `safe_rlhf_iteration`. `select_algorithm` picks
one by name from the settings, `register_algorithm` adds one; `AlgoState` is what an
algorithm carries across iterations. The steps they are made of (`steps`) and the
batch-level glue (`batch_ops`: verl's ``compute_advantage``, ``compute_data_metrics``) are
here too. Layered above `jaxflow.workers` and `jaxflow.algos`, below the trainer.
"""

from jaxflow.programs.batch_ops import (
    apply_kl_penalty_to_batch,
    batch_from_prompts,
    compute_advantage,
    compute_data_metrics,
    group_ids_from_uid,
)
from jaxflow.programs.ppo import ppo_iteration
from jaxflow.programs.registry import (
    ALGORITHM_REGISTRY,
    ESTIMATOR_PROGRAMS,
    algorithm_names,
    get_algorithm,
    register_algorithm,
    rollout_scores_old_log_probs,
    select_algorithm,
)
from jaxflow.programs.remax import greedy_baseline, remax_iteration
from jaxflow.programs.safe_rlhf import (
    COST_RULES,
    compute_cost_advantages,
    compute_costs,
    rule_costs,
    safe_rlhf_iteration,
)
from jaxflow.programs.state import AlgoState
from jaxflow.programs.steps import StepTimer

__all__ = [
    "ALGORITHM_REGISTRY",
    "COST_RULES",
    "ESTIMATOR_PROGRAMS",
    "AlgoState",
    "StepTimer",
    "algorithm_names",
    "apply_kl_penalty_to_batch",
    "batch_from_prompts",
    "compute_advantage",
    "compute_cost_advantages",
    "compute_costs",
    "compute_data_metrics",
    "get_algorithm",
    "greedy_baseline",
    "group_ids_from_uid",
    "ppo_iteration",
    "register_algorithm",
    "remax_iteration",
    "rollout_scores_old_log_probs",
    "rule_costs",
    "safe_rlhf_iteration",
    "select_algorithm",
]
