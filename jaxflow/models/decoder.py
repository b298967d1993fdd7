"""Decoder-only transformers (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) in Flax NNX, with an LM
head, a value head (critic) and a scalar reward head (reward and cost models).

Every parameter carries ``logical_axes`` metadata; activations are pinned with
:func:`jaxflow.mesh.constrain`. Nothing here names a mesh axis.

Padding: ``attention_mask`` [B, L] marks real tokens. Positions are ``cumsum(mask) - 1``, so
left padding (prompts), right padding (responses) or both give the same logits on the real
tokens as the unpadded row. Real tokens of a row must be contiguous.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.mesh import constrain
from jaxflow.models import lora, ordered
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


def token_einsum(spec: str, x, w, batch_invariant: bool = False) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a ``spec`` starting ``"BL"`` (x's two leading dims are
    tokens) as one product over the B * L tokens: XLA:CPU then runs plain matrix products in
    both directions, where the weight gradients of ``BL``-batched einsums (contracting B and L)
    went through slow transposing fusions (measured on the actor's train step: 11.6 -> 10.0 s).
    ``batch_invariant``: `jaxflow.models.ordered.einsum`."""
    B, L = x.shape[:2]
    einsum = ordered.einsum if batch_invariant else jnp.einsum
    y = einsum(spec.replace("BL", "T"), x.reshape(B * L, *x.shape[2:]), w)
    return y.reshape(B, L, *y.shape[1:])


def project(module: nnx.Module, name: str, spec: str, x, dtype) -> jax.Array:
    """``x W`` for ``module``'s projection ``name`` (`token_einsum` with ``spec``) in
    ``dtype``, plus its LoRA update when it has an adapter (`jaxflow.models.lora`)."""
    y = token_einsum(spec, x, getattr(module, name)[...].astype(dtype), module.cfg.batch_invariant)
    adapter = lora.adapter_of(module, name)
    return y if adapter is None else y + adapter(x).astype(y.dtype)


