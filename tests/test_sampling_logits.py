"""Logits processing and token sampling (jaxflow.sampling.logits_processing), checked against
an independent NumPy transcription of HF transformers' warpers and by chi-square tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxflow.sampling import (
    process_logits,
    sample_tokens,
    sampling_probs,
    token_log_probs,
    top_k_mask,
    top_p_mask,
)
from jaxflow.sampling.logits_processing import _block_width, argmax


def _softmax(z):
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """HF transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper,
    transcribed for one row of logits in float64."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1.0:
        order = np.argsort(z)  # ascending
        cum = np.cumsum(_softmax(z)[order])
        remove = cum <= 1 - top_p
        remove[-1] = False  # min_tokens_to_keep = 1
        z = z.copy()
        z[order[remove]] = -np.inf
    return _softmax(z)


# Logits of a tiny vocabulary, chosen so that no cumulative mass sits on a top-p boundary.
LOGITS_V = np.array([2.0, 1.3, 0.9, 0.4, 0.0, -0.3, -1.0, -2.2], np.float32)
CONFIGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (2.0, 3, 1.0),
    (1.0, 0, 0.7),
    (0.8, 5, 0.8),
    (1.5, 6, 0.9),
]


@functools.partial(jax.jit, static_argnames=("top_k",))
def _process(logits, temperature, top_p, *, top_k):
    return process_logits(logits, temperature, top_k, top_p), sampling_probs(logits, temperature, top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_masks_match_hf_warpers(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 32)).astype(np.float32) * 2
    z, got = _process(logits, temperature, top_p, top_k=top_k)
    want = np.stack([reference_probs(row, temperature, top_k, top_p) for row in logits])
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Masked entries are exactly -inf, kept ones are the tempered logits.
    z = np.asarray(z)
    np.testing.assert_array_equal(np.isinf(z), want == 0)
    np.testing.assert_allclose(z[want > 0], (logits / temperature)[want > 0], rtol=1e-6)


def test_mask_edge_cases():
    logits = jnp.asarray(LOGITS_V)[None]
    assert top_k_mask(logits, 0) is logits and top_k_mask(logits, 8) is logits
    # top_p = 1 keeps everything; a tiny top_p keeps exactly the most likely token; per-row
    # top_p follows each row's value.
    rows = np.broadcast_to(LOGITS_V, (4, LOGITS_V.size))
    z = np.asarray(jax.jit(top_p_mask)(rows, np.float32([1.0, 1e-6, 0.5, 0.99])))
    np.testing.assert_array_equal(z[0], LOGITS_V)
    want = [np.sum(reference_probs(LOGITS_V, 1.0, 0, p) > 0) for p in (1.0, 1e-6, 0.5, 0.99)]
    np.testing.assert_array_equal(np.isfinite(z).sum(axis=-1), want)


DRAWS = 40_000


@functools.partial(jax.jit, static_argnames=("top_k", "use_top_p"))
def _sample(seed, logits_NxV, temperature, top_p, *, top_k, use_top_p):
    """One token per row, row i with key i of ``split(key(seed))`` (one program per setting)."""
    keys = jax.random.split(jax.random.key(seed), logits_NxV.shape[0])
    return sample_tokens(keys, logits_NxV, temperature=temperature, top_k=top_k, top_p=top_p, use_top_p=use_top_p)


def _draw(seed, temperature, top_k, top_p, logits_NxV=None):
    if logits_NxV is None:
        logits_NxV = np.broadcast_to(LOGITS_V, (DRAWS, LOGITS_V.size))
    return np.asarray(_sample(seed, logits_NxV, temperature, top_p, top_k=top_k, use_top_p=top_p < 1))


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_sampling_frequencies_match_target(temperature, top_k, top_p):
    """Chi-square goodness of fit of 40k draws against the HF-defined target (p > 1e-3 at a
    fixed seed), tokens outside the support never drawn, and a wrong target rejected."""
    tokens = _draw(0, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=LOGITS_V.size)
    target = reference_probs(LOGITS_V, temperature, top_k, top_p)
    support = target > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], DRAWS * target[support]).pvalue > 1e-3
    # Power: a neighbouring distribution (untruncated, other temperature) is rejected.
    other = reference_probs(LOGITS_V, 0.7 if (temperature, top_k, top_p) == (1.0, 0, 1.0) else 1.0)
    assert stats.chisquare(counts, DRAWS * other).pvalue < 1e-6


