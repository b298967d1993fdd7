"""RLOO: leave-one-out baseline over the 8 responses per prompt, KL in the reward, no critic; tiny Llama, 8 CPU devices."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    return tiny_config("rloo_tiny", "rloo", kl_in_reward=True)
