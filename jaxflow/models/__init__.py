"""Decoder models (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) with LM, value and reward heads, size
presets, and HF checkpoint I/O."""

from jaxflow.models.config import ModelConfig, RopeScaling
from jaxflow.models.decoder import (
    HEADS,
    CausalLM,
    RewardModel,
    ValueModel,
    init_model,
    positions_from_mask,
)
from jaxflow.models.hf_io import CheckpointError, from_pretrained, save_pretrained
from jaxflow.models.presets import PRESETS, get_preset

__all__ = [
    "HEADS",
    "PRESETS",
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "RewardModel",
    "RopeScaling",
    "ValueModel",
    "from_pretrained",
    "get_preset",
    "init_model",
    "positions_from_mask",
    "save_pretrained",
]
