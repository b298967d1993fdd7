"""Build random-init HF transformers models (the independent reference) for parity tests, and
the compiled jaxflow forward (`forward`) the tests compare with them."""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch
import transformers
from flax import nnx

HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def random_hf_model(family: str, seed: int = 0, std: float = 0.1, head=None, **config):
    """An HF model with *every* parameter random (biases and norm scales included, so that a
    wrong mapping of any tensor shows up in the logits)."""
    config_cls, model_cls = HF_CLASSES[family]
    cfg = config_cls(**{**SMALL, **config})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (head or model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + std * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with positions counted over real tokens, the convention jaxflow follows."""
    positions = np.maximum(mask.cumsum(-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def forward(model: nnx.Module, input_ids_BxL, attention_mask_BxL) -> jax.Array:
    """``model(input_ids, attention_mask=mask)``, compiled: one program per model graph (config
    and head) and input shape, shared by every test that calls it, where calling the model eagerly
    compiles each of its ops on its own for every new shape (about 4x the CPU time). Pure: the
    model's variables are read, never written back (``nnx.jit`` would replace them with its
    outputs, shardings respelled)."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, input_ids_BxL, attention_mask_BxL)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, input_ids_BxL, attention_mask_BxL) -> jax.Array:
    return nnx.merge(graphdef, state)(input_ids_BxL, attention_mask=attention_mask_BxL)


def padded_batch(vocab: int, lengths: list[int], total: int, seed: int = 0, left: bool = True):
    """Token ids and mask with rows of the given real lengths, left (or right) padded."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, vocab, size=(len(lengths), total))
    mask = np.zeros((len(lengths), total), np.int64)
    for i, n in enumerate(lengths):
        if left:
            mask[i, total - n :] = 1
        else:
            mask[i, :n] = 1
    return ids * mask, mask
