"""HybridFlow's PPO workload at 13B: llama2_13b actor, critic, reference and reward model on 32 devices
(actor+ref on 16, critic+reward on 16); 1024 prompts x 1024+1024 tokens, 8 mini-batches."""

from ml_collections import ConfigDict

from jaxflow.configs.base import paper_ppo_config


def get_config() -> ConfigDict:
    return paper_ppo_config("ppo_13b")
