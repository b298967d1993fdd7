"""Learning happens: on a fixed seed, a tiny GRPO run (the real trainer: rollouts, a custom
reward function in its worker process, group advantages, the policy update) raises its
training score by a wide margin within a dozen steps (~20 s of CPU on a quiet machine)."""

import numpy as np

from jaxflow.configs import load_config
from jaxflow.trainer.rl import RLTrainer

# The fraction of the 4 response tokens that are digits: a random policy scores ~0.1 (10 of
# the char tokenizer's 100 ids), one that learned to answer in digits 1.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / 4
"""
STEPS = 12


def test_grpo_raises_the_training_score(tmp_path):
    reward = tmp_path / "digits.py"
    reward.write_text(REWARD)
    cfg = load_config(
        "grpo_tiny",
        [
            "jaxflow.placement.type=colocated",
            "jaxflow.model.num_layers=1",
            "jaxflow.model.hidden_size=64",
            "jaxflow.model.intermediate_size=128",
            "jaxflow.sft.warm_start_steps=0",
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=False",
            "trainer.logger=['console']",
            f"custom_reward_function.path={reward}",
            "data.train_batch_size=16",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=16",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.optim.warmup_style=constant",
            "jaxflow.data.num_train_examples=512",
            "jaxflow.data.num_val_examples=8",
            "trainer.seed=0",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        scores = [trainer.train_step(step)["critic/score/mean"] for step in range(1, STEPS + 1)]
    finally:
        trainer.scorer.close()
        trainer.close()
    first, last = np.mean(scores[:3]), np.mean(scores[-3:])
    assert first < 0.25, scores  # a random policy
    assert last - first >= 0.5, scores  # measured on seed 0: 0.11 -> 0.98