def test_per_row_temperature_and_top_p():
    """Traced per-row parameters: each half of the batch follows its own target."""
    half = DRAWS // 2
    temperature = np.repeat(np.float32([0.6, 1.7]), half)
    top_p = np.repeat(np.float32([0.75, 1.0]), half)
    logits = np.broadcast_to(LOGITS_V, (DRAWS, LOGITS_V.size))
    tokens = np.asarray(_sample(3, logits, temperature, top_p, top_k=0, use_top_p=True))
    for rows, t, p in ((slice(0, half), 0.6, 0.75), (slice(half, None), 1.7, 1.0)):
        counts = np.bincount(tokens[rows], minlength=LOGITS_V.size)
        target = reference_probs(LOGITS_V, t, 0, p)
        assert counts[target == 0].sum() == 0
        assert stats.chisquare(counts[target > 0], half * target[target > 0]).pvalue > 1e-3


def test_seeds():
    a = _draw(7, 1.0, 0, 0.7)
    np.testing.assert_array_equal(a, _draw(7, 1.0, 0, 0.7))
    assert (a != _draw(8, 1.0, 0, 0.7)).mean() > 0.3
    # Each row depends on its own key and logits only: changing other rows changes nothing.
    logits = np.broadcast_to(LOGITS_V, (DRAWS, LOGITS_V.size)).copy()
    logits[100:] = logits[100:, ::-1]
    b = _draw(7, 1.0, 0, 0.7, logits)
    np.testing.assert_array_equal(b[:100], a[:100])
    assert (b[100:] != a[100:]).mean() > 0.3


def test_greedy_and_log_probs():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 6)
    greedy = jax.jit(functools.partial(sample_tokens, greedy=True))(keys, logits)
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))
    tokens = rng.integers(0, 50, size=6).astype(np.int32)
    z = logits.astype(np.float64)
    for t in (1.0, 0.7):
        want = (z / t - np.log(np.exp(z / t).sum(-1, keepdims=True)))[np.arange(6), tokens]
        np.testing.assert_allclose(jax.jit(token_log_probs)(logits, tokens, t), want, atol=1e-5)


def test_blocks_that_tile_vocabulary_shards():
    """With the vocabulary split over devices the sampler's blocks tile each shard
    (`_block_width`): argmax is still numpy's (ties, a width that does not tile: the whole
    rows), and the two-level draw still follows softmax(logits) (chi-square), whatever the
    number of shards."""
    assert [_block_width(151936, s) for s in (1, 2, 4, 8)] == [128, 64, 32, 16]
    assert _block_width(100, 2) == 128  # 50 per shard: no power of two >= 8 tiles it
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 1536)).astype(np.float32)
    x[1, 7] = x[1, 1400] = 10.0  # a tie: the first wins
    for shards in (1, 2, 3, 8, 7):
        np.testing.assert_array_equal(np.asarray(jax.jit(argmax, static_argnums=1)(x, shards)), np.argmax(x, -1))
    logits = rng.normal(size=48).astype(np.float32)
    target = _softmax(logits.astype(np.float64))
    for shards, width in ((2, 8), (3, 16)):  # 24 or 16 entries per shard: 6 or 3 blocks, not one block of 48
        assert _block_width(48, shards) == width
        keys = jax.random.split(jax.random.key(shards), DRAWS)
        tokens = jax.jit(functools.partial(sample_tokens, vocab_shards=shards, use_top_p=False))(
            keys, np.broadcast_to(logits, (DRAWS, 48))
        )
        counts = np.bincount(np.asarray(tokens), minlength=48)
        assert stats.chisquare(counts, DRAWS * target).pvalue > 1e-3
