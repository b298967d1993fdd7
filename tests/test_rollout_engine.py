"""The rollout engine's paged cache and continuous batching: paged attention == dense attention
(NumPy), the pallas kernels' paths == the pure-JAX one on the same pages (the GPU kernel in
interpret mode, the TPU kernel's layout and arguments through its reference), slot reuse (a
finished row's slot produces HF's sequence), a pool smaller than the worst case (rows wait for
pages) == an unconstrained one, prefix sharing (n samples == n separate prompts under the same
keys, with fewer pages at the peak), per-row limits, stop strings matched on the device (==
decoding the prefixes), and no recompilation across calls with different length mixes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    dynamic_validate_inputs,
    ref_ragged_paged_attention,
)
from jax.sharding import Mesh

from jaxflow.configs import describe_run, load_config
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.tokenizer import Tokenizer
from jaxflow.mesh import GENERATE_RULES, MeshSpec, state_shardings
from jaxflow.models import from_pretrained
from jaxflow.sampling import (
    EngineOptions,
    PoolLayout,
    SamplingParams,
    StopStrings,
    engine_shape,
    generate,
    generate_from_state,
    lower_generate,
    paged_attention,
    sample_tokens,
)
from jaxflow.sampling.logits_processing import argmax
from jaxflow.sampling.paged import GPU_THREAD_BLOCKS, gpu_partition, ragged_arguments, slot_address
from jaxflow.workers import ActorWorker
from tests.compile_events import CompileEvents
from tests.hf_reference import random_hf_model

VOCAB = 100  # the character tokenizer's ids
PAD = 0
NEW = 24
LENGTHS = (3, 9, 14, 6, 5, 1)


def _random_llama(tmp_path_factory, num_layers: int):
    """A random HF llama (std 0.3: logits far from flat) of ``num_layers`` layers and its
    jaxflow twin."""
    hf = random_hf_model(
        "llama",
        seed=3,
        std=0.3,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    path = tmp_path_factory.mktemp(f"llama_paged_{num_layers}")
    hf.save_pretrained(path)
    return hf, from_pretrained(path, dtype=jnp.float32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One layer: every engine claim here holds at any depth, and each layer compiles separately."""
    return _random_llama(tmp_path_factory, num_layers=1)


@pytest.fixture(scope="module")
def llama_two_layers(tmp_path_factory):
    """Two layers, for the worker test whose stop strings and ids are read off this model's
    free-running rows (the one-layer model's row 1 decodes to at most 4 characters, too few
    for the stop string read off its characters 4:6)."""
    return _random_llama(tmp_path_factory, num_layers=2)


