"""Bad checkpoints give clear errors naming the file and tensor."""

import json
import os

import pytest
from safetensors.numpy import load_file, save_file

import jaxflow.models as models


@pytest.fixture()
def saved(tmp_path):
    model = models.init_model(models.get_preset("tiny_llama"), seed=0)
    models.save_pretrained(model, tmp_path)
    return tmp_path


def test_missing_safetensors_file(saved):
    os.remove(saved / "model.safetensors")
    with pytest.raises(models.CheckpointError, match="no \\*.safetensors files in"):
        models.from_pretrained(saved)


def test_index_naming_a_missing_shard(saved):
    (saved / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(models.CheckpointError, match="model-00002-of-00002.safetensors"):
        models.from_pretrained(saved)


def test_truncated_safetensors_file(saved):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(models.CheckpointError, match=r"model.safetensors: truncated"):
        models.from_pretrained(saved)


def test_unsupported_architecture(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        models.from_pretrained(saved)


def test_tensor_of_the_wrong_shape(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        models.CheckpointError,
        match=r"tensor 'model.layers.0.mlp.(gate|up|down)_proj.weight' in .*model.safetensors "
        r"has shape \((128, 64|64, 128)\); the config implies \((96, 64|64, 96)\)",
    ):
        models.from_pretrained(saved)


def test_missing_tensor(saved):
    arrays = load_file(saved / "model.safetensors")
    del arrays["model.layers.1.self_attn.v_proj.weight"]
    save_file(arrays, saved / "model.safetensors")
    with pytest.raises(models.CheckpointError, match="'model.layers.1.self_attn.v_proj.weight' is missing"):
        models.from_pretrained(saved)


def test_missing_config(saved):
    os.remove(saved / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.from_pretrained(saved)
