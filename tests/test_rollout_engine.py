"""The rollout engine's paged cache and continuous batching: paged attention == dense attention
(NumPy), slot reuse (a finished row's slot produces HF's sequence), prefix sharing (n samples ==
n separate prompts under the same keys), per-row limits, stop strings, and no recompilation
across calls with different length mixes."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.models import from_pretrained
from jaxflow.sampling import (
    SamplingParams,
    generate,
    paged_attention,
    sample_tokens,
    stop_length,
    trace_count,
)
from jaxflow.sampling.logits_processing import argmax
from tests.hf_reference import random_hf_model

VOCAB = 100  # the character tokenizer's ids
PAD = 0
NEW = 24
LENGTHS = (3, 9, 14, 6, 5, 1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = random_hf_model("llama", seed=3, std=0.3, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    path = tmp_path_factory.mktemp("llama_paged")
    hf.save_pretrained(path)
    return hf, from_pretrained(path, dtype=jnp.float32)


def _prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.full((len(lengths), width), PAD, np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(4, VOCAB, size=n)
        mask[i, width - n:] = 1
    return ids, mask


def _hf_greedy(hf, ids, mask):
    out = hf.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                      do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=PAD, eos_token_id=None)
    return out[:, ids.shape[1]:].numpy()


def test_paged_attention_matches_dense():
    """Random pools and page tables (pages in shuffled order), GQA, a chunk of several
    queries with padding (-1), blocks of 2 pages, with and without a sliding window; against
    NumPy attention over each row's keys gathered by hand."""
    rng = np.random.default_rng(0)
    N, G, K, T, M, B, L = 2, 3, 8, 4, 6, 3, 5
    pages = 1 + B * M
    k_pages = rng.normal(size=(N, pages, T, K)).astype(np.float32)
    v_pages = rng.normal(size=(N, pages, T, K)).astype(np.float32)
    table = (1 + rng.permutation(B * M)).reshape(B, M).astype(np.int32)
    q = rng.normal(size=(B, L, N * G, K)).astype(np.float32)
    positions = np.array([[3, 4, 5, 6, 7], [20, 21, 22, 23, -1], [0, 1, -1, -1, -1]], np.int32)
    for window in (None, 5):
        got = np.asarray(paged_attention(q, k_pages, v_pages, table, positions, sliding_window=window,
                                         pages_per_block=2))
        for b in range(B):
            keys = k_pages[:, table[b]].reshape(N, M * T, K)
            values = v_pages[:, table[b]].reshape(N, M * T, K)
            for t in range(L):
                pos = positions[b, t]
                if pos < 0:
                    np.testing.assert_array_equal(got[b, t], 0.0)
                    continue
                seen = np.arange(M * T) <= pos
                if window is not None:
                    seen &= pos - np.arange(M * T) < window
                for h in range(N * G):
                    s = keys[h // G] @ q[b, t, h] / np.sqrt(K)
                    p = np.exp(s[seen] - s[seen].max())
                    want = (p / p.sum()) @ values[h // G][seen]
                    np.testing.assert_allclose(got[b, t, h], want, atol=1e-5)


def test_argmax_matches_numpy():
    """The two-level argmax is numpy's (first index of the maximum), ties and a vocabulary
    that is not a multiple of the block included."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 1000)).astype(np.float32)
    x[1, 7] = x[1, 900] = 10.0  # a tie: the first wins
    x[2, -1] = 10.0  # the padded last block
    x[3] = 0.0  # all equal
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), np.argmax(x, axis=-1))
    keys = jax.random.split(jax.random.key(0), 5)
    np.testing.assert_array_equal(np.asarray(sample_tokens(keys, jnp.asarray(x), greedy=True)), np.argmax(x, -1))


def test_slot_reuse_matches_hf(llama):
    """6 rows with their own limits through 2 decode slots: every row that takes a freed slot
    produces HF's greedy tokens, cut at its limit; the same with a slot per row."""
    hf, model = llama
    ids, mask = _prompts()
    want = _hf_greedy(hf, ids, mask)
    limits = np.array([5, NEW, 9, 17, 3, 11])
    params = SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=())
    for slots in (2, 6):
        out = generate(model, ids, mask, params, max_new_tokens=limits, slots=slots, page_size=4)
        assert out.stats["slots"] == slots
        np.testing.assert_array_equal(np.asarray(out.lengths), limits)
        tokens, m = np.asarray(out.responses), np.asarray(out.response_mask)
        assert tokens.shape == (6, NEW)
        np.testing.assert_array_equal(m, np.arange(NEW)[None] < limits[:, None])
        np.testing.assert_array_equal(np.where(m == 1, tokens, PAD), np.where(m == 1, want, PAD))
        np.testing.assert_array_equal(tokens[m == 0], PAD)
    # with 2 slots the 69 tokens take at least 69 / 2 steps, and the pages in use peak below the pool
    out2 = generate(model, ids, mask, params, max_new_tokens=limits, slots=2, page_size=4)
    assert int(out2.num_steps) >= limits.sum() / 2
    assert 0 < int(np.max(out2.stats["peak_pages"])) <= out2.stats["pages_per_replica"] - 1


def test_prefix_sharing_equals_separate_prompts(llama):
    """n = 4 sampled responses per prompt (the prompt prefilled once, its pages shared, page
    size 4 so that prompts end inside a shared page) equal the responses of the prompts
    repeated 4 times with n = 1: same rows, same keys, same tokens and log-probs."""
    _, model = llama
    ids, mask = _prompts(seed=1)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, n=4, eos_token_ids=(7, 11), seed=5)
    shared = generate(model, ids, mask, params, slots=5, page_size=4)
    separate = generate(model, np.repeat(ids, 4, 0), np.repeat(mask, 4, 0),
                        SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, eos_token_ids=(7, 11), seed=5),
                        slots=7, page_size=4)
    np.testing.assert_array_equal(np.asarray(shared.responses), np.asarray(separate.responses))
    np.testing.assert_array_equal(np.asarray(shared.lengths), np.asarray(separate.lengths))
    np.testing.assert_allclose(np.asarray(shared.log_probs), np.asarray(separate.log_probs), atol=1e-5)
    tokens = np.asarray(shared.responses)
    assert sum((tokens[4 * i] != tokens[4 * i + 1]).any() for i in range(len(ids))) >= 4  # real draws
    # the shared run's prompt pages: one set per prompt, not per sample
    assert shared.stats["pages_per_replica"] < separate.stats["pages_per_replica"]


