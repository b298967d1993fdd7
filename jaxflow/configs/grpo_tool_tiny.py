"""GRPO on the built-in tool task: a tiny Llama learns to call the ``calculator`` tool.

The prompts ask for products of two 3-digit numbers (``mul:482*937=`` -> ``451634``), far
beyond what the tiny model computes. The supervised warm start shows the direct answer for
most problems and, for a quarter of them, the whole conversation: the hermes tool call, the
tool's answer, and the answer copied from it (`jaxflow.data.tasks.CalculatorTask`). Greedy
answers after the warm start mostly answer directly (wrong); sampled rollouts sometimes call
the tool, get the answer right and are reinforced. Rollouts are conversations
(``actor_rollout_ref.rollout.multi_turn``): the tool's answer is appended by the run, and only
the model's own tokens train."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("grpo_tool_tiny", "grpo", kl_loss_type="low_var_kl")
    cfg.algorithm.norm_adv_by_std_in_grpo = True
    cfg.jaxflow.data.builtin_task = "calculator"
    cfg.data.max_prompt_length = 16  # mul:482*937= and BOS
    # The call (~70 tokens), the tool's answer (~40) and the answer (~7), with room to spare.
    cfg.data.max_response_length = 160
    cfg.actor_rollout_ref.rollout.multi_turn.enable = True
    cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns = 2
    cfg.jaxflow.agent.tools = ["calculator"]
    cfg.jaxflow.sft.warm_start_steps = 40
    cfg.trainer.total_training_steps = 150
    cfg.trainer.test_freq = 25
    return cfg
