"""Rotary position embeddings (the HF "rotate half" layout), with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxflow.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """inv_freq_k = theta^(-2k/d) for k < d/2, then scaled per ``cfg.rope_scaling``.

    Llama 3 scaling (wavelength w = 2 pi / inv_freq, L = original context):
    w < L / high_freq_factor keeps its frequency; w > L / low_freq_factor divides it by
    ``factor``; in between, s = (L / w - low) / (high - low) blends the two:
    (1 - s) inv_freq / factor + s inv_freq.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, blended, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x_BxLxHxK: jnp.ndarray, positions_BxL: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotate pairs (x_i, x_{i+K/2}) by angle position * inv_freq_i, in at least float32
    (float64 inputs rotate in float64)."""
    dt = jnp.promote_types(x_BxLxHxK.dtype, jnp.float32)
    angles_BxLxK2 = positions_BxL[..., None].astype(dt) * jnp.asarray(inv_freq, dt)[None, None, :]
    cos = jnp.cos(angles_BxLxK2)[:, :, None, :]
    sin = jnp.sin(angles_BxLxK2)[:, :, None, :]
    x = x_BxLxHxK.astype(dt)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)
