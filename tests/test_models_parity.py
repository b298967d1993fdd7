"""Logits parity with HF transformers (PyTorch CPU) and checkpoint round trips."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxflow.models as models
from tests.hf_reference import forward, hf_logits, padded_batch, random_hf_model

LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)

CASES = {
    "qwen2_tied_bias": ("qwen2", dict(tie_word_embeddings=True)),
    "llama3_rope_scaling": ("llama", dict(rope_theta=5e5, rope_scaling=LLAMA3_ROPE)),
    "qwen3_qk_norm": ("qwen3", dict(head_dim=16)),
    "llama_mqa_one_kv_head": ("llama", dict(num_key_value_heads=1)),
    "llama_gqa_several_kv_heads": ("llama", dict(num_attention_heads=8, num_key_value_heads=4)),
    "mistral": ("mistral", dict()),
}


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory):
    """Each case's HF model saved once with transformers' save_pretrained."""
    out = {}
    for name, (family, config) in CASES.items():
        model = random_hf_model(family, **config)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_with_mixed_left_padding(saved_hf, case):
    hf_model, path = saved_hf[case]
    model = models.from_pretrained(path)
    ids, mask = padded_batch(hf_model.config.vocab_size, [11, 7, 3, 11], total=11, seed=1)
    ours = np.asarray(forward(model, ids, mask))
    ref = hf_logits(hf_model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= 1e-4
    # The config flags really took effect (not silently ignored).
    family, config = CASES[case]
    assert model.cfg.tie_word_embeddings == config.get("tie_word_embeddings", family == "qwen3" and False)
    if case == "llama3_rope_scaling":
        assert model.cfg.rope_scaling.rope_type == "llama3" and model.cfg.rope_theta == 5e5


def test_padded_row_equals_unpadded_row(saved_hf):
    _, path = saved_hf["llama3_rope_scaling"]
    model = models.from_pretrained(path)
    ids, mask = padded_batch(model.cfg.vocab_size, [6], total=6, seed=3)
    lone = np.asarray(forward(model, ids, mask))[0]
    # One batch [2, 9]: the row left-padded by 3, then right-padded by 3.
    pad = np.zeros((1, 3), ids.dtype)
    padded = np.concatenate([np.concatenate([pad, ids], 1), np.concatenate([ids, pad], 1)])
    padded_mask = np.concatenate([np.concatenate([pad, mask], 1), np.concatenate([mask, pad], 1)])
    out = np.asarray(forward(model, padded, padded_mask))
    left_out, right_out = out[0, 3:], out[1, :6]
    np.testing.assert_allclose(left_out, lone, atol=1e-5)
    np.testing.assert_allclose(right_out, lone, atol=1e-5)


def test_transformers_reads_what_jaxflow_writes(tmp_path):
    """jaxflow -> save_pretrained -> transformers -> same logits."""
    for preset in ("tiny_llama", "tiny_qwen2", "tiny_qwen3"):
        model = models.init_model(models.get_preset(preset), seed=3)
        path = tmp_path / preset
        models.save_pretrained(model, path)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        ids, mask = padded_batch(model.cfg.vocab_size, [9, 4], total=9, seed=2)
        ours = np.asarray(forward(model, ids, mask))
        ref = hf_logits(hf_model, ids, mask)
        assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-5, preset


def test_sharded_checkpoint_with_index_round_trips(tmp_path):
    model = models.init_model(models.get_preset("tiny_llama"), seed=4)
    models.save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    again = models.from_pretrained(tmp_path)
    # [2, 9]: the shape test_transformers_reads_what_jaxflow_writes compiles tiny_llama's forward for.
    ids, mask = padded_batch(model.cfg.vocab_size, [5, 9], total=9, seed=5)
    ours = np.asarray(forward(model, ids, mask))
    assert np.abs(ours - hf_logits(hf_model, ids, mask))[mask.astype(bool)].max() <= 1e-5
    np.testing.assert_array_equal(np.asarray(forward(again, ids, mask)), ours)


def test_value_head_round_trips_as_token_classification(tmp_path):
    actor = models.init_model(models.get_preset("tiny_llama"), seed=5)
    models.save_pretrained(actor, tmp_path / "actor")
    # A critic initialised from an actor checkpoint: same trunk, zero value head.
    critic = models.from_pretrained(tmp_path / "actor", head="value")
    ids, mask = padded_batch(actor.cfg.vocab_size, [7, 3], total=7, seed=6)
    np.testing.assert_array_equal(np.asarray(forward(critic, ids, mask)), 0.0)
    np.testing.assert_array_equal(
        np.asarray(critic.model.embed_tokens.get_value()), np.asarray(actor.model.embed_tokens.get_value())
    )
    critic = models.init_model(models.get_preset("tiny_llama"), head="value", seed=6)
    critic.score[...] = jax.random.normal(jax.random.key(0), critic.score.get_value().shape) * 0.1
    critic.score_bias[...] = jnp.array([0.3])
    models.save_pretrained(critic, tmp_path / "critic")
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        tmp_path / "critic", attn_implementation="eager"
    ).eval()
    ref = hf_logits(hf, ids, mask)[..., 0]
    ours = np.asarray(forward(critic, ids, mask))
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-5


def test_reward_model_matches_sequence_classification(tmp_path):
    hf = random_hf_model("llama", head=transformers.LlamaForSequenceClassification, num_labels=1, pad_token_id=0)
    hf.save_pretrained(tmp_path)
    rm = models.from_pretrained(tmp_path, head="reward")
    # Right-padded rows: HF reads the last non-pad token, we read the last masked-in token.
    ids, mask = padded_batch(hf.config.vocab_size, [8, 5, 2], total=8, seed=7, left=False)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[:, 0].numpy()
    ours = np.asarray(forward(rm, ids, mask))
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_bf16_parameters_and_compute(saved_hf):
    hf_model, path = saved_hf["qwen2_tied_bias"]
    model = models.from_pretrained(path, dtype=jnp.bfloat16)
    assert {v.dtype for v in jax.tree.leaves(jax.tree.map(lambda x: x, model))} <= {jnp.dtype(jnp.bfloat16)}
    ids, mask = padded_batch(hf_model.config.vocab_size, [8, 5], total=8, seed=8)
    ours = np.asarray(forward(model, ids, mask))
    assert ours.dtype == np.float32
    ref = hf_logits(hf_model, ids, mask)
    # bf16 has ~3 significant digits: compare against fp32 at bf16 precision.
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 0.05 * np.abs(ref).max()
