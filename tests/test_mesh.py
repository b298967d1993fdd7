"""Resource pools, mesh specs, rule sets and placements on 8 simulated devices: every role's
parameters land on the intended devices with the intended specs and shard shapes, and the
misconfigurations fail with clear errors."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxflow.mesh import (
    GENERATE_RULES,
    HYBRID_GENERATE_RULES,
    HYBRID_GENERATE_RULES_KV_HEAD_DIM,
    HYBRID_TRAIN_RULES,
    HYBRID_TRAIN_RULES_KV_HEAD_DIM,
    TRAIN_RULES,
    MeshSpec,
    Placement,
    ResourcePool,
    generation_mesh,
    get_rules,
    hybrid_rules,
    make_placement,
    split_pools,
)
from jaxflow.models import ModelConfig
from tests.host_states import random_state

# hidden 64, 8 heads of 8, 8 kv heads: every Megatron dimension splits 8 ways.
CFG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8
)
GQA = CFG.replace(num_kv_heads=2)


def ids(devices) -> list[int]:
    return [d.id for d in np.asarray(devices).flat]


def flat_params(state) -> dict[str, jax.Array]:
    return {
        jax.tree_util.keystr(p): v.get_value()
        for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    }


@pytest.fixture(scope="module")
def tiny_state():
    return random_state(CFG, seed=3)


# --- pools ----------------------------------------------------------------------------


def test_split_pools_4_2_2_and_fill():
    pools = split_pools({"actor": 4, "critic": 2, "reward": 2})
    assert list(pools) == ["actor", "critic", "reward"]
    assert [p.device_ids for p in pools.values()] == [(0, 1, 2, 3), (4, 5), (6, 7)]
    assert pools["critic"].size == len(pools["critic"]) == 2
    filled = split_pools([("a", 2), ("b", -1)])
    assert filled["b"].device_ids == (2, 3, 4, 5, 6, 7)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"a": 4, "b": 2}, "add up to 6 but there are 8 devices"),
        ({"a": 4, "b": 8}, "add up to 12 but there are 8 devices"),
        ([("a", 4), ("a", 4)], "duplicate pool names"),
        ({"a": -1, "b": -1}, "at most one pool may have size -1"),
        ({"a": 0, "b": 8}, "sizes are positive"),
        ({"a": 8, "b": -1}, "leave 0 devices"),
    ],
)
def test_split_pools_errors(sizes, match):
    with pytest.raises(ValueError, match=match):
        split_pools(sizes)


def test_pool_rejects_repeated_device():
    d = jax.devices()[0]
    with pytest.raises(ValueError, match="lists a device twice"):
        ResourcePool("p", (d, d))


# --- mesh specs -------------------------------------------------------------------------


def test_mesh_spec_builds_over_pool_in_order():
    pools = split_pools({"actor": 4, "rest": 4})
    mesh = MeshSpec(fsdp=2, tp=2).build(pools["actor"])
    assert mesh.axis_names == ("dp", "fsdp", "tp")
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 2, "tp": 2}
    assert ids(mesh.devices) == [0, 1, 2, 3]
    mesh = MeshSpec.parse("dp=-1,tp=2").build(pools["rest"])
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 1, "tp": 2}
    assert ids(mesh.devices) == [4, 5, 6, 7]
    assert MeshSpec.parse({"fsdp": -1}).resolve(8) == {"dp": 1, "fsdp": 8, "tp": 1}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MeshSpec(fsdp=4, tp=4).build(jax.devices()), "has 16 devices but the pool has 8"),
        (lambda: MeshSpec(fsdp=-1, tp=-1), "at most one mesh axis may be -1"),
        (lambda: MeshSpec(fsdp=-1, tp=3).build(jax.devices()), "do not divide the pool of 8"),
        (lambda: MeshSpec(tp=0), "sizes are positive"),
        (lambda: MeshSpec.parse("fsdp=4,pp=2"), r"unknown mesh axes \['pp'\]"),
        (lambda: MeshSpec.parse("fsdp=4,fsdp=2"), "names axis 'fsdp' twice"),
        (lambda: MeshSpec.parse("fsdp4"), "axis=size pairs"),
        (
            lambda: MeshSpec(fsdp=2, tp=4).build(
                jax.devices(), model=CFG.replace(num_heads=6, num_kv_heads=6, head_dim=8)
            ),
            r"tp=4 does not divide num_heads=6",
        ),
        (
            lambda: MeshSpec(fsdp=2, tp=4).build(jax.devices(), model=GQA),
            r"tp=4 does not divide num_kv_heads=2.*head_dim",
        ),
        (
            lambda: MeshSpec(fsdp=2, tp=4).build(jax.devices(), model=GQA, rules=HYBRID_TRAIN_RULES),
            r"fsdp=2 x tp=4 does not divide num_heads=8|fsdp=2 x tp=4 does not divide num_kv_heads=2",
        ),
    ],
)
def test_mesh_spec_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mesh_spec_model_check_passes_when_rules_fit():
    MeshSpec(fsdp=2, tp=4).build(jax.devices(), model=GQA, rules=HYBRID_TRAIN_RULES_KV_HEAD_DIM)
    MeshSpec(fsdp=4, tp=2).build(jax.devices(), model=GQA)  # TRAIN_RULES: kv_heads over tp=2


# --- rules ------------------------------------------------------------------------------


def test_rule_sets_by_name_and_hybrid_choice():
    assert get_rules("train") is TRAIN_RULES and get_rules("generate") is GENERATE_RULES
    assert get_rules("hybrid_train") is HYBRID_TRAIN_RULES
    with pytest.raises(KeyError, match="unknown rule set 'trian'"):
        get_rules("trian")
    assert hybrid_rules(CFG, 8) == (HYBRID_TRAIN_RULES, HYBRID_GENERATE_RULES)
    assert hybrid_rules(GQA, 8) == (HYBRID_TRAIN_RULES_KV_HEAD_DIM, HYBRID_GENERATE_RULES_KV_HEAD_DIM)
    with pytest.raises(ValueError, match="neither num_kv_heads=2 nor head_dim=6"):
        hybrid_rules(GQA.replace(head_dim=6), 8)


# --- generation meshes -----------------------------------------------------------------


def test_generation_mesh_groupings():
    train = MeshSpec(fsdp=4, tp=2).build(jax.devices())
    hybrid = generation_mesh(train, 2, ("fsdp", "tp"), "hybrid")
    assert dict(hybrid.shape) == {"tp": 2, "dp": 4}
    # micro-DP groups (same tp index) are consecutive devices; TP groups are strided.
    assert [ids(row) for row in hybrid.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    vanilla = generation_mesh(train, 2, ("fsdp", "tp"), "vanilla")
    assert dict(vanilla.shape) == {"dp": 4, "tp": 2}
    assert [ids(row) for row in vanilla.devices] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Both keep the training mesh's flat device order (one jit can take one and return the other).
    assert ids(hybrid.devices) == ids(vanilla.devices) == ids(train.devices)
    # A training dp (weight replicas) becomes a leading 'replica' axis.
    with_dp = generation_mesh(MeshSpec(dp=2, fsdp=2, tp=2).build(jax.devices()), 2, ("fsdp", "tp"))
    assert dict(with_dp.shape) == {"replica": 2, "tp": 2, "dp": 2}
    assert ids(with_dp.devices[1, 0]) == [4, 5]


def test_generation_mesh_errors():
    train = MeshSpec(fsdp=4, tp=2).build(jax.devices())
    with pytest.raises(ValueError, match="generation tp=3 must divide .* = 8"):
        generation_mesh(train, 3, ("fsdp", "tp"))
    with pytest.raises(ValueError, match="must list the weight axes .* last and in that order"):
        generation_mesh(train, 2, ("tp", "fsdp"))
    with pytest.raises(ValueError, match="unknown grouping"):
        generation_mesh(train, 2, ("fsdp", "tp"), "strided")


# --- placement --------------------------------------------------------------------------


def assert_placed(arr: jax.Array, spec: P, device_ids: list[int], shard_shape: tuple[int, ...]):
    assert arr.sharding.spec == spec
    assert ids(arr.sharding.mesh.devices) == device_ids
    assert sorted(s.device.id for s in arr.addressable_shards) == device_ids
    assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}
    full = np.asarray(arr)
    for s in arr.addressable_shards:  # every shard is its slice of the full array
        np.testing.assert_array_equal(np.asarray(s.data), full[s.index])


def test_placement_4_2_2_params_land_on_their_pools(tiny_state):
    placement = Placement.from_groups(
        [("actor", 4, ("actor", "ref")), ("critic", 2, ("critic",)), ("reward", 2, ("reward", "cost"))],
        meshes={"actor": "fsdp=2,tp=2", "critic": "tp=2"},
        gen_tp={"actor": 2},
        models={"actor": CFG},
    )
    assert placement.groups() == {"actor": ("actor", "ref"), "critic": ("critic",), "reward": ("reward", "cost")}
    assert placement.colocated_with("cost") == ("reward", "cost")
    assert placement.pool("ref").device_ids == (0, 1, 2, 3)

    q, gate, emb, norm = (
        "['model']['layers'][0]['self_attn']['q_proj']",
        "['model']['layers'][1]['mlp']['gate_proj']",
        "['model']['embed_tokens']",
        "['model']['norm']['weight']",
    )
    actor = flat_params(placement.place("actor", tiny_state))
    # Hybrid training rules: Megatron dims split jointly over (fsdp, tp) = 4 ways on devices 0-3.
    assert_placed(actor[q], P(None, ("fsdp", "tp"), None), [0, 1, 2, 3], (64, 2, 8))
    assert_placed(actor[gate], P(None, ("fsdp", "tp")), [0, 1, 2, 3], (64, 32))
    assert_placed(actor[emb], P(("fsdp", "tp"), None), [0, 1, 2, 3], (64, 64))
    assert_placed(actor[norm], P(None), [0, 1, 2, 3], (64,))
    ref = flat_params(placement.place("ref", tiny_state, "infer"))  # TRAIN_RULES, fsdp=4
    assert_placed(ref[q], P("fsdp", "tp", None), [0, 1, 2, 3], (16, 8, 8))
    critic = flat_params(placement.place("critic", tiny_state))  # TRAIN_RULES, tp=2
    assert_placed(critic[q], P("fsdp", "tp", None), [4, 5], (64, 4, 8))
    assert_placed(critic[gate], P("fsdp", "tp"), [4, 5], (64, 64))
    cost = flat_params(placement.place("cost", tiny_state, "infer"))  # fsdp=2 on devices 6, 7
    assert_placed(cost[emb], P("tp", "fsdp"), [6, 7], (256, 32))
    # The actor's generation layout: tp=2 over strided devices, replicated over micro-DP groups.
    gen = flat_params(placement.place("actor", tiny_state, "generate"))
    assert_placed(gen[q], P(None, "tp", None), [0, 1, 2, 3], (64, 4, 8))
    gen_mesh = placement.mesh("actor", "generate")
    assert [ids(row) for row in gen_mesh.devices] == [[0, 1], [2, 3]]
    assert placement.rules("actor", "generate") == HYBRID_GENERATE_RULES


def test_placement_colocated_all_roles_on_8(tiny_state):
    placement = make_placement("colocated", models={"actor": GQA})
    assert placement.groups() == {"global": ("actor", "critic", "ref", "reward", "cost")}
    for role in placement.roles:
        assert ids(placement.mesh(role).devices) == list(range(8))
    # GQA with 2 kv heads on 8 devices: the hybrid rules split k/v over head_dim instead.
    assert placement.rules("actor") == HYBRID_TRAIN_RULES_KV_HEAD_DIM
    state = random_state(GQA, seed=1)
    actor = flat_params(placement.place("actor", state))
    k = "['model']['layers'][0]['self_attn']['k_proj']"
    assert_placed(actor[k], P(None, None, ("fsdp", "tp")), list(range(8)), (64, 2, 1))
    critic = flat_params(placement.place("critic", tiny_state))
    assert_placed(critic["['lm_head']"], P("fsdp", "tp"), list(range(8)), (8, 256))


def test_placement_split_preset():
    placement = make_placement("split", meshes={"critic": "fsdp=2,tp=2"})
    assert placement.groups() == {"actor": ("actor", "ref"), "critic": ("critic", "reward", "cost")}
    assert placement.pool("actor").device_ids == (0, 1, 2, 3)
    assert ids(placement.mesh("reward").devices) == [4, 5, 6, 7]
    assert dict(placement.mesh("critic").shape) == {"dp": 1, "fsdp": 2, "tp": 2}
    assert "pool 'critic' devices [4, 5, 6, 7]" in placement.describe()
    standalone = make_placement("standalone", sizes={"actor": 4, "critic": 2, "reward": 2})
    assert standalone.colocated_with("actor") == ("actor",)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Placement.from_groups([("a", 4, ("actor",)), ("b", 4, ("actor",))]), "role 'actor' is placed twice"),
        (
            lambda: Placement.from_groups([("a", 8, ("actor",))], meshes={"critic": "tp=2"}),
            r"roles \['critic'\] that no pool",
        ),
        (lambda: Placement.from_groups([("a", 8, ("actor",))], meshes={"actor": "fsdp=3"}), "role 'actor' on pool 'a'"),
        (lambda: Placement.from_groups([("a", 6, ("actor",))]), "add up to 6 but there are 8"),
        (
            lambda: Placement.from_groups(
                [("a", 8, ("actor",))], meshes={"actor": "fsdp=2,tp=4"}, gen_tp={"actor": 3}, models={"actor": CFG}
            ),
            "generation tp=3 does not divide fsdp\\*tp=8",
        ),
        (
            lambda: Placement.from_groups(
                [("a", 8, ("critic",))],
                meshes={"critic": "tp=8"},
                models={"critic": CFG.replace(num_heads=4, num_kv_heads=4, head_dim=16)},
            ),
            "role 'critic'.*tp=8 does not divide num_heads=4",
        ),
        (lambda: Placement.split(groups=(("actor",), ("critic",), ("ref",))), "do not split evenly"),
        (lambda: make_placement("ring"), "unknown placement 'ring'"),
    ],
)
def test_placement_errors(make, match):
    with pytest.raises((ValueError, KeyError), match=match):
        make()


def test_placement_queries_fail_clearly():
    placement = make_placement("colocated")
    with pytest.raises(KeyError, match="role 'rm' is not placed"):
        placement.pool("rm")
    with pytest.raises(KeyError, match="role 'critic' has no 'generate' phase"):
        placement.rules("critic", "generate")
