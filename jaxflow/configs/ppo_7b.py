"""HybridFlow's PPO workload at 7B: llama2_7b actor, critic, reference and reward model on 16 devices
(actor+ref on 8, critic+reward on 8); 1024 prompts x 1024+1024 tokens, 8 mini-batches."""

from ml_collections import ConfigDict

from jaxflow.configs.base import paper_ppo_config


def get_config() -> ConfigDict:
    return paper_ppo_config("ppo_7b")
