"""The rollout engine (jaxflow.sampling.engine): parity with HF transformers' generate, cached
== uncached logits, log-probs == teacher forcing, EOS handling, n samples, seeds, sharding on a
(dp=4, tp=2) mesh, and no recompilation across calls of one bucket."""

import dataclasses
import re

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from scipy import stats

from jaxflow.mesh import GENERATE_RULES, state_shardings
from jaxflow.models import from_pretrained
from jaxflow.sampling import (
    DEFAULT_SLOTS,
    EngineOptions,
    SamplingParams,
    bucket_size,
    engine_shape,
    generate,
    generate_from_state,
    lower_generate,
)
from jaxflow.sampling.engine import DEFAULT_PAGE_SIZE
from jaxflow.workers.forward import log_probs_and_entropy
from tests.compile_events import CompileEvents
from tests.hf_reference import random_hf_model

VOCAB = 128
PAD = 0
NEW = 32
PROMPT_LENGTHS = (3, 9, 14, 6)


def _hf_model(kind: str, seed: int):
    """A random-init tiny HF model (every parameter random, biases and norm scales included)
    with large weights (std 0.3), so that logits are far from flat."""
    return random_hf_model(
        kind,
        seed=seed,
        std=0.3,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        tie_word_embeddings=kind == "qwen2",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )


