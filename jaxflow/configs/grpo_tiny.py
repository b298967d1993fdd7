"""GRPO, the default run: 8 responses per prompt, group-normalised rewards, KL loss, no critic;
tiny Llama, 8 CPU devices. The task is digit reversal (``rev:314=`` -> ``413``): validation
scores the greedy answers on 256 distinct held-out strings the run never trains on, so the
score measures a learned rule, not memorised answers."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("grpo_tiny", "grpo", kl_loss_type="low_var_kl")
    cfg.algorithm.norm_adv_by_std_in_grpo = True
    # 3-digit reversal: prompts of 9 tokens (with BOS), answers of 4 (with EOS); ~300 of the
    # 1000 strings are held out, 256 of them (distinct) are the validation set.
    cfg.jaxflow.data.builtin_task = "reverse_digits"
    cfg.data.max_prompt_length = 10
    cfg.data.max_response_length = 4
    # 40 supervised steps teach the answer format but not the rule (held-out score ~0.16);
    # GRPO finds the rule within ~75 steps; the cosine decay then holds it.
    cfg.jaxflow.sft.warm_start_steps = 40
    cfg.trainer.total_training_steps = 150
    cfg.trainer.test_freq = 25
    return cfg
