"""The one typed description of a run: an experiment config (ml_collections, verl's keys) in,
a frozen `RunSpec` out. Real runs (`jaxflow.trainer`), dry runs (`jaxflow.plan`), the SFT job
and the auto-mapper consume it, through `jaxflow.configs.prepare.prepare_run` (the spec, the
tokenizer and the prompts); nothing below them reads a raw config key. Each key is read here
once (``rollout.n`` included)::

    spec = describe_run(cfg, tokenizer=tok)       # after configs.validate(cfg)
    spec.placement.mesh("actor", "train")         # meshes and rules per role and phase
    spec.roles["ref"], spec.actor, spec.rollout   # each active role's settings
    spec.algorithm                                # what the algorithm's iteration reads

Sizes. verl's batch keys count prompts; the worker configs count responses (``* n``).
Optimizer steps (the learning-rate schedules' length) are counted per role:
``training_steps * ppo_epochs * (train_batch_size / ppo_mini_batch_size)``, the actor's
without the ``trainer.critic_warmup`` steps in which it does not update. ``training_steps`` is
``trainer.total_training_steps`` or, when that is unset, ``total_epochs * (prompts //
train_batch_size)`` (the loader drops the last partial batch).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ml_collections import ConfigDict

from jaxflow.agents import AgentConfig
from jaxflow.agents.rollout import MultiTurn, load_environment, load_tools
from jaxflow.algos.settings import (
    AlgorithmConfig,
    AlgorithmSettings,
    RolloutCorrectionConfig,
    SafeRLHFConfig,
)
from jaxflow.configs.overrides import ConfigError
from jaxflow.configs.resolve import (
    PRESET_PREFIX,
    active_roles,
    build_placement,
    checkpoint_dir,
    lora_config,
    model_config,
    model_path,
    platform,
    ref_in_actor,
)
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.tokenizer import load_tokenizer
from jaxflow.mesh import Placement, Role
from jaxflow.models import ModelConfig
from jaxflow.rewards import OverlongBuffer
from jaxflow.sampling import SamplingParams
from jaxflow.workers import (
    ActorConfig,
    CriticConfig,
    ForwardConfig,
    OptimConfig,
    RoleSettings,
    RolloutConfig,
)

# Policy-loss options of the modes that take them (actor_rollout_ref.actor.policy_loss.*).
POLICY_LOSS_OPTIONS = {
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "dro": ("dro_beta",),
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where a role's weights come from and their shape.

    ``path``: an HF checkpoint directory, or ``""`` for a preset initialised from ``seed``.
    ``config``: the `ModelConfig` (dtypes, scanning and remat from ``jaxflow.model``); None
    only for a checkpoint without a ``config.json``. ``follows_actor``: the role starts from
    the actor's configured weights (``actor_rollout_ref.model.path``): the reference always,
    the critic when ``critic.model.path`` is empty; a warm start replaces them together.
    """

    role: str
    head: str
    path: str
    config: ModelConfig | None
    seed: int
    follows_actor: bool = False

    @property
    def is_preset(self) -> bool:
        return not self.path


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """The rule scorer (`jaxflow.rewards.RewardScorer`'s settings): the custom function and its
    time limits per sample, per batch and for loading, the failure fraction that stops the
    run, and whether the code reward's untrusted code must run isolated (``sandbox``)."""

    custom_reward_path: str | None
    custom_reward_name: str
    timeout_s: float
    batch_timeout_s: float
    load_timeout_s: float
    max_failure_fraction: float
    sandbox: str


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The prompts (verl's ``data``, ``jaxflow.data``): ``train_files`` / ``val_files`` (empty:
    the built-in task ``builtin_task`` with ``task_params``, ``num_train_examples`` /
    ``num_val_examples`` drawn with ``seed``), the prompt column, the prompt length and what
    happens to longer prompts, the training order (``shuffle``, ``seed``) and the validation
    batch (None: the whole set)."""

    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    builtin_task: str
    task_params: tuple[tuple[str, Any], ...]
    num_train_examples: int
    num_val_examples: int
    prompt_key: str
    max_prompt_length: int
    truncation: str
    shuffle: bool
    seed: int
    val_batch_size: int | None


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """The loop's plumbing (verl's ``trainer``, ``jaxflow.trainer``): where the run writes
    (``run_dir``) and what it logs, when it validates and checkpoints, how it resumes, how
    many checkpoints it keeps (the stricter of the actor's and the critic's limits; None:
    all), the non-finite guard, the driver (``backend``) and its restarts."""

    project_name: str
    experiment_name: str
    run_dir: str
    logger: tuple[str, ...]
    log_val_generations: int
    test_freq: int
    val_before_train: bool
    save_freq: int
    save_hf: bool
    resume_mode: str
    resume_from_path: str | None
    resume_other_experiment: bool
    max_ckpt_to_keep: int | None
    max_nonfinite_steps: int
    backend: str
    max_restarts: int
    compile_ahead: bool  # `jaxflow.trainer.compile_ahead.compile_ahead` before step 1
    mode: str  # sync | one_step_off | async (`jaxflow.trainer.ahead`)
    max_staleness: int
    partial_rollout: bool  # a sync interrupts the rollouts in flight (`jaxflow.trainer.rollouter`)
    partial_rollout_segment: int  # tokens per row between two chances to park for a sync


@dataclasses.dataclass(frozen=True)
class SFTSpec:
    """The supervised job (``jaxflow.sft``). ``warm_start_steps``: an RL run's warm start, 0
    when the actor has weights of its own (``actor_rollout_ref.model.path``)."""

    steps: int
    warm_start_steps: int
    lr: float
    warmup_steps: int
    weight_decay: float
    batch_size: int
    micro_batch_size_per_device: int
    test_freq: int
    output_dir: str


@dataclasses.dataclass(frozen=True)
class MappingSpec:
    """How the pools and meshes are chosen (``jaxflow.placement``): ``type`` ``auto`` (the
    auto-mapper at start-up, `jaxflow.automap.auto_place`), ``colocated``, ``split`` or
    ``custom``; for ``auto``, the device profile ``device_kind`` (``""``: the local devices')
    and its ``devices_per_host`` (0: the profile's; on Ray, ``jaxflow.ray.devices_per_host``);
    ``rollout_devices``: the last devices, the actor's rollout pool (0: none;
    `jaxflow.trainer.rollouter`)."""

    type: str
    device_kind: str
    devices_per_host: int
    rollout_devices: int = 0


@dataclasses.dataclass(frozen=True)
class DryRunSpec:
    """``jaxflow.dry_run``: plan and compile instead of training, against ``device_memory_gib``
    per device."""

    enable: bool
    device_memory_gib: float


@dataclasses.dataclass(frozen=True)
class RaySpec:
    """``jaxflow.ray`` (the Ray backend's hosts, bundles and deadlines; its restarts:
    `TrainerSpec.max_restarts`): what the trainer builds the backend's ``RayConfig`` from."""

    address: str
    devices_per_host: int
    cpus_per_host: float
    accelerator: str
    compile_deadline_s: float
    step_deadline_s: float
    sync_deadline_s: float
    schedule_timeout_s: float
    tpu_topology: str
    tpu_version: str


RoleConfig = ActorConfig | CriticConfig | ForwardConfig


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a run (or a plan of it) needs to know, typed.

    Attributes:
      name: ``trainer.experiment_name``; ``job``: ``rl`` | ``sft``.
      placement: pools, meshes and logical-axis rules per role and phase, the actor's
        generation tp and the model shapes; None until the auto-mapper places a run whose
        ``mapping.type`` is ``auto`` (`jaxflow.automap.auto_place`).
      roles: the active roles in order, each with its worker's settings: the actor's
        `ActorConfig` (mini- and micro-batches in responses, the log-prob forward, the optimizer
        sized by ``actor_optimizer_steps``), the critic's `CriticConfig`, the inference roles'
        `ForwardConfig` (the reward and cost models share ``reward_model``'s); ``models``: their
        `ModelSpec`.
      rollout: training and validation `SamplingParams` side by side.
      reward: the rule scorer's settings; ``overlong``: DAPO's overlong reward shaping
        (``reward_model.overlong_buffer``; None: off).
      actor_reference: LoRA: the reference policy's forward, served by the actor (its base
        model, no role of its own: ``ref_in_actor``); None otherwise.
      algorithm: what the algorithm's iteration reads.
      prompt_length, response_length: P and R; ``train_batch_size``: prompts per step.
      training_steps: iterations of the run; ``critic_warmup``: the first steps without an
        actor update.
      data, trainer, sft: the prompts, the loop's plumbing, the supervised job.
      mapping, dry_run, ray: how the placement is chosen, the dry run, the Ray backend.
    """

    name: str
    job: str
    num_devices: int
    placement: Placement | None
    roles: Mapping[str, RoleConfig]
    models: Mapping[str, ModelSpec]
    rollout: RolloutConfig
    reward: RewardSpec
    overlong: OverlongBuffer | None
    algorithm: AlgorithmSettings
    prompt_length: int
    response_length: int
    train_batch_size: int
    training_steps: int
    critic_warmup: int
    seed: int
    data: DataSpec
    trainer: TrainerSpec
    sft: SFTSpec
    mapping: MappingSpec
    dry_run: DryRunSpec
    ray: RaySpec
    actor_reference: ForwardConfig | None = None

    @property
    def ref_in_actor(self) -> bool:
        """LoRA: the reference is the actor's base model, served by the actor."""
        return self.actor_reference is not None

    @property
    def actor(self) -> ActorConfig:
        """The policy update's settings (``roles["actor"]``)."""
        return self.roles["actor"]

    @property
    def critic(self) -> CriticConfig | None:
        """The value update's settings (None without a critic)."""
        return self.roles.get("critic")

    @property
    def role_settings(self) -> RoleSettings:
        """What the role workers are built with besides their models and placement (both
        backends take it whole)."""
        none = ForwardConfig()
        return RoleSettings(
            actor_config=self.actor,
            rollout=self.rollout,
            critic_config=self.critic or CriticConfig(),
            ref=self.roles.get("ref", self.actor_reference or none),
            reward=self.roles.get("reward", none),
            cost=self.roles.get("cost", none),
            ref_in_actor=self.ref_in_actor,
        )

    @property
    def n(self) -> int:
        """Responses per prompt of a training rollout."""
        return self.rollout.train.n

    @property
    def rollout_rows(self) -> int:
        """Responses per training step: ``train_batch_size * n``."""
        return self.train_batch_size * self.n


def start_actor_from(spec: RunSpec, path: str) -> RunSpec:
    """``spec`` with the actor, and the roles that follow its weights (`ModelSpec.follows_actor`),
    started from the checkpoint directory ``path`` (e.g. the run's supervised warm start, which
    trained the actor's own model: the shapes stay)."""
    models = {
        role: dataclasses.replace(m, path=path) if role == "actor" or m.follows_actor else m
        for role, m in spec.models.items()
    }
    return dataclasses.replace(spec, models=models)


def from_section(cls: type, section: ConfigDict, **values: Any) -> Any:
    """``cls`` (a dataclass mirroring a config section) from the section's keys of its field
    names, ``values`` taking precedence. A field whose default is such a dataclass (verl's
    ``algorithm.kl_ctrl``) and whose key is a sub-section is read from it the same way."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values or f.name not in section:
            continue
        value = section[f.name]
        if dataclasses.is_dataclass(f.default) and isinstance(value, ConfigDict):
            value = from_section(type(f.default), value)
        kwargs[f.name] = value
    return cls(**kwargs, **values)


def build_tokenizer(cfg: ConfigDict) -> Any:
    """``jaxflow.data.tokenizer``: ``char`` (the built-in character tokenizer), a tokenizer
    directory / ``tokenizer.json``, or ``model`` (the actor checkpoint's own tokenizer).

    ``char`` with an actor checkpoint that ships a different tokenizer is refused
    (``ConfigError``): the model's ids mean other tokens."""
    name = cfg.jaxflow.data.tokenizer
    if name == "char":
        tokenizer = CharTokenizer()
        path = model_path(cfg, "actor")
        own = os.path.join(os.path.expanduser(path), "tokenizer.json") if path else ""
        if own and os.path.isfile(own) and load_tokenizer(own).backend.get_vocab() != tokenizer.backend.get_vocab():
            raise ConfigError(
                "jaxflow.data.tokenizer",
                f"is 'char' (the built-in character tokenizer) but the actor "
                f"checkpoint {path} ships its own tokenizer, whose ids mean other tokens; set "
                "jaxflow.data.tokenizer=model (or the path of the tokenizer the model was trained with)",
            )
        return tokenizer
    if name == "model":
        name = cfg.actor_rollout_ref.model.path
    return load_tokenizer(name)


def training_steps(cfg: ConfigDict, num_train_prompts: int | None) -> int:
    """``trainer.total_training_steps``, else ``total_epochs * (prompts // train_batch_size)``
    (``num_train_prompts`` defaults to the built-in task's ``num_train_examples``)."""
    t = cfg.trainer
    if t.total_training_steps:
        return int(t.total_training_steps)
    prompts = cfg.jaxflow.data.num_train_examples if num_train_prompts is None else num_train_prompts
    per_epoch = prompts // cfg.data.train_batch_size
    if per_epoch < 1:
        raise ValueError(
            f"{prompts} training prompts make no batch of data.train_batch_size={cfg.data.train_batch_size}"
        )
    return int(t.total_epochs) * per_epoch


def optimizer_steps(steps: int, train_batch_size: int, mini_batch_size: int, epochs: int) -> int:
    """Optimizer steps of ``steps`` iterations: each makes ``epochs * (train_batch_size /
    mini_batch_size)`` (both in prompts)."""
    return steps * epochs * (train_batch_size // mini_batch_size)


def _optim(section: ConfigDict, total_steps: int, state_dtype: str) -> OptimConfig:
    return from_section(
        OptimConfig,
        section.optim,
        betas=tuple(section.optim.betas),
        grad_clip=section.grad_clip,
        total_training_steps=max(1, total_steps),
        state_dtype=state_dtype,
    )


def rollout_correction(cfg: ConfigDict) -> RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``."""
    return from_section(RolloutCorrectionConfig, cfg.algorithm.rollout_correction)


def policy_loss_kwargs(cfg: ConfigDict, mode: str) -> tuple[tuple[str, Any], ...]:
    """The options of the policy loss ``mode``: its ``policy_loss.*`` keys, sapo's gate
    temperatures (``actor.tau_pos/neg``), bypass mode's ``algorithm.rollout_correction``."""
    a = cfg.actor_rollout_ref.actor
    kwargs = tuple((k, a.policy_loss[k]) for k in POLICY_LOSS_OPTIONS.get(mode, ()))
    if mode == "sapo":
        kwargs += (("tau_pos", a.tau_pos), ("tau_neg", a.tau_neg))
    if mode == "bypass_mode":
        kwargs += (("rollout_correction", rollout_correction(cfg)),)
    return kwargs


def update_settings(cfg: ConfigDict, section: ConfigDict, updates: int, n: int, packed: bool) -> dict[str, Any]:
    """What the actor's and the critic's PPO updates share besides the keys of their
    ``section`` that keep verl's names (epochs, micro-batches, shuffling, token budgets), as
    `ActorConfig` / `CriticConfig` keywords: mini-batches of prompts as ``* n`` responses,
    the seed, remove padding (``packed``), the optimizer sized by the ``updates`` steps that
    update, and (multi-turn rollouts) training on the model's own tokens only (``loss_mask``)."""
    s = section
    steps = optimizer_steps(updates, cfg.data.train_batch_size, s.ppo_mini_batch_size, s.ppo_epochs)
    return dict(
        ppo_mini_batch_size=s.ppo_mini_batch_size * n,
        seed=cfg.trainer.seed,
        use_remove_padding=packed,
        use_loss_mask=cfg.actor_rollout_ref.rollout.multi_turn.enable,
        optim=_optim(s, steps, cfg.jaxflow.optim.state_dtype),
    )


def actor_config(cfg: ConfigDict, steps: int, n: int) -> ActorConfig:
    """verl's ``actor_rollout_ref.actor`` (+ the rollout's log-prob forward); ``n``: the
    training rollouts' responses per prompt; no update in the ``trainer.critic_warmup`` steps.
    ``algorithm.rollout_correction.bypass_mode`` selects the ``bypass_mode`` loss (as verl's
    ``apply_bypass_mode``)."""
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    mode = "bypass_mode" if cfg.algorithm.rollout_correction.bypass_mode else a.policy_loss.loss_mode
    updates = max(0, steps - cfg.trainer.critic_warmup)
    return from_section(
        ActorConfig,
        a,
        **update_settings(cfg, a, updates, n, packed=cfg.actor_rollout_ref.model.use_remove_padding),
        loss_mode=mode,
        policy_loss_kwargs=policy_loss_kwargs(cfg, mode),
        log_prob_micro_batch_size_per_device=r.log_prob_micro_batch_size_per_device,
        log_prob_use_dynamic_bsz=r.log_prob_use_dynamic_bsz,
        log_prob_max_token_len_per_device=r.log_prob_max_token_len_per_device,
        log_balance=cfg.trainer.balance_batch,
        lora=lora_config(cfg),
        lora_adapter_path=os.path.expanduser(cfg.actor_rollout_ref.model.lora_adapter_path),
    )


def critic_config(cfg: ConfigDict, steps: int, n: int) -> CriticConfig:
    """verl's ``critic``; ``n``: the training rollouts' responses per prompt; ``critic.model.
    lora_*``: LoRA adapters (and the value head) trained instead of every weight."""
    c = cfg.critic
    settings = update_settings(cfg, c, steps, n, packed=c.model.use_remove_padding)
    return from_section(CriticConfig, c, **settings, lora=lora_config(cfg, "critic"))


def sampling_params(
    cfg: ConfigDict, section: ConfigDict, eos_token_id: int | None, pad_token_id: int | None
) -> SamplingParams:
    """A rollout section (``rollout`` or ``rollout.val_kwargs``) as `SamplingParams`."""
    r = cfg.actor_rollout_ref.rollout
    greedy = not section.do_sample or section.temperature == 0
    eos = () if r.ignore_eos or eos_token_id is None else (eos_token_id,)
    eos += tuple(t for t in r.stop_token_ids if t not in eos)
    return SamplingParams(
        max_new_tokens=cfg.data.max_response_length,
        greedy=greedy,
        temperature=1.0 if greedy else section.temperature,
        top_k=max(0, section.top_k),
        top_p=section.top_p,
        n=section.n,
        eos_token_ids=eos,
        seed=cfg.trainer.seed,
        pad_token_id=pad_token_id,
        stop=tuple(r.stop),
    )


def rollout_config(
    cfg: ConfigDict, eos_token_id: int | None, pad_token_id: int | None, tokenizer: Any = None
) -> RolloutConfig:
    """The training rollouts (``rollout.*``) and the validation rollouts (``rollout.val_kwargs``),
    with the run's tokenizer (built here when stop strings need one and none is given)."""
    r, probe = cfg.actor_rollout_ref.rollout, cfg.jaxflow.rollout_probe
    needs_tokenizer = bool(r.stop) or r.multi_turn.enable
    if needs_tokenizer and tokenizer is None:
        tokenizer = build_tokenizer(cfg)
    probing = probe.enable == "on" or (probe.enable == "auto" and lora_config(cfg) is not None)
    return RolloutConfig(
        train=sampling_params(cfg, r, eos_token_id, pad_token_id),
        val=sampling_params(cfg, r.val_kwargs, eos_token_id, pad_token_id),
        max_num_seqs=r.max_num_seqs,
        max_total_tokens=r.max_total_tokens,
        tokenizer=tokenizer if needs_tokenizer else None,
        probe_tolerance=probe.tolerance if probing else 0.0,
        multi_turn=multi_turn(cfg),
    )


def _task_params(task: str, data: ConfigDict) -> tuple[tuple[str, Any], ...]:
    """The built-in task's parameters from ``jaxflow.data.*``."""
    name = task.removeprefix("jaxflow/")
    if name == "addition":
        return (("digits", data.addition_digits),)
    if name == "calculator":
        return (("tool_fraction", data.tool_fraction), ("sum_fraction", data.sum_fraction))
    return ()


def multi_turn(cfg: ConfigDict) -> MultiTurn | None:
    """``actor_rollout_ref.rollout.multi_turn`` and ``jaxflow.agent.tools`` as the actor's
    conversation loop (None: single-turn rollouts)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    config = AgentConfig(
        fmt=mt.format,
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_response_tokens=cfg.data.max_response_length,
    )
    environment = load_environment(mt.interaction_config_path) if mt.interaction_config_path else None
    tools = load_tools(list(cfg.jaxflow.agent.tools), mt.tool_config_path)
    return MultiTurn(config, tools, environment, reuse_kv=cfg.jaxflow.agent.reuse_kv)


def algorithm_settings(cfg: ConfigDict) -> AlgorithmSettings:
    """verl's ``algorithm``, ``jaxflow.safe_rlhf`` and ``jaxflow.trainer.rollout_agreement``."""
    a = cfg.algorithm
    return AlgorithmSettings(
        algorithm=from_section(
            AlgorithmConfig,
            a,
            gdpo_reward_keys=tuple(a.gdpo_reward_keys),
            gdpo_reward_weights=None if a.gdpo_reward_weights is None else tuple(a.gdpo_reward_weights),
        ),
        safe_rlhf=from_section(SafeRLHFConfig, cfg.jaxflow.safe_rlhf),
        rollout_agreement=cfg.jaxflow.trainer.rollout_agreement,
    )


def reward_spec(cfg: ConfigDict) -> RewardSpec:
    """``custom_reward_function`` and ``jaxflow.reward``."""
    fn = cfg.custom_reward_function
    return from_section(RewardSpec, cfg.jaxflow.reward, custom_reward_path=fn.path, custom_reward_name=fn.name)


def forward_configs(cfg: ConfigDict) -> dict[str, ForwardConfig]:
    """The inference roles' forwards: the reference's (``actor_rollout_ref.ref``, packed with
    the actor's ``use_remove_padding``), the reward and cost models' (``reward_model``)."""
    r = cfg.actor_rollout_ref
    reward = ForwardConfig(
        micro_batch_size_per_device=cfg.reward_model.micro_batch_size_per_device,
        use_remove_padding=cfg.reward_model.model.use_remove_padding,
    )
    ref = ForwardConfig(
        micro_batch_size_per_device=r.ref.log_prob_micro_batch_size_per_device,
        use_remove_padding=r.model.use_remove_padding,
        max_token_len_per_device=r.ref.log_prob_max_token_len_per_device if r.ref.log_prob_use_dynamic_bsz else None,
    )
    return {"ref": ref, "reward": reward, "cost": reward}


def role_configs(cfg: ConfigDict, steps: int, n: int) -> dict[str, RoleConfig]:
    """Each active role's worker settings (`RunSpec.roles`), in role order."""
    forwards = forward_configs(cfg)
    out: dict[str, RoleConfig] = {}
    for role in active_roles(cfg):
        if role == "actor":
            out[role] = actor_config(cfg, steps, n)
        elif role == "critic":
            out[role] = critic_config(cfg, steps, n)
        else:
            out[role] = forwards[role]
    return out


def overlong_buffer(cfg: ConfigDict) -> OverlongBuffer | None:
    """``reward_model.overlong_buffer`` over ``data.max_response_length`` (None: disabled)."""
    ob = cfg.reward_model.overlong_buffer
    if not ob.enable:
        return None
    return OverlongBuffer(ob.len, ob.penalty_factor, cfg.data.max_response_length, ob.log)


def data_spec(cfg: ConfigDict) -> DataSpec:
    """``data`` and ``jaxflow.data`` (the tokenizer: `build_tokenizer`)."""
    d, j = cfg.data, cfg.jaxflow.data
    task = j.builtin_task
    return from_section(
        DataSpec,
        d,
        train_files=tuple(f for f in d.train_files.split(",") if f),
        val_files=tuple(f for f in d.val_files.split(",") if f),
        builtin_task=task,
        task_params=_task_params(task, j),
        num_train_examples=j.num_train_examples,
        num_val_examples=j.num_val_examples,
    )


def trainer_spec(cfg: ConfigDict) -> TrainerSpec:
    """``trainer``, ``jaxflow.trainer``, ``jaxflow.backend`` and ``jaxflow.ray.max_restarts``."""
    t = cfg.trainer
    keep = [k for k in (t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep) if k is not None]
    return from_section(
        TrainerSpec,
        t,
        run_dir=checkpoint_dir(cfg),
        logger=tuple(t.logger),
        resume_other_experiment=cfg.jaxflow.trainer.resume_other_experiment,
        max_ckpt_to_keep=min(keep) if keep else None,
        max_nonfinite_steps=cfg.jaxflow.trainer.max_nonfinite_steps,
        backend=cfg.jaxflow.backend,
        max_restarts=cfg.jaxflow.ray.max_restarts,
        compile_ahead={"on": True, "off": False}.get(cfg.jaxflow.trainer.compile_ahead, platform(cfg) != "cpu"),
    )


def sft_spec(cfg: ConfigDict) -> SFTSpec:
    """``jaxflow.sft`` (no warm start for an actor with weights of its own)."""
    s = cfg.jaxflow.sft
    return from_section(SFTSpec, s, warm_start_steps=0 if cfg.actor_rollout_ref.model.path else s.warm_start_steps)


def mapping_spec(cfg: ConfigDict) -> MappingSpec:
    """``jaxflow.placement``'s choice of mapper (on Ray, hosts of ``jaxflow.ray.devices_per_host``)."""
    p = cfg.jaxflow.placement
    ray = cfg.jaxflow.backend == "ray"
    return from_section(
        MappingSpec, p, devices_per_host=cfg.jaxflow.ray.devices_per_host if ray else p.devices_per_host
    )


def model_spec(
    cfg: ConfigDict, role: str, eos_token_id: int | None = None, pad_token_id: int | None = None
) -> ModelSpec:
    """A role's weights: a checkpoint directory, or a preset (its eos / pad ids the tokenizer's)."""
    path = model_path(cfg, role)
    mc = model_config(cfg, role)
    checkpoint = bool(path) and not path.startswith(PRESET_PREFIX)
    if mc is not None and not checkpoint:
        mc = mc.replace(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    follows = role == "ref" or (role == "critic" and not cfg.critic.model.path)
    return ModelSpec(
        role=role,
        head=Role(role).head,
        path=path if checkpoint else "",
        config=mc,
        seed=cfg.trainer.seed,
        follows_actor=follows,
    )


def describe_run(
    cfg: ConfigDict,
    *,
    tokenizer: Any = None,
    devices: Sequence[Any] | None = None,
    num_train_prompts: int | None = None,
    with_placement: bool = True,
) -> RunSpec:
    """The `RunSpec` of a validated config.

    ``tokenizer``: the run's (`build_tokenizer`): its eos / pad ids are the rollouts' stop
    token and a preset model's ids, and it matches ``rollout.stop`` strings (None: no ids;
    built from the config for stop strings). ``devices``: those of the placement (default:
    the first ``jaxflow.num_devices``; on Ray, stand-ins for its hosts' devices).
    ``num_train_prompts``: the training set's size, which sizes the schedules when
    ``trainer.total_training_steps`` is unset (default: the built-in task's).
    ``with_placement=False``, or ``jaxflow.placement.type=auto``: no placement yet
    (``placement`` is None): the auto-mapper places the run.
    """
    steps = training_steps(cfg, num_train_prompts)
    eos, pad = (None, None) if tokenizer is None else (tokenizer.eos_token_id, tokenizer.pad_token_id)
    rollout = rollout_config(cfg, eos, pad, tokenizer)
    placed = with_placement and not (cfg.jaxflow.placement.type == "auto" and cfg.jaxflow.job == "rl")
    return RunSpec(
        name=cfg.trainer.experiment_name,
        job=cfg.jaxflow.job,
        num_devices=cfg.jaxflow.num_devices,
        placement=build_placement(cfg, devices) if placed else None,
        roles=role_configs(cfg, steps, rollout.train.n),  # rollout.n, read once
        models={r: model_spec(cfg, r, eos, pad) for r in active_roles(cfg)},
        rollout=rollout,
        reward=reward_spec(cfg),
        overlong=overlong_buffer(cfg),
        algorithm=algorithm_settings(cfg),
        prompt_length=cfg.data.max_prompt_length,
        response_length=cfg.data.max_response_length,
        train_batch_size=cfg.data.train_batch_size,
        training_steps=steps,
        critic_warmup=cfg.trainer.critic_warmup,
        seed=cfg.trainer.seed,
        data=data_spec(cfg),
        trainer=trainer_spec(cfg),
        sft=sft_spec(cfg),
        mapping=mapping_spec(cfg),
        dry_run=from_section(DryRunSpec, cfg.jaxflow.dry_run),
        ray=from_section(RaySpec, cfg.jaxflow.ray),
        actor_reference=forward_configs(cfg)["ref"] if ref_in_actor(cfg) else None,
    )
