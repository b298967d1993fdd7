"""PPO with a critic (GAE) and an in-reward KL penalty: tiny Llama, addition task, 8 CPU devices."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("ppo_tiny", "gae", kl_in_reward=True)
    # A small entropy bonus keeps PPO exploring while its critic is still learning per-prompt values.
    cfg.actor_rollout_ref.actor.entropy_coeff = 0.01
    return cfg
