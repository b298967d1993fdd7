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
class AlgorithmConfig:
    """verl's ``algorithm`` section.

    Attributes:
      adv_estimator: a registered advantage estimator (``gae``, ``grpo``, ``rloo``, ...).
      gamma, lam: discount and GAE lambda.
      norm_adv_by_std_in_grpo: GRPO's std normalisation (False: Dr.GRPO).
      use_kl_in_reward: subtract ``beta * kl(old_log_probs, ref_log_prob)`` from the scores.
      kl_penalty: the KL estimator of that penalty (``kl``, ``abs``, ``mse``, ``low_var_kl``).
      kl_ctrl: its coefficient's controller.
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = KLControlConfig()


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
    """Everything an algorithm's iteration reads besides the workers and the prompts."""

    algorithm: AlgorithmConfig = AlgorithmConfig()
    safe_rlhf: SafeRLHFConfig = SafeRLHFConfig()
