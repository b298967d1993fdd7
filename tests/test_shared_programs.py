"""One path from a config to compiled programs: the programs the dry run lowers on abstract
inputs are the programs a real run calls. For every shipped config at tiny size (the paper's
workload shrunk to 8 devices, with its decode slots, bf16 weights, scanned and rematerialised
layers and split placement), a real `RLTrainer` runs one training step while every jitted
program its workers call is recorded with its arguments (shapes, dtypes, shardings); the dry
run's plan of the same config lowers its programs on ``ShapeDtypeStruct``s. The StableHLO
texts must be identical: same function, micro-batch count, shardings, optimizer constants (the
schedule's length included), on-policy or not, packed or padded, decode slots, and the
3D-HybridEngine's train -> generate programs. The recorded programs are lowered, not run
(`Recorder`) and the models are zeros (`zero_weights`), so the test compiles nothing."""

import types

import jax
import numpy as np
import pytest

import jaxflow.workers.actor as actor_module
from jaxflow.configs import load_config
from jaxflow.configs.prepare import prepare_run
from jaxflow.plan.dry_run import DEFAULT_PROGRAMS, OPTIONAL_PROGRAMS, plan
from jaxflow.plan.lowering import with_shardings
from jaxflow.reshard import HybridEngine
from jaxflow.sampling import lower_generate
from jaxflow.trainer import builders
from jaxflow.trainer.rl import RLTrainer
from jaxflow.workers import trainable as workers_trainable
from jaxflow.workers.base import RoleWorker
from jaxflow.workers.train_state import abstract_train_state

SMALL = [
    "jaxflow.placement.type=colocated",
    "jaxflow.model.num_layers=1",
    "jaxflow.model.hidden_size=64",
    "jaxflow.model.intermediate_size=128",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "jaxflow.data.num_train_examples=64",
    "jaxflow.data.num_val_examples=8",
    "trainer.total_training_steps=3",
    "jaxflow.sft.warm_start_steps=0",
]
# Remove padding packs each row's real tokens; with every response at full length (the
# recorder's rollouts) and prompts longer than R, each row fills its own bin, as in the dry
# run's worst case.
PACKED = ["actor_rollout_ref.model.use_remove_padding=True"]
PAPER_SHRUNK = [  # a paper workload on 8 devices: split pools of 4, the same key choices at toy sizes
    "jaxflow.num_devices=8",
    "jaxflow.placement.pool_sizes=(4,4)",
    "jaxflow.mesh.actor.train.dp=1",
    "jaxflow.mesh.actor.train.fsdp=2",
    "jaxflow.mesh.actor.train.tp=2",
    "jaxflow.mesh.actor.generate.tp=2",
    "jaxflow.mesh.critic.dp=1",
    "jaxflow.mesh.critic.fsdp=2",
    "jaxflow.mesh.critic.tp=2",
    "jaxflow.mesh.ref.fsdp=-1",
    "jaxflow.mesh.reward.fsdp=-1",
    "jaxflow.model.vocab_size=128",
    "jaxflow.model.hidden_size=64",
    "jaxflow.model.intermediate_size=128",
    "jaxflow.model.num_layers=2",
    "jaxflow.model.num_heads=8",
    "jaxflow.model.num_kv_heads=4",
    "data.max_prompt_length=8",
    "data.max_response_length=4",
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=2",
    "critic.ppo_micro_batch_size_per_device=2",
    "actor_rollout_ref.rollout.max_num_seqs=4",
    "jaxflow.data.num_train_examples=64",
    "jaxflow.data.num_val_examples=8",
    "trainer.total_training_steps=2",
    "jaxflow.sft.warm_start_steps=0",
]
CASES = {
    # a reward model and the in-reward KL (reference), micro-batched forwards and updates
    "ppo_tiny": SMALL
    + [
        "reward_model.enable=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device=1",
        "reward_model.micro_batch_size_per_device=1",
        "critic.ppo_micro_batch_size_per_device=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=1",
        "critic.forward_micro_batch_size_per_device=1",
    ],
    # epoch mode (the schedules' length from the data); one mini-batch of one epoch: on-policy
    "grpo_tiny": SMALL + ["trainer.total_training_steps=None", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
    # the greedy baseline rollout; actor and reference forwards over packed tokens
    "remax_tiny": SMALL + PACKED,
    "rloo_tiny": SMALL,
    # packed updates by a token budget (dynamic micro-batches)
    "reinforce_pp_tiny": SMALL
    + PACKED
    + ["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_device=24"],
    # a cost model beside the reward model, both over packed tokens
    "safe_rlhf_tiny": SMALL
    + [
        "jaxflow.safe_rlhf.cost_model_path=preset:tiny_llama",
        "reward_model.enable=True",
        "reward_model.model.use_remove_padding=True",
    ],
    **{name: PAPER_SHRUNK for name in ("ppo_7b", "ppo_13b", "ppo_34b", "ppo_70b")},
}
ROLES = {"ActorWorker": "actor", "ReferenceWorker": "ref", "CriticWorker": "critic"}
# the workers' program keys (packed forwards: by the column they compute) -> the plan's kinds
KINDS = {
    "log_probs": "log_probs",
    "values": "values",
    "scores": "scores",
    "update": "train_step",
    "old_log_probs": "log_probs",
    "ref_log_prob": "log_probs",
    "token_level_scores": "scores",
    "token_level_cost": "scores",
}


def abstract(tree):
    """Arguments as ``ShapeDtypeStruct`` leaves (device arrays keep their shardings)."""

    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, (np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x

    return jax.tree.map(leaf, tree)


def zeros(info):
    """Zero arrays of a tree of ``ShapeDtypeStruct``s, placed by their shardings."""
    return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), info)