def positions_from_mask(attention_mask_BxL: jax.Array) -> jax.Array:
    """Position of each token among the real tokens of its row (0 on leading padding)."""
    return jnp.maximum(jnp.cumsum(attention_mask_BxL.astype(jnp.int32), axis=-1) - 1, 0)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in at least float32 (``batch_invariant``:
    the mean's sum in index order, `jaxflow.models.ordered`)."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs, axes=("norm",), batch_invariant=False):
        self.eps, self.batch_invariant = eps, batch_invariant
        self.weight = _param(rngs, _ones, (dim,), axes, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(wide(x.dtype))
        if self.batch_invariant:
            mean_sq = ordered.sum_in_index_order(lambda i: x32[..., i] ** 2, x.shape[-1])[..., None] / x.shape[-1]
        else:
            mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(mean_sq + self.eps)
        scale = self.weight[...].astype(x32.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return (y * scale).astype(x.dtype)


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm:
    """A hidden-size RMSNorm of ``cfg``."""
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, rngs, batch_invariant=cfg.batch_invariant)


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
            self.q_norm = RMSNorm(K, cfg.rms_norm_eps, pd, rngs, ("head_dim",), cfg.batch_invariant)
            self.k_norm = RMSNorm(K, cfg.rms_norm_eps, pd, rngs, ("head_dim",), cfg.batch_invariant)
        lora.attach(self, cfg.lora, rngs)

    def __call__(self, x_BxLxD, positions_BxL, mask_BxLxS, cache: Any = None, pool: Any = None):
        """y [B, L, D] and, with an external KV ``cache`` (see `Decoder.__call__`), this
        layer's updated ``pool``; without one, attention over this call's tokens under
        ``mask_BxLxS``."""
        cfg = self.cfg
        dt = cfg.dtype
        x = x_BxLxD.astype(dt)
        q = project(self, "q_proj", "BLD,DHK->BLHK", x, dt)
        k = project(self, "k_proj", "BLD,DNK->BLNK", x, dt)
        v = project(self, "v_proj", "BLD,DNK->BLNK", x, dt)
        if cfg.attention_bias:
            q = q + self.q_bias[...].astype(dt)[None, None]
            k = k + self.k_bias[...].astype(dt)[None, None]
            v = v + self.v_bias[...].astype(dt)[None, None]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inverse_frequencies(cfg)
        # RoPE pairs feature i with i + K/2. Where head_dim is split over devices (the
        # *_KV_HEAD_DIM rules) the pair lives on two devices, and XLA would swap the halves with
        # a collective-permute, which XLA:CPU rendezvouses over *every* device of the program: in
        # the rollout's per-replica decode loop, whose replicas run different step counts, that
        # hangs. RoPE on whole head_dim instead (an all-gather inside the head_dim group, the
        # rotation pinned whole too so that the partitioner does not split it again, then a local
        # split; all no-ops under the other rules).
        q_whole, k_whole = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
        q = constrain(apply_rope(constrain(q, q_whole), positions_BxL, inv_freq), q_whole)
        k = constrain(apply_rope(constrain(k, k_whole), positions_BxL, inv_freq), k_whole)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if cache is not None:  # the external KV store (the rollout engine's paged cache) writes and attends
            out, pool = cache.attend(q, k, v, pool)
        elif cfg.attention_impl == "cudnn":
            out = fused_attention(q, k, v, mask_BxLxS, "cudnn")
        else:
            attention = ordered_attention if cfg.batch_invariant else dot_product_attention
            out = attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask_BxLxS)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return project(self, "o_proj", "BLHK,HKD->BLD", out, dt), pool


def dot_product_attention(q_BxLxHxK, k_BxNxKxS, v_BxNxSxK, mask_BxLxS) -> jax.Array:
    """softmax(q k / sqrt(K) + mask) v with G = H / N query heads per kv head (keys given
    [B, N, K, S], values [B, N, S, K]: both products batched over (B, N) with operands in
    matmul order, which XLA:CPU runs about 2x faster than over [B, S, N, K]); the softmax
    runs in at least float32.
    Fully masked rows (padding queries) stay finite."""
    B, L, H, K = q_BxLxHxK.shape
    N, S = k_BxNxKxS.shape[1], k_BxNxKxS.shape[-1]
    G = H // N
    # Rows M = (G, L) of one matmul per (batch, kv head), both operands in matmul order.
    q_BxNxMxK = q_BxLxHxK.reshape(B, L, N, G, K).transpose(0, 2, 3, 1, 4).reshape(B, N, G * L, K)
    sdt = wide(q_BxLxHxK.dtype)
    scores = jnp.einsum("BNMK,BNKS->BNMS", q_BxNxMxK, k_BxNxKxS).astype(sdt) * (K**-0.5)
    probs = masked_softmax(scores.reshape(B, N, G, L, S), mask_BxLxS[:, None, None, :, :])
    probs = probs.astype(v_BxNxSxK.dtype).reshape(B, N, G * L, S)
    out_BxNxMxK = jnp.einsum("BNMS,BNSK->BNMK", probs, v_BxNxSxK)
    return out_BxNxMxK.reshape(B, N, G, L, K).transpose(0, 3, 1, 2, 4).reshape(B, L, H, K)


def ordered_attention(q_BxLxHxK, k_BxNxKxS, v_BxNxSxK, mask_BxLxS) -> jax.Array:
    """`dot_product_attention` (same arguments and result) with its sums over head_dim and over
    keys taken in index order and a batch-invariant exponential (`jaxflow.models.ordered`), in
    at least float32: masked keys add exact zeros, so a query's output depends on its visible
    keys alone, bit for bit, whether it is one of a whole sequence's queries (a training or
    scoring forward) or a decode step's query over a KV cache (the rollout engine attends with
    this function too, for a ``batch_invariant`` model). The train-rollout agreement mode; its
    cost is ``K + 2 S`` sequential steps per attention instead of two matrix products."""
    B, L, H, K = q_BxLxHxK.shape
    N, S = k_BxNxKxS.shape[1], k_BxNxKxS.shape[-1]
    G = H // N
    sdt = wide(q_BxLxHxK.dtype)
    q_BxNxMxK = q_BxLxHxK.reshape(B, L, N, G, K).transpose(0, 2, 3, 1, 4).reshape(B, N, G * L, K).astype(sdt)
    k_BxNxKxS, v_BxNxSxK = k_BxNxKxS.astype(sdt), v_BxNxSxK.astype(sdt)
    scores_BxNxMxS = ordered.sum_in_index_order(lambda i: q_BxNxMxK[..., i, None] * k_BxNxKxS[:, :, None, i, :], K)
    mask = mask_BxLxS[:, None, None, :, :]
    s = jnp.where(mask, (scores_BxNxMxS * (K**-0.5)).reshape(B, N, G, L, S), jnp.finfo(sdt).min)
    e = ordered.exp(s - jnp.max(s, axis=-1, keepdims=True))  # a max is the same in any order
    probs = (e / ordered.sum_in_index_order(lambda j: e[..., j], S)[..., None]).reshape(B, N, G * L, S)
    out_BxNxMxK = ordered.sum_in_index_order(lambda j: probs[..., j, None] * v_BxNxSxK[:, :, None, j, :], S)
    out_BxNxMxK = out_BxNxMxK.astype(q_BxLxHxK.dtype)
    return out_BxNxMxK.reshape(B, N, G, L, K).transpose(0, 3, 1, 2, 4).reshape(B, L, H, K)


def fused_attention(q_BxLxHxK, k_BxSxNxK, v_BxSxNxK, mask_BxLxS, implementation: str) -> jax.Array:
    """`dot_product_attention` through ``jax.nn.dot_product_attention`` (``cudnn``: cuDNN's
    fused attention on GPU; ``xla``: JAX's reference, for checking this layout on any
    backend). Every query also sees itself, so a padding query's row is never fully masked
    (its output is ignored; a real query's keys are unchanged, as a real query always sees
    itself)."""
    L, S = mask_BxLxS.shape[1:]
    mask = mask_BxLxS | (jnp.arange(L)[:, None] == jnp.arange(S)[None, :])[None]
    return jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxSxNxK, v_BxSxNxK, mask=mask[:, None], implementation=implementation
    )