def test_per_row_limits_and_bad_limits(llama):
    _, model = llama
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(), seed=1)
    per_prompt = np.array([1, 2, 3, 4, 5, 6])
    out = generate(model, ids, mask, params, max_new_tokens=per_prompt, slots=3)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.repeat(per_prompt, 2))
    assert out.responses.shape == (12, NEW)
    full = generate(model, ids, mask, params, slots=3)  # same keys: the limited rows are prefixes
    m = np.asarray(out.response_mask) == 1
    np.testing.assert_array_equal(np.asarray(out.responses)[m], np.asarray(full.responses)[m])
    with pytest.raises(ValueError, match="max_new_tokens must be an int or an integer array"):
        generate(model, ids, mask, params, max_new_tokens=np.ones(5, np.int32))
    with pytest.raises(ValueError, match=">= 1 for every row"):
        generate(model, ids, mask, params, max_new_tokens=np.zeros(12, np.int32))
    with pytest.raises(ValueError, match="<= SamplingParams.max_new_tokens"):
        generate(model, ids, mask, params, max_new_tokens=NEW + 1)


def _reference_stop(text_of, tokens, stops):
    for k in range(1, len(tokens) + 1):
        if any(s in text_of(tokens[:k]) for s in stops):
            return k
    return len(tokens)


def test_stop_strings(llama):
    """Rows end after the token that completes a stop string, found through the tokenizer's
    decode (a linear scan over prefixes as the reference)."""
    _, model = llama
    tok = CharTokenizer()
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(), seed=2)
    free = generate(model, ids, mask, params)
    texts = [tok.decode([int(t) for t in row]) for row in np.asarray(free.responses)]
    stops = (texts[0][5:7], texts[3][2:5])  # strings that occur mid-response in rows 0 and 3
    out = generate(model, ids, mask, SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(), seed=2, stop=stops),
                   tokenizer=tok)
    lengths = np.asarray(out.lengths)
    for row, full_row in enumerate(np.asarray(free.responses)):
        want = _reference_stop(lambda t: tok.decode([int(x) for x in t]), full_row, stops)
        assert lengths[row] == want == stop_length(full_row, stops, tok)
        np.testing.assert_array_equal(np.asarray(out.responses)[row, :want], full_row[:want])
        assert (np.asarray(out.responses)[row, want:] == PAD).all()
        assert (np.asarray(out.response_mask)[row] == (np.arange(NEW) < want)).all()
    assert lengths[0] < NEW and lengths[3] < NEW  # both rows were cut
    with pytest.raises(ValueError, match="needs a tokenizer"):
        generate(model, ids, mask, SamplingParams(max_new_tokens=4, stop=("a",)))


class _CompileCounter:
    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listener(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def test_no_recompilation_across_length_mixes(llama):
    """Calls with different per-row limits and prompt lengths (one bucket) trace and
    compile nothing after the first."""
    _, model = llama
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(9,), seed=0)
    ids, mask = _prompts()
    generate(model, ids, mask, params, max_new_tokens=np.full(12, NEW), slots=4).responses.block_until_ready()
    traces = trace_count()
    rng = np.random.default_rng(0)
    with _CompileCounter() as compiles:
        for k in range(3):
            lengths = rng.integers(1, 15, size=6)
            ids, mask = _prompts(tuple(lengths), seed=k)
            limits = rng.integers(1, NEW + 1, size=len(lengths) * 2)
            out = generate(model, ids, mask, params, max_new_tokens=limits, slots=4)
            assert (np.asarray(out.lengths) <= limits).all()
    assert compiles.count == 0 and trace_count() == traces
