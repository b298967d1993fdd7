"""One path from a config to compiled programs: the programs the dry run lowers on abstract
inputs are the programs a real run calls. For shipped configs at tiny size, a real `RLTrainer`
is built (models, workers, optimizers) and each of its workers' jitted programs is lowered on
the worker's own arrays; the dry run's plan of the same config lowers its programs on
``ShapeDtypeStruct``s. The StableHLO texts must be identical: same function, same micro-batch
count, same shardings, same optimizer constants (the schedule's length included)."""

import numpy as np
import pytest

from jaxflow.configs import load_config
from jaxflow.plan.dry_run import DEFAULT_PROGRAMS, OPTIONAL_PROGRAMS, plan
from jaxflow.sampling import lower_generate
from jaxflow.trainer.rl import RLTrainer
from jaxflow.workers.critic import CriticConfig
from jaxflow.workers.forward import PROMPT_KEYS

TINY = ["jaxflow.model.num_layers=1", "jaxflow.model.hidden_size=64", "jaxflow.model.intermediate_size=128",
        "data.train_batch_size=16", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8", "jaxflow.data.num_train_examples=64", "jaxflow.data.num_val_examples=8",
        "trainer.total_training_steps=3"]
CASES = {
    # ppo with a reward model and the in-reward KL (reference), micro-batched forwards
    "ppo_tiny": ["reward_model.enable=True", "algorithm.use_kl_in_reward=True",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device=2",
                 "reward_model.micro_batch_size_per_device=2", "critic.ppo_micro_batch_size_per_device=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=1"],
    # grpo in epoch mode (total_training_steps unset: the schedules' length from the data)
    "grpo_tiny": ["trainer.total_training_steps=None", "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=2"],
}


def _real_args(worker, name, rows, P, R):
    """The real worker's arguments of ``name``: its parameters (or train state) and zero
    columns placed by the worker itself."""
    cols = {k: np.zeros((rows, P if k.startswith("prompt") else R), np.int32) for k in PROMPT_KEYS}
    cols["prompt_mask"][:, -1] = 1
    if name.endswith("train_step"):
        keys = worker.config.update_keys() if name.startswith("actor") else CriticConfig.UPDATE_KEYS
        cols |= {k: np.zeros((rows, R), np.float32) for k in keys if k not in PROMPT_KEYS}
        scalars = {"temperature": np.float32(1.0)} if name.startswith("actor") else {}
        return worker.state, worker.put(cols), scalars
    scalars = {"temperature": np.float32(1.0)} if name.endswith("log_probs") else {}
    return worker.params, worker.put(cols), scalars


@pytest.mark.parametrize("config", sorted(CASES))
def test_dry_run_lowers_the_programs_the_run_calls(config, tmp_path):
    cfg = load_config(config, TINY + CASES[config] + [f"trainer.default_local_dir={tmp_path}"])
    trainer = RLTrainer(cfg)
    spec = trainer.spec
    report, programs = plan(trainer.cfg, DEFAULT_PROGRAMS + OPTIONAL_PROGRAMS)  # the placement it resolved
    w = trainer.workers
    groups = {"actor": w.actor, "ref": w.ref, "critic": w.critic, "reward": w.reward.model if w.reward else None}
    P, R, rows = spec.prompt_length, spec.response_length, spec.rollout_rows
    compared = []
    for program in programs:
        role, what = program.name.split("/")
        if what == "reshard":
            continue  # HybridEngine.report: the engine's own programs, not one jit
        worker = groups[role].worker
        if what == "generate":
            engine = worker.engine
            assert program.mesh is engine.gen_mesh or dict(program.mesh.shape) == dict(engine.gen_mesh.shape)
            with engine.generation(worker.params) as gen_params:
                n = spec.rollout.train.n
                ids = np.ones((program_rows(program) // n, P), np.int32)
                real = lower_generate(worker.graphdef, gen_params, ids, ids, spec.rollout.train,
                                      mesh=engine.gen_mesh, rules=engine.gen_rules).as_text()
        elif what == "train_step":
            fn = worker.train_program(worker.config.ppo_mini_batch_size)
            real = fn.lower(*_real_args(worker, program.name, worker.config.ppo_mini_batch_size, P, R)).as_text()
        else:
            fn = {"log_probs": lambda: worker.log_probs_program(rows), "values": lambda: worker.values_program(rows),
                  "scores": lambda: worker.scores_program(rows)}[what]()
            real = fn.lower(*_real_args(worker, program.name, rows, P, R)).as_text()
        planned = program.lower().as_text()
        assert planned == real, program.name
        compared.append(program.name)
    want = {"actor/generate", "actor/train_step", "actor/log_probs"} | (
        {"ref/log_probs", "reward/scores", "critic/values", "critic/train_step"} if config == "ppo_tiny" else set())
    assert want <= set(compared), set(compared)
    # The micro-batch counts are the configured ones (32 rows over 8 data-parallel ranks at 2
    # per device: 2 micro-batches), for the reference and the reward model alike.
    if config == "ppo_tiny":
        assert report.role("ref").micro_batches["ref/log_probs"] == rows // (2 * 8) == 2
        assert report.role("reward").micro_batches["reward/scores"] == rows // (2 * 8)


def program_rows(program) -> int:
    """Sequences of one generate call, from the plan's description (``... -> N sequences``)."""
    return int(program.description.split("-> ")[1].split(" ")[0])
