"""Partial rollouts (jaxflow.sampling.partial, issue 23 item 3): a rollout interrupted by
weight syncs and resumed under the same weights samples the uninterrupted rollout's tokens
(EOS ids, stop strings and per-row limits before, across and after the interrupts); resumed
under new weights it keeps its first segment, records each token's policy version and continues
as HF transformers' greedy decoding of prompt + prefix under the new weights; the actor's
entry points give `generate`'s rows plus ``token_versions``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.mesh import MeshSpec
from jaxflow.models import from_pretrained
from jaxflow.sampling import (
    SamplingParams,
    generate_from_state,
    resume_partial,
    run_partial,
    start_partial,
    swap_weights,
)
from jaxflow.workers import ActorWorker, RolloutConfig
from tests.hf_reference import random_hf_model

VOCAB = 100  # the character tokenizer's ids
PAD = 0
NEW = 24
LENGTHS = (3, 9, 14, 6)
K = 6  # the first interrupt: after K tokens per row
# Read off the free-running rows of the seed-3 model at seed 1 (the test asserts what they do):
# EOS 69 ends row 2 at 3 tokens (before the first interrupt) and row 6 at 19 (after the
# second); "Hl" and "@\\" are rows 3 and 7's tokens 5 and 6, completed across the first interrupt.
EOS = (69,)
STOPS = ("Hl", "@\\")
LIMITS = np.array([NEW, NEW, 5, NEW], np.int32)  # prompt 2's rows end at their limit before the interrupt
# Re-prefilled keys and values vs the decode steps' (a model without batch_invariant): the
# log-probs of the tokens after an interrupt within this many float32 ulps of their magnitude
# (measured: at most 37 over seeds 1-3 and interrupts after 1, 6 and 13 tokens).
ULPS = 64


def _random_llama(tmp_path_factory, seed: int):
    hf = random_hf_model(
        "llama",
        seed=seed,
        std=0.3,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    path = tmp_path_factory.mktemp(f"llama_partial_{seed}")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Two random llamas of one architecture (the weights before and after a sync): (HF, path)."""
    return _random_llama(tmp_path_factory, 3), _random_llama(tmp_path_factory, 4)


def _prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.full((len(lengths), width), PAD, np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(4, VOCAB, size=n)
        mask[i, width - n :] = 1
    return ids, mask


def _versions(lengths, segments):
    """The expected token versions [N, NEW]: ``segments`` is [(end column, version), ...]; padding
    holds the row's last token's version."""
    want = np.zeros((len(lengths), NEW), np.int32)
    for r, length in enumerate(lengths):
        start = 0
        for end, version in segments:
            want[r, start:end] = version
            start = end
        want[r, length:] = want[r, length - 1]
    return want


def test_interrupted_and_resumed_under_the_same_weights_is_the_uninterrupted_rollout(llamas):
    """n = 2 samples of 4 prompts, sampled at T = 1 with an EOS id, two stop strings and per-prompt
    limits, interrupted after 6 tokens, run in segments of 7 until a sync after two of them, then
    to the end, the (same) weights synced at each interrupt under a new version: the uninterrupted
    rollout's tokens and lengths; the first segment's log-probs bit for bit (the same program),
    the later ones within `ULPS` float32 ulps (re-prefill vs cached decode). Rows that ended
    before an interrupt (EOS, limit) are never run again; a stop string completed across the
    interrupt ends its row as without it. Versions: 0 for tokens [0, 6), 1 for [6, 20), 2 after."""
    (_, path), _ = llamas
    graphdef, state = nnx.split(from_pretrained(path, dtype=jnp.float32))
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=EOS, stop=STOPS, seed=1)
    kw = dict(max_new_tokens=LIMITS, tokenizer=CharTokenizer())
    full = generate_from_state(graphdef, state, ids, mask, params, **kw)
    lengths = np.asarray(full.lengths)
    assert lengths.tolist() == [NEW, NEW, 3, 7, 5, 5, 19, 7]  # the cases the constants above were read for

    p = run_partial(start_partial(graphdef, state, ids, mask, params, version=0, **kw), max_steps=K)
    first = p.output()
    assert p.lengths_N.tolist() == [K, K, 3, K, 5, 5, K, K] and p.done_N.tolist() == [0, 0, 1, 0, 1, 1, 0, 0]
    np.testing.assert_array_equal(first.responses, np.where(first.response_mask == 1, full.responses, PAD))
    np.testing.assert_array_equal(first.log_probs, np.where(first.response_mask == 1, full.log_probs, 0.0))
    asked = []
    p = run_partial(swap_weights(p, state, 1), max_steps=7, until=lambda: asked.append(1) or len(asked) > 2)
    assert p.segments == 3 and p.lengths_N.tolist() == [20, 20, 3, 7, 5, 5, 19, 7] and not p.done
    p = resume_partial(p, state, 2)
    assert p.done and p.segments == 4
    out = p.output()
    np.testing.assert_array_equal(out.lengths, lengths)
    np.testing.assert_array_equal(out.responses, np.asarray(full.responses))
    np.testing.assert_array_equal(out.response_mask, np.asarray(full.response_mask))
    np.testing.assert_allclose(out.log_probs, np.asarray(full.log_probs), rtol=ULPS * 2.0**-23, atol=0)
    np.testing.assert_array_equal(out.token_versions, _versions(lengths, [(K, 0), (20, 1), (NEW, 2)]))
    assert run_partial(p) is p  # nothing left to run


