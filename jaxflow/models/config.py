"""Decoder configuration: one frozen dataclass for the Llama / Mistral / Qwen2 / Qwen3 family,
read from and written to HF ``config.json`` dictionaries."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from jaxflow.models.lora import LoRAConfig

# HF architecture name -> (model_type, family). The family selects the block details.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
}
MODEL_TYPES = {model_type: family for model_type, family in ARCHITECTURES.values()}
_HEAD_SUFFIXES = ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification")

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` is plain RoPE; ``linear`` divides every frequency by
    ``factor``; ``llama3`` is Llama 3.1's piecewise scaling of low frequencies."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


ATTENTION_IMPLS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only transformer.

    ``param_dtype`` is what parameters are stored in; ``dtype`` what matmuls compute in
    (softmax, norms and the final log-softmax always run in float32). ``attention_impl``: the
    attention of forwards without a KV cache: ``xla`` (jaxflow's, any backend) or ``cudnn``
    (cuDNN's fused attention through ``jax.nn.dot_product_attention``, GPU only).
    ``batch_invariant``: every sum of the projections, heads and attention taken in index
    order, one term at a time (`jaxflow.models.ordered`, `decoder.ordered_attention`;
    the rollout engine then attends with the same function), so a token's outputs do not depend
    on how many tokens a call holds or where they sit: the rollout's decode steps and a full
    forward give the same bits (the train-rollout agreement mode; slow, for checking). ``lora``:
    LoRA adapters on the projections (`jaxflow.models.lora`; not part of the HF config).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None  # Mistral; None = full causal attention
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # jaxflow options
    scan_layers: bool = False
    remat_policy: str = "none"  # none | full | dots | dots_no_batch
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    attention_impl: str = "xla"  # xla | cudnn: attention without a KV cache (training, scoring forwards)
    batch_invariant: bool = False  # sums in index order: decode steps == a full forward, bit for bit
    lora: LoRAConfig | None = None  # adapters on the projections (`jaxflow.models.lora`); None: none

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {sorted(MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {self.rope_scaling.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.remat_policy not in ("none", "full", "dots", "dots_no_batch"):
            raise ValueError(f"unknown remat_policy {self.remat_policy!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.attention_impl == "cudnn" and not self.cudnn_attention_ok:
            raise ValueError(
                f"attention_impl='cudnn' needs bfloat16 or float16 compute and head_dim a multiple of 8 up to 256 "
                f"(dtype {jnp.dtype(self.dtype).name}, head_dim {self.head_dim})"
            )

    @property
    def cudnn_attention_ok(self) -> bool:
        """Whether cuDNN's fused attention takes this model (dtype and head_dim)."""
        return jnp.dtype(self.dtype) in (jnp.bfloat16, jnp.float16) and self.head_dim % 8 == 0 and self.head_dim <= 256

    @property
    def family(self) -> str:
        return MODEL_TYPES[self.model_type]

    def replace(self, **kwargs) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)

    # --- HF config.json ------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Read an HF config dict (transformers 4 or 5 spelling of the RoPE fields)."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in MODEL_TYPES:
            for arch in archs:
                base = next((arch[: -len(s)] for s in _HEAD_SUFFIXES if arch.endswith(s)), None)
                if base and base + "ForCausalLM" in ARCHITECTURES:
                    model_type = ARCHITECTURES[base + "ForCausalLM"][0]
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r} (model_type={hf.get('model_type')!r}); "
                f"jaxflow supports {sorted(ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; jaxflow's decoders use SwiGLU (silu)")
        # RoPE: transformers 5 writes `rope_parameters` (theta inside); published checkpoints
        # have top-level `rope_theta` and `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        )
        num_heads = hf["num_attention_heads"]
        family = MODEL_TYPES[model_type]
        sliding = hf.get("sliding_window")
        if family != "llama" and not hf.get("use_sliding_window", False):
            sliding = None
        eos = hf.get("eos_token_id")
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            model_type=model_type,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, **overrides) -> ModelConfig:
        try:
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"{path} lacks the required key {key!r}")
        return cls.from_hf_dict(hf, **overrides)

    def to_hf_dict(self, architecture_suffix: str = "ForCausalLM") -> dict[str, Any]:
        arch = next(a for a, (mt, _) in ARCHITECTURES.items() if mt == self.model_type)
        rope: dict[str, Any] = {"rope_type": self.rope_scaling.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling.rope_type != "default":
            rope["factor"] = self.rope_scaling.factor
        if self.rope_scaling.rope_type == "llama3":
            rope.update(
                low_freq_factor=self.rope_scaling.low_freq_factor,
                high_freq_factor=self.rope_scaling.high_freq_factor,
                original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
            )
        hf: dict[str, Any] = {
            "architectures": [arch.replace("ForCausalLM", architecture_suffix)],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings, so transformers 4 and 5 read the same RoPE.
            "rope_theta": self.rope_theta,
            "rope_scaling": None
            if self.rope_scaling.rope_type == "default"
            else {k: v for k, v in rope.items() if k != "rope_theta"},
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": jnp.dtype(self.param_dtype).name,
        }
        if self.family == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
            if self.model_type == "mistral":
                hf["sliding_window"] = self.sliding_window
        else:
            hf["use_sliding_window"] = False
            if self.family == "qwen3":
                hf["attention_bias"] = False
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if value is not None:
                hf[key] = list(value) if isinstance(value, tuple) else value
        return hf
