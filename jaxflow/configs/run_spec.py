"""The one typed description of a run: an experiment config (ml_collections, verl's keys) in,
a frozen `RunSpec` out. Real runs (`jaxflow.trainer`), dry runs (`jaxflow.plan`) and, next,
the auto-mapper and the Ray backend consume it; nothing below this module reads a raw config
key. Each key is read here once (``rollout.n`` included)::

    spec = describe_run(cfg)                      # after configs.validate(cfg)
    spec.placement.mesh("actor", "train")         # meshes and rules per role and phase
    spec.actor, spec.critic, spec.rollout         # worker settings, micro-batches included
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

from jaxflow.algos.settings import (
    AlgorithmConfig,
    AlgorithmSettings,
    KLControlConfig,
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
from jaxflow.sampling import SamplingParams
from jaxflow.workers import ActorConfig, CriticConfig, OptimConfig, RoleSettings, RolloutConfig

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
    only for a checkpoint without a ``config.json``.
    """

    role: str
    head: str
    path: str
    config: ModelConfig | None
    seed: int

    @property
    def is_preset(self) -> bool:
        return not self.path


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """The reward: an optional reward model (its forward micro-batch, packed or padded; the
    cost model shares them), and the rule scorer: the custom function and its time limits per
    sample, per batch and for loading, and the failure fraction that stops the run."""

    model: bool
    micro_batch_size_per_device: int | None
    custom_function_path: str | None
    custom_function_name: str
    timeout_s: float
    batch_timeout_s: float
    load_timeout_s: float
    max_failure_fraction: float
    use_remove_padding: bool = False


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


