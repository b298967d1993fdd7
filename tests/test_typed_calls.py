"""Control by arguments, data in containers: `Batch.meta` is provenance only. A batch whose
meta claims a bogus temperature gives the log-probs, and the update, that the workers'
configured (or explicitly passed) temperature gives; the rollout's reward metrics come back as
returned metrics, not in the batch (balance metrics come from the actor's update)."""

import jax
import numpy as np
import pytest

import jaxflow.models as models
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.iterations import steps
from jaxflow.mesh import MeshSpec, hybrid_rules
from jaxflow.sampling import SamplingParams
from jaxflow.workers import ActorConfig, ActorWorker, LocalWorkerGroup, OptimConfig, RolloutConfig, Workers
from jaxflow.workers.reference import ReferenceWorker
from jaxflow.workers.reward import RewardFn, RuleRewardWorker

CFG = models.get_preset(
    "tiny_llama",
    vocab_size=128,
    num_layers=1,
    hidden_size=64,
    intermediate_size=128,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
)
T = 0.7
ROLLOUT = RolloutConfig(train=SamplingParams(max_new_tokens=4, n=2, temperature=T, eos_token_ids=(), seed=0))
B, P, R = 8, 5, 4


@pytest.fixture(scope="module")
def workers():
    mesh = MeshSpec(fsdp=4, tp=2).build(jax.devices())
    train_rules, _ = hybrid_rules(CFG, 8)
    model = models.init_model(CFG, seed=0)
    actor = ActorWorker(
        model, mesh, train_rules, ActorConfig(ppo_mini_batch_size=B, optim=OptimConfig(lr=1e-2)), ROLLOUT, gen_tp=2
    )
    ref = ReferenceWorker(model, MeshSpec(fsdp=8).build(jax.devices()), "train", temperature=T)
    return actor, ref


def _batch(meta):
    rng = np.random.default_rng(0)
    tensors = {
        "prompt_ids": rng.integers(4, 100, (B, P)).astype(np.int32),
        "prompt_mask": np.ones((B, P), np.int32),
        "responses": rng.integers(4, 100, (B, R)).astype(np.int32),
        "response_mask": np.ones((B, R), np.int32),
        "advantages": rng.normal(size=(B, R)).astype(np.float32),
    }
    return Batch.from_dict(tensors, meta=meta)


def _values(out, key):
    return np.asarray(jax.device_get(out[key]))


def test_log_probs_ignore_a_bogus_meta_temperature(workers):
    actor, ref = workers
    plain, bogus = _batch({}), _batch({"temperature": 5.0})
    for worker, key in ((actor, "old_log_probs"), (ref, "ref_log_prob")):
        configured = _values(worker.log_probs(plain), key)
        np.testing.assert_array_equal(_values(worker.log_probs(bogus), key), configured)
        np.testing.assert_array_equal(_values(worker.log_probs(bogus, temperature=T), key), configured)
        # The argument is what drives it.
        assert not np.allclose(_values(worker.log_probs(plain, temperature=5.0), key), configured, atol=1e-3)


def test_update_ignores_a_bogus_meta_temperature(workers):
    actor, _ = workers
    initial = jax.device_get(actor.state)

    def update(batch, **kwargs):
        actor.state = jax.device_put(initial, actor.state_shardings)
        metrics = actor.update(batch, step=0, **kwargs)
        return metrics, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(actor.state.params))]

    # On-policy (one mini-batch, one epoch, no old_log_probs): the step's own forward at T.
    configured, params = update(_batch({}))
    bogus, bogus_params = update(_batch({"temperature": 5.0}))
    for k in configured:
        np.testing.assert_array_equal(bogus[k], configured[k], err_msg=k)
    assert all(np.array_equal(a, b) for a, b in zip(params, bogus_params))
    hot, _ = update(_batch({}), temperature=5.0)
    assert not np.allclose(hot["actor/entropy"], configured["actor/entropy"])
    actor.state = jax.device_put(initial, actor.state_shardings)


def test_rollout_metrics_are_returned_not_carried(workers):
    actor, _ = workers
    tok = CharTokenizer()
    w = Workers(actor=LocalWorkerGroup(actor), reward=RewardFn(rule=LocalWorkerGroup(RuleRewardWorker(tok))))
    prompts = Batch.from_dict(
        {"prompt_ids": np.full((4, P), 10, np.int32), "prompt_mask": np.ones((4, P), np.int32)},
        {"data_source": ["jaxflow/addition"] * 4, "ground_truth": ["1", "2", "3", "4"]},
    )
    batch, metrics = steps.rollout(w, prompts, steps.StepTimer(), step=0)
    assert len(batch) == 8
    assert {"reward/mean", "reward/num_errors"} <= set(metrics)
    assert set(batch.meta) <= {"temperature"}  # provenance of the rollout only
