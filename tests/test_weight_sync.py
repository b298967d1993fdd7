"""Weights streamed between two pools of one process (`jaxflow.reshard.weight_sync`): the
rollout pool's copy equals the trainer's bit for bit in the generation layout on its own
devices, a device never holds more than its generation shard plus one piece, repeated syncs
move new values, the delta mode sends exactly the changed leaves, and bad input is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxflow.mesh import MeshSpec, hybrid_rules, state_shardings
from jaxflow.models import ModelConfig
from jaxflow.reshard import WeightSync, derive_generation_rules, generation_shardings
from tests.host_states import random_state

CFG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8
)


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def trainer(host, dp=1, fsdp=2, tp=2, devices=None):
    """The trainer's state on the first dp*fsdp*tp devices (or ``devices``)."""
    n = dp * fsdp * tp
    mesh = MeshSpec(dp=dp, fsdp=fsdp, tp=tp).build(devices or jax.devices()[:n])
    rules, _ = hybrid_rules(CFG, fsdp * tp)
    return jax.device_put(host, state_shardings(host, rules, mesh)), rules, mesh


def live_bytes(devices) -> dict[int, int]:
    """Bytes of the live device buffers on each of ``devices``, read from JAX (not from the
    sync's own count); a buffer seen through several arrays (a shard's view) counts once."""
    ids = {d.id for d in devices}
    buffers = {}
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            if s.device.id in ids:
                buffers[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    out = dict.fromkeys(ids, 0)
    for (dev, _), n in buffers.items():
        out[dev] += n
    return out


# (dp, fsdp, tp) of the trainer on the first devices, the rollout's tp on the next 4
LAYOUTS = [
    ((1, 2, 2), 2),  # each generation shard from two training shards
    ((1, 2, 2), 4),  # generation shard = training shard
    ((1, 2, 2), 1),  # replicated generation copies, each from four pieces
    ((2, 2, 1), 4),  # replicated training shards, generation shards sliced out of them
]


@pytest.mark.parametrize("train_layout,gen_tp", LAYOUTS)
def test_sync_is_bit_exact_on_the_rollout_devices_within_the_bound(train_layout, gen_tp):
    host = random_state(CFG)
    dp, fsdp, tp = train_layout
    train, rules, mesh = trainer(host, dp, fsdp, tp)
    rollout = jax.devices()[4:]
    want = generation_shardings(host, rules, mesh, rollout, gen_tp)
    sync = WeightSync(want)
    before = live_bytes(jax.devices())
    gen, rep = sync(train)
    after = live_bytes(jax.devices())

    flat_want = jax.tree.leaves(want, is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))
    for x, h, s in zip(jax.tree.leaves(gen), jax.tree.leaves(host), flat_want):
        np.testing.assert_array_equal(bits(x), bits(h))
        assert x.sharding == s and x.sharding.device_set == set(rollout)
    # every rollout device received exactly its generation shard, nothing else
    per_device = {d.id: 0 for d in rollout}
    for x in jax.tree.leaves(gen):
        for sh in x.addressable_shards:
            per_device[sh.device.id] += sh.data.nbytes
    assert rep.bytes_moved == sum(per_device.values())
    assert rep.dest_shard_bytes == max(per_device.values())
    # no leftover pieces: the sync added its output to the rollout devices and nothing to the trainer's
    assert {i: after[i] - before[i] for i in per_device} == per_device
    assert all(after[d.id] == before[d.id] for d in jax.devices()[:4])
    assert rep.peak_device_bytes <= rep.dest_shard_bytes + rep.largest_piece_bytes
    if gen_tp > 1:  # the generation layout splits the big weights: no piece is a whole one
        assert rep.largest_piece_bytes < max(np.asarray(h).nbytes for h in jax.tree.leaves(host))
    assert rep.leaves_sent == rep.leaves_total and rep.changed_fraction == 1.0 and rep.seconds > 0


def test_cast_copy_equals_numpy_cast_and_moves_half_the_bytes():
    host = random_state(CFG)
    train, rules, mesh = trainer(host)
    want = generation_shardings(host, rules, mesh, jax.devices()[4:], 2)
    gen32, rep32 = WeightSync(want)(train)
    gen16, rep16 = WeightSync(want, dtype=jnp.bfloat16)(train)
    for x, h in zip(jax.tree.leaves(gen16), jax.tree.leaves(host)):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(bits(x), bits(np.asarray(h).astype(jnp.bfloat16)))
    assert 2 * rep16.bytes_moved == rep32.bytes_moved and 2 * rep16.model_bytes == rep32.model_bytes