def _prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.full((len(lengths), width), PAD, np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(4, VOCAB, size=n)
        mask[i, width - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def hf_greedy(llama):
    """HF's greedy tokens [B, NEW] and their log-probs for `_prompts()`, computed once."""
    hf, _ = llama
    return _hf_greedy(hf, *_prompts())


def _hf_greedy(hf, ids, mask):
    """HF's greedy tokens [B, NEW] and their log-softmax."""
    out = hf.generate(
        torch.tensor(ids, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        do_sample=False,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        pad_token_id=PAD,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, ids.shape[1] :].numpy()
    logp = torch.log_softmax(torch.stack(out.scores, dim=1), -1).numpy()
    return tokens, np.take_along_axis(logp, tokens[..., None], -1)[..., 0]


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
    attend = jax.jit(paged_attention, static_argnames=("sliding_window", "pages_per_block"))  # not op by op
    for window in (None, 5):
        got = np.asarray(attend(q, k_pages, v_pages, table, positions, sliding_window=window, pages_per_block=2))
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


def test_kernel_paths_equal_pure_jax():
    """The same pages and queries through each layout's write and attention: the GPU pallas
    kernel (interpret mode on CPU) on decode queries, and the TPU layout (interleaved k/v
    heads) with `ragged_arguments` through the ragged kernel's own reference (the kernel
    itself needs a TPU), for decode and for a prefill chunk, equal the pure-JAX attention."""
    rng = np.random.default_rng(1)
    N, G, K, T, M, B = 2, 3, 16, 4, 6, 3
    pages = 1 + B * M
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(N, pages, T, K)), jnp.float32) for _ in range(2))
    table = (1 + rng.permutation(B * M)).reshape(B, M).astype(np.int32)
    decode = np.array([[7], [20], [-1]], np.int32)
    chunk = np.array([[8, 9, 10, -1], [0, 1, 2, 3], [-1, -1, -1, -1]], np.int32)
    for positions in (decode, chunk):
        L = positions.shape[1]
        q = rng.normal(size=(B, L, N * G, K)).astype(np.float32)
        k_new, v_new = (rng.normal(size=(B, L, N, K)).astype(np.float32) for _ in range(2))
        page, offset = jax.jit(slot_address, static_argnums=2)(table, positions, T)
        pool = jax.jit(PoolLayout("jax").write)((k_pages, v_pages), page, offset, k_new, v_new)
        want = np.asarray(jax.jit(paged_attention)(q, *pool, table, positions))
        real = positions >= 0
        tpu = PoolLayout("tpu")
        kv_pool = jax.jit(lambda k, v, *new: tpu.write(tpu.from_heads_major(k, v), *new))(
            k_pages, v_pages, page, offset, k_new, v_new
        )
        for got_pool, want_pool in zip(jax.jit(tpu.to_heads_major)(kv_pool), pool):
            np.testing.assert_array_equal(np.asarray(got_pool), np.asarray(want_pool))
        args = [np.asarray(a) for a in jax.jit(ragged_arguments)(table, positions)]
        flat_q = q.reshape(B * L, N * G, K)
        dynamic_validate_inputs(flat_q, kv_pool, *args, sm_scale=K**-0.5)
        # the reference loops over the sequences in Python: jitted with its int arguments fixed
        got = jax.jit(lambda q, kv, args=args: ref_ragged_paged_attention(q, kv, *args, sm_scale=K**-0.5))(
            flat_q, kv_pool
        )
        np.testing.assert_allclose(np.asarray(got).reshape(q.shape)[real], want[real], atol=1e-5)
        for pages_per_block in (8, 1) if L == 1 else ():  # the table padded from 6 to 8 pages in 4 splits
            gpu = jax.jit(
                lambda q, pool, positions, pb=pages_per_block: PoolLayout("gpu", interpret=True).attend(
                    q, pool, table, positions, sliding_window=None, pages_per_block=pb
                )
            )(q, pool, positions)
            np.testing.assert_allclose(np.asarray(gpu), want, atol=1e-5)


def test_gpu_partition_fills_the_gpu_with_the_widest_blocks():
    """The GPU kernel's table split: one split when rows x kv heads fill `GPU_THREAD_BLOCKS`
    (256 rows x 2 heads: each block reads 8 pages per iteration), more splits for few rows;
    the padded table holds the splits' whole compute blocks and every page of the table."""
    assert gpu_partition(24, 256, 2, 8) == (1, 8, 24)
    assert gpu_partition(25, 256, 2, 8) == (1, 8, 32)
    assert gpu_partition(24, 8, 2, 8) == (16, 2, 32)  # 8 x 2 x 16 = 256 blocks: no split of under one page
    for pages in range(1, 40):
        for rows in (1, 3, 64, 300):
            splits, per_block, padded = gpu_partition(pages, rows, 2, 4)
            assert padded >= pages and padded % (splits * per_block) == 0 and 1 <= per_block <= 4
            assert splits <= pages and (rows * 2 * splits >= GPU_THREAD_BLOCKS or 2 * splits > pages)


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


