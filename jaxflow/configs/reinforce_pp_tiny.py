"""REINFORCE++: discounted token returns whitened over the batch, k2 KL loss, no critic; tiny Llama, 8 CPU devices."""

from ml_collections import ConfigDict

from jaxflow.configs.base import tiny_config


def get_config() -> ConfigDict:
    cfg = tiny_config("reinforce_pp_tiny", "reinforce_plus_plus", kl_loss_type="mse")
    cfg.algorithm.gamma = 1.0
    return cfg
