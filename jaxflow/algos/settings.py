"""The algorithm's settings as small frozen dataclasses: verl's ``algorithm`` section
(`AlgorithmConfig`, with its KL controller `KLControlConfig`) and jaxflow's Safe-RLHF
constraint (`SafeRLHFConfig`), bundled as `AlgorithmSettings`, the one typed value an
algorithm's iteration (`jaxflow.iterations`) reads. `jaxflow.configs.describe_run` builds it from
an experiment config."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
    """verl's ``algorithm.kl_ctrl``: the in-reward KL coefficient's controller
    (`jaxflow.algos.get_kl_controller`): ``fixed`` or ``adaptive`` (towards ``target_kl``
    over ``horizon`` responses)."""

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: float = 10000.0
    target_kl: float = 0.1


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``: corrections for the gap between the policy
    that sampled (the rollout engine's ``rollout_log_probs``) and the one trained
    (`jaxflow.algos.rollout_correction`).

    Attributes:
      rollout_is: importance weights ``pi_train / pi_rollout`` per ``token`` or per
        ``sequence`` (None: none).
      rollout_is_threshold: their bound: a number (truncation, TIS) or ``"lower_upper"``
        (weights outside are zeroed, IcePop); a number or its text.
      rollout_rs: rejection sampling: comma-separated criteria among ``token_k{1,2,3}``,
        ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}``, ``seq_max_k{2,3}`` (None: none).
      rollout_rs_threshold: one threshold per criterion (comma-separated) or one for all;
        ``*_k1`` criteria take ``"lower_upper"`` ratio bounds (one number ``u``: ``1/u_u``).
      bypass_mode: train against the rollout's log-probs (no ``old_log_probs`` recompute)
        with the ``bypass_mode`` policy loss.
      loss_type: that loss: ``ppo_clip`` (PPO against the rollout policy) or ``reinforce``
        (REINFORCE with the IS weights).
      rollout_is_batch_normalize: rescale the IS weights to mean 1 over the batch.
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig:
    """verl's ``algorithm.filter_groups``: DAPO's dynamic sampling (`jaxflow.iterations.dynamic_sampling`).

    Attributes:
      enable: keep only the prompt groups whose ``metric`` varies across their samples,
        generating more prompt batches until the training batch is full.
      metric: ``seq_reward`` (sum of ``token_level_scores``), ``seq_final_reward`` (sum of
        ``token_level_rewards``, after the in-reward KL penalty) or a named value of the
        reward (``acc``, or a key of the reward function's dict).
      max_num_gen_batches: the most generation batches per step (> 0); more is an error, as
        verl's; <= 0: no limit.
    """

    enable: bool = False
    metric: str | None = None
    max_num_gen_batches: int = 0


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """verl's ``algorithm`` section.

    Attributes:
      adv_estimator: a registered advantage estimator (``gae``, ``grpo``, ``rloo``, ...).
      gamma, lam: discount and GAE lambda.
      norm_adv_by_std_in_grpo: GRPO's std normalisation (False: Dr.GRPO).
      use_kl_in_reward: subtract ``beta * kl(old_log_probs, ref_log_prob)`` from the scores.
      kl_penalty: the KL estimator of that penalty (``kl``, ``abs``, ``mse``, ``low_var_kl``).
      kl_ctrl: its coefficient's controller.
      gdpo_reward_keys, gdpo_reward_weights: ``gdpo``'s reward dimensions (keys of the reward
        function's dict) and their weights (None: all 1).
      rollout_correction: the rollout-correction settings (bypass mode, IS weights, rejection).
      filter_groups: DAPO's dynamic sampling.
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = KLControlConfig()
    gdpo_reward_keys: tuple[str, ...] = ()
    gdpo_reward_weights: tuple[float, ...] | None = None
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()


@dataclasses.dataclass(frozen=True)
class SafeRLHFConfig:
    """``jaxflow.safe_rlhf.*`` (see `jaxflow.iterations.safe_rlhf` for the maths)."""

    enable: bool = False
    cost_model_path: str = ""
    cost_rule: str = "forbidden_chars"
    forbidden_chars: str = "9"
    cost_threshold: float = 0.1
    lambda_init: float = 1.0
    lambda_lr: float = 0.05
    lambda_update_scale: str = "linear"
    lambda_max: float | None = None


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
    """Everything an algorithm's iteration reads besides the workers and the prompts.

    Attributes:
      algorithm: verl's ``algorithm`` section.
      safe_rlhf: ``jaxflow.safe_rlhf.*``.
      rollout_agreement: ``jaxflow.rollout_agreement``: every step scores the trainer's
        ``old_log_probs`` (also where an on-policy update would take them from its own
        forward), so the train-rollout agreement (``training/rollout_*`` metrics) is logged.
    """

    algorithm: AlgorithmConfig = AlgorithmConfig()
    safe_rlhf: SafeRLHFConfig = SafeRLHFConfig()
    rollout_agreement: bool = False