def _prompts(lengths=PROMPT_LENGTHS, seed=0, width=None):
    rng = np.random.default_rng(seed)
    width = width or max(lengths)
    ids = np.full((len(lengths), width), PAD, np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(1, VOCAB, size=n)
        mask[i, width - n :] = 1
    return ids, mask


def _hf_generate(hf, ids, mask, eos=None):
    out = hf.generate(
        torch.tensor(ids, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        do_sample=False,
        max_new_tokens=NEW,
        pad_token_id=PAD,
        eos_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, ids.shape[1] :].numpy()
    tokens = np.pad(tokens, ((0, 0), (0, NEW - tokens.shape[1])), constant_values=PAD)
    scores = torch.stack(out.scores, dim=1).numpy()  # [B, steps, V]
    return tokens, scores


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request, tmp_path_factory):
    hf = _hf_model(request.param, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, from_pretrained(path, dtype=jnp.float32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = _hf_model("llama", seed=1)
    path = tmp_path_factory.mktemp("llama_engine")
    hf.save_pretrained(path)
    return hf, from_pretrained(path, dtype=jnp.float32)


GREEDY = SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=())
LOGITS = EngineOptions(return_logits=True)


def test_greedy_matches_hf(models):
    """32 greedy tokens, left-padded prompts of lengths 3..14, token for token."""
    kind, hf, model = models
    ids, mask = _prompts()
    want, scores = _hf_generate(hf, ids, mask)
    top2 = np.sort(scores, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3, "near-tie in the reference: pick another seed"
    out = generate(model, ids, mask, GREEDY)
    assert out.responses.shape == (4, NEW)
    np.testing.assert_array_equal(np.asarray(out.responses), want)
    np.testing.assert_array_equal(np.asarray(out.lengths), [NEW] * 4)
    assert int(out.num_steps) == NEW
    # Greedy log-probs are log_softmax at temperature 1 of HF's (unprocessed) scores.
    hf_logp = np.take_along_axis(torch.log_softmax(torch.tensor(scores), -1).numpy(), want[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.log_probs), hf_logp, atol=1e-4)


def test_eos_matches_hf_and_stops_early(llama):
    """Several EOS ids taken from the unconstrained output, so that every row stops at a
    different step: same tokens, padding and lengths as HF; the loop exits once all rows have
    stopped (num_steps == max(lengths) < max_new_tokens)."""
    hf, model = llama
    ids, mask = _prompts()
    free, _ = _hf_generate(hf, ids, mask)
    eos = sorted({int(free[0, 4]), int(free[1, 11]), int(free[2, 19]), int(free[3, 26])})
    want, _ = _hf_generate(hf, ids, mask, eos=eos)
    out = generate(model, ids, mask, SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=tuple(eos)))
    np.testing.assert_array_equal(np.asarray(out.responses), want)
    lengths = np.asarray(out.lengths)
    # The EOS token ends (and belongs to) each response; nothing before it is an EOS.
    for row, n in zip(want, lengths):
        assert row[n - 1] in eos and not np.isin(row[: n - 1], eos).any() and (row[n:] == PAD).all()
    np.testing.assert_array_equal(np.asarray(out.response_mask), np.arange(NEW)[None] < lengths[:, None])
    assert len(set(lengths.tolist())) > 1
    assert int(out.num_steps) == lengths.max() < NEW
    np.testing.assert_array_equal(np.asarray(out.log_probs)[np.asarray(out.response_mask) == 0], 0.0)


SAMPLED = SamplingParams(
    max_new_tokens=40, temperature=0.7, top_k=40, top_p=0.95, n=2, eos_token_ids=tuple(range(5, VOCAB, 11)), seed=3
)


@pytest.fixture(scope="module")
def sampled(llama):
    """A sampled rollout with per-step logits (debug), n = 2, 12 EOS ids out of 128."""
    _, model = llama
    ids, mask = _prompts(lengths=(5, 2, 11, 8), seed=1)
    return ids, mask, generate(model, ids, mask, SAMPLED, options=LOGITS)


@pytest.fixture(scope="module")
def teacher_forced_logits(llama, sampled):
    """The logits [B * n, response length, V] that predict each response token of the
    `sampled` rollout, from one uncached forward over prompt + response (one compile)."""
    _, model = llama
    ids, mask, out = sampled
    n = SAMPLED.n
    seq = np.concatenate([np.repeat(ids, n, axis=0), np.asarray(out.responses)], axis=1)
    seq_mask = np.concatenate([np.repeat(mask, n, axis=0), np.asarray(out.response_mask)], axis=1)
    logits = jax.jit(lambda s, x, m: nnx.merge(*s)(x, attention_mask=m))(nnx.split(model), seq, seq_mask)
    L = ids.shape[1]
    return np.asarray(logits)[:, L - 1 : L - 1 + out.responses.shape[1]]  # logits that predict response j


def test_cached_logits_equal_full_forward(sampled, teacher_forced_logits):
    _, _, out = sampled
    full = teacher_forced_logits
    m = np.asarray(out.response_mask).astype(bool)
    assert m.sum() > 40
    np.testing.assert_allclose(np.asarray(out.logits)[m], full[m], atol=1e-4, rtol=0)


def test_log_probs_equal_teacher_forcing(sampled, teacher_forced_logits):
    _, _, out = sampled
    logp = jax.nn.log_softmax(teacher_forced_logits / SAMPLED.temperature, axis=-1)
    want = np.take_along_axis(np.asarray(logp), np.asarray(out.responses)[..., None], -1)[..., 0]
    m = np.asarray(out.response_mask).astype(bool)
    np.testing.assert_allclose(np.asarray(out.log_probs)[m], want[m], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.log_probs)[~m], 0.0)


def test_batch_invariant_rollout_log_probs_are_the_trainers_bit_for_bit(
    llama, sampled, teacher_forced_logits, tmp_path
):
    """The train-rollout agreement mode's model (``batch_invariant``): its forward is the
    default model's to rounding, and the engine, which decodes it with the same order-stable
    sums (`paged.ordered_paged_attention`), reports log-probs of the sampled tokens equal bit
    for bit to the trainer's (`log_probs_and_entropy`: one forward over prompt + response, as
    the actor scores old log-probs) with 8 rows per decode step; the default model's differ
    there by a few float32 spacings."""
    hf, _ = llama
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=jnp.float32, batch_invariant=True)
    ids, mask = _prompts(lengths=(5, 2, 11, 8), seed=1)
    out = generate(model, ids, mask, SAMPLED)
    n = SAMPLED.n
    rows = dict(prompt_ids=np.repeat(ids, n, axis=0), prompt_mask=np.repeat(mask, n, axis=0))
    rows |= dict(responses=np.asarray(out.responses), response_mask=np.asarray(out.response_mask))
    m = rows["response_mask"] > 0
    assert m.sum() > 40
    # the same model: the same tokens as the default attention's rollout, the same logits to rounding
    np.testing.assert_array_equal(rows["responses"], np.asarray(sampled[2].responses))
    L = ids.shape[1]
    forward = jax.jit(lambda s, x, a: nnx.merge(*s)(x, attention_mask=a))
    seq = np.concatenate([rows["prompt_ids"], rows["responses"]], axis=1)
    seq_mask = np.concatenate([rows["prompt_mask"], rows["response_mask"]], axis=1)
    logits = np.asarray(forward(nnx.split(model), seq, seq_mask))[:, L - 1 : L - 1 + rows["responses"].shape[1]]
    np.testing.assert_allclose(logits[m], teacher_forced_logits[m], atol=1e-4, rtol=0)
    trainer = jax.jit(lambda s, t: log_probs_and_entropy(nnx.merge(*s), t, SAMPLED.temperature, False)[0])
    want = np.asarray(trainer(nnx.split(model), rows))
    np.testing.assert_array_equal(np.asarray(out.log_probs)[m], want[m])


