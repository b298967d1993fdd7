"""The 3D-HybridEngine frees the actor's training copy while it generates (HybridFlow's zero
redundancy), measured by the bytes of live device buffers (``jax.live_arrays()``, per device
from their addressable shards) at the moment the sampler runs, on 8 simulated devices; and
train -> generate -> train stays bit-identical."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jaxflow.workers.actor as actor_module
from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec, hybrid_rules
from jaxflow.models import ModelConfig, init_model
from jaxflow.reshard import shard_bytes
from jaxflow.sampling import SamplingParams
from jaxflow.workers import ActorConfig, ActorWorker, OptimConfig, RolloutConfig

CFG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8
)


def live_bytes_per_device(shapes: set[tuple[int, ...]], exclude: set[int]) -> dict[int, int]:
    """Bytes per device id of the live arrays whose global shape is one of ``shapes`` (the
    weights' shapes), leaving out the arrays whose id is in ``exclude``."""
    out: dict[int, int] = {}
    for x in jax.live_arrays():
        if id(x) in exclude or x.is_deleted() or tuple(x.shape) not in shapes:
            continue
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def _bits(tree):
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.fixture(scope="module")
def actor():
    mesh = MeshSpec(fsdp=4, tp=2).build(jax.devices())
    train_rules, _ = hybrid_rules(CFG, 8)
    rollout = RolloutConfig(train=SamplingParams(max_new_tokens=4, n=2, eos_token_ids=(), seed=0))
    return ActorWorker(
        init_model(CFG, seed=0),
        mesh,
        train_rules,
        ActorConfig(ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-3)),
        rollout,
        gen_tp=2,
    )


def test_generation_holds_one_generation_shard_of_the_weights(actor, monkeypatch):
    engine = actor.engine
    leaves = jax.tree.leaves(actor.params)
    shapes = {tuple(x.shape) for x in leaves}
    train_shard = shard_bytes(leaves, [x.sharding for x in leaves])
    gen_sh = jax.tree.leaves(engine.gen_shardings(actor.params), is_leaf=lambda x: isinstance(x, NamedSharding))
    gen_shard = shard_bytes(leaves, gen_sh)
    assert 3 * train_shard < gen_shard <= 4 * train_shard  # gen tp=2 of weights split 8 ways (norms replicated)
    seen = []
    real = actor_module.generate_from_state
    # Arrays of other tests still alive in this process (same shapes, e.g. a module's fixture)
    # are not this actor's weights.
    gc.collect()
    others = {id(x) for x in jax.live_arrays()} - {id(x) for x in jax.tree.leaves(actor.state)}

    def measuring(graphdef, params, *args, **kwargs):
        opt = {id(x) for x in jax.tree.leaves(actor.state.opt_state)}  # Adam's moments share the shapes
        seen.append(live_bytes_per_device(shapes, opt | others))
        return real(graphdef, params, *args, **kwargs)

    monkeypatch.setattr(actor_module, "generate_from_state", measuring)
    before = _bits(actor.params)
    prompts = {"prompt_ids": np.ones((8, 4), np.int32), "prompt_mask": np.ones((8, 4), np.int32)}
    out = actor.generate(Batch.from_dict(prompts), step=0)
    assert len(out) == 16 and seen
    # Measured, during generation: every device holds exactly one generation shard of the
    # weights (the training shard was donated into it).
    for per_device in seen:
        assert set(per_device) == set(range(8))
        assert all(b == gen_shard for b in per_device.values()), (per_device, gen_shard, train_shard)
    # And after it, the training weights are back, bit-identical, in their layout; the
    # generation copy is gone.
    after = live_bytes_per_device(shapes, {id(x) for x in jax.tree.leaves(actor.state.opt_state)})
    assert all(b == train_shard for b in after.values())
    assert all(np.array_equal(a, b) for a, b in zip(before, _bits(actor.params)))
    assert [x.sharding for x in jax.tree.leaves(actor.params)] == [x.sharding for x in leaves]

    # Without the swap (the engine's keep-alive variant) a device holds both copies.
    with engine.generation(actor.params):
        both = live_bytes_per_device(shapes, {id(x) for x in jax.tree.leaves(actor.state.opt_state)})
    assert all(b >= gen_shard + train_shard for b in both.values()), (both, gen_shard, train_shard)


def test_train_generate_train_is_bit_identical(actor):
    """Two updates with a rollout between them give the same weights as the same two updates
    with no rollout between them (a copy of the actor that never generates)."""
    rng = np.random.default_rng(0)
    R, P = 4, 4
    mini = {
        "prompt_ids": rng.integers(1, 200, (8, P)).astype(np.int32),
        "prompt_mask": np.ones((8, P), np.int32),
        "responses": rng.integers(1, 200, (8, R)).astype(np.int32),
        "response_mask": np.ones((8, R), np.int32),
        "old_log_probs": np.full((8, R), -5.0, np.float32),
        "advantages": rng.normal(size=(8, R)).astype(np.float32),
    }
    twin = ActorWorker(
        (actor.graphdef, jax.device_get(actor.params)), actor.mesh, actor.rules, actor.config, actor.rollout, gen_tp=2
    )
    twin.set_train_state(jax.device_get(actor.state))
    actor.train_step(mini)
    twin.train_step(mini)
    actor.generate(Batch.from_dict({"prompt_ids": mini["prompt_ids"], "prompt_mask": mini["prompt_mask"]}), step=1)
    actor.train_step(mini)
    twin.train_step(mini)
    assert all(np.array_equal(a, b) for a, b in zip(_bits(actor.state), _bits(twin.state)))
