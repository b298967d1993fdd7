"""Models on 8 simulated devices: sharded forward == unsharded, parameter specs from the rules,
bytes per device; and the size presets' parameter counts without allocation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxflow.models as models
from jaxflow.mesh import TRAIN_RULES, logical_axes_tree, sharding_rules
from tests.hf_reference import padded_batch


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    # Wide enough that every matrix splits 8 ways (embed 64 / fsdp 4, heads 4 / tp 2 ...).
    model = models.init_model(models.get_preset("tiny_llama"), seed=11)
    path = tmp_path_factory.mktemp("tiny")
    models.save_pretrained(model, path)
    return path


def test_sharded_forward_equals_unsharded_and_specs_follow_rules(tiny_checkpoint):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    ref_model = models.from_pretrained(tiny_checkpoint)
    model = models.from_pretrained(tiny_checkpoint, mesh=mesh, rules=TRAIN_RULES)

    expected = {
        ("model", "embed_tokens"): P("tp", "fsdp"),
        ("model", "layers", 0, "self_attn", "q_proj"): P("fsdp", "tp", None),
        ("model", "layers", 0, "self_attn", "k_proj"): P("fsdp", "tp", None),
        ("model", "layers", 0, "self_attn", "o_proj"): P("tp", None, "fsdp"),
        ("model", "layers", 1, "mlp", "gate_proj"): P("fsdp", "tp"),
        ("model", "layers", 1, "mlp", "down_proj"): P("tp", "fsdp"),
        ("model", "layers", 1, "input_layernorm", "weight"): P(None),
        ("lm_head",): P("fsdp", "tp"),
    }
    state = nnx.state(model)
    flat = {
        tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p): v.get_value()
        for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    }
    for path, spec in expected.items():
        arr = flat[path]
        assert arr.sharding.spec == spec, path
        assert arr.sharding.mesh.devices.size == 8
    # Every parameter's sharding is what the rules give for its logical axes.
    names = jax.tree.leaves(logical_axes_tree(state), is_leaf=lambda x: isinstance(x, tuple))
    from jaxflow.mesh import logical_to_spec

    for axes, arr in zip(names, jax.tree.leaves(state)):
        assert arr.sharding.spec == logical_to_spec(axes, TRAIN_RULES, mesh)
    # The large matrices hold total/8 bytes on each device.
    for path in [("model", "embed_tokens"), ("lm_head",), ("model", "layers", 0, "mlp", "up_proj")]:
        arr = flat[path]
        per_device = {s.data.nbytes for s in arr.addressable_shards}
        assert per_device == {arr.nbytes // 8}, path

    ids, mask = padded_batch(model.cfg.vocab_size, [12, 5, 9, 1, 12, 7, 3, 10], total=12, seed=0)

    @jax.jit
    def forward(m, ids, mask):
        with sharding_rules(TRAIN_RULES, mesh):
            return m(ids, attention_mask=mask)

    sharded = forward(model, ids, mask)
    unsharded = jax.jit(lambda m, i, a: m(i, attention_mask=a))(ref_model, ids, mask)
    assert np.abs(np.asarray(sharded) - np.asarray(unsharded)).max() <= 1e-5
    # Activations followed the rules: logits are split over batch (dp/fsdp) and vocab (tp).
    assert sharded.sharding.spec == P("fsdp", None, "tp")


def test_bad_mesh_divisibility_is_a_clear_error(tiny_checkpoint):
    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("fsdp", "tp"))
    with pytest.raises(ValueError, match=r"k_proj.*cannot be split over mesh axes \('tp',\)"):
        models.from_pretrained(tiny_checkpoint, mesh=mesh)


PUBLISHED = {
    "llama2_7b": 6.74e9,
    "llama2_13b": 13.0e9,
    "codellama_34b": 33.7e9,
    "llama2_70b": 69.0e9,
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "qwen2_5_7b": 7.62e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_without_allocation(name):
    cfg = models.get_preset(name, scan_layers=True, param_dtype=jnp.bfloat16)
    abstract = nnx.eval_shape(lambda: models.init_model(cfg))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract)))
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, count
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))


def test_every_preset_builds_abstractly():
    for name in models.PRESETS:
        cfg = models.get_preset(name, scan_layers=True)
        abstract = nnx.eval_shape(lambda: models.init_model(cfg))
        assert jax.tree.leaves(nnx.state(abstract))
