"""Every documented config key does something: changing it changes the run, or validation
refuses the change with an error naming the key.

`CHECKS` has one row per key of `jaxflow.configs.base.FIELDS` (so a key added without a row
fails `test_every_key_has_a_check`): a new value, the config context in which the key takes
effect (e.g. the critic's keys with a critic, a token budget with dynamic micro-batches),
and where the effect is observed, in what the run is built from: the typed run description
(`describe_run`: placement, meshes, model configs, worker configs, sampling, algorithm,
data, trainer and SFT settings), the datasets and data loader the trainer builds from it,
the tokenizer, the Ray backend's config, the auto-mapper's device profile, the dry run's
plan, or the CLI's choice of run directory. Nothing is allocated: no model is built and
nothing compiles (the dry run's plan lowers nothing either); the placement is built over
stand-in devices, so any device count plans.
"""

import functools
import json
import operator

import pytest

from jaxflow.configs import ConfigError, load_config
from jaxflow.configs.base import FIELDS
from jaxflow.configs.prepare import build_dataset, dataset_sources
from jaxflow.configs.run_spec import build_tokenizer, describe_run
from jaxflow.mesh.devices import FakeDevice
from jaxflow.trainer.builders import ray_config

BASE = [
    "jaxflow.placement.type=colocated",
    "reward_model.enable=True",
    "jaxflow.data.num_train_examples=64",
    "jaxflow.data.num_val_examples=8",
]


class View:
    """What the run is built from, for one config (each part computed on first use)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __repr__(self) -> str:
        return "View"

    @functools.cached_property
    def tokenizer(self):
        return build_tokenizer(self.cfg)

    @functools.cached_property
    def spec(self):
        devices = [FakeDevice(i) for i in range(self.cfg.jaxflow.num_devices)]
        return describe_run(self.cfg, tokenizer=self.tokenizer, devices=devices)

    @functools.cached_property
    def datasets(self):
        return [build_dataset(self.spec.data, source, self.tokenizer) for source in dataset_sources(self.spec.data)]


MT = "actor_rollout_ref.rollout.multi_turn"
MULTI_TURN = [f"{MT}.enable=True", "jaxflow.agent.tools=['calculator']"]


def spec(path):
    """Observed in the run description: ``spec.<path>``."""
    get = operator.attrgetter(path)
    return lambda v: get(v.spec)


def role(name, path):
    """Observed in a role's settings: ``spec.roles[name].<path>``."""
    get = operator.attrgetter(path)
    return lambda v: get(v.spec.roles[name])


def mesh(role, phase="train"):
    return lambda v: dict(v.spec.placement.mesh(role, phase).shape)


def model(role):
    return lambda v: v.spec.models[role].config


def pools(v):
    """Pool name -> (devices, roles)."""
    return {
        name: (v.spec.placement.pools[name].size, tuple(roles)) for name, roles in v.spec.placement.groups().items()
    }


def first_prompts(v):
    """The token ids of the first training and validation prompts."""
    return [ds.prompt_ids(0).tolist() for ds in v.datasets]


def sources(v):
    return [repr(s) for s in dataset_sources(v.spec.data)]


def epoch_order(v):
    from jaxflow.trainer.builders import train_loader

    return train_loader(v.spec, v.datasets[0]).epoch_order(0).tolist()


def profile(v):
    from jaxflow.automap.auto import placement_profile

    return placement_profile(v.spec)


def dry_run_budget(v):
    from jaxflow.configs.prepare import prepare_run
    from jaxflow.plan.dry_run import plan

    return plan(prepare_run(v.cfg, with_datasets=False).spec, ["actor/train_step"])[0].device_memory_bytes


def run_dir(v):
    from jaxflow.run import _run_dir

    return _run_dir(v.cfg)


# key -> (new value, context overrides, observer); or Refused(value, words).
class Refused(tuple):
    pass