class Recorder:
    """Records the lowered text of every program call the run makes, by program name, in
    place of running it: each call returns zeros of the program's output shapes and
    shardings (what a program computes does not change which programs the run calls; the
    rollout returns every response at full length, the packed layouts' worst case). So the
    step's control flow is the real one and nothing is compiled."""

    def __init__(self, monkeypatch, spec):
        self.texts: dict[str, list[str]] = {}
        recorder = self
        compiled = RoleWorker._compiled

        def recording_compiled(worker, key, build):
            fn = compiled(worker, key, build)
            name = f"{recorder.role(worker)}/{KINDS[key[1] if key[0] == 'packed' else key[0]]}"

            def call(*args):
                lowered = fn.lower(*abstract(args))
                recorder.add(name, lowered.as_text())
                return zeros(lowered.out_info)

            return call

        def recording_generate(
            graphdef,
            state,
            ids,
            mask,
            params,
            *,
            mesh,
            rules,
            rng,
            options,
            max_new_tokens=None,
            tokenizer=None,
            prompt_index=None,
        ):
            assert max_new_tokens is None and tokenizer is None  # no per-row limits or stop strings here
            names = {spec.rollout.train: "actor/generate", spec.rollout.resolve("greedy"): "actor/generate_greedy"}
            lowered = lower_generate(
                graphdef,
                abstract(state),
                ids,
                mask,
                params,
                mesh=mesh,
                rules=rules,
                options=options,
                prompt_index=prompt_index,
            )
            recorder.add(names[params], lowered.as_text())
            rows, length = len(ids) * params.n, params.max_new_tokens
            responses = np.random.default_rng(0).integers(10, 60, (rows, length)).astype(np.int32)
            return types.SimpleNamespace(
                responses=responses,
                response_mask=np.ones((rows, length), np.int32),
                log_probs=np.zeros((rows, length), np.float32),
            )

        def recording_to_generation(engine, train_state, **kwargs):
            lowered = engine.lowered(abstract(train_state))
            recorder.add("actor/reshard", tuple(p.as_text() for p in lowered))
            return zeros(with_shardings(engine.gen_shardings(train_state), abstract(train_state)))

        def fake_to_training(engine, gen_state, **kwargs):
            return zeros(with_shardings(engine.train_shardings(gen_state), abstract(gen_state)))

        monkeypatch.setattr(RoleWorker, "_compiled", recording_compiled)
        monkeypatch.setattr(actor_module, "generate_from_state", recording_generate)
        monkeypatch.setattr(HybridEngine, "to_generation", recording_to_generation)
        monkeypatch.setattr(HybridEngine, "to_training", fake_to_training)

    @staticmethod
    def role(worker) -> str:
        name = type(worker).__name__
        if name == "RewardModelWorker":
            return "cost" if worker.output_key == "token_level_cost" else "reward"
        return ROLES[name]

    def add(self, name, text):
        self.texts.setdefault(name, [])
        if text not in self.texts[name]:
            self.texts[name].append(text)


