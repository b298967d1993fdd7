"""Roles on resource pools (8 devices split 4 + 2 + 2, and all 8 colocated): parameters and
optimizer state land on the intended devices with the intended specs; batches move between
pools bit-exactly; worker groups expose registered methods with their protocols; the rule
scorer worker scores decoded responses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxflow.models as models
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.mesh import Placement, logical_axes_tree, logical_to_spec
from jaxflow.workers import (
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    DP_COMPUTE_REPEAT,
    DP_TRAIN,
    ONE_TO_ALL,
    LocalWorkerGroup,
    RuleRewardWorker,
    WorkerGroupInfo,
    build_local_workers,
    register,
)
from jaxflow.workers.protocols import call_spmd, dispatch_method

CFG = models.get_preset("tiny_llama", vocab_size=128)
ROLE_MODELS = {"actor": CFG, "ref": CFG, "critic": CFG, "reward": CFG}


@pytest.fixture(scope="module")
def modules():
    return {
        "lm": models.init_model(CFG, "lm", seed=0),
        "value": models.init_model(CFG, "value", seed=1),
        "reward": models.init_model(CFG, "reward", seed=2),
    }


def _build(placement, modules):
    return build_local_workers(
        placement, actor=modules["lm"], ref=modules["lm"], critic=modules["value"], reward_model=modules["reward"]
    )


@pytest.fixture(scope="module")
def split(modules):
    placement = Placement.from_groups(
        [("actor", 4, ("actor", "ref")), ("critic", 2, ("critic",)), ("reward", 2, ("reward",))],
        meshes={"actor": "fsdp=2,tp=2"},
        gen_tp={"actor": 2},
        models=ROLE_MODELS,
    )
    return placement, _build(placement, modules)


@pytest.fixture(scope="module")
def colocated(modules):
    placement = Placement.colocated(
        roles=("actor", "ref", "critic", "reward"),
        meshes={"actor": "dp=2,fsdp=2,tp=2"},
        gen_tp={"actor": 2},
        models=ROLE_MODELS,
    )
    return placement, _build(placement, modules)


def _groups(w):
    return {"actor": w.actor, "ref": w.ref, "critic": w.critic, "reward": w.reward.model}


def _param(state, *path):
    for p in path:
        state = state[p]
    return state[...]


def _check_placement(placement, w):
    for role, group in _groups(w).items():
        worker = group.worker
        pool_ids = set(placement.pool(role).device_ids)
        phase = "train" if role in ("actor", "critic") else "infer"
        rules, mesh = placement.rules(role, phase), placement.mesh(role, "train")
        assert worker.mesh is mesh and worker.rules == rules, role
        assert {d.id for d in group.devices} == pool_ids
        axes = jax.tree.leaves(logical_axes_tree(worker.params), is_leaf=lambda x: isinstance(x, tuple))
        for names, x in zip(axes, jax.tree.leaves(worker.params)):
            assert {d.id for d in x.sharding.device_set} == pool_ids, role
            assert x.sharding.mesh == mesh and x.sharding.spec == logical_to_spec(names, rules, mesh), (role, names)
            # The bytes per device are what the spec says: no device holds a replica it should not.
            n_shards = int(
                np.prod([mesh.shape[a] for s in x.sharding.spec if s for a in ((s,) if isinstance(s, str) else s)])
            )
            assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // n_shards}, (role, names)
        if role in ("actor", "critic"):  # Adam's moments live where their parameters do
            mu = optax.tree_utils.tree_get(worker.state.opt_state, "mu")  # Adam's first moment
            for p, m in zip(jax.tree.leaves(worker.params), jax.tree.leaves(mu)):
                assert m.sharding == p.sharding
        assert group.info.dp_size == worker.dp_size
        assert group.info.world_size == len(pool_ids)


def test_split_pools_4_2_2(split):
    placement, w = split
    _check_placement(placement, w)
    actor, ref, critic, reward = (g.worker for g in _groups(w).values())
    assert {d.id for d in actor.mesh.devices.flat} == {0, 1, 2, 3}
    assert {d.id for d in critic.mesh.devices.flat} == {4, 5}
    assert {d.id for d in reward.mesh.devices.flat} == {6, 7}
    # The actor trains with the hybrid rules: Megatron dims over (fsdp, tp); 2 kv heads do not
    # split 4 ways, so k/v split over head_dim (jaxflow.mesh.hybrid_rules).
    attn = ("model", "layers", 0, "self_attn")
    assert _param(actor.params, *attn, "q_proj").sharding.spec == P(None, ("fsdp", "tp"), None)
    assert _param(actor.params, *attn, "k_proj").sharding.spec == P(None, None, ("fsdp", "tp"))
    assert _param(critic.params, "model", "embed_tokens").sharding.spec == P("tp", "fsdp")
    assert _param(reward.params, "score").sharding.spec == P("fsdp", None)
    assert actor.dp_size == 2 and ref.dp_size == 4 and critic.dp_size == 2
    assert w.actor.methods() == [
        "abstract_train_state",
        "export_adapter",
        "export_hf",
        "generate",
        "generation_seconds",
        "get_train_state",
        "log_probs",
        "params_finite",
        "ref_log_probs",
        "restore_train_state",
        "rollout_metrics",
        "save_train_state",
        "set_train_state",
        "update",
    ]
    # A train state from the host (e.g. a checkpoint) goes back into the critic's layout.
    (state,) = w.critic.get_train_state()
    w.critic.set_train_state(jax.device_get(state))
    for a, b in zip(jax.tree.leaves(critic.state), jax.tree.leaves(state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Generation layout of the 3D-HybridEngine: same 4 devices, tp=2 x micro-dp=2.
    engine = actor.engine
    assert dict(engine.gen_mesh.shape) == {"tp": 2, "dp": 2}
    np.testing.assert_array_equal(engine.gen_mesh.devices, placement.mesh("actor", "generate").devices)
    gen = engine.to_generation(actor.params)
    q = _param(gen, *attn, "q_proj")
    assert q.sharding.spec == P(None, "tp", None) and {d.id for d in q.sharding.device_set} == {0, 1, 2, 3}
    np.testing.assert_array_equal(np.asarray(q), np.asarray(_param(actor.params, *attn, "q_proj")))


def test_colocated_8(colocated):
    placement, w = colocated
    _check_placement(placement, w)
    for group in _groups(w).values():
        assert {d.id for d in group.devices} == set(range(8))
    actor = w.actor.worker
    assert dict(actor.mesh.shape) == {"dp": 2, "fsdp": 2, "tp": 2} and actor.dp_size == 4
    assert w.critic.worker.dp_size == 8
    assert dict(actor.engine.gen_mesh.shape) == {"replica": 2, "tp": 2, "dp": 2}


def _special_batch(rows=8):
    rng = np.random.default_rng(0)
    f = rng.normal(size=(rows, 3)).astype(np.float32)
    f[0, 0], f[1, 1], f[2, 2] = np.nan, -0.0, np.inf  # bit patterns that value checks could miss
    return Batch.from_dict(
        {
            "ids": rng.integers(0, 1000, (rows, 5)).astype(np.int32),
            "f": f,
            "h": rng.normal(size=(rows, 2)).astype(jnp.bfloat16),
            "flag": rng.integers(0, 2, (rows,)).astype(bool),
        },
        {"uid": [f"u{i}" for i in range(rows)]},
        {"temperature": 0.7},
    )


def _assert_bit_exact(moved, original, device_ids, dp_axes):
    assert moved.non_tensors.keys() == original.non_tensors.keys() and moved.meta == original.meta
    np.testing.assert_array_equal(moved["uid"], original["uid"])
    for k, x in moved.tensors.items():
        assert isinstance(x, jax.Array)
        assert {d.id for d in x.sharding.device_set} == device_ids, k
        assert x.sharding.spec[0] == dp_axes, k
        host, ref = np.asarray(x), np.asarray(original[k])
        assert host.dtype == ref.dtype and host.shape == ref.shape
        np.testing.assert_array_equal(host.view(np.uint8), ref.view(np.uint8), err_msg=k)


def test_batch_moves_between_pools_bit_exact(split):
    _, w = split
    batch = _special_batch()
    on_actor = w.actor.put(batch)
    _assert_bit_exact(on_actor, batch, {0, 1, 2, 3}, ("dp", "fsdp"))
    on_critic = w.critic.put(on_actor)  # device to device, actor pool -> critic pool
    _assert_bit_exact(on_critic, batch, {4, 5}, ("dp", "fsdp"))
    on_reward = w.reward.model.put(on_critic)
    _assert_bit_exact(on_reward, batch, {6, 7}, ("dp", "fsdp"))
    back = w.ref.put(on_reward)
    _assert_bit_exact(back, batch, {0, 1, 2, 3}, ("dp", "fsdp"))


# ---------------------------------------------------------------- group API with a toy worker


class Toy:
    """A worker without a model: doubles a column on its mesh, repeats rows, reports metrics."""

    def __init__(self, mesh):
        self.mesh, self.dp_axes = mesh, ("dp",)
        self.seen = []

    def put(self, batch):
        sharding = jax.sharding.NamedSharding(self.mesh, P("dp"))
        return {k: jax.device_put(v, sharding) for k, v in batch.tensors.items()}

    @register(DP_COMPUTE)
    def double(self, batch):
        x = self.put(batch)["x"]
        self.seen.append(x.shape[0])
        return Batch({"y": x * 2})

    @register(DP_COMPUTE_REPEAT)
    def rollout(self, batch, n=3):
        return batch.repeat(n).update(tensors={"sample": np.tile(np.arange(n), len(batch))})

    @register(DP_COMPUTE_METRIC)
    def stats(self, batch):
        return {"mean_x": np.asarray([batch["x"].mean()])}

    @register(DP_TRAIN)
    def train(self, batch):
        return {"rows": np.asarray([len(batch)])}

    @register(ONE_TO_ALL)
    def hello(self, name):
        return f"hi {name}"

    def not_registered(self):
        return 0


def test_group_exposes_registered_methods_with_protocols():
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    group = LocalWorkerGroup(Toy, mesh=mesh)
    assert group.methods() == ["double", "hello", "rollout", "stats", "train"]
    assert group.info == WorkerGroupInfo.from_mesh(mesh, ("dp",))
    with pytest.raises(AttributeError, match="no registered method 'not_registered'"):
        group.not_registered()
    batch = Batch.from_dict({"x": np.arange(6, dtype=np.float32)}, {"uid": list("abcdef")})
    out = group.double(batch)  # 6 rows padded to 8 for dp=4, run once, unpadded
    assert group.worker.seen == [8]
    np.testing.assert_array_equal(np.asarray(out["y"]), 2 * np.arange(6))
    assert group.hello("you") == ["hi you"]
    with pytest.raises(ValueError, match="does not split evenly"):
        group.train(batch)  # 6 rows on 4 shards: a training step never trains on padding copies
    assert group.train(Batch.from_dict({"x": np.arange(8.0)})) == {"rows": 8.0}
    assert group.stats(batch) == {"mean_x": pytest.approx(np.mean([0, 1, 2, 3, 4, 5, 0, 1]))}
    # n outputs per input row: the padding rows' n outputs each are removed.
    rolled = group.rollout(batch)
    assert len(rolled) == 18
    np.testing.assert_array_equal(rolled["uid"], np.repeat(list("abcdef"), 3))
    np.testing.assert_array_equal(rolled["sample"], np.tile(np.arange(3), 6))
    # The per-rank path (what a multi-process backend runs) gives the same rows.
    per_rank = dispatch_method(group.info, DP_COMPUTE_REPEAT, group.worker.rollout, batch)
    single = call_spmd(group.info, DP_COMPUTE_REPEAT, group.worker.rollout, batch)
    assert per_rank.equals(single)


def test_rule_reward_worker_scores_decoded_responses():
    tok = CharTokenizer()
    answers = ["175", "12", "7", "99"]
    said = ["175", "13", " 7 ", "9"]  # right, wrong, right after stripping, wrong
    R = 6
    responses = np.zeros((4, R), np.int32)
    mask = np.zeros((4, R), np.int32)
    for i, text in enumerate(said):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        responses[i, : len(ids)], mask[i, : len(ids)] = ids, 1
    batch = Batch.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": ["jaxflow/addition"] * 4, "ground_truth": answers},
    )
    [(out, metrics)] = LocalWorkerGroup(RuleRewardWorker(tok)).scores(batch)
    scores = np.asarray(out["token_level_scores"])
    np.testing.assert_array_equal(scores.sum(-1), [1.0, 0.0, 1.0, 0.0])
    last = mask.sum(-1) - 1
    assert scores[0, last[0]] == 1.0 and scores[2, last[2]] == 1.0  # on the last (EOS) token
    assert list(out["response_text"]) == said
    assert metrics["reward/mean"] == 0.5 and not out.meta  # metrics are returned, not carried in the batch
