"""From an experiment config (ml_collections, verl's key names) to the objects a run needs:
tokenizer, prompt datasets, models, worker configs. The config is unpacked here, at the
edge; everything below takes small typed values."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

import jaxflow.models as models
from jaxflow.configs import model_config
from jaxflow.configs.resolve import model_path
from jaxflow.configs.resolve import PRESET_PREFIX
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.dataset import PromptDataset, write_builtin_datasets
from jaxflow.data.tasks import Task, get_task
from jaxflow.data.tokenizer import load_tokenizer
from jaxflow.workers import ActorConfig, CriticConfig, OptimConfig, RolloutConfig


def build_tokenizer(cfg: ConfigDict) -> Any:
    """``jaxflow.data.tokenizer``: ``char`` (the built-in character tokenizer), a tokenizer
    directory / ``tokenizer.json``, or ``model`` (the actor checkpoint's own tokenizer)."""
    name = cfg.jaxflow.data.tokenizer
    if name == "char":
        return CharTokenizer()
    if name == "model":
        name = cfg.actor_rollout_ref.model.path
    return load_tokenizer(name)


def builtin_task(cfg: ConfigDict) -> Task:
    """The built-in task ``jaxflow.data.builtin_task`` with its configured parameters."""
    name = cfg.jaxflow.data.builtin_task
    params = {"digits": cfg.jaxflow.data.addition_digits} if name in ("addition", "jaxflow/addition") else {}
    return get_task(name, **params)


def dataset_files(cfg: ConfigDict, run_dir: str) -> tuple[list[str], list[str]]:
    """``(train files, val files)``: the configured ones, or the built-in task written (once,
    deterministically) under ``run_dir/data`` in verl's parquet schema."""
    train = [f for f in cfg.data.train_files.split(",") if f]
    val = [f for f in cfg.data.val_files.split(",") if f]
    if not train or not val:
        d = cfg.jaxflow.data
        written = write_builtin_datasets(os.path.join(run_dir, "data"), tasks=(builtin_task(cfg),),
                                         n_train=d.num_train_examples, n_test=d.num_val_examples,
                                         seed=cfg.data.seed)
        train = train or [written["train"]]
        val = val or [written["test"]]
    return train, val


def build_dataset(cfg: ConfigDict, files: list[str], tokenizer: Any) -> PromptDataset:
    return PromptDataset(files, tokenizer, prompt_key=cfg.data.prompt_key,
                         max_prompt_length=cfg.data.max_prompt_length, truncation=cfg.data.truncation)


def load_model(cfg: ConfigDict, role: str, head: str, tokenizer: Any, *, mesh=None, rules=None,
               seed: int | None = None) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, params)`` of a role's model: a checkpoint directory read straight into the
    role's mesh, or a preset initialised from ``trainer.seed`` (its eos/pad ids taken from the
    tokenizer). A value head on an actor checkpoint starts at zero."""
    path = model_path(cfg, role)
    m = cfg.jaxflow.model
    if path and not path.startswith(PRESET_PREFIX):
        model = models.from_pretrained(
            os.path.expanduser(path), dtype=getattr(jnp, m.dtype), compute_dtype=getattr(jnp, m.compute_dtype),
            mesh=mesh, rules=rules, head=head, scan_layers=m.scan_layers, remat_policy=m.remat_policy)
        return nnx.split(model)
    mcfg = model_config(cfg, role).replace(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if mcfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"jaxflow.model.vocab_size={mcfg.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer.vocab_size} ids")
    seed = cfg.trainer.seed if seed is None else seed
    return nnx.split(models.init_model(mcfg, head=head, seed=seed))


def _optim(section: ConfigDict, grad_clip: float, total_steps: int, state_dtype: str) -> OptimConfig:
    o = section.optim
    return OptimConfig(state_dtype=state_dtype,
        lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), grad_clip=grad_clip,
        lr_warmup_steps=o.lr_warmup_steps, lr_warmup_steps_ratio=o.lr_warmup_steps_ratio,
        total_training_steps=total_steps, warmup_style=o.warmup_style, min_lr_ratio=o.min_lr_ratio)


_POLICY_LOSS_OPTIONS = {
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
}


def actor_config(cfg: ConfigDict, optimizer_steps: int) -> ActorConfig:
    """verl's ``actor_rollout_ref.actor`` as an `ActorConfig` (mini-batches in responses)."""
    a, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    mode = a.policy_loss.loss_mode
    return ActorConfig(
        ppo_mini_batch_size=a.ppo_mini_batch_size * n,
        ppo_micro_batch_size_per_device=a.ppo_micro_batch_size_per_device,
        ppo_epochs=a.ppo_epochs, shuffle=a.shuffle, seed=cfg.trainer.seed,
        loss_mode=mode, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
        policy_loss_kwargs=tuple((k, a.policy_loss[k]) for k in _POLICY_LOSS_OPTIONS.get(mode, ())),
        entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        log_prob_micro_batch_size_per_device=cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device,
        use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding, use_dynamic_bsz=a.use_dynamic_bsz,
        ppo_max_token_len_per_device=a.ppo_max_token_len_per_device,
        log_prob_use_dynamic_bsz=cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz,
        log_prob_max_token_len_per_device=cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_device,
        optim=_optim(a, a.grad_clip, optimizer_steps, cfg.jaxflow.optim.state_dtype))