@jax.custom_vjp
def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax over the last axis of ``scores`` where ``mask`` (broadcast) holds, the rest at the
    dtype's minimum (a fully masked row stays finite: uniform).

    Its VJP is written out, d scores = p (dp - sum(dp p)), from the probabilities alone: autodiff
    of ``jax.nn.softmax`` keeps the scores too and runs a slower chain of fusions on XLA:CPU
    (measured: attention forward + backward of the train step 17% faster)."""
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(scores.dtype).min), axis=-1)


def _masked_softmax_fwd(scores, mask):
    probs = masked_softmax(scores, mask)
    return probs, probs


def _masked_softmax_bwd(probs, d_probs):
    return probs * (d_probs - jnp.sum(d_probs * probs, axis=-1, keepdims=True)), None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x gate) * (x up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        D, F, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.gate_proj = _param(rngs, _normal, (D, F), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, _normal, (D, F), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, _normal, (F, D), ("mlp", "embed"), pd)
        lora.attach(self, cfg.lora, rngs)

    def __call__(self, x_BxLxD):
        dt = self.cfg.dtype
        x = x_BxLxD.astype(dt)
        gate = project(self, "gate_proj", "BLD,DF->BLF", x, dt)
        up = project(self, "up_proj", "BLD,DF->BLF", x, dt)
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return project(self, "down_proj", "BLF,FD->BLD", h, dt)


class Block(nnx.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); y = h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = _norm(cfg, rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, mask, cache=None, pool=None):
        attn, pool = self.self_attn(self.input_layernorm(x), positions, mask, cache, pool)
        h = x + attn.astype(x.dtype)
        y = h + self.mlp(self.post_attention_layernorm(h)).astype(x.dtype)
        return constrain(y, ("batch", "length", "embed")), pool


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
        self.embed_tokens = _param(
            rngs, _normal, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype
        )
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = _norm(cfg, rngs)

    def __call__(
        self,
        input_ids_BxL,
        attention_mask_BxL=None,
        positions_BxL=None,
        cache: Any = None,
        inputs_embeds_BxLxD=None,
        segment_ids_BxL=None,
    ):
        """Hidden states [B, L, D] after the final norm, and the updated cache (or None).

        Without a cache, tokens attend causally to the real tokens of their row. With
        ``segment_ids_BxL`` (packed rows, `jaxflow.workers.packing`: 0 = empty slot) a token
        attends only to earlier tokens of its own segment; ``attention_mask_BxL`` is then
        ``segment_ids > 0`` and ``positions_BxL`` must be given (per segment).
        ``inputs_embeds_BxLxD``, when given, replaces the embedding lookup (``input_ids_BxL``
        then only supplies the shape).

        ``cache`` is an external KV store (the rollout engine's
        `jaxflow.sampling.PagedKVCache`): anything with ``pools`` (a tuple of one pool per layer),
        ``replace_pools(pools)`` and ``attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, pool) ->
        (out_BxLxHxK, pool)``. It writes and attends for every layer, at the caller's
        ``positions_BxL``.
        """
        cfg = self.cfg
        B, L = input_ids_BxL.shape
        if cache is not None:
            if segment_ids_BxL is not None or positions_BxL is None:
                raise ValueError("a KV cache takes the caller's positions and no packed segments")
            x = jnp.take(self.embed_tokens[...], input_ids_BxL, axis=0).astype(cfg.dtype)
            x = constrain(x, ("batch", "length", "embed"))
            x, pools = self._run_layers(x, positions_BxL, None, cache, cache.pools)
            return self.norm(x), cache.replace_pools(pools)
        if segment_ids_BxL is not None:
            if positions_BxL is None:
                raise ValueError("packed segments need per-segment positions")
            attention_mask_BxL = segment_ids_BxL > 0
        if attention_mask_BxL is None:
            attention_mask_BxL = jnp.ones((B, L), jnp.int32)
        if positions_BxL is None:
            positions_BxL = positions_from_mask(attention_mask_BxL)
        slots = jnp.arange(L)
        allowed_LxL = slots[None, :] <= slots[:, None]
        if cfg.sliding_window is not None:
            allowed_LxL &= slots[:, None] - slots[None, :] < cfg.sliding_window
        mask_BxLxL = allowed_LxL[None, :, :] & attention_mask_BxL.astype(bool)[:, None, :]
        if segment_ids_BxL is not None:
            mask_BxLxL &= segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]

        if inputs_embeds_BxLxD is None:
            inputs_embeds_BxLxD = jnp.take(self.embed_tokens[...], input_ids_BxL, axis=0)
        x = inputs_embeds_BxLxD.astype(cfg.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        x, _ = self._run_layers(x, positions_BxL, mask_BxLxL, None, None)
        return self.norm(x), None

    def unstack_layers(self) -> None:
        """A scanned decoder's stacked layers become one block per layer (sliced here, once),
        for a KV-cached forward in a loop (the rollout engine calls this before its decode
        loop): each layer's weights and page pool are then whole buffers, the pools written in
        place. Scanning the cached forward instead made the decode step 2.3x slower on an
        H200 (MEASURED: 1.40 vs 0.61 s per 256 x 256-token rollout). No-op when unrolled."""
        if not self.cfg.scan_layers:
            return
        graphdef, stacked = nnx.split(self.layers)

        def layer(i):
            return jax.tree.map(
                lambda v: v.copy(v[...][i], logical_axes=tuple(v.get_metadata()["logical_axes"])[1:]),
                stacked,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )

        self.layers = nnx.List([nnx.merge(graphdef, layer(i)) for i in range(self.cfg.num_layers)])
        self.cfg = self.cfg.replace(scan_layers=False)

    def _run_layers(self, x, positions, mask, cache, pools):
        """x through every block; with a cache, each block's pool in and out (``pools`` as
        `__call__` describes them)."""
        cfg = self.cfg

        def apply_block(graphdef, state, x, pool, index):
            with lora.layer_scope(index):  # each layer its own LoRA dropout masks (training only)
                return nnx.merge(graphdef, state)(x, positions, mask, cache, pool)

        if cfg.remat_policy != "none":
            apply_block = jax.checkpoint(apply_block, policy=_REMAT_POLICIES[cfg.remat_policy], static_argnums=(0,))

        if cfg.scan_layers:
            if cache is not None:
                raise ValueError("a KV-cached forward runs layer by layer: call unstack_layers() first")
            graphdef, state = nnx.split(self.layers)

            def body(x, layer):
                state_l, index = layer
                x, _ = apply_block(graphdef, state_l, x, None, index)
                return x, None

            x, _ = jax.lax.scan(body, x, (state, jnp.arange(cfg.num_layers)))
            return x, None

        new_pools = []
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            x, pool = apply_block(graphdef, state, x, None if pools is None else pools[i], i)
            new_pools.append(pool)
        return x, None if pools is None else tuple(new_pools)


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
            head, spec = self.model.embed_tokens[...], "BLD,VD->BLV"
        else:
            head, spec = self.lm_head[...], "BLD,DV->BLV"
        logits = token_einsum(spec, hidden_BxLxD.astype(dt), head.astype(dt), self.cfg.batch_invariant)
        return constrain(logits.astype(wide(dt)), ("batch", "length", "vocab"))

    def __call__(self, input_ids_BxL, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        hidden, _ = self.model(input_ids_BxL, attention_mask, positions, segment_ids_BxL=segment_ids)
        return self.logits(hidden)


class ValueModel(nnx.Module):
    """Critic: decoder + a linear value head, one scalar per token (float32) [B, L].

    The head is HF's ``*ForTokenClassification`` ``score`` layer with one label, so a critic
    checkpoint round-trips through transformers; it can start from an actor checkpoint.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Decoder(cfg, rngs)
        # Under LoRA the head trains beside the adapters (`lora.TRAINED_HEADS`), in their dtype.
        dtype = cfg.param_dtype if cfg.lora is None else cfg.lora.param_dtype
        self.score = _param(rngs, _zeros, (cfg.hidden_size, 1), ("embed", None), dtype)
        self.score_bias = _param(rngs, _zeros, (1,), (None,), dtype)

    def __call__(self, input_ids_BxL, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        hidden, _ = self.model(input_ids_BxL, attention_mask, positions, segment_ids_BxL=segment_ids)
        dt = wide(hidden.dtype)
        values = token_einsum("BLD,DO->BLO", hidden.astype(dt), self.score[...].astype(dt))
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
        return token_einsum("BLD,DO->BLO", hidden.astype(dt), self.score[...].astype(dt))[..., 0]

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
