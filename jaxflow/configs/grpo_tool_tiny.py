"""GRPO on the built-in tool task: a tiny Llama learns to call the ``calculator`` tool.

The prompts ask for products of two 3-digit numbers (``mul:482*937=`` -> ``451634``), far
beyond what the tiny model computes. The supervised warm start (300 steps) shows sums of two
5-digit numbers worked through the tool (half the demonstrations: the hermes tool call, the
tool's answer, the answer copied from it) and products answered directly, except 10% of them
worked through the tool (`jaxflow.data.tasks.CalculatorTask`). So the model learns the call
and the copy on the sums but answers held-out products directly, and wrongly; GRPO finds
that products pay when it calls the tool. Rollouts are conversations
(``actor_rollout_ref.rollout.multi_turn``): the tool's answer is appended by the run, and only
the model's own tokens train.

Measured on the quiet 2-core CPU (2026-11-28, 7 min 27 s in all, the first RL step 222 s after
the start): held-out 0.00 after the warm start (the tool called on 0% of the held-out
problems) -> 0.758 at step 20 -> 0.828 at step 40 -> 0.836 at step 60, the tool called on 100%
of the held-out problems from step 20 (13 min 53 s with the machine busy, same scores). (Earlier settings: with products alone, 45% of them
through the tool, the warm start already scored 0.60; with 25-35%, it never learnt to copy
the tool's answer and RL found no reward.)"""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("grpo_tool_tiny", "grpo", kl_loss_type="low_var_kl")
    cfg.algorithm.norm_adv_by_std_in_grpo = True
    cfg.jaxflow.data.builtin_task = "calculator"
    cfg.data.max_prompt_length = 18  # the warm start's add:48211+93702= and BOS
    # The call (~70 tokens), the tool's answer (~40) and the answer (~7), with room to spare.
    cfg.data.max_response_length = 160
    cfg.actor_rollout_ref.rollout.multi_turn.enable = True
    cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns = 2
    cfg.jaxflow.agent.tools = ["calculator"]
    cfg.jaxflow.data.sum_fraction = 0.5  # sums worked through the tool: the call and the copy
    cfg.jaxflow.data.tool_fraction = 0.1  # products: 90% answered directly, 10% through the tool
    cfg.jaxflow.sft.warm_start_steps = 300
    cfg.data.train_batch_size = 16  # x 8 conversations
    cfg.trainer.total_training_steps = 60
    cfg.trainer.test_freq = 20
    return cfg
