"""ReMax: REINFORCE with the reward of a greedy response as baseline, no critic; tiny Llama, 8 CPU devices."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    return tiny_config("remax_tiny", "remax", kl_in_reward=True)