def test_slot_reuse_matches_hf(llama, hf_greedy):
    """6 rows with their own limits through 2 decode slots: every row that takes a freed slot
    produces HF's greedy tokens, cut at its limit; the same with a slot per row, and with a
    slot per row in a page pool far below the worst case, where rows wait for pages
    (measured waits > 0)."""
    _, model = llama
    ids, mask = _prompts()
    want, _ = hf_greedy
    limits = np.array([5, NEW, 9, 17, 3, 11])
    params = SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=())
    worst = engine_shape(model.cfg, len(ids), ids.shape[1], NEW, slots=6, page_size=4).worst_case_pages
    for slots, kv_tokens in ((2, None), (6, None), (6, 4 * 44)):
        out = generate(
            model,
            ids,
            mask,
            params,
            max_new_tokens=limits,
            options=EngineOptions(slots=slots, page_size=4, kv_tokens=kv_tokens),
        )
        assert out.stats["slots"] == slots
        np.testing.assert_array_equal(np.asarray(out.lengths), limits)
        tokens, m = np.asarray(out.responses), np.asarray(out.response_mask)
        assert tokens.shape == (6, NEW)
        np.testing.assert_array_equal(m, np.arange(NEW)[None] < limits[:, None])
        np.testing.assert_array_equal(np.where(m == 1, tokens, PAD), np.where(m == 1, want, PAD))
        np.testing.assert_array_equal(tokens[m == 0], PAD)
        pages, peak, waits = out.stats["pages_per_replica"], int(out.stats["peak_pages"][0]), int(out.stats["waits"][0])
        assert 0 < peak <= pages - 1
        if slots == 2:  # the 69 tokens take at least 69 / 2 steps
            assert int(out.num_steps) >= limits.sum() / 2 and waits == 0
        if kv_tokens:
            assert pages == 45 < worst and waits > 0


def test_gpu_kernel_in_the_engine(llama, hf_greedy):
    """The engine with the GPU pallas kernel (interpret mode on CPU) on a (dp=4, tp=2) mesh,
    the kernel run per kv-head shard under shard_map: HF's greedy tokens and log-probs. The
    6 prompts leave the last replica without rows, so the replicas' decode loops run
    different step counts: nothing inside the loop may need devices of another replica
    (XLA:CPU would hang on a collective-permute, which rendezvouses every device)."""
    _, model = llama
    ids, mask = _prompts()
    want, want_logp = hf_greedy
    params = SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=())
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, GENERATE_RULES, mesh))
    out = generate_from_state(graphdef, state, ids, mask, params, mesh=mesh, options=EngineOptions(attention="gpu"))
    assert out.stats["attention"] == "gpu"
    np.testing.assert_array_equal(np.asarray(out.responses), want)
    np.testing.assert_allclose(np.asarray(out.log_probs), want_logp, atol=1e-4)
    with pytest.raises(ValueError, match="runs on TPU only"):
        generate(model, ids, mask, params, options=EngineOptions(attention="tpu"))


def test_head_dim_split_over_tp_stays_inside_each_replica(llama, hf_greedy):
    """The k/v feature dimension split over tp (the *_KV_HEAD_DIM rules, for GQA models whose
    kv-head count does not divide the weight-parallel degree) puts RoPE's pairs (i, i + K/2)
    on two devices. The compiled rollout has no collective-permute: XLA:CPU rendezvouses
    every device of the program for one, so replicas whose decode loops run different step
    counts hang (seen: `ppo_tiny`, colocated, 8 devices, at step 3). On a (dp=4, tp=2) mesh
    whose replicas run different step counts, HF's greedy tokens."""
    _, model = llama
    rules = tuple(
        (name, None if name == "kv_heads" else "tp" if name == "head_dim" else axes) for name, axes in GENERATE_RULES
    )
    ids, mask = _prompts()
    want, _ = hf_greedy
    limits = np.array([5, NEW, 9, 17, 3, 11])
    params = SamplingParams(max_new_tokens=NEW, greedy=True, eos_token_ids=())
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, rules, mesh))
    assert state["model"]["layers"][0]["self_attn"]["k_proj"][...].sharding.spec[-1] == "tp"  # head_dim split
    hlo = lower_generate(graphdef, state, ids, mask, params, mesh=mesh, rules=rules, max_new_tokens=limits)
    hlo = hlo.compile().as_text()
    assert "all-gather" in hlo and "collective-permute" not in hlo
    out = generate_from_state(graphdef, state, ids, mask, params, mesh=mesh, rules=rules, max_new_tokens=limits)
    tokens, m = np.asarray(out.responses), np.asarray(out.response_mask)
    np.testing.assert_array_equal(m, np.arange(NEW)[None] < limits[:, None])
    np.testing.assert_array_equal(np.where(m == 1, tokens, PAD), np.where(m == 1, want, PAD))


