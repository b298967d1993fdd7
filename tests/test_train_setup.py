"""How a run sets its training roles up, from the config: the optimizer state's dtype and a
train step that compiles once, learning-rate schedules sized by the optimizer steps the run
really makes, and preset models initialised directly in their shardings."""

import dataclasses
import json

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.configs import load_config
from jaxflow.configs.run_spec import build_tokenizer, describe_run
from jaxflow.reshard import hlo, shard_bytes
from jaxflow.trainer.builders import init_program, load_model
from jaxflow.trainer.rl import RLTrainer
from jaxflow.workers.roles import RoleSettings, make_role_worker
from jaxflow.workers.train_state import minibatch_indices

SMALL = [
    "jaxflow.placement.type=colocated",
    "jaxflow.model.num_layers=1",
    "jaxflow.model.hidden_size=64",
    "jaxflow.model.intermediate_size=128",
    "jaxflow.sft.warm_start_steps=0",
]


def _spec(cfg):
    return describe_run(cfg, tokenizer=build_tokenizer(cfg))


class CompileCounter:
    """Backend compiles while active (jax.monitoring's compile-duration events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listener(self, event, duration, **kwargs):
        self.count += event == self.EVENT

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


# ----------------------------------------------------------------------------- optimizer state


def _adam_moments(opt_state):
    """``{"mu": [leaves], "nu": [leaves]}`` of the optimizer state (Adam's first and second moments)."""
    out = {"mu": [], "nu": []}
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        names = [getattr(p, "name", None) for p in path]
        for moment in out:
            if moment in names:
                out[moment].append(leaf)
    return out


def test_bf16_params_with_fp32_moments_from_init_and_one_compile():
    cfg = load_config(
        "ppo_tiny",
        SMALL
        + ["jaxflow.model.dtype=bfloat16", "jaxflow.model.compute_dtype=bfloat16", "jaxflow.optim.state_dtype=float32"],
    )
    spec = _spec(cfg)
    assert spec.actor.optim.state_dtype == "float32"
    p = spec.placement
    model = load_model(spec.models["actor"], p.mesh("actor", "train"), p.rules("actor", "train"))
    actor = make_role_worker("actor", p, model, RoleSettings(actor_config=spec.actor, rollout=spec.rollout))
    assert {x.dtype for x in jax.tree.leaves(actor.params)} == {jnp.dtype(jnp.bfloat16)}
    moments = _adam_moments(actor.state.opt_state)
    n = len(jax.tree.leaves(actor.params))
    assert len(moments["mu"]) == len(moments["nu"]) == n  # one of each per parameter
    assert {x.dtype for m in moments.values() for x in m} == {jnp.dtype(jnp.float32)}  # fp32 at init already

    rows = spec.actor.ppo_mini_batch_size
    P, R = spec.prompt_length, spec.response_length
    rng = np.random.default_rng(0)
    batch = {
        "prompt_ids": rng.integers(4, 100, (rows, P)).astype(np.int32),
        "prompt_mask": np.ones((rows, P), np.int32),
        "responses": rng.integers(4, 100, (rows, R)).astype(np.int32),
        "response_mask": np.ones((rows, R), np.int32),
        "old_log_probs": np.full((rows, R), -4.6, np.float32),
        "advantages": rng.normal(size=(rows, R)).astype(np.float32),
    }
    first = actor.train_step(batch)  # compiles the step
    with CompileCounter() as compiles:
        later = [actor.train_step(batch) for _ in range(2)]
    assert compiles.count == 0  # steps 2 and 3 reuse step 1's program: the state's types never changed
    assert all(m["actor/update_skipped"] == 0 for m in [first, *later])
    assert int(actor.state.step) == 3
    moments = _adam_moments(actor.state.opt_state)
    assert {x.dtype for m in moments.values() for x in m} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(actor.params)} == {jnp.dtype(jnp.bfloat16)}


# ----------------------------------------------------------------------------- schedules


def test_schedules_are_sized_by_the_optimizer_steps_of_the_run(tmp_path):
    """Epoch mode (trainer.total_training_steps unset) on a data file: the prompts that survive
    the data filter size the run; the actor skips the critic warm-up steps; each update makes
    ppo_epochs * (train_batch_size / ppo_mini_batch_size) optimizer steps."""
    path = tmp_path / "train.jsonl"
    rows = [
        {
            "data_source": "jaxflow/addition",
            "prompt": f"{i % 10}+{i % 7}=",
            "ability": "math",
            "reward_model": {"ground_truth": str(i % 10 + i % 7)},
            "extra_info": {},
        }
        for i in range(43)
    ]
    rows += [{**rows[0], "prompt": "1+" * 20 + "1="}] * 5  # longer than max_prompt_length: filtered out
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(
        "ppo_tiny",
        SMALL
        + [
            f"data.train_files={path}",
            f"data.val_files={path}",
            "data.truncation=filter",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=None",
            "trainer.total_epochs=2",
            "trainer.critic_warmup=3",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=3",
            "critic.ppo_mini_batch_size=4",
            "critic.ppo_epochs=1",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
            "critic.optim.warmup_style=cosine",
            "critic.optim.min_lr_ratio=0.2",
        ],
    )
    trainer = RLTrainer(cfg)
    assert len(trainer.train_data) == 43  # the 5 long prompts were filtered
    # By hand: 43 // 8 = 5 batches per epoch, 2 epochs = 10 steps; the actor updates in
    # steps 4..10 (7 steps) x 3 epochs x 8/2 = 4 mini-batches = 84 optimizer steps; the critic
    # in all 10 steps x 1 epoch x 8/4 = 2 mini-batches = 20.
    assert trainer.total_steps == 10
    actor, critic = trainer.workers.actor.worker, trainer.workers.critic.worker
    assert actor.config.optim.total_training_steps == 84
    assert critic.config.optim.total_training_steps == 20
    # One update of each makes that many optimizer steps (the mini-batches `update` iterates).
    responses = cfg.data.train_batch_size * 2
    gen = np.random.default_rng(0)
    assert len(minibatch_indices(responses, actor.config.ppo_mini_batch_size, actor.config.ppo_epochs, True, gen)) == 12
    assert (
        len(minibatch_indices(responses, critic.config.ppo_mini_batch_size, critic.config.ppo_epochs, True, gen)) == 2
    )
    # The cosine schedules reach their floor exactly at the last optimizer step.
    for worker, total, floor in ((actor, 84, 0.1), (critic, 20, 0.2)):
        lr = worker.config.optim.lr
        assert float(worker.schedule(total)) == pytest.approx(floor * lr, rel=1e-6)
        assert float(worker.schedule(total - 1)) > floor * lr * (1 + 1e-4)


