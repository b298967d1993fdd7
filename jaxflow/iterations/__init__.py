"""jaxflow.iterations: the algorithms' iterations as short functions over worker groups, and
their self-describing registry.

An iteration is ``fn(w, prompts, settings, state, *, step, update_actor) -> metrics`` over
the `jaxflow.workers.Workers` ``w`` with the algorithm's typed settings
(`jaxflow.algos.AlgorithmSettings`): `ppo_iteration` (PPO, GRPO, RLOO, REINFORCE++ by the
advantage estimator), `remax_iteration`, `safe_rlhf_iteration`. `register_algorithm` makes
one an `Algorithm`: the record of its estimators, critic, rollouts and state (`AlgoState`)
that the trainer, the dry run and the auto-mapper query; `algorithm_for` / `select_algorithm`
pick one from the settings. The steps they are made of (`steps`) and the batch-level glue
(`batch_ops`: verl's ``compute_advantage``, ``compute_data_metrics``) are here too. Layered
above `jaxflow.workers` and `jaxflow.algos`, below the trainer. ("Program" in jaxflow means a
compiled XLA function.)
"""

from jaxflow.iterations.batch_ops import (
    apply_kl_penalty_to_batch,
    batch_from_prompts,
    compute_advantage,
    compute_data_metrics,
    estimator_reads,
    group_ids_from_uid,
)
from jaxflow.iterations.ppo import ppo_iteration
from jaxflow.iterations.registry import (
    ALGORITHM_REGISTRY,
    Algorithm,
    algorithm_for,
    algorithm_names,
    estimator_algorithm,
    get_algorithm,
    register_algorithm,
    rollout_scores_old_log_probs,
    select_algorithm,
)
from jaxflow.iterations.remax import greedy_baseline, remax_iteration
from jaxflow.iterations.safe_rlhf import (
    COST_RULES,
    SafeRLHFState,
    compute_cost_advantages,
    compute_costs,
    rule_costs,
    safe_rlhf_iteration,
)
from jaxflow.iterations.state import AlgoState, KLState
from jaxflow.iterations.steps import StepTimer

__all__ = [
    "ALGORITHM_REGISTRY",
    "COST_RULES",
    "AlgoState",
    "Algorithm",
    "KLState",
    "SafeRLHFState",
    "StepTimer",
    "algorithm_for",
    "algorithm_names",
    "apply_kl_penalty_to_batch",
    "batch_from_prompts",
    "compute_advantage",
    "compute_cost_advantages",
    "compute_costs",
    "compute_data_metrics",
    "estimator_algorithm",
    "estimator_reads",
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
