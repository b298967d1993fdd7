"""GRPO on the built-in code task: a tiny Llama writes one-line Python functions, scored by
running them against hidden tests in a sandbox.

The prompts name an affine function (``code:x*7+2=``); the answer is its code
(``def f(x):\\n    return x*7+2``) and the reward the fraction of five hidden tests it passes,
each sample run in its own sandboxed process (`jaxflow.rewards.score_code`: CPU-time, memory,
file-size and process limits, no network; ``jaxflow.reward.sandbox``). The supervised warm
start teaches the shape of the answer; held-out functions score the rule."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("grpo_code_tiny", "grpo", kl_loss_type="low_var_kl")
    cfg.algorithm.norm_adv_by_std_in_grpo = True
    cfg.jaxflow.data.builtin_task = "code"
    cfg.data.max_prompt_length = 16  # code:x*7+2= and BOS
    cfg.data.max_response_length = 32  # def f(x):\n    return x*7+2 and EOS
    cfg.jaxflow.sft.warm_start_steps = 40
    cfg.trainer.total_training_steps = 50
    cfg.trainer.test_freq = 25
    return cfg