def test_small_pool_equals_unconstrained(llama):
    """A sampled rollout (top-p, EOS ids, n = 2, per-row limits) through a page pool far below
    the worst case (rows wait for pages: the measured waits are > 0) gives exactly the
    tokens, lengths and log-probs of the worst-case pool (where nobody waits) under the same
    keys (the greedy case: `test_slot_reuse_matches_hf`). The default pool of a rollout with
    EOS ids is below the worst case too."""
    _, model = llama
    ids, mask = _prompts()
    limits = np.array([5, NEW, 9, 17, 3, 11, NEW, 2, 20, 14, 8, NEW])
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.9, n=2, eos_token_ids=(7, 11), seed=4)
    shape = engine_shape(model.cfg, len(ids), ids.shape[1], NEW, n=2, slots=6, page_size=4)
    big = generate(
        model,
        ids,
        mask,
        params,
        max_new_tokens=limits,
        options=EngineOptions(slots=6, page_size=4, kv_tokens=shape.worst_case_pages * 4),
    )
    small = generate(
        model, ids, mask, params, max_new_tokens=limits, options=EngineOptions(slots=6, page_size=4, kv_tokens=4 * 44)
    )
    assert big.stats["pages_per_replica"] == shape.worst_case_pages and int(big.stats["waits"][0]) == 0
    assert small.stats["pages_per_replica"] == 45 < shape.worst_case_pages
    assert int(small.stats["waits"][0]) > 0 and int(small.stats["peak_pages"][0]) <= 44
    for name in ("responses", "lengths", "response_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(small, name)), np.asarray(getattr(big, name)))
    np.testing.assert_allclose(np.asarray(small.log_probs), np.asarray(big.log_probs), atol=1e-5)
    default = engine_shape(model.cfg, 64, 16, 512, n=8)
    assert default.pages < default.worst_case_pages / 3
    with pytest.raises(ValueError, match="kv_tokens=40 is below the smallest pool"):
        generate(model, ids, mask, params, options=EngineOptions(slots=6, page_size=4, kv_tokens=40))


def test_prefix_sharing_equals_separate_prompts(llama):
    """n = 4 sampled responses per prompt (the prompt prefilled once, its pages shared, page
    size 4 so that prompts end inside a shared page) equal the responses of the prompts
    repeated 4 times with n = 1: same rows, same keys, same tokens and log-probs. With the
    same slots, sharing holds fewer pages at the peak (measured)."""
    _, model = llama
    ids, mask = _prompts(seed=1)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, n=4, eos_token_ids=(7, 11), seed=5)
    kw = dict(options=EngineOptions(slots=8, page_size=4, kv_tokens=4 * 1000))  # more than the worst case: nobody waits
    shared = generate(model, ids, mask, params, **kw)
    separate = generate(
        model,
        np.repeat(ids, 4, 0),
        np.repeat(mask, 4, 0),
        SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, eos_token_ids=(7, 11), seed=5),
        **kw,
    )
    np.testing.assert_array_equal(np.asarray(shared.responses), np.asarray(separate.responses))
    np.testing.assert_array_equal(np.asarray(shared.lengths), np.asarray(separate.lengths))
    np.testing.assert_allclose(np.asarray(shared.log_probs), np.asarray(separate.log_probs), atol=1e-5)
    tokens = np.asarray(shared.responses)
    assert sum((tokens[4 * i] != tokens[4 * i + 1]).any() for i in range(len(ids))) >= 4  # real draws
    assert int(shared.stats["waits"][0]) == int(separate.stats["waits"][0]) == 0
    # 8 slots hold the samples of 2 prompts (shared) or 8 copies of prompts (separate), whose
    # prompt pages (up to 4 of 4 tokens) are held once per copy
    assert int(shared.stats["peak_pages"][0]) + 8 <= int(separate.stats["peak_pages"][0])


