"""HybridFlow's PPO workload at 34B: codellama_34b actor, critic, reference and reward model on 64 devices
(actor+ref on 32, critic+reward on 32); 1024 prompts x 1024+1024 tokens, 8 mini-batches."""

from ml_collections import ConfigDict

from jaxflow.configs.base import paper_ppo_config


def get_config() -> ConfigDict:
    return paper_ppo_config("ppo_34b")
