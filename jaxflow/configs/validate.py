""":func:`validate`: every problem of a config, each named by its key.

:func:`validate` raises one :class:`ConfigError` listing every problem it finds, each as
``key: what is wrong``. It checks in three stages and stops after the first stage that finds
something, so that one mistake does not cascade into follow-on complaints:

1. schema: unknown keys (with the closest valid ones), missing keys, wrong types;
2. single fields: enum values, ranges, files that must exist, algorithm requirements
   (a critic for ``gae``, ``rollout.n >= 2`` for group baselines, ...);
3. structure: placement and pool sizes, mesh shapes against their pools, the actor's
   generation tp, batch arithmetic over the data-parallel ranks, and model shapes against
   the meshes (heads / kv heads / vocab / mlp divisible by their shards) when the model's
   shape is known (a preset, or a checkpoint's ``config.json``).

Enum values come from jaxflow's own registries where one exists (advantage estimators,
policy losses, KL estimators), so user-registered names validate. Importing this module is
cheap; :func:`validate` imports those registries, the presets and the mesh rules (and so JAX)
on first use.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from typing import Any

from ml_collections import ConfigDict

from jaxflow.configs.base import BOUNDS, KEY_TYPES, Bound
from jaxflow.configs.overrides import ELEMENT_TYPES, ConfigError, get_value, leaf_keys, suggest, type_name
from jaxflow.configs.resolve import (
    PLACEMENT_TYPES,
    PRESET_PREFIX,
    active_roles,
    build_placement,
    critic_enabled,
    data_parallel_size,
    mesh_key,
    mesh_sizes,
    model_config,
    model_path,
    path_key,
    placement_groups,
    uses_lora,
)
from jaxflow.mesh import ROLES
from jaxflow.mesh.devices import FakeDevice
from jaxflow.rewards.scorer import SANDBOX_MODES

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
DTYPES = ("auto", "float32", "bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
COMPILE_AHEAD = ("auto", "on", "off")
TRAINER_MODES = ("sync", "one_step_off", "async")  # `jaxflow.trainer.ahead`
PROBE_MODES = ("auto", "on", "off")
RESUME_MODES = ("disable", "auto", "resume_path")
JOBS = ("rl", "sft")
BACKENDS = ("local", "ray")
RAY_ACCELERATORS = ("cpu", "gpu", "tpu")
WARMUP_STYLES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")
COST_RULES = ("forbidden_chars", "length")
# Estimators whose baseline comes from the other responses to the same prompt.
GROUP_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
)
# Estimators that read the actor's sum_pi_squared column (verl's actor.calculate_sum_pi_squared).
SUM_PI_SQUARED_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
RC = "algorithm.rollout_correction"
ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


class _Checker:
    """Collects ``(key, message)`` problems of one config."""

    def __init__(self, cfg: ConfigDict):
        self.cfg = cfg
        self.items: list[tuple[str, str]] = []

    def add(self, key: str, msg: str) -> None:
        self.items.append((key, msg))

    def check(self, ok: bool, key: str, msg: str) -> bool:
        if not ok:
            self.add(key, msg)
        return ok

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)

    def one_of(self, key: str, valid: Iterable[str]) -> bool:
        valid, value = list(valid), get_value(self.cfg, key)
        hint = suggest(str(value), valid)
        return self.check(value in valid, key, f"must be one of {', '.join(valid)}; got {value!r}{hint}")

    def bounded(self, key: str, bound: Bound) -> bool:
        """The key's value within ``bound`` (None, for optional keys, passes; a sequence, each
        element)."""
        value = get_value(self.cfg, key)
        if value is None:
            return True
        items = value if isinstance(value, (tuple, list)) else [value]
        shown = tuple(value) if isinstance(value, (tuple, list)) else value
        return self.check(all(bound.holds(x) for x in items), key, f"must be {bound.describe()}, got {shown}")

    def at_least(self, key: str, minimum: float = 1, note: str = "") -> bool:
        return self.bounded(key, Bound(lo=minimum, note=note))

    def positive(self, key: str, note: str = "") -> bool:
        return self.bounded(key, Bound(lo=0, ends="(]", note=note))


# ----------------------------------------------------------------------------- stage 1: schema


def _type_ok(value: Any, typ: type) -> bool:
    if typ is bool:
        return isinstance(value, bool)
    if typ in (int, float):
        ok = (int,) if typ is int else (int, float)
        return isinstance(value, ok) and not isinstance(value, bool)
    if typ in (tuple, list):
        return isinstance(value, (tuple, list))
    return isinstance(value, typ)


def _numbers(value: Any) -> list[float]:
    """The float values in a key's value (itself, or a sequence's elements)."""
    items = value if isinstance(value, (tuple, list)) else [value]
    return [x for x in items if isinstance(x, float)]


def _check_schema(c: _Checker) -> None:
    keys = leaf_keys(c.cfg)
    for key in keys:
        if key not in KEY_TYPES:
            c.add(key, f"unknown config key{suggest(key, KEY_TYPES)}")
            continue
        typ, optional = KEY_TYPES[key]
        value = get_value(c.cfg, key)
        if value is None:
            c.check(optional, key, f"must be a {type_name(typ, False)}, got None")
        elif not _type_ok(value, typ):
            c.add(key, f"expected {type_name(typ, optional)}, got {value!r} ({type(value).__name__})")
        elif key in ELEMENT_TYPES and not all(_type_ok(x, ELEMENT_TYPES[key]) for x in value):
            c.add(key, f"expected a {typ.__name__} of {ELEMENT_TYPES[key].__name__}, got {value!r}")
        elif key.endswith(".betas") and len(value) != 2:
            c.add(key, f"expected (beta1, beta2), got {value!r}")
        elif not all(math.isfinite(x) for x in _numbers(value)):
            c.add(key, f"must be a finite number, got {value!r}")
    present = set(keys)
    missing = [key for key in KEY_TYPES if key not in present]
    if len(missing) > 3:  # not built on the base config: one line, not one per key
        c.add(
            "--config",
            f"the config lacks {len(missing)} of the {len(KEY_TYPES)} keys (e.g. "
            f"{', '.join(missing[:3])}); build it on jaxflow.configs.base.get_base_config() and change "
            "what you need",
        )
    else:
        for key in missing:
            c.add(key, "missing; configs start from jaxflow.configs.base.get_base_config()")


# ----------------------------------------------------------------------------- stage 2: fields


def _check_enums(c: _Checker) -> None:
    from jaxflow.algos import LOSS_AGG_MODES, advantage_estimator_names, kl_estimator_names, policy_loss_names
    from jaxflow.algos.safe_rlhf import LAGRANGE_SCALES
    from jaxflow.data.dataset import TRUNCATION_MODES
    from jaxflow.data.tasks import TASKS
    from jaxflow.models import PRESETS

    kl = kl_estimator_names()
    for key, valid in [
        ("jaxflow.job", JOBS),
        ("jaxflow.backend", BACKENDS),
        ("jaxflow.placement.type", PLACEMENT_TYPES),
        ("data.truncation", TRUNCATION_MODES),
        ("algorithm.adv_estimator", advantage_estimator_names()),
        ("algorithm.kl_penalty", kl),
        ("algorithm.kl_ctrl.type", KL_CTRL_TYPES),
        (f"{ACTOR}.loss_agg_mode", LOSS_AGG_MODES),
        (f"{ACTOR}.policy_loss.loss_mode", policy_loss_names()),
        (f"{ACTOR}.kl_loss_type", kl),
        (f"{ACTOR}.optim.warmup_style", WARMUP_STYLES),
        ("critic.loss_agg_mode", LOSS_AGG_MODES),
        ("critic.optim.warmup_style", WARMUP_STYLES),
        ("trainer.resume_mode", RESUME_MODES),
        ("jaxflow.model.preset", PRESETS),
        ("jaxflow.model.dtype", DTYPES),
        ("jaxflow.model.compute_dtype", DTYPES),
        ("jaxflow.model.remat_policy", REMAT_POLICIES),
        ("jaxflow.trainer.compile_ahead", COMPILE_AHEAD),
        ("trainer.mode", TRAINER_MODES),
        ("jaxflow.reward.sandbox", SANDBOX_MODES),
        ("jaxflow.optim.state_dtype", STATE_DTYPES),
        ("jaxflow.data.builtin_task", TASKS),
        ("jaxflow.safe_rlhf.cost_rule", COST_RULES),
        ("jaxflow.safe_rlhf.lambda_update_scale", LAGRANGE_SCALES),
        ("jaxflow.ray.accelerator", RAY_ACCELERATORS),
    ]:
        c.one_of(key, valid)
    # Accepted keys whose other values jaxflow does not implement yet: refuse them rather than
    # run something else than asked.
    c.check(
        c.cfg.data.reward_fn_key == "data_source",
        "data.reward_fn_key",
        "rule-based rewards are dispatched by the data_source column only",
    )
    _check_partial_rollout(c)
    for name in c.cfg.trainer.logger:
        c.check(
            name in LOGGERS,
            "trainer.logger",
            f"unknown logger {name!r}; loggers are {', '.join(LOGGERS)}{suggest(name, LOGGERS)}",
        )
    rollout = c.cfg.actor_rollout_ref.rollout
    c.check("" not in rollout.stop, f"{ROLLOUT}.stop", f"stop strings must not be empty, got {list(rollout.stop)!r}")
    c.check(
        all(not isinstance(t, int) or t >= 0 for t in rollout.stop_token_ids),
        f"{ROLLOUT}.stop_token_ids",
        f"must be token ids >= 0, got {list(rollout.stop_token_ids)!r}",
    )


def _check_bounds(c: _Checker) -> None:
    """Every key with a `Bound` in the ``FIELDS`` table holds a value within it (the keys of a
    part of the run that is off, e.g. the critic's without a critic, are not checked)."""
    on = {"": True, "critic": critic_enabled(c.cfg), "adaptive_kl": c.cfg.algorithm.kl_ctrl.type == "adaptive"}
    for key, bound in BOUNDS.items():
        if on[bound.when]:
            c.bounded(key, bound)


def _check_token_budgets(c: _Checker) -> None:
    """A token budget (dynamic micro-batches) packs rows: it needs remove padding and must hold
    one padded row."""
    cfg = c.cfg
    row = cfg.data.max_prompt_length + cfg.data.max_response_length
    for flag, budget, padding in (
        (f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_device", "actor_rollout_ref.model"),
        (
            f"{ROLLOUT}.log_prob_use_dynamic_bsz",
            f"{ROLLOUT}.log_prob_max_token_len_per_device",
            "actor_rollout_ref.model",
        ),
        (
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_device",
            "actor_rollout_ref.model",
        ),
        ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_device", "critic.model"),
        ("critic.use_dynamic_bsz", "critic.forward_max_token_len_per_device", "critic.model"),
    ):
        if get_value(cfg, flag):
            c.check(
                get_value(cfg, f"{padding}.use_remove_padding"),
                flag,
                f"dynamic micro-batches need {padding}.use_remove_padding=True (token budgets pack rows)",
            )
            c.check(
                get_value(cfg, budget) >= row,
                budget,
                f"must hold one padded row: >= max_prompt_length + max_response_length = {row} tokens",
            )


def _check_ray(c: _Checker) -> None:
    """The Ray backend's hosts: whole hosts for the run and for every pool; a TPU topology
    names its generation."""
    cfg = c.cfg
    per = cfg.jaxflow.ray.devices_per_host
    if per >= 1 and cfg.jaxflow.backend == "ray":
        c.check(
            cfg.jaxflow.num_devices % per == 0,
            "jaxflow.ray.devices_per_host",
            f"jaxflow.num_devices={cfg.jaxflow.num_devices} is not a whole number of hosts of {per} devices",
        )
        c.check(
            all(size % per == 0 for size in cfg.jaxflow.placement.pool_sizes),
            "jaxflow.placement.pool_sizes",
            f"{tuple(cfg.jaxflow.placement.pool_sizes)}: with the ray backend every pool takes whole hosts of "
            f"{per} devices (jaxflow.ray.devices_per_host)",
        )
    topology = cfg.jaxflow.ray.tpu_topology
    if topology:
        c.check(
            all(n.isdigit() and int(n) > 0 for n in str(topology).lower().split("x")),
            "jaxflow.ray.tpu_topology",
            f"{topology!r} is not a TPU topology such as '4x4' or '2x2x4'",
        )
        c.check(
            bool(cfg.jaxflow.ray.tpu_version),
            "jaxflow.ray.tpu_version",
            "must name the TPU generation (e.g. 'v5p') when jaxflow.ray.tpu_topology is set",
        )


def _check_partial_rollout(c: _Checker) -> None:
    """``trainer.partial_rollout``: the weight syncs of the rollout pool's rollouter (local or
    Ray) interrupt its rollouts (`jaxflow.trainer.rollouter`); where it cannot run, one line."""
    cfg, key = c.cfg, "trainer.partial_rollout"
    if not cfg.trainer.partial_rollout:
        return
    c.check(
        cfg.jaxflow.placement.rollout_devices > 0,
        key,
        "interrupts a rollout pool's rollouts; set jaxflow.placement.rollout_devices",
    )
    c.check(
        not cfg.actor_rollout_ref.rollout.multi_turn.enable,
        key,
        "partial rollouts sample one response per sample (no actor_rollout_ref.rollout.multi_turn)",
    )


def _check_rollout_pool(c: _Checker) -> None:
    """``jaxflow.placement.rollout_devices``: the last N devices as the actor's rollout pool
    (`jaxflow.trainer.rollouter`; on Ray `jaxflow.workers.ray.RayRolloutPool`, whole hosts of
    its own), an RL run placed by hand, the pool a whole number of generation tp groups; what
    it does not run yet is refused."""
    cfg, key = c.cfg, "jaxflow.placement.rollout_devices"
    n, pool = cfg.jaxflow.num_devices, cfg.jaxflow.placement.rollout_devices
    if pool <= 0:
        return
    tp = cfg.jaxflow.mesh.actor.generate.tp
    c.check(pool < n, key, f"{pool} leaves none of the jaxflow.num_devices={n} devices to the other roles")
    c.check(pool % tp == 0, key, f"{pool} devices are not whole groups of jaxflow.mesh.actor.generate.tp={tp}")
    per = cfg.jaxflow.ray.devices_per_host
    c.check(
        cfg.jaxflow.backend != "ray" or per < 1 or pool % per == 0,
        key,
        f"{pool} devices are not whole hosts of jaxflow.ray.devices_per_host={per} (the Ray backend's pool is a "
        "worker group of its own hosts)",
    )
    c.check(cfg.jaxflow.job == "rl", key, f"is for RL runs (jaxflow.job is {cfg.jaxflow.job!r})")
    c.check(
        cfg.jaxflow.placement.type != "auto",
        key,
        "the auto-mapper does not plan a rollout pool yet; set jaxflow.placement.type to colocated, split or custom",
    )
    c.check(not uses_lora(cfg), key, "the rollout pool does not sync LoRA adapters yet")
    c.check(
        cfg.jaxflow.rollout_probe.enable != "on",
        key,
        "the rollout probe compares the actor's own generation weights; it is not built for the rollout pool",
    )


def _check_ranges(c: _Checker) -> None:
    """The keys' bounds, then what a bound cannot say: token budgets, Ray's hosts, a
    temperature of 0 while sampling."""
    _check_bounds(c)
    _check_token_budgets(c)
    _check_ray(c)
    for prefix in (ROLLOUT, f"{ROLLOUT}.val_kwargs"):
        s = get_value(c.cfg, prefix)
        c.check(
            not (s.do_sample and s.temperature == 0),
            f"{prefix}.temperature",
            f"is 0 but {prefix}.do_sample is true; use a temperature > 0, or do_sample=false (greedy)",
        )


def _check_algorithm(c: _Checker) -> None:
    cfg = c.cfg
    if cfg.jaxflow.job != "rl":
        return
    est, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if est in GROUP_ESTIMATORS:
        c.check(
            n >= 2,
            f"{ROLLOUT}.n",
            f"algorithm.adv_estimator={est!r} compares the responses to one prompt and needs rollout.n >= 2, got {n}",
        )
    if est in SUM_PI_SQUARED_ESTIMATORS:
        c.add(
            "algorithm.adv_estimator",
            f"{est!r} needs the actor's sum_pi_squared column (sum_v pi(v)^2 per token, verl's "
            "actor.calculate_sum_pi_squared), which jaxflow's actor does not compute yet; the estimator itself is "
            "jaxflow.algos.compute_optimal_token_baseline_advantage",
        )
    if est == "gdpo":
        _check_gdpo(c)
    if est == "gae" and cfg.critic.enable is False:
        c.add(
            "critic.enable",
            "algorithm.adv_estimator='gae' needs a critic (value model), but critic.enable is "
            "false; enable it or use a critic-free estimator (grpo, rloo, remax, "
            "reinforce_plus_plus, ...)",
        )
    _check_policy_loss_options(c)
    _check_rollout_correction(c)
    _check_dapo(c)
    s = cfg.jaxflow.safe_rlhf
    if s.enable:
        c.positive("jaxflow.safe_rlhf.lambda_lr")
        if s.lambda_update_scale == "log":
            c.positive("jaxflow.safe_rlhf.lambda_init", " for lambda_update_scale='log'")
        else:
            c.at_least("jaxflow.safe_rlhf.lambda_init", 0)
        if s.lambda_max is not None:
            c.check(
                s.lambda_max >= s.lambda_init,
                "jaxflow.safe_rlhf.lambda_max",
                f"{s.lambda_max} is below jaxflow.safe_rlhf.lambda_init={s.lambda_init}",
            )
        if not s.cost_model_path and s.cost_rule == "forbidden_chars":
            c.check(
                bool(s.forbidden_chars),
                "jaxflow.safe_rlhf.forbidden_chars",
                "the forbidden_chars cost rule needs at least one character",
            )


def _check_dapo(c: _Checker) -> None:
    """``algorithm.filter_groups`` and ``reward_model.overlong_buffer`` (whether the algorithm
    samples more prompt batches: `jaxflow.plan.lowering.run_algorithm`)."""
    fg, ob = c.cfg.algorithm.filter_groups, c.cfg.reward_model.overlong_buffer
    if fg.enable:
        c.check(
            bool(fg.metric),
            "algorithm.filter_groups.metric",
            "must be set when filter_groups is enabled: seq_reward, seq_final_reward, acc, or a key of the reward "
            "function's dict",
        )
    if ob.enable:
        limit = c.cfg.data.max_response_length
        c.check(
            0 < ob.len <= limit,
            "reward_model.overlong_buffer.len",
            f"must be in [1, data.max_response_length={limit}] when the overlong penalty is enabled, got {ob.len}",
        )


def _check_gdpo(c: _Checker) -> None:
    keys, weights = list(c.cfg.algorithm.gdpo_reward_keys), c.cfg.algorithm.gdpo_reward_weights
    if c.check(
        bool(keys),
        "algorithm.gdpo_reward_keys",
        "gdpo needs the reward dimensions: keys of the dict the reward function returns, e.g. "
        "[format_reward,accuracy_reward]",
    ):
        c.check(len(set(keys)) == len(keys), "algorithm.gdpo_reward_keys", f"names a key twice: {keys}")
    if weights is not None:
        c.check(
            len(weights) == len(keys),
            "algorithm.gdpo_reward_weights",
            f"{len(weights)} weights for the {len(keys)} algorithm.gdpo_reward_keys {keys}",
        )


def _check_policy_loss_options(c: _Checker) -> None:
    a = c.cfg.actor_rollout_ref.actor
    mode = a.policy_loss.loss_mode
    if mode == "dro":
        beta = a.policy_loss.dro_beta
        c.check(
            beta is not None and beta > 0,
            f"{ACTOR}.policy_loss.dro_beta",
            f"the dro loss needs a positive dro_beta, got {beta}",
        )
    if mode == "sapo":
        c.positive(f"{ACTOR}.tau_pos", " (sapo's gate divides by it)")
        c.positive(f"{ACTOR}.tau_neg", " (sapo's gate divides by it)")


def _check_rollout_correction(c: _Checker) -> None:
    from jaxflow.algos.rollout_correction import (
        BYPASS_LOSS_TYPES,
        ROLLOUT_IS_LEVELS,
        parse_rollout_is_threshold,
        parse_rollout_rs,
        parse_rollout_rs_thresholds,
    )

    rc = c.cfg.algorithm.rollout_correction
    c.one_of(f"{RC}.loss_type", BYPASS_LOSS_TYPES)
    if rc.rollout_is is not None and c.one_of(f"{RC}.rollout_is", ROLLOUT_IS_LEVELS):
        try:
            parse_rollout_is_threshold(rc.rollout_is_threshold)
        except (TypeError, ValueError) as e:
            c.add(f"{RC}.rollout_is_threshold", str(e))
    if rc.rollout_rs is not None:
        try:
            options = parse_rollout_rs(rc.rollout_rs)
        except ValueError as e:
            c.add(f"{RC}.rollout_rs", str(e))
        else:
            try:
                parse_rollout_rs_thresholds(options, rc.rollout_rs_threshold)
            except (TypeError, ValueError) as e:
                c.add(f"{RC}.rollout_rs_threshold", str(e))
    mode = c.cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if not rc.bypass_mode and mode != "bypass_mode":
        for key in ("rollout_is", "rollout_rs"):
            c.check(
                rc[key] is None,
                f"{RC}.{key}",
                "applies in bypass mode only (algorithm.rollout_correction.bypass_mode=True): verl's decoupled mode "
                "(IS weights / rejection against recomputed old log-probs) is not implemented in jaxflow",
            )


def _check_sft(c: _Checker) -> None:
    """An sft job, and the supervised warm start of an RL run (same keys, ``warm_start_steps``
    steps)."""
    cfg = c.cfg
    s = cfg.jaxflow.sft
    warm_start = cfg.jaxflow.job == "rl" and s.warm_start_steps > 0 and not cfg.actor_rollout_ref.model.path
    if cfg.jaxflow.job != "sft" and not warm_start:
        return
    for key in ("batch_size", "micro_batch_size_per_device") + (() if warm_start else ("steps",)):
        c.at_least(f"jaxflow.sft.{key}")
    c.at_least("jaxflow.sft.warmup_steps", 0)
    c.at_least("jaxflow.sft.weight_decay", 0)
    c.positive("jaxflow.sft.lr")
    c.check(
        s.batch_size <= cfg.jaxflow.data.num_train_examples,
        "jaxflow.sft.batch_size",
        f"{s.batch_size} demonstrations per step, but jaxflow.data.num_train_examples draws only "
        f"{cfg.jaxflow.data.num_train_examples}",
    )
    if warm_start:
        return
    c.check(
        bool(cfg.jaxflow.sft.output_dir), "jaxflow.sft.output_dir", "must name the directory to write the checkpoint to"
    )
    c.check(
        not cfg.data.train_files,
        "data.train_files",
        "the sft job trains on the built-in task's demonstrations; leave data.train_files empty",
    )


def _check_adapter_settings(c: _Checker, key: str) -> None:
    """``{key}.lora_alpha``, ``lora_dropout`` and ``target_modules`` of a role with LoRA."""
    from jaxflow.models.lora import parse_target_modules

    c.positive(f"{key}.lora_alpha")
    c.bounded(f"{key}.lora_dropout", Bound(0.0, 1.0, "[)"))
    try:
        parse_target_modules(get_value(c.cfg, f"{key}.target_modules"))
    except ValueError as e:
        c.add(f"{key}.target_modules", str(e))


def _check_critic_lora(c: _Checker) -> None:
    """The critic's LoRA keys: an RL job's critic."""
    m, key = c.cfg.critic.model, "critic.model"
    if m.lora_rank <= 0:
        c.at_least(f"{key}.lora_rank", 0)
        return
    if c.cfg.jaxflow.job != "rl" or not critic_enabled(c.cfg):
        c.add(f"{key}.lora_rank", "LoRA adapters train an rl job's critic, and this run has no critic")
        return
    _check_adapter_settings(c, key)


def _check_lora(c: _Checker) -> None:
    """The actor's LoRA keys (an RL job's; an sft job trains every weight) and the rollout probe."""
    from jaxflow.models.hf_io import CheckpointError
    from jaxflow.models.peft_io import read_adapter_config

    cfg, m, key = c.cfg, c.cfg.actor_rollout_ref.model, "actor_rollout_ref.model"
    c.one_of("jaxflow.rollout_probe.enable", PROBE_MODES)
    c.bounded("jaxflow.rollout_probe.tolerance", Bound(0.0, 1.0, "(]"))
    if m.lora_rank <= 0 and not m.lora_adapter_path:
        c.at_least(f"{key}.lora_rank", 0)
        return
    if cfg.jaxflow.job != "rl":
        c.add(f"{key}.lora_rank", "LoRA adapters train an rl job's actor; an sft job trains every weight")
        return
    _check_adapter_settings(c, key)
    if m.lora_adapter_path:
        try:
            lora, _ = read_adapter_config(os.path.expanduser(m.lora_adapter_path))
        except (FileNotFoundError, CheckpointError, KeyError, ValueError) as e:
            c.add(f"{key}.lora_adapter_path", f"{m.lora_adapter_path!r}: {e}")
            return
        c.check(
            m.lora_rank in (0, lora.rank),
            f"{key}.lora_rank",
            f"is {m.lora_rank} but the adapter in lora_adapter_path has rank {lora.rank} (its config gives the "
            "adapters' shape; leave lora_rank at 0)",
        )


def _check_paths(c: _Checker) -> None:
    from jaxflow.models import PRESETS

    cfg = c.cfg
    crf = cfg.custom_reward_function
    if crf.path is not None:
        path = os.path.expanduser(crf.path)
        c.check(
            os.path.isfile(path),
            "custom_reward_function.path",
            f"file not found: {crf.path!r} (resolved to {os.path.abspath(path)})",
        )
        c.check(bool(crf.name), "custom_reward_function.name", "must name the function in custom_reward_function.path")
    for key in ("data.train_files", "data.val_files"):
        for f in filter(None, (p.strip() for p in get_value(cfg, key).split(","))):
            c.check(os.path.isfile(os.path.expanduser(f)), key, f"file not found: {f!r}")
    if cfg.trainer.resume_mode == "resume_path":
        c.check(
            bool(cfg.trainer.resume_from_path),
            "trainer.resume_from_path",
            "trainer.resume_mode is 'resume_path' but no checkpoint path is given",
        )
    for role in ROLES:
        path = model_path(cfg, role)
        if path.startswith(PRESET_PREFIX):
            name = path[len(PRESET_PREFIX) :]
            c.check(
                name in PRESETS,
                path_key(role),
                f"unknown preset {name!r}{suggest(name, PRESETS)}; presets: {', '.join(PRESETS)}",
            )


def _check_multi_turn(c: _Checker) -> None:
    """``multi_turn.*`` and ``jaxflow.agent.tools``: a known format, known built-in tools, tool
    and interaction configs that load; multi-turn runs on the local backend, with a tool or an
    environment."""
    from jaxflow.agents import FORMATS
    from jaxflow.agents.rollout import BUILTIN_TOOLS, load_environment, load_tools

    mt, key = c.cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    c.one_of(f"{key}.format", FORMATS)
    for name in c.cfg.jaxflow.agent.tools:
        c.check(
            name in BUILTIN_TOOLS, "jaxflow.agent.tools", f"unknown tool {name!r}; built-in: {sorted(BUILTIN_TOOLS)}"
        )
    for name, load in (
        ("tool_config_path", lambda p: load_tools([], p)),
        ("interaction_config_path", load_environment),
    ):
        if mt[name]:
            try:
                load(mt[name])
            except ValueError as e:
                c.check(False, f"{key}.{name}", str(e))
    if not mt.enable:
        return
    c.check(
        bool(c.cfg.jaxflow.agent.tools or mt.tool_config_path or mt.interaction_config_path),
        f"{key}.enable",
        "multi-turn rollouts need tools (jaxflow.agent.tools, multi_turn.tool_config_path) or an environment "
        "(multi_turn.interaction_config_path)",
    )
    c.check(c.cfg.jaxflow.backend == "local", f"{key}.enable", "multi-turn rollouts run on the local backend so far")


def _check_model_shape(c: _Checker) -> None:
    from jaxflow.data.char_tokenizer import DEFAULT_CHARS, SPECIAL_TOKENS
    from jaxflow.models import PRESETS

    cfg, m = c.cfg, c.cfg.jaxflow.model
    ok = True
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        ok &= c.at_least(f"jaxflow.model.{key}", 0, " (0 = the preset's)")
    if not ok or m.preset not in PRESETS:
        return
    base = PRESETS[m.preset]
    heads, kv = m.num_heads or base.num_heads, m.num_kv_heads or base.num_kv_heads
    hidden = m.hidden_size or base.hidden_size
    c.check(hidden % heads == 0, "jaxflow.model.num_heads", f"num_heads={heads} does not divide hidden_size={hidden}")
    c.check(heads % kv == 0, "jaxflow.model.num_kv_heads", f"num_kv_heads={kv} does not divide num_heads={heads}")
    if cfg.jaxflow.data.tokenizer == "char" and not cfg.actor_rollout_ref.model.path:
        need, vocab = len(SPECIAL_TOKENS) + len(DEFAULT_CHARS), m.vocab_size or base.vocab_size
        c.check(
            vocab >= need, "jaxflow.model.vocab_size", f"{vocab} rows are fewer than the char tokenizer's {need} ids"
        )
    if not cfg.data.train_files:
        c.check(
            cfg.jaxflow.data.num_train_examples >= cfg.data.train_batch_size,
            "jaxflow.data.num_train_examples",
            f"{cfg.jaxflow.data.num_train_examples} built-in prompts are fewer than "
            f"data.train_batch_size={cfg.data.train_batch_size}",
        )


# ----------------------------------------------------------------------------- stage 3: structure


def _auto(cfg: ConfigDict) -> bool:
    """An RL run whose pools and meshes the auto-mapper picks (an sft job treats auto as
    colocated: it runs the actor alone on every device)."""
    return cfg.jaxflow.placement.type == "auto" and cfg.jaxflow.job == "rl"


def _check_batches(c: _Checker) -> None:
    """Mini-batches of whole prompts split over the data-parallel ranks into micro-batches."""
    cfg = c.cfg
    if cfg.jaxflow.job == "sft":
        s, dp = cfg.jaxflow.sft, data_parallel_size(cfg, "actor")
        if c.check(
            s.batch_size % dp == 0,
            "jaxflow.sft.batch_size",
            f"{s.batch_size} demonstrations do not split over the actor's {dp} data-parallel ranks "
            "(dp*fsdp of jaxflow.mesh.actor.train)",
        ):
            per = s.batch_size // dp
            c.check(
                per % s.micro_batch_size_per_device == 0,
                "jaxflow.sft.micro_batch_size_per_device",
                f"{per} demonstrations per data-parallel rank ({s.batch_size}/{dp}) are not a multiple "
                f"of {s.micro_batch_size_per_device}",
            )
        return
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    for role, prefix in (("actor", ACTOR), ("critic", "critic")):
        if role == "critic" and not critic_enabled(cfg):
            continue
        mini = get_value(cfg, f"{prefix}.ppo_mini_batch_size")
        micro = get_value(cfg, f"{prefix}.ppo_micro_batch_size_per_device")
        if not c.check(
            batch % mini == 0,
            f"{prefix}.ppo_mini_batch_size",
            f"data.train_batch_size={batch} prompts do not split into mini-batches of {mini} prompts",
        ):
            continue
        if _auto(cfg):  # the auto-mapper proposes only meshes whose data-parallel ranks split the batches
            continue
        dp = data_parallel_size(cfg, role)
        responses = mini * n
        if not c.check(
            responses % dp == 0,
            f"{prefix}.ppo_mini_batch_size",
            f"a mini-batch of {mini} prompts x rollout.n={n} = {responses} responses does not split "
            f"over the {role}'s {dp} data-parallel ranks (dp*fsdp of {mesh_key(role)})",
        ):
            continue
        per = responses // dp
        # A micro-batch bounds memory: one larger than a rank's rows means a single pass.
        c.check(
            per <= micro or per % micro == 0,
            f"{prefix}.ppo_micro_batch_size_per_device",
            f"{per} responses per data-parallel rank per mini-batch ({mini} prompts x n={n} / {dp} ranks) "
            f"are not a multiple of the micro-batch size {micro}",
        )


def _describe(model: Any, role: str, cfg: ConfigDict) -> str:
    path = model_path(cfg, role) or f"{PRESET_PREFIX}{cfg.jaxflow.model.preset}"
    return (
        f"{role} model {path}: heads={model.num_heads}, kv_heads={model.num_kv_heads}, "
        f"head_dim={model.head_dim}, hidden={model.hidden_size}, mlp={model.intermediate_size}, "
        f"vocab={model.vocab_size}"
    )


def _check_model_fit(c: _Checker) -> None:
    """Model dimensions divisible by the mesh axes that shard them, with the rules each role's
    phases use (jaxflow.mesh.DEFAULT_ROLE_RULES; the actor's hybrid rules and generation)."""
    from jaxflow.mesh import DEFAULT_ROLE_RULES, check_model_fits, get_rules, hybrid_rules

    cfg = c.cfg
    for role in active_roles(cfg):
        model = model_config(cfg, role)
        if model is None:
            continue
        sizes, key = mesh_sizes(cfg, role), mesh_key(role)
        where = ",".join(f"{a}={s}" for a, s in sizes.items())
        rules = DEFAULT_ROLE_RULES[role]
        try:
            if rules.get("train") == "hybrid_train":
                n = sizes["fsdp"] * sizes["tp"]
                train_rules, gen_rules = hybrid_rules(model, n, tp=sizes["tp"])
                check_model_fits(model, sizes, train_rules)
                if "generate" in rules:
                    key, tp = "jaxflow.mesh.actor.generate.tp", cfg.jaxflow.mesh.actor.generate.tp
                    where = f"tp={tp} on the training mesh {where}"
                    check_model_fits(model, {"replica": sizes["dp"], "tp": tp, "dp": n // tp}, gen_rules)
            else:
                for phase in ("train", "infer"):
                    if phase in rules:
                        check_model_fits(model, sizes, get_rules(rules[phase]))
        except ValueError as e:
            c.add(key, f"({where}) does not fit the {_describe(model, role, cfg)}: {e}")
    _check_model_lengths(c)


def _check_model_lengths(c: _Checker) -> None:
    """The prompt and response lengths, the char tokenizer and the stop token ids against the
    actor model (when its shape is known)."""
    cfg = c.cfg
    actor = model_config(cfg, "actor")
    if actor is not None:
        beyond = [t for t in cfg.actor_rollout_ref.rollout.stop_token_ids if t >= actor.vocab_size]
        c.check(
            not beyond,
            f"{ROLLOUT}.stop_token_ids",
            f"{beyond} are not ids of the actor model's vocabulary (0..{actor.vocab_size - 1}): it never samples "
            "them, so they would never stop a response",
        )
        total = cfg.data.max_prompt_length + cfg.data.max_response_length
        c.check(
            total <= actor.max_position_embeddings,
            "data.max_response_length",
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the actor model's "
            f"max_position_embeddings={actor.max_position_embeddings}",
        )
        if cfg.jaxflow.data.tokenizer == "char" and cfg.actor_rollout_ref.model.path:
            c.check(
                actor.vocab_size >= 100,
                "actor_rollout_ref.model.path",
                f"the model's vocab_size={actor.vocab_size} is smaller than the char tokenizer's 100 ids",
            )


def _check_kv_budget(c: _Checker, replicas: int) -> None:
    """``rollout.max_total_tokens`` (when set) holds the smallest KV-cache pool the rollout can
    run in on each of ``replicas`` generation replicas (`jaxflow.sampling.batcher.pool_bounds`:
    one prefill group's prompts and one response, in pages). Without a placement yet (auto),
    ``replicas`` is the device count: the fewest prompts per replica, a bound that any plan
    needs."""
    from jaxflow.sampling.batcher import pool_bounds
    from jaxflow.sampling.engine import (
        DEFAULT_PAGE_SIZE,
        PREFILL_ROWS,
        PROMPT_BUCKET_MIN,
        RESPONSE_BUCKET_MIN,
        bucket_size,
    )

    cfg, key = c.cfg, f"{ROLLOUT}.max_total_tokens"
    budget = cfg.actor_rollout_ref.rollout.max_total_tokens
    if not budget:
        return
    calls = [cfg.data.train_batch_size, cfg.data.val_batch_size]  # prompts per generate call (val: if known)
    if cfg.data.val_batch_size is None and not cfg.data.val_files:
        calls[1] = cfg.jaxflow.data.num_val_examples
    prompts = max(bucket_size(n, multiple=replicas) // replicas for n in calls if n)
    group, T = min(prompts, PREFILL_ROWS), DEFAULT_PAGE_SIZE
    P = bucket_size(cfg.data.max_prompt_length, minimum=PROMPT_BUCKET_MIN)
    R = bucket_size(cfg.data.max_response_length, minimum=RESPONSE_BUCKET_MIN)
    least, _ = pool_bounds(prompts, P, R, prompts, group, T)
    c.check(
        1 + -(-budget // T) >= least,
        key,
        f"{budget} tokens is below the smallest KV-cache pool this rollout can run in, {(least - 1) * T} tokens per "
        f"generation replica (a prefill group of {group} prompts of {P} tokens and one response of {R}, in pages "
        f"of {T}); set at least that, or 0 for the default budget",
    )


def _check_structure(c: _Checker) -> None:
    cfg = c.cfg
    try:
        placement_groups(cfg)
        for role in active_roles(cfg):
            mesh_sizes(cfg, role)
    except ConfigError as e:
        c.items.extend(e.problems)
        return
    sizes, tp = mesh_sizes(cfg, "actor"), cfg.jaxflow.mesh.actor.generate.tp
    n = sizes["fsdp"] * sizes["tp"]
    c.check(
        n % tp == 0,
        "jaxflow.mesh.actor.generate.tp",
        f"generation tp={tp} must divide the actor's training weight-parallel degree fsdp*tp = "
        f"{sizes['fsdp']}*{sizes['tp']} = {n} (jaxflow.mesh.actor.train)",
    )
    _check_batches(c)
    if not c.items:
        gen_dp = sizes["dp"] * (n // tp if n % tp == 0 else 1)  # the actor's generation replicas
        _check_kv_budget(c, gen_dp)
        _check_model_fit(c)


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def ignored_under_auto(given: ConfigDict, resolved: ConfigDict) -> list[str]:
    """The keys that ``given`` sets (a value other than the base config's) and that
    ``jaxflow.placement.type=auto`` replaced in ``resolved`` (meshes, ``rollout.max_num_seqs``),
    each as ``"key=given (auto: chosen)"``."""
    from jaxflow.configs.base import get_base_config

    base = get_base_config()
    out = []
    for key in leaf_keys(given):
        if key == "jaxflow.placement.type" or key not in KEY_TYPES:
            continue
        mine, chosen = _plain(get_value(given, key)), _plain(get_value(resolved, key))
        if mine != chosen and mine != _plain(get_value(base, key)):
            out.append(f"{key}={mine} (auto: {chosen})")
    return out


def warn_ignored_under_auto(given: ConfigDict, resolved: ConfigDict) -> list[str]:
    """One warning line naming what `ignored_under_auto` finds and how to keep it; the list."""
    ignored = ignored_under_auto(given, resolved)
    if ignored:
        logging.getLogger(__name__).warning(
            "jaxflow.placement.type is auto, so the auto-mapper's plan replaced %s; to run with your own settings, "
            "set jaxflow.placement.type=colocated (or split, or custom)",
            ", ".join(ignored),
        )
    return ignored


def validate(cfg: ConfigDict) -> None:
    """Raises :class:`ConfigError` listing every problem of ``cfg`` (see the module docstring)."""
    c = _Checker(cfg)
    _check_schema(c)
    c.raise_if_any()
    for check in (
        _check_enums,
        _check_ranges,
        _check_algorithm,
        _check_sft,
        _check_lora,
        _check_critic_lora,
        _check_paths,
        _check_multi_turn,
        _check_model_shape,
        _check_rollout_pool,
    ):
        check(c)
    c.raise_if_any()
    if _auto(cfg):
        # The auto-mapper picks pools and meshes at start-up (jaxflow.automap.auto_place; the
        # run validates the config that records its choice); here only what needs no mesh.
        p = cfg.jaxflow.placement
        c.check(not p.groups, "jaxflow.placement.groups", "is only used by placement type 'custom' (type is 'auto')")
        c.check(
            not p.pool_sizes,
            "jaxflow.placement.pool_sizes",
            "is only used by placement types 'split' and 'custom' (type is 'auto')",
        )
        _check_batches(c)
        _check_model_lengths(c)
        _check_kv_budget(c, cfg.jaxflow.num_devices)
        c.raise_if_any()
        return
    _check_structure(c)
    c.raise_if_any()
    try:  # the run's own placement code, on stand-in devices: a net for anything missed above
        build_placement(cfg, [FakeDevice(i) for i in range(cfg.jaxflow.num_devices)])
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("jaxflow.placement", str(e)) from None
