"""Decoder-only transformers (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) in Flax NNX, with an LM
head, a value head (critic) and a scalar reward head (reward and cost models).

Every parameter carries ``logical_axes`` metadata; activations are pinned with
:func:`jaxflow.mesh.constrain`. Nothing here names a mesh axis.

Padding: ``attention_mask`` [B, L] marks real tokens. Positions are ``cumsum(mask) - 1``, so
left padding (prompts), right padding (responses) or both give the same logits on the real
tokens as the unpadded row. Real tokens of a row must be contiguous.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.mesh import constrain
from jaxflow.models.config import ModelConfig
from jaxflow.models.rope import apply_rope, inverse_frequencies

_INIT_STD = 0.02
_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def wide(dtype) -> Any:
    """The dtype of the numerically sensitive parts (norms, softmax, logits, heads): at least
    float32, float64 for a float64 model (so a float64 model is float64 end to end)."""
    return jnp.promote_types(dtype, jnp.float32)


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=tuple(axes))


_normal = jax.nn.initializers.normal(_INIT_STD)
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, laid out for single-query decoding:
    ``k`` [layers, B, kv_heads, head_dim, S] and ``v`` [layers, B, kv_heads, S, head_dim].

    Both attention products are then batched over (B, kv_heads) with the cache operand in
    matmul order, scores = q [G, K] @ k [K, S] and out = p [G, S] @ v [S, K]: no transpose of
    the cache at any step, and XLA:CPU runs them about 2x faster than over a [B, S, N, K]
    cache. Writing a step's keys touches one column of ``k``.

    With unrolled layers the cache may also be held per layer (``split_layers()``: tuples of
    one array per layer, without the leading ``layers``). A decode loop should carry that
    form: each layer's buffer is then updated in place, where the stacked form is sliced and
    re-stacked (the whole cache copied) at every step.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]

    K_AXES = ("layers", "batch", "kv_heads", "head_dim", "cache_length")
    V_AXES = ("layers", "batch", "kv_heads", "cache_length", "head_dim")

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
        L, N, K = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        dtype = dtype or cfg.dtype
        return cls(jnp.zeros((L, batch, N, K, length), dtype), jnp.zeros((L, batch, N, length, K), dtype))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def length(self) -> int:
        """The number of cache slots S."""
        return (self.k[0] if self.per_layer else self.k).shape[-1]

    def replace_kv(self, k, v) -> KVCache:
        return KVCache(k, v)

    def split_layers(self) -> KVCache:
        return self if self.per_layer else KVCache(tuple(self.k), tuple(self.v))

    def stack_layers(self) -> KVCache:
        return KVCache(jnp.stack(self.k), jnp.stack(self.v)) if self.per_layer else self


def positions_from_mask(attention_mask_BxL: jax.Array) -> jax.Array:
    """Position of each token among the real tokens of its row (0 on leading padding)."""
    return jnp.maximum(jnp.cumsum(attention_mask_BxL.astype(jnp.int32), axis=-1) - 1, 0)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in at least float32."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs, axes=("norm",)):
        self.eps = eps
        self.weight = _param(rngs, _ones, (dim,), axes, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(wide(x.dtype))
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.weight[...].astype(x32.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return (y * scale).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; optional q/k/v bias (Qwen2) and q/k norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H, N, K, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.q_proj = _param(rngs, _normal, (D, H, K), ("embed", "heads", "head_dim"), pd)
        self.k_proj = _param(rngs, _normal, (D, N, K), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, _normal, (D, N, K), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, _normal, (H, K, D), ("heads", "head_dim", "embed"), pd)
        if cfg.attention_bias:
            self.q_bias = _param(rngs, _zeros, (H, K), ("heads", "head_dim"), pd)
            self.k_bias = _param(rngs, _zeros, (N, K), ("kv_heads", "head_dim"), pd)
            self.v_bias = _param(rngs, _zeros, (N, K), ("kv_heads", "head_dim"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(K, cfg.rms_norm_eps, pd, rngs, axes=("head_dim",))
            self.k_norm = RMSNorm(K, cfg.rms_norm_eps, pd, rngs, axes=("head_dim",))

    def __call__(self, x_BxLxD, positions_BxL, mask_BxLxS, kv: tuple[jax.Array, jax.Array] | None = None,
                 cache_index: jax.Array | None = None):
        cfg = self.cfg
        dt = cfg.dtype
        x = x_BxLxD.astype(dt)
        q = jnp.einsum("BLD,DHK->BLHK", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("BLD,DNK->BLNK", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("BLD,DNK->BLNK", x, self.v_proj[...].astype(dt))
        if cfg.attention_bias:
            q = q + self.q_bias[...].astype(dt)[None, None]
            k = k + self.k_bias[...].astype(dt)[None, None]
            v = v + self.v_bias[...].astype(dt)[None, None]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inverse_frequencies(cfg)
        q = constrain(apply_rope(q, positions_BxL, inv_freq), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions_BxL, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if callable(mask_BxLxS):  # an external KV store (the rollout engine's paged cache) attends
            out, new_kv = mask_BxLxS(q, k, v, kv)
            out = constrain(out, ("batch", "length", "heads", "head_dim"))
            return jnp.einsum("BLHK,HKD->BLD", out, self.o_proj[...].astype(dt)), new_kv
        k_BxNxKxL, v_BxNxLxK = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
        new_kv = None
        if kv is not None:
            cache_k, cache_v = kv
            cache_k = jax.lax.dynamic_update_slice(cache_k, k_BxNxKxL.astype(cache_k.dtype), (0, 0, 0, cache_index))
            cache_v = jax.lax.dynamic_update_slice(cache_v, v_BxNxLxK.astype(cache_v.dtype), (0, 0, cache_index, 0))
            new_kv = (cache_k, cache_v)
            k_BxNxKxL, v_BxNxLxK = cache_k.astype(dt), cache_v.astype(dt)
        out = dot_product_attention(q, k_BxNxKxL, v_BxNxLxK, mask_BxLxS)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        y = jnp.einsum("BLHK,HKD->BLD", out, self.o_proj[...].astype(dt))
        return y, new_kv


def dot_product_attention(q_BxLxHxK, k_BxNxKxS, v_BxNxSxK, mask_BxLxS) -> jax.Array:
    """softmax(q k / sqrt(K) + mask) v with G = H / N query heads per kv head (keys given
    [B, N, K, S], values [B, N, S, K], as `KVCache` holds them); the softmax runs in at least float32.
    Fully masked rows (padding queries) stay finite."""
    B, L, H, K = q_BxLxHxK.shape
    N, S = k_BxNxKxS.shape[1], k_BxNxKxS.shape[-1]
    G = H // N
    # Rows M = (G, L) of one matmul per (batch, kv head), both operands in matmul order.
    q_BxNxMxK = q_BxLxHxK.reshape(B, L, N, G, K).transpose(0, 2, 3, 1, 4).reshape(B, N, G * L, K)
    sdt = wide(q_BxLxHxK.dtype)
    scores = jnp.einsum("BNMK,BNKS->BNMS", q_BxNxMxK, k_BxNxKxS).astype(sdt) * (K ** -0.5)
    scores = scores.reshape(B, N, G, L, S)
    scores = jnp.where(mask_BxLxS[:, None, None, :, :], scores, jnp.finfo(sdt).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxNxSxK.dtype).reshape(B, N, G * L, S)
    out_BxNxMxK = jnp.einsum("BNMS,BNSK->BNMK", probs, v_BxNxSxK)
    return out_BxNxMxK.reshape(B, N, G, L, K).transpose(0, 3, 1, 2, 4).reshape(B, L, H, K)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x gate) * (x up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        D, F, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.gate_proj = _param(rngs, _normal, (D, F), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, _normal, (D, F), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, _normal, (F, D), ("mlp", "embed"), pd)

    def __call__(self, x_BxLxD):
        dt = self.cfg.dtype
        x = x_BxLxD.astype(dt)
        gate = jnp.einsum("BLD,DF->BLF", x, self.gate_proj[...].astype(dt))
        up = jnp.einsum("BLD,DF->BLF", x, self.up_proj[...].astype(dt))
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return jnp.einsum("BLF,FD->BLD", h, self.down_proj[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); y = h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, mask, kv=None, cache_index=None):
        attn, new_kv = self.self_attn(self.input_layernorm(x), positions, mask, kv, cache_index)
        h = x + attn.astype(x.dtype)
        y = h + self.mlp(self.post_attention_layernorm(h)).astype(x.dtype)
        return constrain(y, ("batch", "length", "embed")), new_kv


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """One Block whose parameters carry a leading ``layers`` dimension (for ``lax.scan``)."""
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(Block(cfg, nnx.Rngs(key))))(keys)
    state = jax.tree.map(
        lambda v: v.copy(logical_axes=("layers",) + tuple(v.get_metadata()["logical_axes"])),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, state)


class Decoder(nnx.Module):
    """Token embedding, the transformer blocks and the final norm."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = _param(rngs, _normal, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, rngs)

    def __call__(self, input_ids_BxL, attention_mask_BxL=None, positions_BxL=None,
                 cache: KVCache | None = None, cache_index=None, kv_mask_BxS=None, inputs_embeds_BxLxD=None,
                 segment_ids_BxL=None):
        """Hidden states [B, L, D] after the final norm, and the updated cache (or None).

        Without a cache, tokens attend causally to the real tokens of their row. With
        ``segment_ids_BxL`` (packed rows, `jaxflow.workers.packing`: 0 = empty slot) a token
        attends only to earlier tokens of its own segment; ``attention_mask_BxL`` is then
        ``segment_ids > 0`` and ``positions_BxL`` must be given (per segment). With a cache
        of S slots, the L new tokens are written at slots [cache_index, cache_index + L) and
        attend to every slot j <= their own whose ``kv_mask_BxS`` is set (the caller marks
        the new slots real before calling). ``inputs_embeds_BxLxD``, when given, replaces the
        embedding lookup (``input_ids_BxL`` then only supplies the shape).

        ``cache`` may also be an external KV store (anything with ``k``, ``v`` (stacked or
        per layer, like `KVCache`), ``replace_kv(k, v)`` and ``attend(q_BxLxHxK, k_BxLxNxK,
        v_BxLxNxK, (k_layer, v_layer)) -> (out_BxLxHxK, (k_layer, v_layer))``, e.g. the rollout
        engine's paged cache): it writes and attends for every layer, with ``positions_BxL``
        given by the caller.
        """
        cfg = self.cfg
        B, L = input_ids_BxL.shape
        if cache is not None and not isinstance(cache, KVCache):
            x = jnp.take(self.embed_tokens[...], input_ids_BxL, axis=0).astype(cfg.dtype)
            x = constrain(x, ("batch", "length", "embed"))
            x, cache = self._run_layers(x, positions_BxL, cache.attend, cache, None)
            return self.norm(x), cache
        if segment_ids_BxL is not None:
            if cache is not None or positions_BxL is None:
                raise ValueError("packed segments need per-segment positions and no KV cache")
            attention_mask_BxL = segment_ids_BxL > 0
        if attention_mask_BxL is None:
            attention_mask_BxL = jnp.ones((B, L), jnp.int32)
        if positions_BxL is None:
            positions_BxL = positions_from_mask(attention_mask_BxL)
        if cache is None:
            q_slots, k_slots, key_valid = jnp.arange(L), jnp.arange(L), attention_mask_BxL
        else:
            q_slots = cache_index + jnp.arange(L)
            k_slots = jnp.arange(cache.length)
            key_valid = kv_mask_BxS
        allowed_LxS = k_slots[None, :] <= q_slots[:, None]
        if cfg.sliding_window is not None:
            allowed_LxS &= q_slots[:, None] - k_slots[None, :] < cfg.sliding_window
        mask_BxLxS = allowed_LxS[None, :, :] & key_valid.astype(bool)[:, None, :]
        if segment_ids_BxL is not None:
            mask_BxLxS &= segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]

        if inputs_embeds_BxLxD is None:
            inputs_embeds_BxLxD = jnp.take(self.embed_tokens[...], input_ids_BxL, axis=0)
        x = inputs_embeds_BxLxD.astype(cfg.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        x, cache = self._run_layers(x, positions_BxL, mask_BxLxS, cache, cache_index)
        return self.norm(x), cache

    def _run_layers(self, x, positions, mask, cache, cache_index):
        cfg = self.cfg

        def apply_block(graphdef, state, x, kv):
            return nnx.merge(graphdef, state)(x, positions, mask, kv, cache_index)

        if cfg.remat_policy != "none":
            apply_block = jax.checkpoint(apply_block, policy=_REMAT_POLICIES[cfg.remat_policy], static_argnums=(0,))

        if cfg.scan_layers:
            if cache is not None and isinstance(cache.k, tuple):
                raise ValueError("scanned layers take a stacked KVCache (see KVCache.stack_layers)")
            graphdef, state = nnx.split(self.layers)

            def body(x, layer):
                state_l, kv_l = layer
                y, new_kv = apply_block(graphdef, state_l, x, kv_l)
                return y, new_kv

            kvs = None if cache is None else (cache.k, cache.v)
            x, new_kvs = jax.lax.scan(body, x, (state, kvs))
            return x, None if cache is None else cache.replace_kv(*new_kvs)

        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, new_kv = apply_block(graphdef, state, x, kv)
            if cache is not None:
                new_k.append(new_kv[0])
                new_v.append(new_kv[1])
        if cache is None:
            return x, None
        if isinstance(cache.k, tuple):
            return x, cache.replace_kv(tuple(new_k), tuple(new_v))
        return x, cache.replace_kv(jnp.stack(new_k), jnp.stack(new_v))


class CausalLM(nnx.Module):
    """Decoder + LM head (tied to the embedding when the config says so).

    ``model(input_ids, attention_mask=mask)`` -> logits [B, L, V] in float32 (float64 for a
    float64 model).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Decoder(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

    def logits(self, hidden_BxLxD: jax.Array) -> jax.Array:
        dt = self.cfg.dtype
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("BLD,VD->BLV", hidden_BxLxD.astype(dt), self.model.embed_tokens[...].astype(dt))
        else:
            logits = jnp.einsum("BLD,DV->BLV", hidden_BxLxD.astype(dt), self.lm_head[...].astype(dt))
        return constrain(logits.astype(wide(dt)), ("batch", "length", "vocab"))

    def __call__(self, input_ids_BxL, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        hidden, _ = self.model(input_ids_BxL, attention_mask, positions, segment_ids_BxL=segment_ids)
        return self.logits(hidden)

    def forward_with_cache(self, input_ids_BxL, positions_BxL, kv_mask_BxS, cache: KVCache, cache_index):
        """Logits [B, L, V] for L new tokens written into ``cache`` at ``cache_index``."""
        hidden, cache = self.model(input_ids_BxL, None, positions_BxL, cache, cache_index, kv_mask_BxS)
        return self.logits(hidden), cache


class ValueModel(nnx.Module):
    """Critic: decoder + a linear value head, one scalar per token (float32) [B, L].

    The head is HF's ``*ForTokenClassification`` ``score`` layer with one label, so a critic
    checkpoint round-trips through transformers; it can start from an actor checkpoint.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Decoder(cfg, rngs)
        self.score = _param(rngs, _zeros, (cfg.hidden_size, 1), ("embed", None), cfg.param_dtype)
        self.score_bias = _param(rngs, _zeros, (1,), (None,), cfg.param_dtype)

    def __call__(self, input_ids_BxL, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        hidden, _ = self.model(input_ids_BxL, attention_mask, positions, segment_ids_BxL=segment_ids)
        dt = wide(hidden.dtype)
        values = jnp.einsum("BLD,DO->BLO", hidden.astype(dt), self.score[...].astype(dt))
        return values[..., 0] + self.score_bias[...].astype(dt)[0]


class RewardModel(nnx.Module):
    """Reward (or Safe-RLHF cost) model: decoder + a bias-free scalar head read at the last
    real token of each row -> [B] (float32). HF's ``*ForSequenceClassification`` layout."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Decoder(cfg, rngs)
        self.score = _param(rngs, _normal, (cfg.hidden_size, 1), ("embed", None), cfg.param_dtype)

    def token_scores(self, input_ids_BxL, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        hidden, _ = self.model(input_ids_BxL, attention_mask, positions, segment_ids_BxL=segment_ids)
        dt = wide(hidden.dtype)
        return jnp.einsum("BLD,DO->BLO", hidden.astype(dt), self.score[...].astype(dt))[..., 0]

    def __call__(self, input_ids_BxL, attention_mask=None, positions=None) -> jax.Array:
        B, L = input_ids_BxL.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, L), jnp.int32)
        scores_BxL = self.token_scores(input_ids_BxL, attention_mask, positions)
        last_BxL = jnp.where(attention_mask > 0, jnp.arange(L)[None, :], 0)
        last_B = jnp.max(last_BxL, axis=-1)
        return jnp.take_along_axis(scores_BxL, last_B[:, None], axis=-1)[:, 0]


HEADS: dict[str, type[nnx.Module]] = {"lm": CausalLM, "value": ValueModel, "reward": RewardModel}


def init_model(cfg: ModelConfig, head: str = "lm", seed: int = 0) -> Any:
    """A randomly initialised model (HF's init: normal(0.02) weights, unit norms)."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose from {sorted(HEADS)}")
    return HEADS[head](cfg, rngs=nnx.Rngs(seed))