def _hf_greedy(hf, ids, mask, new):
    """HF's greedy tokens [B, new] and their log-softmax."""
    out = hf.generate(
        torch.tensor(ids, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=PAD,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, ids.shape[1] :].numpy()
    logp = torch.log_softmax(torch.stack(out.scores, dim=1), -1).numpy()
    return tokens, np.take_along_axis(logp, tokens[..., None], -1)[..., 0]


def test_resumed_under_new_weights_continues_with_them(llamas):
    """Greedy rows interrupted after 5 tokens under the weights of version 3 and resumed under
    other weights (version 4): the first 5 tokens and log-probs stay as the first segment gave
    them (= HF's greedy decoding with the old weights), the rest is HF's greedy continuation of
    prompt + those 5 tokens with the new weights (log-probs to 1e-4, as the engine's HF parity
    tests); versions [3] * 5 + [4] * 19. Prompt 1's row, limited to 3 tokens, ended before the
    interrupt: untouched, all version 3."""
    (hf_old, old_path), (hf_new, new_path) = llamas
    graphdef, old = nnx.split(from_pretrained(old_path, dtype=jnp.float32))
    _, new = nnx.split(from_pretrained(new_path, dtype=jnp.float32))
    ids, mask = _prompts()
    limits, k = np.array([NEW, 3, NEW, NEW], np.int32), 5
    params = SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=())
    p = run_partial(start_partial(graphdef, old, ids, mask, params, version=3, max_new_tokens=limits), max_steps=k)
    first = p.output()
    want_old, logp_old = _hf_greedy(hf_old, ids, mask, k)
    np.testing.assert_array_equal(first.lengths, [k, 3, k, k])
    np.testing.assert_array_equal(
        first.responses[:, :k][first.response_mask[:, :k] == 1], want_old[:, :k][first.response_mask[:, :k] == 1]
    )
    out = resume_partial(p, new, 4).output()
    np.testing.assert_array_equal(out.responses[:, :k], first.responses[:, :k])
    np.testing.assert_array_equal(out.log_probs[:, :k], first.log_probs[:, :k])
    np.testing.assert_allclose(out.log_probs[:, :k], np.where(first.response_mask[:, :k] == 1, logp_old, 0), atol=1e-4)
    np.testing.assert_array_equal(out.lengths, limits)
    np.testing.assert_array_equal(out.token_versions[1], np.full(NEW, 3))
    rows = [0, 2, 3]
    np.testing.assert_array_equal(out.token_versions[rows], _versions(limits[rows], [(k, 3), (NEW, 4)]))
    continued_ids = np.concatenate([ids[rows], out.responses[rows, :k]], axis=1)
    continued_mask = np.concatenate([mask[rows], np.ones((len(rows), k), np.int32)], axis=1)
    want_new, logp_new = _hf_greedy(hf_new, continued_ids, continued_mask, NEW - k)
    np.testing.assert_array_equal(out.responses[rows, k:], want_new)
    np.testing.assert_allclose(out.log_probs[rows, k:], logp_new, atol=1e-4)
    with pytest.raises(ValueError, match="versions only grow"):
        swap_weights(p, new, 2)
    with pytest.raises(ValueError, match="holds no weights"):
        run_partial(dataclasses.replace(p, weights=None))
    with pytest.raises(ValueError, match="with n = 1"):
        generate_from_state(graphdef, old, ids, mask, dataclasses.replace(params, n=2), generated=np.ones(4, np.int32))


def test_actor_partial_rollout_is_generate_with_token_versions(llamas):
    """`ActorWorker.start_partial` / `run_partial` / `finish_partial` (batch-invariant model, so
    re-prefilled keys and values equal the decode steps' bit for bit): interrupted after 6
    tokens (version 7) and resumed after a sync of the same weights (version 8), the rows are
    `generate`'s for the same step, bit for bit, uids included, plus ``token_versions``."""
    (_, path), _ = llamas
    model = from_pretrained(path, dtype=jnp.float32, batch_invariant=True)
    sampling = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=EOS, seed=5)
    actor = ActorWorker(
        nnx.split(model), MeshSpec().build(jax.devices()[:1]), "train", rollout=RolloutConfig(train=sampling)
    )
    ids, mask = _prompts()
    prompts = Batch.from_dict({"prompt_ids": ids, "prompt_mask": mask, "max_new_tokens": LIMITS})
    want = actor.generate(prompts, step=2)
    partial = actor.run_partial(actor.start_partial(prompts, step=2, version=7), 7, max_steps=K)
    assert not partial.done and partial.version == 7 and partial.rollout.weights is None
    with pytest.raises(ValueError, match="not finished"):
        actor.finish_partial(partial)
    got = actor.finish_partial(actor.run_partial(partial, 8))
    for key in ("prompt_ids", "responses", "response_mask", "rollout_log_probs"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)
    assert list(got.non_tensors["uid"]) == list(want.non_tensors["uid"]) and got.meta == want.meta
    lengths = np.asarray(want["response_mask"]).sum(1)
    assert (lengths > K).any() and (lengths < K).any()
    versions = np.asarray(got["token_versions"])
    assert versions.dtype == np.int32
    np.testing.assert_array_equal(versions, _versions(lengths, [(K, 7), (NEW, 8)]))
