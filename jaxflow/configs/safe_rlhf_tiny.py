"""Safe RLHF: task reward under a rule-based cost constraint (answers containing '9' cost 1,
mean cost <= 0.1) through a Lagrange multiplier; GRPO advantages for reward and cost, no
critic; tiny Llama, 8 CPU devices."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("safe_rlhf_tiny", "grpo", kl_loss_type="low_var_kl")
    s = cfg.jaxflow.safe_rlhf
    s.enable = True
    s.cost_model_path = ""  # rule-based cost, measurable exactly
    s.cost_rule = "forbidden_chars"
    s.forbidden_chars = "9"  # 19% of the correct sums contain a 9: a real reward / cost trade-off
    s.cost_threshold = 0.1
    s.lambda_init = 1.0
    s.lambda_lr = 0.05
    s.lambda_update_scale = "linear"
    return cfg