def test_repeated_syncs_move_the_updated_weights_and_free_the_old_copy():
    host = random_state(CFG)
    train, rules, mesh = trainer(host)
    sync = WeightSync(generation_shardings(host, rules, mesh, jax.devices()[4:], 2))
    first, _ = sync(train)
    updated = jax.tree.map(lambda x: x * 2 + 1, train)
    second, rep = sync(updated)
    for x, u in zip(jax.tree.leaves(second), jax.tree.leaves(updated)):
        np.testing.assert_array_equal(bits(x), bits(u))
    assert all(x.is_deleted() for x in jax.tree.leaves(first))  # never two rollout copies
    assert rep.leaves_sent == rep.leaves_total


def test_delta_sends_nothing_when_nothing_changed_and_exactly_the_changed_leaves():
    # float32 masters whose values bf16 represents: flipping a float32's lowest bit then
    # leaves its bf16 copy alone (the 16 dropped bits 0x0001 round down)
    host = jax.tree.map(lambda h: h.astype(jnp.bfloat16).astype(np.float32), random_state(CFG))
    train, rules, mesh = trainer(host)
    sync = WeightSync(generation_shardings(host, rules, mesh, jax.devices()[4:], 2), dtype=jnp.bfloat16, delta=True)
    first, rep = sync(train)
    assert rep.leaves_sent == rep.leaves_total and rep.changed_fraction == 1.0

    again, rep = sync(train)
    assert rep.leaves_sent == 0 and rep.bytes_moved == 0 and rep.changed_fraction == 0.0
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(first)))

    leaves, treedef = jax.tree.flatten(train)
    changed = {1: leaves[1].at[0, 0].add(1.0), 4: leaves[4] * 3}  # one element; a whole leaf
    leaves[7] = lax.bitcast_convert_type(lax.bitcast_convert_type(leaves[7], jnp.uint32) ^ 1, jnp.float32)
    leaves[9] = leaves[9] + 0.0  # a new array, the same bytes
    leaves = [changed.get(i, x) for i, x in enumerate(leaves)]
    third, rep = sync(jax.tree.unflatten(treedef, leaves))
    old, new = jax.tree.leaves(again), jax.tree.leaves(third)
    assert [i for i, (a, b) in enumerate(zip(old, new)) if a is not b] == sorted(changed)
    for x, u in zip(new, leaves):
        np.testing.assert_array_equal(bits(x), bits(np.asarray(u).astype(jnp.bfloat16)))
    sent_bytes = sum(np.asarray(leaves[i]).size * 2 for i in changed)
    assert rep.leaves_sent == 2 and rep.changed_fraction == sent_bytes / rep.model_bytes


def test_bad_input_is_refused_clearly():
    host = random_state(CFG)
    train, rules, mesh = trainer(host)
    gen_rules = derive_generation_rules(rules, mesh)
    rollout_mesh = MeshSpec(dp=2, tp=2).build(jax.devices()[4:])

    other = random_state(CFG.replace(num_layers=1))
    with pytest.raises(ValueError, match="different tree structures"):
        WeightSync(state_shardings(other, gen_rules, rollout_mesh))(train)

    overlapping = MeshSpec(dp=2, tp=2).build(jax.devices()[2:6])
    with pytest.raises(ValueError, match=r"pools overlap on devices \[2, 3\]"):
        WeightSync(state_shardings(host, gen_rules, overlapping))(train)

    sync = WeightSync(state_shardings(host, gen_rules, rollout_mesh))
    sync(train)
    wider, _, _ = trainer(random_state(CFG.replace(intermediate_size=256)))
    with pytest.raises(ValueError, match="differs from .* of the first sync"):
        sync(wider)

    odd = WeightSync(state_shardings(host, gen_rules, MeshSpec(tp=4).build(jax.devices()[4:])))
    narrow, _, _ = trainer(random_state(CFG.replace(num_heads=2, num_kv_heads=2, head_dim=32)), fsdp=2, tp=1)
    with pytest.raises(ValueError, match="does not fit the generation layout"):
        odd(narrow)