@dataclasses.dataclass(frozen=True)
class SFTSpec:
    """The supervised job (``jaxflow.sft``; ``warm_start_steps``: an RL run's warm start)."""

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
class RunSpec:
    """Everything a run (or a plan of it) needs to know, typed.

    Attributes:
      name: ``trainer.experiment_name``; ``job``: ``rl`` | ``sft``.
      placement: pools, meshes and logical-axis rules per role and phase, the actor's
        generation tp and the model shapes; None when the run is described before it has one
        (``describe_run(..., with_placement=False)``: the auto-mapper plans it).
      roles: the active roles in order; ``models``: their `ModelSpec`.
      actor: the policy update (mini- and micro-batches in responses, the log-prob forward's
        micro-batch, the optimizer sized by ``actor_optimizer_steps``).
      rollout: training and validation `SamplingParams` side by side.
      ref_micro_batch_size_per_device: the reference log-prob forward's micro-batch;
        ``ref_use_remove_padding`` / ``ref_max_token_len_per_device``: its packed forward;
        ``ref_in_actor``: the reference is the actor's base model (LoRA), not a role.
      critic: the value update (None without a critic).
      reward: the reward model / rule scorer settings (the cost model shares the reward
        model's forward micro-batch).
      algorithm: what the algorithm's iteration reads.
      prompt_length, response_length: P and R; ``train_batch_size``: prompts per step.
      training_steps: iterations of the run; ``critic_warmup``: the first steps without an
        actor update.
      data, trainer, sft: the prompts, the loop's plumbing, the supervised job.
    """

    name: str
    job: str
    num_devices: int
    placement: Placement | None
    roles: tuple[str, ...]
    models: Mapping[str, ModelSpec]
    actor: ActorConfig
    rollout: RolloutConfig
    ref_micro_batch_size_per_device: int | None
    critic: CriticConfig | None
    reward: RewardSpec
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
    ref_use_remove_padding: bool = False
    ref_max_token_len_per_device: int | None = None
    ref_in_actor: bool = False  # LoRA: the reference is the actor's base model, served by the actor

    @property
    def role_settings(self) -> RoleSettings:
        """What the role workers are built with besides their models and placement (both
        backends take it whole)."""
        return RoleSettings(
            actor_config=self.actor,
            rollout=self.rollout,
            critic_config=self.critic or CriticConfig(),
            ref_micro_batch_size_per_device=self.ref_micro_batch_size_per_device,
            reward_micro_batch_size_per_device=self.reward.micro_batch_size_per_device,
            ref_use_remove_padding=self.ref_use_remove_padding,
            ref_max_token_len_per_device=self.ref_max_token_len_per_device,
            reward_use_remove_padding=self.reward.use_remove_padding,
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
    o = section.optim
    return OptimConfig(
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
        grad_clip=section.grad_clip,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_warmup_steps_ratio=o.lr_warmup_steps_ratio,
        total_training_steps=max(1, total_steps),
        warmup_style=o.warmup_style,
        min_lr_ratio=o.min_lr_ratio,
        state_dtype=state_dtype,
    )


def rollout_correction(cfg: ConfigDict) -> RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``."""
    r = cfg.algorithm.rollout_correction
    return RolloutCorrectionConfig(**{f.name: r[f.name] for f in dataclasses.fields(RolloutCorrectionConfig)})


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


def actor_config(cfg: ConfigDict, steps: int, n: int) -> ActorConfig:
    """verl's ``actor_rollout_ref.actor`` (+ the rollout's log-prob micro-batch); ``n``: the
    training rollouts' responses per prompt. ``algorithm.rollout_correction.bypass_mode``
    selects the ``bypass_mode`` loss (as verl's ``apply_bypass_mode``)."""
    a = cfg.actor_rollout_ref.actor
    mode = "bypass_mode" if cfg.algorithm.rollout_correction.bypass_mode else a.policy_loss.loss_mode
    updates = max(0, steps - cfg.trainer.critic_warmup)
    return ActorConfig(
        ppo_mini_batch_size=a.ppo_mini_batch_size * n,
        ppo_micro_batch_size_per_device=a.ppo_micro_batch_size_per_device,
        ppo_epochs=a.ppo_epochs,
        shuffle=a.shuffle,
        seed=cfg.trainer.seed,
        loss_mode=mode,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        policy_loss_kwargs=policy_loss_kwargs(cfg, mode),
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        log_prob_micro_batch_size_per_device=cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device,
        use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding,
        use_dynamic_bsz=a.use_dynamic_bsz,
        ppo_max_token_len_per_device=a.ppo_max_token_len_per_device,
        log_prob_use_dynamic_bsz=cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz,
        log_prob_max_token_len_per_device=cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_device,
        log_balance=cfg.trainer.balance_batch,
        lora=lora_config(cfg),
        lora_adapter_path=os.path.expanduser(cfg.actor_rollout_ref.model.lora_adapter_path),
        optim=_optim(
            a,
            optimizer_steps(updates, cfg.data.train_batch_size, a.ppo_mini_batch_size, a.ppo_epochs),
            cfg.jaxflow.optim.state_dtype,
        ),
    )


def critic_config(cfg: ConfigDict, steps: int, n: int) -> CriticConfig:
    """verl's ``critic``; ``n``: the training rollouts' responses per prompt."""
    c = cfg.critic
    return CriticConfig(
        ppo_mini_batch_size=c.ppo_mini_batch_size * n,
        ppo_micro_batch_size_per_device=c.ppo_micro_batch_size_per_device,
        ppo_epochs=c.ppo_epochs,
        shuffle=c.shuffle,
        seed=cfg.trainer.seed,
        cliprange_value=c.cliprange_value,
        loss_agg_mode=c.loss_agg_mode,
        forward_micro_batch_size_per_device=c.forward_micro_batch_size_per_device,
        use_remove_padding=c.model.use_remove_padding,
        use_dynamic_bsz=c.use_dynamic_bsz,
        ppo_max_token_len_per_device=c.ppo_max_token_len_per_device,
        forward_max_token_len_per_device=c.forward_max_token_len_per_device,
        optim=_optim(
            c,
            optimizer_steps(steps, cfg.data.train_batch_size, c.ppo_mini_batch_size, c.ppo_epochs),
            cfg.jaxflow.optim.state_dtype,
        ),
    )


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
    if r.stop and tokenizer is None:
        tokenizer = build_tokenizer(cfg)
    probing = probe.enable == "on" or (probe.enable == "auto" and lora_config(cfg) is not None)
    return RolloutConfig(
        train=sampling_params(cfg, r, eos_token_id, pad_token_id),
        val=sampling_params(cfg, r.val_kwargs, eos_token_id, pad_token_id),
        max_num_seqs=r.max_num_seqs,
        max_total_tokens=r.max_total_tokens,
        tokenizer=tokenizer if r.stop else None,
        probe_tolerance=probe.tolerance if probing else 0.0,
    )


def algorithm_settings(cfg: ConfigDict) -> AlgorithmSettings:
    """verl's ``algorithm`` and ``jaxflow.safe_rlhf``."""
    a, s = cfg.algorithm, cfg.jaxflow.safe_rlhf
    k = a.kl_ctrl
    return AlgorithmSettings(
        algorithm=AlgorithmConfig(
            adv_estimator=a.adv_estimator,
            gamma=a.gamma,
            lam=a.lam,
            norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
            use_kl_in_reward=a.use_kl_in_reward,
            kl_penalty=a.kl_penalty,
            kl_ctrl=KLControlConfig(type=k.type, kl_coef=k.kl_coef, horizon=k.horizon, target_kl=k.target_kl),
            gdpo_reward_keys=tuple(a.gdpo_reward_keys),
            gdpo_reward_weights=None if a.gdpo_reward_weights is None else tuple(a.gdpo_reward_weights),
            rollout_correction=rollout_correction(cfg),
        ),
        safe_rlhf=SafeRLHFConfig(
            enable=s.enable,
            cost_model_path=s.cost_model_path,
            cost_rule=s.cost_rule,
            forbidden_chars=s.forbidden_chars,
            cost_threshold=s.cost_threshold,
            lambda_init=s.lambda_init,
            lambda_lr=s.lambda_lr,
            lambda_update_scale=s.lambda_update_scale,
            lambda_max=s.lambda_max,
        ),
    )


def reward_spec(cfg: ConfigDict) -> RewardSpec:
    """``reward_model``, ``custom_reward_function`` and ``jaxflow.reward``."""
    fn, r = cfg.custom_reward_function, cfg.jaxflow.reward
    return RewardSpec(
        model="reward" in active_roles(cfg),
        micro_batch_size_per_device=cfg.reward_model.micro_batch_size_per_device,
        custom_function_path=fn.path,
        custom_function_name=fn.name,
        timeout_s=r.timeout_s,
        batch_timeout_s=r.batch_timeout_s,
        load_timeout_s=r.load_timeout_s,
        max_failure_fraction=r.max_failure_fraction,
        use_remove_padding=cfg.reward_model.model.use_remove_padding,
    )


def data_spec(cfg: ConfigDict) -> DataSpec:
    """``data`` and ``jaxflow.data`` (the tokenizer: `build_tokenizer`)."""
    d, j = cfg.data, cfg.jaxflow.data
    task = j.builtin_task
    params = (("digits", j.addition_digits),) if task in ("addition", "jaxflow/addition") else ()
    return DataSpec(
        train_files=tuple(f for f in d.train_files.split(",") if f),
        val_files=tuple(f for f in d.val_files.split(",") if f),
        builtin_task=task,
        task_params=params,
        num_train_examples=j.num_train_examples,
        num_val_examples=j.num_val_examples,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        shuffle=d.shuffle,
        seed=d.seed,
        val_batch_size=d.val_batch_size,
    )


def trainer_spec(cfg: ConfigDict) -> TrainerSpec:
    """``trainer``, ``jaxflow.trainer``, ``jaxflow.backend`` and ``jaxflow.ray.max_restarts``."""
    t = cfg.trainer
    keep = [k for k in (t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep) if k is not None]
    return TrainerSpec(
        project_name=t.project_name,
        experiment_name=t.experiment_name,
        run_dir=checkpoint_dir(cfg),
        logger=tuple(t.logger),
        log_val_generations=t.log_val_generations,
        test_freq=t.test_freq,
        val_before_train=t.val_before_train,
        save_freq=t.save_freq,
        save_hf=t.save_hf,
        resume_mode=t.resume_mode,
        resume_from_path=t.resume_from_path,
        resume_other_experiment=cfg.jaxflow.trainer.resume_other_experiment,
        max_ckpt_to_keep=min(keep) if keep else None,
        max_nonfinite_steps=cfg.jaxflow.trainer.max_nonfinite_steps,
        backend=cfg.jaxflow.backend,
        max_restarts=cfg.jaxflow.ray.max_restarts,
        compile_ahead={"on": True, "off": False}.get(cfg.jaxflow.trainer.compile_ahead, platform(cfg) != "cpu"),
    )


def sft_spec(cfg: ConfigDict) -> SFTSpec:
    """``jaxflow.sft``."""
    s = cfg.jaxflow.sft
    return SFTSpec(
        steps=s.steps,
        warm_start_steps=s.warm_start_steps,
        lr=s.lr,
        warmup_steps=s.warmup_steps,
        weight_decay=s.weight_decay,
        batch_size=s.batch_size,
        micro_batch_size_per_device=s.micro_batch_size_per_device,
        test_freq=s.test_freq,
        output_dir=s.output_dir,
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
    return ModelSpec(role=role, head=Role(role).head, path=path if checkpoint else "", config=mc, seed=cfg.trainer.seed)


def describe_run(
    cfg: ConfigDict,
    *,
    devices: Sequence[Any] | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    num_train_prompts: int | None = None,
    with_placement: bool = True,
    tokenizer: Any = None,
) -> RunSpec:
    """The `RunSpec` of a validated config.

    ``devices``: those of the placement (default: the first ``jaxflow.num_devices``).
    ``eos_token_id`` / ``pad_token_id``: the tokenizer's (stop tokens of the rollouts, and the
    ids of a preset model). ``num_train_prompts``: the training set's size, which sizes the
    schedules when ``trainer.total_training_steps`` is unset (default: the built-in task's).
    ``with_placement=False``: no placement (``placement`` is None), for a config whose
    placement is still ``auto``: the auto-mapper describes the run before it places it.
    ``tokenizer``: the run's (for ``rollout.stop``; default: built from the config when needed).
    """
    steps = training_steps(cfg, num_train_prompts)
    roles = active_roles(cfg)
    rollout = rollout_config(cfg, eos_token_id, pad_token_id, tokenizer)
    n = rollout.train.n  # rollout.n, read once
    return RunSpec(
        name=cfg.trainer.experiment_name,
        job=cfg.jaxflow.job,
        num_devices=cfg.jaxflow.num_devices,
        placement=build_placement(cfg, devices) if with_placement else None,
        roles=roles,
        models={r: model_spec(cfg, r, eos_token_id, pad_token_id) for r in roles},
        actor=actor_config(cfg, steps, n),
        rollout=rollout,
        ref_micro_batch_size_per_device=cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_device,
        critic=critic_config(cfg, steps, n) if "critic" in roles else None,
        reward=reward_spec(cfg),
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
        ref_use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding,
        ref_max_token_len_per_device=(
            cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_device
            if cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz
            else None
        ),
        ref_in_actor=ref_in_actor(cfg),
    )