def test_sampled_stopping_and_interleaving(sampled):
    ids, _, out = sampled
    tokens, lengths = np.asarray(out.responses), np.asarray(out.lengths)
    eos = np.asarray(SAMPLED.eos_token_ids)
    assert tokens.shape == (len(ids) * SAMPLED.n, SAMPLED.max_new_tokens)
    np.testing.assert_array_equal(np.asarray(out.response_mask), np.arange(tokens.shape[1])[None] < lengths[:, None])
    for row, n in zip(tokens, lengths):
        assert not np.isin(row[: n - 1], eos).any() and (row[n:] == PAD).all()
        assert n == tokens.shape[1] or row[n - 1] in eos
    assert int(out.num_steps) == lengths.max()
    # The two samples of a prompt are different draws (an identical short pair is possible).
    assert sum((tokens[2 * i] != tokens[2 * i + 1]).any() for i in range(len(ids))) >= 3
    # Sampled tokens respect top-k: each is among the 40 largest logits of its step.
    logits = np.asarray(out.logits)
    m = np.asarray(out.response_mask).astype(bool)
    rank = (logits > np.take_along_axis(logits, tokens[..., None], -1)).sum(-1)
    assert rank[m].max() < SAMPLED.top_k


def test_seeds_end_to_end(llama, sampled):
    """Same seed, same rollout (another call of the same program); another seed differs."""
    _, model = llama
    ids, mask, first = sampled
    again = generate(model, ids, mask, SAMPLED, options=LOGITS)
    np.testing.assert_array_equal(np.asarray(again.responses), np.asarray(first.responses))
    other = generate(model, ids, mask, dataclasses.replace(SAMPLED, seed=4), options=LOGITS)
    assert (np.asarray(other.responses) != np.asarray(first.responses)).any()


def test_first_token_distribution(llama):
    """End to end on the model: 4096 samples of one prompt's first token follow the tempered,
    top-k and top-p filtered softmax of the model's logits (chi-square, fixed seed)."""
    hf, model = llama
    ids, mask = _prompts(lengths=(7,), seed=2)
    params = SamplingParams(max_new_tokens=1, temperature=1.5, top_k=12, top_p=0.9, n=4096, eos_token_ids=())
    out = generate(model, ids, mask, params)  # 4096 rows through DEFAULT_SLOTS slots, one shared prompt
    assert int(out.num_steps) == 4096 // DEFAULT_SLOTS and out.responses.shape == (4096, 1)
    with torch.no_grad():
        logits = hf(torch.tensor(ids, dtype=torch.long)).logits[0, -1].double().numpy()
    z = logits / params.temperature
    z = np.where(z >= np.sort(z)[-params.top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < params.top_p
    target = np.zeros_like(p)
    target[order[keep]] = p[order[keep]]
    target /= target.sum()
    counts = np.bincount(np.asarray(out.responses)[:, 0], minlength=VOCAB)
    assert counts[target == 0].sum() == 0
    assert stats.chisquare(counts[target > 0], 4096 * target[target > 0]).pvalue > 1e-3


def test_n_samples_greedy_repeat(llama):
    """n = 3 greedy rows are the n = 1 row repeated (interleaved: prompt-major)."""
    _, model = llama
    ids, mask = _prompts()
    one = generate(model, ids, mask, SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=()))
    three = generate(model, ids, mask, SamplingParams(max_new_tokens=NEW, greedy=True, n=3, eos_token_ids=()))
    np.testing.assert_array_equal(np.asarray(three.responses), np.repeat(np.asarray(one.responses), 3, axis=0))


def test_sharded_equals_unsharded(llama):
    """(dp=4, tp=2) mesh: the same greedy tokens; each dp group runs its own replica (prompts,
    slots and page pool split over dp) with the pools split over kv heads (tp) inside the
    program, so no device ever holds another replica's pages or all kv heads."""
    _, model = llama
    ids, mask = _prompts()
    want = generate(model, ids, mask, GREEDY)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, GENERATE_RULES, mesh))
    out = generate_from_state(graphdef, state, ids, mask, GREEDY, mesh=mesh, options=EngineOptions(return_cache=True))
    np.testing.assert_array_equal(np.asarray(out.responses), np.asarray(want.responses))
    np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(want.log_probs), atol=1e-4)
    assert out.responses.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("dp", None)), 2)

    cfg = model.cfg
    pages, T, N, K = out.stats["pages_per_replica"], DEFAULT_PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim
    shape = engine_shape(cfg, len(ids), ids.shape[1], NEW, replicas=4)
    assert shape.prompts == 1 and pages <= shape.worst_case_pages
    assert out.stats["replicas"] == 4
    pool_spec = NamedSharding(mesh, PartitionSpec("dp", None, "tp", None, None, None))
    for pool in out.cache:
        assert pool.shape == (4, cfg.num_layers, N, pages, T, K)
        assert pool.sharding.is_equivalent_to(pool_spec, 6)
        assert {s.data.shape for s in pool.addressable_shards} == {(1, cfg.num_layers, 1, pages, T, K)}
    # In the compiled program every pool buffer is a per-device shard: 1 replica, 1 kv head.
    hlo = (
        lower_generate(graphdef, state, ids, mask, GREEDY, mesh=mesh, options=EngineOptions(return_cache=True))
        .compile()
        .as_text()
    )
    heads = re.findall(rf"f32\[((?:\d+,)*)(\d+),{pages},{T},{K}\]", hlo)
    assert heads and {h for _, h in heads} == {"1"}
    assert all(set(lead.strip(",").split(",")) <= {"1", str(cfg.num_layers), ""} for lead, _ in heads)