def critic_config(cfg: ConfigDict, optimizer_steps: int) -> CriticConfig:
    c, n = cfg.critic, cfg.actor_rollout_ref.rollout.n
    fields = {f.name for f in dataclasses.fields(CriticConfig)}
    kwargs = dict(
        ppo_mini_batch_size=c.ppo_mini_batch_size * n,
        ppo_micro_batch_size_per_device=c.ppo_micro_batch_size_per_device,
        ppo_epochs=c.ppo_epochs, shuffle=c.shuffle, seed=cfg.trainer.seed,
        cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
        forward_micro_batch_size_per_device=c.forward_micro_batch_size_per_device,
        use_remove_padding=c.model.use_remove_padding, use_dynamic_bsz=c.use_dynamic_bsz,
        ppo_max_token_len_per_device=c.ppo_max_token_len_per_device,
        forward_max_token_len_per_device=c.forward_max_token_len_per_device,
        optim=_optim(c, c.grad_clip, optimizer_steps, cfg.jaxflow.optim.state_dtype))
    return CriticConfig(**{k: v for k, v in kwargs.items() if k in fields})


def role_options(cfg: ConfigDict) -> dict[str, dict[str, Any]]:
    """The forward options of the reference and reward / cost workers (verl's
    ``actor_rollout_ref.ref`` and ``reward_model``)."""
    r = cfg.actor_rollout_ref.ref
    ref = dict(use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding,
               max_token_len_per_device=r.log_prob_max_token_len_per_device if r.log_prob_use_dynamic_bsz else None)
    scorer = dict(use_remove_padding=cfg.reward_model.model.use_remove_padding)
    return {"ref": ref, "reward": scorer, "cost": scorer}


def rollout_config(cfg: ConfigDict, tokenizer: Any, *, validation: bool = False) -> RolloutConfig:
    """Sampling of training rollouts, or of validation (``rollout.val_kwargs``)."""
    r = cfg.actor_rollout_ref.rollout
    src = r.val_kwargs if validation else r
    greedy = not src.do_sample or src.temperature == 0
    return RolloutConfig(
        n=src.n, max_new_tokens=cfg.data.max_response_length,
        temperature=1.0 if greedy else src.temperature, top_k=max(0, src.top_k), top_p=src.top_p,
        greedy=greedy, eos_token_ids=() if r.ignore_eos else (tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id, seed=cfg.trainer.seed, max_num_seqs=r.max_num_seqs)


def optimizer_steps(cfg: ConfigDict, training_steps: int) -> int:
    """Optimizer steps of the whole run: per training step, ppo_epochs x mini-batches."""
    a = cfg.actor_rollout_ref.actor
    return training_steps * a.ppo_epochs * (cfg.data.train_batch_size // a.ppo_mini_batch_size)


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves with the arrays' shardings (checkpoint restore targets)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