def test_per_row_limits_and_bad_limits(llama):
    _, model = llama
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(), seed=1)
    per_prompt = np.array([1, 2, 3, 4, 5, 6])
    out = generate(model, ids, mask, params, max_new_tokens=per_prompt, options=EngineOptions(slots=3))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.repeat(per_prompt, 2))
    assert out.responses.shape == (12, NEW)
    full = generate(
        model, ids, mask, params, options=EngineOptions(slots=3)
    )  # same keys: the limited rows are prefixes
    m = np.asarray(out.response_mask) == 1
    np.testing.assert_array_equal(np.asarray(out.responses)[m], np.asarray(full.responses)[m])
    with pytest.raises(ValueError, match="max_new_tokens must be an int or an integer array"):
        generate(model, ids, mask, params, max_new_tokens=np.ones(5, np.int32))
    with pytest.raises(ValueError, match=">= 1 for every row"):
        generate(model, ids, mask, params, max_new_tokens=np.zeros(12, np.int32))
    with pytest.raises(ValueError, match="<= SamplingParams.max_new_tokens"):
        generate(model, ids, mask, params, max_new_tokens=NEW + 1)


def _reference_stop(tokenizer, tokens, stops):
    """The number of tokens to keep: the first k whose decoded prefix holds a stop string."""
    for k in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode([int(t) for t in tokens[:k]]) for s in stops):
            return k
    return len(tokens)


def test_stop_strings(llama):
    """Rows end on the device after the token that completes a stop string: lengths equal a
    scan over the decoded prefixes of the free-running rows, tokens equal up to there. A cut
    row frees its slot at once: through 3 slots the run takes exactly the steps (and gives
    the tokens) of a run whose per-row limits are those lengths, fewer than the free run."""
    _, model = llama
    tok = CharTokenizer()
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(), seed=2)
    kw = dict(options=EngineOptions(slots=3, kv_tokens=1 << 20))  # the worst-case pool (no waits) whatever the stops
    free = generate(model, ids, mask, params, **kw)
    texts = [tok.decode([int(t) for t in row]) for row in np.asarray(free.responses)]
    stops = tuple(texts[r][r % 5 + 2 : r % 5 + 4] for r in range(0, 12, 2))  # strings that occur mid-response
    out = generate(model, ids, mask, dataclasses.replace(params, stop=stops), tokenizer=tok, **kw)
    lengths = np.asarray(out.lengths)
    for row, full_row in enumerate(np.asarray(free.responses)):
        want = _reference_stop(tok, full_row, stops)
        assert lengths[row] == want
        np.testing.assert_array_equal(np.asarray(out.responses)[row, :want], full_row[:want])
        assert (np.asarray(out.responses)[row, want:] == PAD).all()
        assert (np.asarray(out.response_mask)[row] == (np.arange(NEW) < want)).all()
    assert (lengths[::2] < NEW).all()
    limited = generate(model, ids, mask, params, max_new_tokens=lengths, **kw)
    np.testing.assert_array_equal(np.asarray(limited.responses), np.asarray(out.responses))
    assert int(out.num_steps) == int(limited.num_steps) < int(free.num_steps)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        generate(model, ids, mask, SamplingParams(max_new_tokens=4, stop=("a",)))


