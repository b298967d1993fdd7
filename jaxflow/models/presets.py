"""Size presets with the published shapes, and tiny configs for tests and CPU runs."""

from __future__ import annotations

from typing import Any

from jaxflow.models.config import ModelConfig, RopeScaling

_LLAMA3_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

# What a family's published configs share besides their sizes.
_LLAMA2 = dict(rms_norm_eps=1e-5)
_LLAMA3 = dict(rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072)
_QWEN2 = dict(model_type="qwen2", rope_theta=1e6, attention_bias=True, max_position_embeddings=32768)
_QWEN3 = dict(model_type="qwen3", rope_theta=1e6, qk_norm=True, max_position_embeddings=40960)


def _llama(V, D, F, L, H, N, **kw) -> ModelConfig:
    """A decoder of vocabulary V, hidden size D, MLP size F, L layers, H query and N key/value
    heads of size D / H, and the family settings ``kw``."""
    return ModelConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=N,
        head_dim=D // H,
        **kw,
    )


def _tiny(**kw) -> ModelConfig:
    return _llama(256, 64, 128, 2, 4, 2, max_position_embeddings=512, **kw)


PRESETS: dict[str, ModelConfig] = {
    "llama2_7b": _llama(32000, 4096, 11008, 32, 32, 32, **_LLAMA2),
    "llama2_13b": _llama(32000, 5120, 13824, 40, 40, 40, **_LLAMA2),
    "codellama_34b": _llama(32000, 8192, 22016, 48, 64, 8, **_LLAMA2, rope_theta=1e6, max_position_embeddings=16384),
    "llama2_70b": _llama(32000, 8192, 28672, 80, 64, 8, **_LLAMA2),
    "llama3_8b": _llama(128256, 4096, 14336, 32, 32, 8, **_LLAMA3),
    "llama3_70b": _llama(128256, 8192, 28672, 80, 64, 8, **_LLAMA3),
    "qwen2_5_0_5b": _llama(151936, 896, 4864, 24, 14, 2, **_QWEN2, tie_word_embeddings=True),
    "qwen2_5_7b": _llama(152064, 3584, 18944, 28, 28, 4, **_QWEN2),
    "qwen2_5_72b": _llama(152064, 8192, 29568, 80, 64, 8, **_QWEN2),
    "qwen3_8b": _llama(151936, 4096, 12288, 36, 32, 8, **_QWEN3),
    # Tiny configs: every family's features at one size small enough for CPU tests in seconds.
    "tiny_llama": _tiny(),
    "tiny_qwen2": _tiny(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "tiny_qwen3": _tiny(model_type="qwen3", qk_norm=True),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
