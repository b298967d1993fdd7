"""Logits processing and token sampling: pure functions over a batch of next-token logits.

The sampling distribution follows HF transformers' (and vLLM's) order of warpers::

    z   = logits / T                                   (temperature T > 0)
    z_k = z where z >= (k-th largest z) else -inf      (top-k; k = 0 keeps all)
    z_p = z_k where sum_{j: z_k[j] > z_k[i]} softmax(z_k)[j] < p else -inf
                                                       (top-p / nucleus; p = 1 keeps all)
    token ~ softmax(z_p)

Top-p keeps the smallest set of most likely tokens whose probability reaches ``p`` (a token
stays while the mass strictly above it is below ``p``; the most likely token always stays).
Greedy decoding is ``argmax(logits)``.

The log-probability reported for a sampled token is ``log_softmax(logits / T)[token]``
(T = 1 for greedy), *without* the top-k / top-p truncation: the same quantity the actor's
log-prob and train steps compute, as in verl.

`apply_temperature`, `top_k_mask`, `top_p_mask` and `process_logits` work in vocabulary space
(masked entries are ``-inf``) and define the target distribution. `sample_tokens` draws from
the same distribution; with top-k it works on the k candidates of ``lax.top_k`` only. Nothing
sorts the vocabulary: top-p finds its threshold by bisection and the draw is a two-level
inverse CDF (see `_nucleus` and `_categorical`), because XLA's CPU sort and per-entry
random numbers cost more than the model's decode step at a 32k vocabulary.

Randomness is per row: ``keys_B`` holds one PRNG key per row, so a row's sample does not
depend on the batch it is in, on padding rows, or on how the batch is sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflow.mesh import constrain
from jaxflow.models import ordered

NEG_INF = -jnp.inf


def _as_column(x, ndim: int) -> jax.Array:
    """A scalar or per-row [B] value shaped to broadcast against [B, V]."""
    x = jnp.asarray(x, jnp.float32)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim)) if x.ndim else x


def apply_temperature(logits_BxV: jax.Array, temperature) -> jax.Array:
    """``logits / T`` in float32; ``temperature`` is a scalar or a per-row [B] array."""
    return logits_BxV.astype(jnp.float32) / _as_column(temperature, logits_BxV.ndim)


def top_k_mask(logits_BxV: jax.Array, k: int) -> jax.Array:
    """Keep the ``k`` largest logits of each row (and any ties with the k-th), ``-inf``
    elsewhere. ``k <= 0`` or ``k >= V`` keeps everything. ``k`` is static."""
    V = logits_BxV.shape[-1]
    if k <= 0 or k >= V:
        return logits_BxV
    kth_Bx1 = jax.lax.top_k(logits_BxV, k)[0][..., -1:]
    return jnp.where(logits_BxV >= kth_Bx1, logits_BxV, NEG_INF)


def _nucleus(logits_BxC: jax.Array, top_p) -> jax.Array:
    """Top-p by bisection, without sorting (XLA's CPU sort of a 32k-152k vocabulary costs
    hundreds of milliseconds).

    With probabilities q = softmax(z) and f(t) = sum_{j: q_j > t} q_j (non-increasing), token
    i is kept iff f(q_i) < p, i.e. iff q_i >= tau, tau the smallest float32 t with f(t) < p.
    Non-negative float32 values are ordered like their int32 bit patterns, so 31 halvings of
    [0, +inf] in bit space find tau exactly.
    """
    probs = jax.nn.softmax(logits_BxC, axis=-1)
    p = _as_column(top_p, logits_BxC.ndim)
    shape = logits_BxC.shape[:-1] + (1,)
    lo = jnp.zeros(shape, jnp.int32)  # invariant: f(lo) >= p  (f(0) = 1 up to rounding)
    hi = jnp.full(shape, 0x7F800000, jnp.int32)  # +inf, f(+inf) = 0 < p

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        t = jax.lax.bitcast_convert_type(mid, jnp.float32)
        below = jnp.sum(jnp.where(probs > t, probs, 0.0), axis=-1, keepdims=True) < p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    _, hi = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    tau = jax.lax.bitcast_convert_type(hi, jnp.float32)
    keep = (probs >= tau) | (p >= 1.0)
    return jnp.where(keep, logits_BxC, NEG_INF)


def top_p_mask(logits_BxV: jax.Array, top_p) -> jax.Array:
    """Keep the nucleus of each row (see the module docstring), ``-inf`` elsewhere.
    ``top_p`` is a scalar or a per-row [B] array and may be traced; ``top_p >= 1`` keeps all.
    Tokens tied with the least likely kept token are kept."""
    return _nucleus(logits_BxV, top_p)


def process_logits(logits_BxV: jax.Array, temperature=1.0, top_k: int = 0, top_p=1.0) -> jax.Array:
    """Temperature, then top-k, then top-p: the logits of the sampling distribution."""
    z = apply_temperature(logits_BxV, temperature)
    z = top_k_mask(z, top_k)
    return top_p_mask(z, top_p)


def sampling_probs(logits_BxV: jax.Array, temperature=1.0, top_k: int = 0, top_p=1.0) -> jax.Array:
    """The distribution `sample_tokens` draws from, as probabilities [B, V]."""
    return jax.nn.softmax(process_logits(logits_BxV, temperature, top_k, top_p), axis=-1)


def sample_tokens(
    keys_B: jax.Array,
    logits_BxV: jax.Array,
    *,
    greedy: bool = False,
    temperature=1.0,
    top_k: int = 0,
    top_p=1.0,
    use_top_p: bool | None = None,
    vocab_shards: int = 1,
) -> jax.Array:
    """One token per row (int32 [B]) from ``softmax(process_logits(...))``, or the argmax
    when ``greedy``.

    ``greedy``, ``top_k``, ``use_top_p`` and ``vocab_shards`` are static; ``temperature`` and
    ``top_p`` may be traced (scalars or per-row [B]). ``use_top_p`` (default: ``top_p < 1``
    when ``top_p`` is a Python number) says whether the nucleus step runs at all. ``keys_B``
    is one PRNG key per row (typed key array [B]). ``vocab_shards``: the devices the
    vocabulary of the logits is split over (`_block_width`).
    """
    if greedy:
        return argmax(logits_BxV, vocab_shards)
    if use_top_p is None:
        if not isinstance(top_p, (int, float)):
            raise ValueError("pass use_top_p=True/False when top_p is an array")
        use_top_p = top_p < 1.0
    V = logits_BxV.shape[-1]
    z = apply_temperature(logits_BxV, temperature)
    ids_BxC = None
    if 0 < top_k < V:
        z, ids_BxC = jax.lax.top_k(z, top_k)  # the k candidates
    if use_top_p:
        z = _nucleus(z, top_p)
    choice_B = _categorical(keys_B, z, 1 if ids_BxC is not None else vocab_shards)
    if ids_BxC is None:
        return choice_B
    return jnp.take_along_axis(ids_BxC, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


_BLOCK = 128


def _block_width(size: int, shards: int = 1) -> int:
    """Entries per block of the two-level argmax and draw: 128, or with the entries split
    over ``shards`` devices the largest power of two (>= 8) that tiles each shard, so that no
    block straddles two devices. A straddling block makes XLA all-gather the whole row at
    every step (measured in the compiled HLO: [slots, 151936] float32 per decode step for
    Qwen2.5's vocabulary over tp=2, where 75968 entries per shard are not a multiple of 128)."""
    if shards > 1 and size % shards == 0:
        width = _BLOCK
        while width > 8 and (size // shards) % width:
            width //= 2
        if (size // shards) % width == 0:
            return width
    return _BLOCK


def _whole_rows_if_straddling(z_BxV: jax.Array, width: int, shards: int) -> jax.Array:
    """``z`` gathered whole on every device of its row when blocks of ``width`` entries would
    straddle its ``shards`` (one all-gather, instead of the shifts that padding and
    reshaping a split vocabulary take; a collective-permute inside a decode loop whose
    replicas run different step counts can hang XLA:CPU, which rendezvouses every device for
    it)."""
    V = z_BxV.shape[-1]
    straddles = V % shards != 0 or width >= V or (V // shards) % width != 0
    return constrain(z_BxV, ("batch", None)) if shards > 1 and straddles else z_BxV


def argmax(logits_BxV: jax.Array, vocab_shards: int = 1) -> jax.Array:
    """``jnp.argmax(logits, -1)`` (the first index of the maximum), int32 [B], in two levels:
    the maxima of blocks of `_block_width` entries, the first block holding the row's
    maximum, then the first maximum inside that block. XLA:CPU runs a vocabulary-wide argmax
    as a scalar (value, index) reduction, 20-40x slower than a plain max (22 ms vs 0.6 ms
    for [64, 32000], measured); this was why greedy decoding ran slower than sampling."""
    B, V = logits_BxV.shape
    width = _block_width(V, vocab_shards)
    nblocks = -(-V // width)
    z = _whole_rows_if_straddling(logits_BxV, width, vocab_shards)
    if nblocks * width != V:
        z = jnp.pad(z, ((0, 0), (0, nblocks * width - V)), constant_values=NEG_INF)
    z_BxNxW = z.reshape(B, nblocks, width)
    block_B = jnp.argmax(jnp.max(z_BxNxW, axis=-1), axis=-1)
    in_block_BxW = jnp.take_along_axis(z_BxNxW, block_B[:, None, None], axis=1)[:, 0]
    return (block_B * width + jnp.argmax(in_block_BxW, axis=-1)).astype(jnp.int32)


def _categorical(keys_B: jax.Array, logits_BxC: jax.Array, shards: int = 1) -> jax.Array:
    """Draw index i of each row with probability softmax(logits)[i] (-inf never drawn).

    Two-level inverse-CDF sampling with two uniforms per row: pick a block of
    `_block_width` entries (``shards``: the devices the C entries are split over) with
    probability equal to its mass, then an entry within the block in proportion to its
    probability. Exact in distribution, and the cumulative sums run over the block masses
    or one block's entries, so float32 rounding stays at the level of the block masses. It
    needs 2 random numbers per row where Gumbel-max needs C, which makes it several times
    cheaper for a 32k-152k vocabulary on CPU.
    """
    B, C = logits_BxC.shape
    width = _block_width(C, shards)
    nblocks = -(-C // width)
    width = width if nblocks > 1 else C
    z = _whole_rows_if_straddling(logits_BxC.astype(jnp.float32), width, shards)
    if nblocks * width != C:
        z = jnp.pad(z, ((0, 0), (0, nblocks * width - C)), constant_values=NEG_INF)
    w_BxNxW = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)).reshape(B, nblocks, width)
    u_Bx2 = jax.vmap(lambda k: jax.random.uniform(k, (2,)))(keys_B)

    def pick(weights_BxM, u_B):
        """Smallest i with cumsum(weights)[i] > u * sum(weights), over positive weights."""
        cdf = jnp.cumsum(weights_BxM, axis=-1)
        total = jnp.sum(weights_BxM, axis=-1, keepdims=True)  # a reduction, not the last entry of a sharded cdf
        i = jnp.sum(cdf <= u_B[:, None] * total, axis=-1)
        # Rounding can put u * total at the total: fall back to the last positive weight (a
        # max over indices, not a reversed copy: no data movement when the entries are sharded)
        last = jnp.max(jnp.where(weights_BxM > 0, jnp.arange(weights_BxM.shape[-1]), 0), axis=-1)
        return jnp.minimum(i, last)

    # the block masses, whole on every device of the row (a small gather): their prefix sum
    # then needs no collective-permute between the vocabulary shards
    block_B = pick(constrain(jnp.sum(w_BxNxW, axis=-1), ("batch", None)), u_Bx2[:, 0])
    in_block_BxW = jnp.take_along_axis(w_BxNxW, block_B[:, None, None], axis=1)[:, 0]
    return (block_B * width + pick(in_block_BxW, u_Bx2[:, 1])).astype(jnp.int32)


def token_log_probs(logits_BxV: jax.Array, tokens_B: jax.Array, temperature=1.0, batch_invariant=False) -> jax.Array:
    """``log_softmax(logits / T)[token]`` per row, float32 [B] (no top-k / top-p);
    ``batch_invariant``: computed as the trainer computes a batch-invariant model's log-probs
    (`jaxflow.models.ordered`: the temperature as a product, the normaliser's sum in index order)."""
    if batch_invariant:
        z = ordered.divide(logits_BxV.astype(jnp.float32), _as_column(temperature, logits_BxV.ndim))
    else:
        z = apply_temperature(logits_BxV, temperature)
    picked = jnp.take_along_axis(z, tokens_B[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - ordered.logsumexp(z, batch_invariant)