A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"
CRITIC = ["critic.enable=True"]
PACKED = ["actor_rollout_ref.model.use_remove_padding=True"]
SAFE = ["jaxflow.safe_rlhf.enable=True", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
COST = SAFE + ["jaxflow.safe_rlhf.cost_model_path=preset:tiny_llama"]
# Split pools whose second half takes any size: critic and reward models replicated (dp).
SPLIT = [
    "jaxflow.placement.type=split",
    "jaxflow.placement.pool_sizes=(4,4)",
    "jaxflow.mesh.critic.dp=-1",
    "jaxflow.mesh.critic.fsdp=1",
    "jaxflow.mesh.reward.dp=-1",
    "jaxflow.mesh.reward.fsdp=1",
    "actor_rollout_ref.rollout.n=6",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=8",
    "critic.ppo_micro_batch_size_per_device=4",
]
GDPO = ["algorithm.adv_estimator=gdpo", f"{R}.n=2", "algorithm.gdpo_reward_keys=[fmt]"]
RC = "algorithm.rollout_correction"
BYPASS = [f"{RC}.bypass_mode=True"]
FG, OB = "algorithm.filter_groups", "reward_model.overlong_buffer"
FILTER = [f"{FG}.enable=True", f"{FG}.metric=acc"]
OVERLONG = [f"{OB}.enable=True", f"{OB}.len=2"]
LORA = ["actor_rollout_ref.model.lora_rank=8"]
CRITIC_LORA = ["critic.model.lora_rank=8"]
FILES = "@files"  # replaced by the test's data files (train with a long prompt, val)


def _optim(prefix, role, context, style):
    """``style``: a warmup style other than the base config's (ppo_tiny: cosine for the actor)."""
    return {
        f"{prefix}.optim.lr": (3e-5, context, spec(f"{role}.optim.lr")),
        f"{prefix}.optim.lr_warmup_steps": (5, context, spec(f"{role}.optim.num_warmup_steps")),
        f"{prefix}.optim.lr_warmup_steps_ratio": (0.5, context, spec(f"{role}.optim.num_warmup_steps")),
        f"{prefix}.optim.warmup_style": (style, context, spec(f"{role}.optim.warmup_style")),
        f"{prefix}.optim.min_lr_ratio": (
            0.3,
            context + [f"{prefix}.optim.warmup_style=cosine"],
            spec(f"{role}.optim.min_lr_ratio"),
        ),
        f"{prefix}.optim.weight_decay": (0.1, context, spec(f"{role}.optim.weight_decay")),
        f"{prefix}.optim.betas": ((0.8, 0.99), context, spec(f"{role}.optim.betas")),
        f"{prefix}.grad_clip": (0.5, context, spec(f"{role}.optim.grad_clip")),
    }


def _mesh(role):
    prefix = f"jaxflow.mesh.{role}"
    context = COST if role == "cost" else []
    return {
        f"{prefix}.dp": (2, context, mesh(role)),
        f"{prefix}.fsdp": (4, context + [f"{prefix}.dp=-1", f"{prefix}.fsdp=8"], mesh(role)),
        f"{prefix}.tp": (2, context, mesh(role)),
    }


CHECKS = {
    # --- data
    "data.train_files": (FILES, [], sources),
    "data.val_files": (FILES, [], sources),
    "data.prompt_key": (
        "question",
        [f"data.train_files={FILES}", f"data.val_files={FILES}", "data.truncation=right"],
        first_prompts,
    ),
    "data.reward_fn_key": Refused(("answer", "by the data_source column only")),
    "data.max_prompt_length": (12, [], spec("prompt_length")),
    "data.max_response_length": (6, [], spec("rollout.train.max_new_tokens")),
    "data.train_batch_size": (16, [], spec("train_batch_size")),
    "data.val_batch_size": (4, [], spec("data.val_batch_size")),
    "data.truncation": (
        "right",
        [f"data.train_files={FILES}", f"data.val_files={FILES}", "data.truncation=left"],
        first_prompts,
    ),
    "data.shuffle": (False, [], epoch_order),
    "data.seed": (7, [], epoch_order),
    # --- actor / reference / rollout
    "actor_rollout_ref.model.path": ("preset:tiny_qwen2", [], model("actor")),
    "actor_rollout_ref.model.use_remove_padding": (True, [], spec("actor.use_remove_padding")),
    "actor_rollout_ref.model.lora_rank": (8, [], spec("actor.lora")),
    "actor_rollout_ref.model.lora_alpha": (32.0, LORA, spec("actor.lora")),
    "actor_rollout_ref.model.target_modules": ("q_proj,v_proj", LORA, spec("actor.lora")),
    "actor_rollout_ref.model.lora_dropout": (0.1, LORA, spec("actor.lora")),
    "actor_rollout_ref.model.lora_adapter_path": ("@adapter", [], spec("actor.lora")),
    f"{A}.ppo_mini_batch_size": (16, [], spec("actor.ppo_mini_batch_size")),
    f"{A}.ppo_micro_batch_size_per_device": (8, [], spec("actor.ppo_micro_batch_size_per_device")),
    f"{A}.ppo_epochs": (2, [], spec("actor.ppo_epochs")),
    f"{A}.use_dynamic_bsz": (True, PACKED, spec("actor.use_dynamic_bsz")),
    f"{A}.ppo_max_token_len_per_device": (
        64,
        PACKED + [f"{A}.use_dynamic_bsz=True"],
        spec("actor.ppo_max_token_len_per_device"),
    ),
    f"{A}.shuffle": (True, [], spec("actor.shuffle")),
    f"{A}.clip_ratio_low": (0.1, [], spec("actor.clip_ratio_low")),
    f"{A}.clip_ratio_high": (0.3, [], spec("actor.clip_ratio_high")),
    f"{A}.clip_ratio_c": (2.0, [], spec("actor.clip_ratio_c")),
    f"{A}.tau_pos": (1.5, [f"{A}.policy_loss.loss_mode=sapo"], spec("actor.policy_loss_kwargs")),
    f"{A}.tau_neg": (1.5, [f"{A}.policy_loss.loss_mode=sapo"], spec("actor.policy_loss_kwargs")),
    f"{A}.loss_agg_mode": ("seq-mean-token-mean", [], spec("actor.loss_agg_mode")),
    f"{A}.policy_loss.loss_mode": ("gspo", [], spec("actor.loss_mode")),
    f"{A}.policy_loss.clip_cov_ratio": (
        0.01,
        [f"{A}.policy_loss.loss_mode=clip_cov"],
        spec("actor.policy_loss_kwargs"),
    ),
    f"{A}.policy_loss.clip_cov_lb": (2.0, [f"{A}.policy_loss.loss_mode=clip_cov"], spec("actor.policy_loss_kwargs")),
    f"{A}.policy_loss.clip_cov_ub": (4.0, [f"{A}.policy_loss.loss_mode=clip_cov"], spec("actor.policy_loss_kwargs")),
    f"{A}.policy_loss.kl_cov_ratio": (0.01, [f"{A}.policy_loss.loss_mode=kl_cov"], spec("actor.policy_loss_kwargs")),
    f"{A}.policy_loss.ppo_kl_coef": (0.5, [f"{A}.policy_loss.loss_mode=kl_cov"], spec("actor.policy_loss_kwargs")),
    f"{A}.policy_loss.dro_beta": (
        0.5,
        [f"{A}.policy_loss.loss_mode=dro", f"{A}.policy_loss.dro_beta=0.1"],
        spec("actor.policy_loss_kwargs"),
    ),
    f"{A}.entropy_coeff": (0.02, [], spec("actor.entropy_coeff")),
    f"{A}.use_kl_loss": (True, ["algorithm.use_kl_in_reward=False"], spec("roles")),  # the reference runs for it
    f"{A}.kl_loss_type": ("mse", [f"{A}.use_kl_loss=True"], spec("actor.kl_loss_type")),
    f"{A}.kl_loss_coef": (0.1, [f"{A}.use_kl_loss=True"], spec("actor.kl_loss_coef")),
    **_optim(A, "actor", [], "constant"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device": (8, [], role("ref", "micro_batch_size_per_device")),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": (True, PACKED, role("ref", "max_token_len_per_device")),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_device": (
        64,
        PACKED + ["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True"],
        role("ref", "max_token_len_per_device"),
    ),
    f"{R}.n": (4, [], spec("n")),
    f"{R}.temperature": (0.7, [], spec("rollout.temperature")),
    f"{R}.top_p": (0.9, [], spec("rollout.train.top_p")),
    f"{R}.top_k": (5, [], spec("rollout.train.top_k")),
    f"{R}.do_sample": (False, [], spec("rollout.train.greedy")),
    f"{R}.ignore_eos": (True, [], spec("rollout.train.eos_token_ids")),
    f"{R}.max_num_seqs": (16, [], spec("rollout.max_num_seqs")),
    f"{R}.max_total_tokens": (512, [], spec("rollout.max_total_tokens")),
    "jaxflow.data.tool_fraction": (0.5, ["jaxflow.data.builtin_task=calculator"], spec("data.task_params")),
    "jaxflow.data.sum_fraction": (0.5, ["jaxflow.data.builtin_task=calculator"], spec("data.task_params")),
    f"{MT}.enable": (True, ["jaxflow.agent.tools=['calculator']"], spec("rollout.multi_turn")),
    f"{MT}.max_assistant_turns": (2, MULTI_TURN, spec("rollout.multi_turn.config.max_assistant_turns")),
    f"{MT}.max_user_turns": (1, MULTI_TURN, spec("rollout.multi_turn.config.max_user_turns")),
    "jaxflow.agent.reuse_kv": (False, MULTI_TURN, spec("rollout.multi_turn.reuse_kv")),
    f"{MT}.format": ("llama3", MULTI_TURN, spec("rollout.multi_turn.config.fmt")),
    f"{MT}.tool_config_path": ("@tools", MULTI_TURN, spec("rollout.multi_turn.tools")),
    f"{MT}.interaction_config_path": ("@interaction", MULTI_TURN, spec("rollout.multi_turn.environment")),
    "jaxflow.agent.tools": (
        ["calculator"],
        [f"{MT}.enable=True", f"{MT}.tool_config_path=@tools"],
        spec("rollout.multi_turn.tools"),
    ),
    f"{R}.stop": (["=="], [], spec("rollout.train.stop")),
    f"{R}.stop_token_ids": ([7], [], spec("rollout.train.eos_token_ids")),
    f"{R}.log_prob_micro_batch_size_per_device": (8, [], spec("actor.log_prob_micro_batch_size_per_device")),
    f"{R}.log_prob_use_dynamic_bsz": (True, PACKED, spec("actor.log_prob_use_dynamic_bsz")),
    f"{R}.log_prob_max_token_len_per_device": (
        64,
        PACKED + [f"{R}.log_prob_use_dynamic_bsz=True"],
        spec("actor.log_prob_max_token_len_per_device"),
    ),
    f"{R}.val_kwargs.n": (2, [], spec("rollout.val.n")),
    f"{R}.val_kwargs.temperature": (
        0.7,
        [f"{R}.val_kwargs.do_sample=True", f"{R}.val_kwargs.temperature=0.5"],
        spec("rollout.val.temperature"),
    ),
    f"{R}.val_kwargs.top_p": (
        0.9,
        [f"{R}.val_kwargs.do_sample=True", f"{R}.val_kwargs.temperature=0.5"],
        spec("rollout.val.top_p"),
    ),
    f"{R}.val_kwargs.top_k": (
        5,
        [f"{R}.val_kwargs.do_sample=True", f"{R}.val_kwargs.temperature=0.5"],
        spec("rollout.val.top_k"),
    ),
    f"{R}.val_kwargs.do_sample": (True, [f"{R}.val_kwargs.temperature=0.5"], spec("rollout.val.greedy")),
    # --- critic
    "critic.enable": (False, ["algorithm.adv_estimator=grpo", f"{R}.n=2"], spec("roles")),
    "critic.model.path": ("preset:tiny_qwen2", CRITIC, model("critic")),
    **_optim(C, "critic", CRITIC, "cosine"),
    "critic.model.use_remove_padding": (True, CRITIC, spec("critic.use_remove_padding")),
    "critic.model.lora_rank": (8, CRITIC, spec("critic.lora")),
    "critic.model.lora_alpha": (32.0, CRITIC + CRITIC_LORA, spec("critic.lora")),
    "critic.model.target_modules": ("q_proj,v_proj", CRITIC + CRITIC_LORA, spec("critic.lora")),
    "critic.model.lora_dropout": (0.1, CRITIC + CRITIC_LORA, spec("critic.lora")),
    "critic.use_dynamic_bsz": (True, CRITIC + ["critic.model.use_remove_padding=True"], spec("critic.use_dynamic_bsz")),
    "critic.ppo_max_token_len_per_device": (
        64,
        CRITIC + ["critic.model.use_remove_padding=True", "critic.use_dynamic_bsz=True"],
        spec("critic.ppo_max_token_len_per_device"),
    ),
    "critic.forward_max_token_len_per_device": (
        64,
        CRITIC + ["critic.model.use_remove_padding=True", "critic.use_dynamic_bsz=True"],
        spec("critic.forward_max_token_len_per_device"),
    ),
    "critic.ppo_mini_batch_size": (16, CRITIC, spec("critic.ppo_mini_batch_size")),
    "critic.ppo_micro_batch_size_per_device": (4, CRITIC, spec("critic.ppo_micro_batch_size_per_device")),
    "critic.forward_micro_batch_size_per_device": (8, CRITIC, spec("critic.forward_micro_batch_size_per_device")),
    "critic.ppo_epochs": (2, CRITIC, spec("critic.ppo_epochs")),
    "critic.shuffle": (True, CRITIC, spec("critic.shuffle")),
    "critic.cliprange_value": (0.2, CRITIC, spec("critic.cliprange_value")),
    "critic.loss_agg_mode": ("seq-mean-token-sum", CRITIC, spec("critic.loss_agg_mode")),
    # --- reward
    "reward_model.enable": (False, [], spec("roles")),
    "reward_model.model.path": ("preset:tiny_qwen2", [], model("reward")),
    "reward_model.model.use_remove_padding": (True, [], role("reward", "use_remove_padding")),
    "reward_model.micro_batch_size_per_device": (8, [], role("reward", "micro_batch_size_per_device")),
    "custom_reward_function.path": ("@reward", [], spec("reward.custom_reward_path")),
    f"{OB}.enable": (True, [f"{OB}.len=2"], spec("overlong")),
    f"{OB}.len": (3, OVERLONG, spec("overlong.length")),
    f"{OB}.penalty_factor": (0.5, OVERLONG, spec("overlong.penalty_factor")),
    f"{OB}.log": (True, OVERLONG, spec("overlong.log")),
    "custom_reward_function.name": (
        "score_it",
        ["custom_reward_function.path=@reward"],
        spec("reward.custom_reward_name"),
    ),
    # --- algorithm
    "algorithm.adv_estimator": ("grpo", [f"{R}.n=2"], spec("algorithm.algorithm.adv_estimator")),
    "algorithm.gamma": (0.9, [], spec("algorithm.algorithm.gamma")),
    "algorithm.gdpo_reward_keys": (["fmt", "acc"], GDPO, spec("algorithm.algorithm.gdpo_reward_keys")),
    "algorithm.gdpo_reward_weights": (
        [1.0, 2.0],
        GDPO + ["algorithm.gdpo_reward_keys=[fmt,acc]"],
        spec("algorithm.algorithm.gdpo_reward_weights"),
    ),
    "algorithm.lam": (0.95, [], spec("algorithm.algorithm.lam")),
    f"{FG}.enable": (True, [f"{FG}.metric=acc"], spec("algorithm.algorithm.filter_groups.enable")),
    f"{FG}.metric": ("seq_reward", FILTER, spec("algorithm.algorithm.filter_groups.metric")),
    f"{FG}.max_num_gen_batches": (5, FILTER, spec("algorithm.algorithm.filter_groups.max_num_gen_batches")),
    "algorithm.norm_adv_by_std_in_grpo": (
        False,
        ["algorithm.adv_estimator=grpo", f"{R}.n=2"],
        spec("algorithm.algorithm.norm_adv_by_std_in_grpo"),
    ),
    "algorithm.use_kl_in_reward": (False, [], spec("algorithm.algorithm.use_kl_in_reward")),
    "algorithm.kl_penalty": ("low_var_kl", [], spec("algorithm.algorithm.kl_penalty")),
    "algorithm.kl_ctrl.type": ("adaptive", [], spec("algorithm.algorithm.kl_ctrl.type")),
    "algorithm.kl_ctrl.kl_coef": (0.01, [], spec("algorithm.algorithm.kl_ctrl.kl_coef")),
    "algorithm.kl_ctrl.horizon": (
        500,
        ["algorithm.kl_ctrl.type=adaptive"],
        spec("algorithm.algorithm.kl_ctrl.horizon"),
    ),
    "algorithm.kl_ctrl.target_kl": (
        0.5,
        ["algorithm.kl_ctrl.type=adaptive"],
        spec("algorithm.algorithm.kl_ctrl.target_kl"),
    ),
    f"{RC}.bypass_mode": (True, [], spec("actor.loss_mode")),
    f"{RC}.loss_type": ("reinforce", BYPASS, spec("actor.policy_loss_kwargs")),
    f"{RC}.rollout_is": ("token", BYPASS, spec("actor.policy_loss_kwargs")),
    f"{RC}.rollout_is_threshold": ("0.5_3.0", BYPASS + [f"{RC}.rollout_is=token"], spec("actor.policy_loss_kwargs")),
    f"{RC}.rollout_is_batch_normalize": (True, BYPASS + [f"{RC}.rollout_is=token"], spec("actor.policy_loss_kwargs")),
    f"{RC}.rollout_rs": ("token_k1", BYPASS + [f"{RC}.rollout_rs_threshold=2.0"], spec("actor.policy_loss_kwargs")),
    f"{RC}.rollout_rs_threshold": (
        "3.0",
        BYPASS + [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2.0"],
        spec("actor.policy_loss_kwargs"),
    ),
    # --- trainer
    "trainer.total_epochs": (3, ["trainer.total_training_steps=None"], spec("training_steps")),
    "trainer.total_training_steps": (7, [], spec("training_steps")),
    "trainer.project_name": ("elsewhere", [], spec("trainer.run_dir")),
    "trainer.experiment_name": ("other", [], spec("trainer.run_dir")),
    "trainer.logger": (["console", "tensorboard"], [], spec("trainer.logger")),
    "trainer.log_val_generations": (3, [], spec("trainer.log_val_generations")),
    "trainer.save_freq": (10, [], spec("trainer.save_freq")),
    "trainer.save_hf": (True, [], spec("trainer.save_hf")),
    "trainer.test_freq": (10, [], spec("trainer.test_freq")),
    "trainer.val_before_train": (False, [], spec("trainer.val_before_train")),
    "trainer.critic_warmup": (2, [], spec("actor.optim.total_training_steps")),  # the actor's updates start later
    "trainer.balance_batch": (True, [], spec("actor.log_balance")),
    "trainer.resume_mode": ("disable", [], spec("trainer.resume_mode")),
    "trainer.resume_from_path": (
        "/elsewhere",
        ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt"],
        spec("trainer.resume_from_path"),
    ),
    "trainer.default_local_dir": ("/tmp/run", [], spec("trainer.run_dir")),
    "trainer.max_actor_ckpt_to_keep": (2, [], spec("trainer.max_ckpt_to_keep")),
    "trainer.max_critic_ckpt_to_keep": (2, [], spec("trainer.max_ckpt_to_keep")),
    "trainer.seed": (5, [], spec("seed")),
    # --- jaxflow: system
    "jaxflow.job": ("sft", [], spec("roles")),
    "jaxflow.backend": ("ray", [], spec("trainer.backend")),
    "jaxflow.ray.address": ("auto", [], lambda v: ray_config(v.spec).address),
    "jaxflow.ray.devices_per_host": (4, [], lambda v: ray_config(v.spec).devices_per_host),
    "jaxflow.ray.accelerator": ("gpu", [], lambda v: ray_config(v.spec).accelerator),
    "jaxflow.ray.cpus_per_host": (2.0, [], lambda v: ray_config(v.spec).cpus_per_host),
    "jaxflow.ray.compile_deadline_s": (60.0, [], lambda v: ray_config(v.spec).compile_deadline_s),
    "jaxflow.ray.step_deadline_s": (60.0, [], lambda v: ray_config(v.spec).step_deadline_s),
    "jaxflow.ray.sync_deadline_s": (60.0, [], lambda v: ray_config(v.spec).sync_deadline_s),
    "jaxflow.ray.schedule_timeout_s": (5.0, [], lambda v: ray_config(v.spec).schedule_timeout_s),
    "jaxflow.ray.max_restarts": (2, [], spec("trainer.max_restarts")),
    "jaxflow.ray.tpu_topology": ("2x2", ["jaxflow.ray.tpu_version=v5p"], lambda v: ray_config(v.spec).tpu_topology),
    "jaxflow.ray.tpu_version": (
        "v6e",
        ["jaxflow.ray.tpu_topology=2x2", "jaxflow.ray.tpu_version=v5p"],
        lambda v: ray_config(v.spec).tpu_version,
    ),
    "jaxflow.num_devices": (4, [], spec("num_devices")),
    "jaxflow.placement.type": ("split", [], pools),
    "jaxflow.placement.device_kind": ("h100", ["jaxflow.placement.type=auto"], profile),
    "jaxflow.placement.devices_per_host": (4, ["jaxflow.placement.type=auto"], profile),
    "jaxflow.placement.groups": (
        "actor,critic;ref,reward",
        ["jaxflow.placement.type=custom", "jaxflow.placement.groups=actor,ref;critic,reward"],
        pools,
    ),
    "jaxflow.placement.pool_sizes": ((2, 6), SPLIT, pools),
    # the last 4 devices are the rollout pool: the roles' pools share the first 4
    "jaxflow.placement.rollout_devices": (4, [], pools),
    "jaxflow.mesh.actor.train.dp": (2, [], mesh("actor")),
    "jaxflow.mesh.actor.train.fsdp": (
        2,
        ["jaxflow.mesh.actor.train.dp=-1", "jaxflow.mesh.actor.train.fsdp=4"],
        mesh("actor"),
    ),
    "jaxflow.mesh.actor.train.tp": (1, [], mesh("actor")),
    "jaxflow.mesh.actor.generate.tp": (1, [], mesh("actor", "generate")),
    **_mesh("critic"),
    **_mesh("ref"),
    **_mesh("reward"),
    **_mesh("cost"),
    # --- jaxflow: model
    "jaxflow.model.preset": ("tiny_qwen2", [], model("actor")),
    "jaxflow.model.vocab_size": (256, [], model("actor")),
    "jaxflow.model.hidden_size": (64, [], model("actor")),
    "jaxflow.model.intermediate_size": (256, [], model("actor")),
    "jaxflow.model.num_layers": (3, [], model("actor")),
    "jaxflow.model.num_heads": (4, [], model("actor")),
    "jaxflow.model.num_kv_heads": (2, [], model("actor")),
    "jaxflow.model.dtype": ("bfloat16", [], model("actor")),
    "jaxflow.model.compute_dtype": ("bfloat16", [], model("actor")),
    "jaxflow.model.scan_layers": (True, [], model("actor")),
    "jaxflow.model.remat_policy": ("full", [], model("actor")),
    "jaxflow.optim.state_dtype": ("bfloat16", [], spec("actor.optim.state_dtype")),
    # --- jaxflow: data / reward / trainer
    "jaxflow.data.builtin_task": ("sort", ["data.max_prompt_length=24"], first_prompts),
    "jaxflow.data.addition_digits": (2, [], first_prompts),
    "jaxflow.data.num_train_examples": (128, ["trainer.total_training_steps=None"], spec("training_steps")),
    "jaxflow.data.num_val_examples": (16, [], lambda v: len(v.datasets[1])),
    "jaxflow.data.tokenizer": ("@tokenizer", [], lambda v: type(v.tokenizer).__name__),
    "jaxflow.reward.timeout_s": (1.0, [], spec("reward.timeout_s")),
    "jaxflow.reward.batch_timeout_s": (10.0, [], spec("reward.batch_timeout_s")),
    "jaxflow.reward.load_timeout_s": (10.0, [], spec("reward.load_timeout_s")),
    "jaxflow.reward.max_failure_fraction": (0.9, [], spec("reward.max_failure_fraction")),
    "jaxflow.reward.sandbox": ("off", [], spec("reward.sandbox")),
    "trainer.mode": ("one_step_off", [], spec("trainer.mode")),
    "trainer.max_staleness": (2, [], spec("trainer.max_staleness")),
    "trainer.partial_rollout": (
        True,
        ["jaxflow.placement.rollout_devices=4", "trainer.mode=async"],
        spec("trainer.partial_rollout"),
    ),
    "trainer.partial_rollout_segment": (
        4,
        ["jaxflow.placement.rollout_devices=4", "trainer.mode=async", "trainer.partial_rollout=true"],
        spec("trainer.partial_rollout_segment"),
    ),
    "jaxflow.trainer.max_nonfinite_steps": (1, [], spec("trainer.max_nonfinite_steps")),
    "jaxflow.trainer.resume_other_experiment": (True, [], spec("trainer.resume_other_experiment")),
    "jaxflow.trainer.compile_ahead": ("on", [], spec("trainer.compile_ahead")),
    "jaxflow.trainer.rollout_agreement": (True, [], spec("algorithm.rollout_agreement")),
    "jaxflow.rollout_probe.enable": ("on", [], spec("rollout.probe_tolerance")),
    "jaxflow.rollout_probe.tolerance": (0.1, LORA, spec("rollout.probe_tolerance")),
    # --- jaxflow: SFT
    "jaxflow.sft.steps": (10, [], spec("sft.steps")),
    "jaxflow.sft.warm_start_steps": (10, [], spec("sft.warm_start_steps")),
    "jaxflow.sft.lr": (1e-4, [], spec("sft.lr")),
    "jaxflow.sft.warmup_steps": (2, [], spec("sft.warmup_steps")),
    "jaxflow.sft.weight_decay": (0.1, [], spec("sft.weight_decay")),
    "jaxflow.sft.batch_size": (32, [], spec("sft.batch_size")),
    "jaxflow.sft.micro_batch_size_per_device": (4, [], spec("sft.micro_batch_size_per_device")),
    "jaxflow.sft.test_freq": (10, [], spec("sft.test_freq")),
    "jaxflow.sft.output_dir": ("/tmp/sft", [], spec("sft.output_dir")),
    # --- jaxflow: Safe RLHF
    "jaxflow.safe_rlhf.enable": (True, [], spec("algorithm.safe_rlhf.enable")),
    "jaxflow.safe_rlhf.cost_model_path": ("preset:tiny_llama", SAFE, spec("roles")),
    "jaxflow.safe_rlhf.cost_rule": ("length", SAFE, spec("algorithm.safe_rlhf.cost_rule")),
    "jaxflow.safe_rlhf.forbidden_chars": ("7", SAFE, spec("algorithm.safe_rlhf.forbidden_chars")),
    "jaxflow.safe_rlhf.cost_threshold": (0.3, SAFE, spec("algorithm.safe_rlhf.cost_threshold")),
    "jaxflow.safe_rlhf.lambda_init": (0.5, SAFE, spec("algorithm.safe_rlhf.lambda_init")),
    "jaxflow.safe_rlhf.lambda_lr": (0.1, SAFE, spec("algorithm.safe_rlhf.lambda_lr")),
    "jaxflow.safe_rlhf.lambda_update_scale": ("log", SAFE, spec("algorithm.safe_rlhf.lambda_update_scale")),
    "jaxflow.safe_rlhf.lambda_max": (5.0, SAFE, spec("algorithm.safe_rlhf.lambda_max")),
    # --- jaxflow: dry run
    "jaxflow.dry_run.enable": (True, [], run_dir),
    "jaxflow.dry_run.device_memory_gib": (40.0, [], dry_run_budget),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``@files``: a data file (a ``prompt`` and a ``question`` column, one prompt longer than
    any max_prompt_length here); ``@reward``: a reward function file; ``@tokenizer``: the
    char tokenizer as a tokenizer.json; ``@adapter``: a PEFT adapter's config (rank 4);
    ``@tools``: a tool config with one tool from a file; ``@interaction``: an interaction
    config (its factory from the same file)."""
    from jaxflow.data.char_tokenizer import CharTokenizer
    from jaxflow.models.lora import LoRAConfig
    from jaxflow.models.peft_io import ADAPTER_CONFIG, peft_config

    root = tmp_path_factory.mktemp("keys")
    rows = [
        {
            "data_source": "jaxflow/addition",
            "prompt": f"{i}+{i}=",
            "question": f"what is {i}+{i}?",
            "reward_model": {"ground_truth": str(2 * i)},
            "extra_info": {},
        }
        for i in range(40)
    ]
    rows[0]["prompt"], rows[0]["question"] = "1+2+3+4+5+6+7+8+9+10+11=", "what is 1+2+3+4+5+6+7+8+9+10+11?"
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.0\n\n\nscore_it = compute_score\n"
    )
    CharTokenizer().backend.save(str(root / "tokenizer.json"))
    (root / "echo.py").write_text("def echo(text):\n    return text\n")
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
    (root / "tools.json").write_text(json.dumps({"tools": [{"callable": "echo.py:echo", "tool_schema": schema}]}))
    (root / "interaction.json").write_text(json.dumps({"interaction": [{"name": "e", "callable": "echo.py:echo"}]}))
    (root / "adapter").mkdir()
    (root / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(peft_config(LoRAConfig(rank=4, alpha=8.0), "")))
    return {
        "@files": str(root / "data.jsonl"),
        "@reward": str(root / "reward.py"),
        "@tokenizer": str(root / "tokenizer.json"),
        "@adapter": str(root / "adapter"),
        "@tools": str(root / "tools.json"),
        "@interaction": str(root / "interaction.json"),
    }


def _text(value, files):
    text = str(list(value) if isinstance(value, list) else value)
    for name, path in files.items():
        text = text.replace(name, path)
    return text


def _load(overrides, files):
    return load_config("ppo_tiny", [_text(o, files) for o in BASE + overrides])


def test_every_key_has_a_check():
    keys = [key for key, *_ in FIELDS]
    assert set(CHECKS) == set(keys), {"unchecked": set(keys) - set(CHECKS), "not a key": set(CHECKS) - set(keys)}
    print(f"{len(CHECKS)} documented keys checked")


@pytest.mark.parametrize("key", [key for key, *_ in FIELDS])
def test_key_changes_the_run_or_is_refused(key, files):
    check = CHECKS[key]
    if isinstance(check, Refused):
        value, words = check
        with pytest.raises(ConfigError, match=words) as info:
            _load([f"{key}={value}"], files)
        assert key in str(info.value)
        return
    value, context, observe = check
    before = _load(context, files)
    after = _load(context + [f"{key}={_text(value, files)}"], files)
    assert observe(View(before)) != observe(View(after)), key
