"""Size presets with the published shapes, and tiny configs for tests and CPU runs."""

from __future__ import annotations

from typing import Any

from jaxflow.models.config import ModelConfig, RopeScaling

_LLAMA3_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def _llama(V, D, F, L, H, N, **kw) -> ModelConfig:
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


PRESETS: dict[str, ModelConfig] = {
    "llama2_7b": _llama(32000, 4096, 11008, 32, 32, 32, rms_norm_eps=1e-5),
    "llama2_13b": _llama(32000, 5120, 13824, 40, 40, 40, rms_norm_eps=1e-5),
    "codellama_34b": _llama(
        32000, 8192, 22016, 48, 64, 8, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=16384
    ),
    "llama2_70b": _llama(32000, 8192, 28672, 80, 64, 8, rms_norm_eps=1e-5),
    "llama3_8b": _llama(
        128256,
        4096,
        14336,
        32,
        32,
        8,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
    ),
    "llama3_70b": _llama(
        128256,
        8192,
        28672,
        80,
        64,
        8,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
    ),
    "qwen2_5_0_5b": _llama(
        151936,
        896,
        4864,
        24,
        14,
        2,
        model_type="qwen2",
        rope_theta=1e6,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2_5_7b": _llama(
        152064,
        3584,
        18944,
        28,
        28,
        4,
        model_type="qwen2",
        rope_theta=1e6,
        attention_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen2_5_72b": _llama(
        152064,
        8192,
        29568,
        80,
        64,
        8,
        model_type="qwen2",
        rope_theta=1e6,
        attention_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen3_8b": ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        model_type="qwen3",
        rope_theta=1e6,
        qk_norm=True,
        max_position_embeddings=40960,
    ),
    # Tiny configs: every family's features, small enough for CPU tests in seconds.
    "tiny_llama": _llama(256, 64, 128, 2, 4, 2, max_position_embeddings=512),
    "tiny_qwen2": _llama(
        256,
        64,
        128,
        2,
        4,
        2,
        model_type="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    "tiny_qwen3": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        model_type="qwen3",
        qk_norm=True,
        max_position_embeddings=512,
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