def test_worker_generate_with_configured_stops_and_limits(llama_two_layers):
    """Through the run description and the actor worker: ``rollout.stop`` strings,
    ``rollout.stop_token_ids`` and a per-prompt ``max_new_tokens`` column end each row where
    a scan of the free-running row (the same keys, no stops) says: the first of its limit,
    EOS / stop id, or stop string (decoded prefixes)."""
    _, model = llama_two_layers
    tok = CharTokenizer()
    keys = [
        "data.max_response_length=24",
        "actor_rollout_ref.rollout.n=2",
        "jaxflow.placement.type=colocated",
        "actor_rollout_ref.rollout.max_total_tokens=2048",
    ]

    def worker(*overrides):
        spec = describe_run(load_config("grpo_tiny", keys + list(overrides)), tokenizer=tok)
        mesh = MeshSpec(fsdp=2).build(jax.devices()[:2])
        return spec, ActorWorker(nnx.split(model), mesh, "train", rollout=spec.rollout)

    ids, mask = _prompts(LENGTHS[:4])
    spec, free_worker = worker()
    assert spec.rollout.train.stop == () and spec.rollout.tokenizer is None
    free = np.asarray(
        free_worker.generate(Batch.from_dict({"prompt_ids": ids, "prompt_mask": mask}), step=3)["responses"]
    )
    texts = [tok.decode([int(t) for t in row]) for row in free]
    stops, stop_id = (texts[1][4:6], texts[4][7:9]), int(free[6, 10])
    spec, actor = worker(
        f"actor_rollout_ref.rollout.stop={list(stops)!r}", f"actor_rollout_ref.rollout.stop_token_ids=[{stop_id}]"
    )
    assert spec.rollout.train.stop == stops and stop_id in spec.rollout.train.eos_token_ids
    limits = np.array([24, 24, 5, 24], np.int32)
    out = actor.generate(Batch.from_dict({"prompt_ids": ids, "prompt_mask": mask, "max_new_tokens": limits}), step=3)
    tokens, response_mask = np.asarray(out["responses"]), np.asarray(out["response_mask"])
    ends = set(spec.rollout.train.eos_token_ids)
    for row, full in enumerate(free):
        want = min(
            np.repeat(limits, 2)[row],
            _reference_stop(tok, full, stops),
            next((k + 1 for k, t in enumerate(full) if int(t) in ends), len(full)),
        )
        assert response_mask[row].sum() == want, row
        np.testing.assert_array_equal(tokens[row, :want], full[:want])
    assert response_mask[1].sum() < 24 and response_mask[4].sum() < 24 and response_mask[6].sum() <= 11
    assert response_mask[4:6].sum(1).max() <= 5


def _bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE (multi-character tokens) trained on a few words."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    words = ["the", "answer", "is", "</answer>", "<answer>", "foo", "bar", "\n", "42", "and"]
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        [" ".join(rng.choice(words, size=20)) for _ in range(200)],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    return Tokenizer(backend)


def test_stop_tables_match_decoded_text():
    """`StopStrings` tables run over token ids (a NumPy walk of the automaton) stop exactly
    where the decoded prefix first holds a stop string, for a byte-level BPE whose tokens
    span several characters and parts of stop strings, on sequences that contain them."""
    tok = _bpe_tokenizer()
    stops = ("</answer>", "\n\n", "r a", "42")
    tables = StopStrings.build(stops, tok, tok.vocab_size)
    assert tables is StopStrings.build(stops, tok, tok.vocab_size)  # cached
    assert tables.next_state_SxC.shape[1] < tok.vocab_size // 4  # classes, not ids
    rng = np.random.default_rng(1)
    words = ["the", "answer", "is", "</", "answer>", "fo", "o", "bar", "\n", "4", "2", "and", " "]
    stopped = 0
    for _ in range(300):
        ids = tok.encode("".join(rng.choice(words, size=12)), add_special_tokens=False)
        state, keep = 0, len(ids)
        for k, t in enumerate(ids):
            c = tables.token_class_V[t]
            if tables.hit_SxC[state, c]:
                keep = k + 1
                break
            state = tables.next_state_SxC[state, c]
        assert keep == _reference_stop(tok, ids, stops), ids
        stopped += keep < len(ids)
    assert stopped > 40  # 53 of 300 sequences hold a stop string


def test_no_recompilation_across_length_mixes(llama):
    """Calls with different per-row limits and prompt lengths (one bucket) trace and
    compile nothing after the first."""
    _, model = llama
    params = SamplingParams(max_new_tokens=NEW, n=2, eos_token_ids=(9,), seed=0)
    ids, mask = _prompts()
    generate(
        model, ids, mask, params, max_new_tokens=np.full(12, NEW), options=EngineOptions(slots=4)
    ).responses.block_until_ready()
    rng = np.random.default_rng(0)
    with CompileEvents("_generate_program") as events:
        for k in range(3):
            lengths = rng.integers(1, 15, size=6)
            ids, mask = _prompts(tuple(lengths), seed=k)
            limits = rng.integers(1, NEW + 1, size=len(lengths) * 2)
            out = generate(model, ids, mask, params, max_new_tokens=limits, options=EngineOptions(slots=4))
            assert (np.asarray(out.lengths) <= limits).all()
    assert events.compiles == 0 and events.traces == 0
