"""HybridFlow's PPO workload at 70B: llama2_70b actor, critic, reference and reward model on 128 devices
(actor+ref on 64, critic+reward on 64); 1024 prompts x 1024+1024 tokens, 8 mini-batches."""

from ml_collections import ConfigDict

from jaxflow.configs.base import paper_ppo_config


def get_config() -> ConfigDict:
    return paper_ppo_config("ppo_70b")