def zero_weights(monkeypatch):
    """Preset models and train states as zeros in their shardings, from the builders' own
    abstract values (`init_program`, `abstract_train_state`): what the weights hold does
    not change which programs the run calls, and nothing compiles."""

    def init_sharded(config, head, seed, mesh, rules):
        graphdef, init = builders.init_program(config, head, seed, mesh, rules)
        return graphdef, zeros(init.eval_shape())

    def create_train_state(params, param_shardings, tx, mesh):
        state, shardings = abstract_train_state(params, param_shardings, tx, mesh)
        return zeros(state), shardings

    monkeypatch.setattr(builders, "init_sharded", init_sharded)
    monkeypatch.setattr(workers_trainable, "create_train_state", create_train_state)


@pytest.mark.parametrize("config", list(CASES))
def test_dry_run_lowers_the_programs_the_run_calls(config, tmp_path, monkeypatch):
    cfg = load_config(config, CASES[config] + [f"trainer.default_local_dir={tmp_path}"])
    zero_weights(monkeypatch)
    trainer = RLTrainer(cfg)
    recorder = Recorder(monkeypatch, trainer.spec)
    trainer.train_step(1)
    monkeypatch.undo()
    planned_run, _, _ = builders.place_run(
        prepare_run(cfg, with_datasets=False), cfg, log=None
    )  # as the dry run starts
    report, programs = plan(planned_run, DEFAULT_PROGRAMS + OPTIONAL_PROGRAMS)
    planned = {p.name: p for p in programs}
    ran = recorder.texts
    # Every program the run called is planned, and the plan's lowering is the one it called.
    assert set(ran) <= set(planned), set(ran) - set(planned)
    for name, texts in ran.items():
        want = tuple(lowered.as_text() for lowered in planned[name].lowered())
        if name == "actor/reshard":
            assert texts == [want], name
        else:
            assert texts == [want[0]], name  # one program per name, the planned one
    # And every program the plan compiles by default is one the run called.
    assert {p for p in DEFAULT_PROGRAMS if p in planned} <= set(ran)
    spec = trainer.spec
    if config == "grpo_tiny":  # on-policy: the rollout scores no old log-probs, the update needs none
        assert "actor/log_probs" not in ran and "on-policy" in planned["actor/train_step"].description
        assert spec.training_steps == 64 // 8
    if config == "remax_tiny":
        assert "actor/generate_greedy" in ran
    if config in ("remax_tiny", "reinforce_pp_tiny", "safe_rlhf_tiny"):
        packed = [
            p
            for p in ("actor/train_step", "ref/log_probs", "reward/scores", "cost/scores")
            if p in planned and "packed" in planned[p].description
        ]
        assert packed, [p.description for p in programs]
    if config == "ppo_tiny":  # 16 rows over 8 data-parallel ranks at 1 per device: 2 micro-batches
        for role, program in (("ref", "ref/log_probs"), ("reward", "reward/scores"), ("critic", "critic/values")):
            assert report.role(role).micro_batches[program] == 2
    if config.startswith("ppo_") and config != "ppo_tiny":  # the paper's: decode slots, bf16, scanned layers
        assert "4 decode slots" in planned["actor/generate"].description
        assert spec.models["actor"].config.scan_layers and spec.rollout.max_num_seqs == 4