def test_scan_layers_matches_unrolled(llama, tmp_path):
    hf, model = llama
    hf.save_pretrained(tmp_path)
    scanned = from_pretrained(tmp_path, dtype=jnp.float32, scan_layers=True)
    ids, mask = _prompts()
    np.testing.assert_array_equal(
        np.asarray(generate(scanned, ids, mask, GREEDY).responses),
        np.asarray(generate(model, ids, mask, GREEDY).responses),
    )


def test_no_recompilation(llama, sampled):
    """Repeated calls with one configuration trace and compile nothing; neither does another
    prompt batch of the same bucket, another seed / temperature / top-p, nor (no retrace)
    another max_new_tokens within the response bucket."""
    _, model = llama
    ids, mask, _ = sampled  # the `sampled` fixture already compiled this program
    with CompileEvents("_generate_program") as events:
        generate(model, ids, mask, SAMPLED, options=LOGITS)
        generate(model, ids, mask, SAMPLED, options=LOGITS)
        ids2, mask2 = _prompts(lengths=(11, 3, 9, 1), seed=5)  # same bucket: 4 rows, <= 16 tokens
        other = dataclasses.replace(SAMPLED, seed=9, temperature=1.2, top_p=0.8)
        out = generate(model, ids2, mask2, other, options=LOGITS)
        out.responses.block_until_ready()
        assert events.compiles == 0
        generate(model, ids, mask, dataclasses.replace(SAMPLED, max_new_tokens=33), options=LOGITS)
    assert events.traces == 0


def test_bucket_padding_rows_are_dropped(llama):
    """3 prompts run in a 4-row bucket (dp = 4): outputs have 3 rows, equal to the same
    prompts' rows in a 4-prompt batch."""
    _, model = llama
    ids, mask = _prompts()
    full = generate(model, ids, mask, GREEDY)
    part = generate(model, ids[:3], mask[:3], GREEDY)
    assert part.responses.shape == (3, NEW)
    np.testing.assert_array_equal(np.asarray(part.responses), np.asarray(full.responses)[:3])


def test_bucket_size():
    assert [bucket_size(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert [bucket_size(n, multiple=4) for n in (1, 4, 5, 9)] == [4, 4, 8, 16]
    assert [bucket_size(n, multiple=3) for n in (1, 4, 7)] == [3, 6, 12]
    assert bucket_size(5, minimum=16) == 16


def test_rejects_right_padded_prompts(llama):
    _, model = llama
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids[:, ::-1], mask[:, ::-1], GREEDY)