# ----------------------------------------------------------------------------- sharded init


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_init_program_holds_one_shard_per_device(role):
    """The preset's init, compiled for 8 devices (``memory_analysis()``): each device's outputs
    are exactly its shard of the model; no device ever holds a split weight whole (no buffer
    of a weight's global shape in the partitioned program); its scratch is bounded by its
    shard, not by the model. On XLA:CPU that scratch is threefry's rolled-loop random bits,
    u32 arrays of each weight's shard shape, which CPU buffer assignment does not reuse
    across weights (measured here: 1.4-1.5 shards, at every model size tried; a GPU or TPU lowers threefry unrolled and
    fused, without them). Initialising the whole model and then placing it would put 8
    shards on a device."""
    cfg = load_config(
        "ppo_tiny",
        [
            "jaxflow.placement.type=colocated",
            "jaxflow.model.hidden_size=128",
            "jaxflow.model.intermediate_size=512",
            "jaxflow.model.vocab_size=512",
            "jaxflow.model.num_layers=1",
        ],
    )
    spec = _spec(cfg)
    m = spec.models[role]
    mesh, rules = spec.placement.mesh(role, "train"), spec.placement.rules(role, "train")
    graphdef, init = init_program(m.config, m.head, m.seed, mesh, rules)
    lowered = init.lower()
    abstract = jax.tree.leaves(lowered.out_info)
    whole = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in abstract)
    shard = shard_bytes(abstract, [x.sharding for x in abstract])
    assert shard <= whole / 7  # split ~8 ways (norms and the value head are replicated)
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes == 0
    assert shard <= mem.output_size_in_bytes <= shard + 8 * len(abstract)  # + XLA's tuple index table
    split = {tuple(x.shape) for x in abstract if x.sharding.shard_shape(x.shape) != tuple(x.shape)}
    shard_shapes = {x.sharding.shard_shape(x.shape) for x in abstract}
    text = compiled.as_text()
    assert not [line for shape in split - shard_shapes for line in hlo.buffers_with_shape(text, shape)]
    assert mem.temp_size_in_bytes < 2 * shard, (mem.temp_size_in_bytes, shard)
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < whole / 3


# ----------------------------------------------------------------------------- warm start


def test_warm_start_hands_its_weights_to_rl_in_memory(tmp_path, monkeypatch):
    """RLTrainer runs the supervised warm start itself and builds the actor and the reference
    from the weights it returns, never reading its checkpoint back (the loader is made to
    fail); the checkpoint is still written for the user."""
    import jaxflow.models
    import jaxflow.workers.base
    from jaxflow.trainer import sft

    returned = {}
    run_sft = sft.run_sft

    def recording(*args, **kwargs):
        metrics, graphdef, params = run_sft(*args, **kwargs)
        returned["params"] = jax.device_get(params)  # host copies: the values SFT ended with
        return metrics, graphdef, params

    def refuse(*args, **kwargs):
        raise AssertionError("the warm start's checkpoint was read back from disk")

    monkeypatch.setattr(sft, "run_sft", recording)
    monkeypatch.setattr(jaxflow.models, "from_pretrained", refuse)
    monkeypatch.setattr(jaxflow.workers.base, "from_pretrained", refuse)
    cfg = load_config(
        "grpo_tiny",
        [o for o in SMALL if "warm_start" not in o]
        + [
            "jaxflow.sft.warm_start_steps=3",
            "jaxflow.sft.test_freq=-1",
            "jaxflow.sft.batch_size=16",
            "jaxflow.sft.micro_batch_size_per_device=4",
            "jaxflow.data.num_train_examples=64",
            "jaxflow.data.num_val_examples=8",
            "data.train_batch_size=16",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    trainer = RLTrainer(cfg)
    assert (tmp_path / "sft_warm_start" / "config.json").is_file()
    assert trainer.spec.models["actor"].path == str(tmp_path / "sft_warm_start")  # the reference's provenance
    sft_leaves = jax.tree.leaves(returned["params"])
    for worker in (trainer.workers.actor.worker, trainer.workers.ref.worker):
        leaves = jax.tree.leaves(jax.device_get(worker.params))
        assert len(leaves) == len(sft_leaves)
        assert all(np.array_equal(a, b) for a, b in zip(leaves, sft_leaves))
    # SFT moved the weights: the RL actor starts from them, not from the preset's init.
    preset = dataclasses.replace(trainer.spec.models["actor"], path="")
    p = trainer.placement
    init = jax.tree.leaves(jax.device_get(load_model(preset, p.mesh("actor", "train"), p.rules("actor", "train"))[1]))
    assert not all(np.array_equal(a, b) for a, b in zip(init, sft_leaves))
