"""How a config is read, for validation and for the run alike: which roles run
(:func:`active_roles`), their pools (:func:`placement_groups`), meshes (:func:`mesh_sizes`),
model shapes (:func:`model_config`) and the :class:`~jaxflow.mesh.Placement` itself
(:func:`build_placement`). Problems raise :class:`~jaxflow.configs.overrides.ConfigError`
naming the key."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ml_collections import ConfigDict

from jaxflow.configs.overrides import ConfigError, get_value
from jaxflow.mesh import DEFAULT_ROLE_RULES, ROLES, SPLIT_GROUPS, TRAINING_ROLES, get_rules
from jaxflow.mesh import data_parallel_size as mesh_data_parallel_size

PLACEMENT_TYPES = ("auto", "colocated", "split", "custom")
PRESET_PREFIX = "preset:"
# jaxflow.model.* keys that override a preset's shape (0 = keep the preset's).
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def critic_enabled(cfg: ConfigDict) -> bool:
    """``critic.enable``, or when it is None, whether the estimator is ``gae`` (as verl)."""
    if cfg.jaxflow.job != "rl":
        return False
    enable = cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae" if enable is None else bool(enable)


def uses_reference(cfg: ConfigDict) -> bool:
    """A reference policy runs when a KL term needs it (loss or in-reward penalty)."""
    return cfg.jaxflow.job == "rl" and bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def uses_lora(cfg: ConfigDict) -> bool:
    """The RL actor trains LoRA adapters (``lora_rank`` > 0 or a ``lora_adapter_path``)."""
    m = cfg.actor_rollout_ref.model
    return cfg.jaxflow.job == "rl" and (m.lora_rank > 0 or bool(m.lora_adapter_path))


def ref_in_actor(cfg: ConfigDict) -> bool:
    """The reference policy is the actor's base model (LoRA: the adapters switched off), served
    by the actor: no reference role, no second copy of the weights."""
    return uses_reference(cfg) and uses_lora(cfg)


def lora_config(cfg: ConfigDict, role: str = "actor") -> Any:
    """The `jaxflow.models.lora.LoRAConfig` of the actor (``actor_rollout_ref.model.lora_*``) or
    of the critic (``critic.model.lora_*``), or None without LoRA. With the actor's
    ``lora_adapter_path`` the adapter's ``adapter_config.json`` gives rank, alpha, targets and
    dropout."""
    from jaxflow.models.lora import LoRAConfig
    from jaxflow.models.peft_io import read_adapter_config

    if role == "critic":
        c = cfg.critic.model
        if cfg.jaxflow.job != "rl" or c.lora_rank <= 0:
            return None
        return LoRAConfig(rank=c.lora_rank, alpha=float(c.lora_alpha), targets=c.target_modules, dropout=c.lora_dropout)
    m = cfg.actor_rollout_ref.model
    if role != "actor" or not uses_lora(cfg):
        return None
    if m.lora_adapter_path:
        return read_adapter_config(os.path.expanduser(m.lora_adapter_path))[0]
    return LoRAConfig(rank=m.lora_rank, alpha=float(m.lora_alpha), targets=m.target_modules, dropout=m.lora_dropout)


def active_roles(cfg: ConfigDict) -> tuple[str, ...]:
    """The roles the run needs, in :data:`ROLES` order (an sft job: the actor only; with LoRA
    the reference is the actor's base, `ref_in_actor`, not a role of its own)."""
    safe = cfg.jaxflow.safe_rlhf
    on = {
        "actor": True,
        "ref": uses_reference(cfg) and not uses_lora(cfg),
        "critic": critic_enabled(cfg),
        "reward": cfg.jaxflow.job == "rl" and bool(cfg.reward_model.enable),
        "cost": cfg.jaxflow.job == "rl" and bool(safe.enable and safe.cost_model_path),
    }
    return tuple(r for r in ROLES if on[r])


def _equal_sizes(n: int, pools: int, key: str) -> list[int]:
    if n % pools:
        raise ConfigError(key, f"{n} devices do not split into {pools} equal pools; set jaxflow.placement.pool_sizes")
    return [n // pools] * pools


def _custom_groups(cfg: ConfigDict) -> list[tuple[str, ...]]:
    """``jaxflow.placement.groups`` (``'actor,ref;critic;reward'``) as role tuples, each role
    known and on one pool, every active role on some pool."""
    text = cfg.jaxflow.placement.groups
    if not text.strip():
        raise ConfigError(
            "jaxflow.placement.groups", "placement type 'custom' needs the pools, e.g. 'actor,ref;critic;reward'"
        )
    groups = [tuple(r.strip() for r in g.split(",") if r.strip()) for g in text.split(";")]
    seen: set[str] = set()
    for g in groups:
        if not g:
            raise ConfigError("jaxflow.placement.groups", f"{text!r} has an empty pool")
        for role in g:
            if role not in ROLES:
                raise ConfigError("jaxflow.placement.groups", f"unknown role {role!r}; roles are {', '.join(ROLES)}")
            if role in seen:
                raise ConfigError("jaxflow.placement.groups", f"role {role!r} is placed on two pools")
            seen.add(role)
    missing = [r for r in active_roles(cfg) if r not in seen]
    if missing:
        raise ConfigError("jaxflow.placement.groups", f"{text!r} places no pool for the active roles {missing}")
    return groups


def placement_size(cfg: ConfigDict) -> int:
    """Devices the placement's pools share: the first ``jaxflow.num_devices`` less the rollout
    pool's (``jaxflow.placement.rollout_devices``: the last ones)."""
    return cfg.jaxflow.num_devices - cfg.jaxflow.placement.rollout_devices


def _devices_text(cfg: ConfigDict) -> str:
    """How the placement's device count reads in an error."""
    n, rollout = cfg.jaxflow.num_devices, cfg.jaxflow.placement.rollout_devices
    if rollout:
        return f"the placement has {n - rollout} (jaxflow.num_devices={n} less jaxflow.placement.rollout_devices={rollout})"
    return f"jaxflow.num_devices is {n}"


def _group_sizes(cfg: ConfigDict, groups: list[tuple[str, ...]]) -> list[int]:
    """``jaxflow.placement.pool_sizes`` (default: equal pools), one per group, adding up to
    the placement's devices (`placement_size`)."""
    n, key = placement_size(cfg), "jaxflow.placement.pool_sizes"
    sizes = list(cfg.jaxflow.placement.pool_sizes) or _equal_sizes(n, len(groups), key)
    if len(sizes) != len(groups):
        pools = ["+".join(g) for g in groups]
        raise ConfigError(key, f"{len(sizes)} sizes {tuple(sizes)} for {len(groups)} pools {pools}")
    if any(s < 1 for s in sizes):
        raise ConfigError(key, f"pool sizes must be >= 1, got {tuple(sizes)}")
    if sum(sizes) != n:
        raise ConfigError(key, f"{tuple(sizes)} add up to {sum(sizes)} devices, but {_devices_text(cfg)}")
    return sizes


def placement_groups(cfg: ConfigDict) -> list[tuple[str, int, tuple[str, ...]]]:
    """``[(pool name, size, roles)]`` in device order, as :meth:`Placement.from_groups` takes
    them (all roles, active or not; pools are named after their first role), over the first
    `placement_size` devices."""
    p, n = cfg.jaxflow.placement, placement_size(cfg)
    if p.type == "auto" and cfg.jaxflow.job == "rl":
        raise ConfigError(
            "jaxflow.placement.type",
            "'auto' is resolved at start-up by the auto-mapper (jaxflow.automap.auto_place), which chooses the "
            "pools and meshes; place the run before building its placement",
        )
    if p.type != "custom" and p.groups:
        raise ConfigError("jaxflow.placement.groups", f"is only used by placement type 'custom' (type is {p.type!r})")
    if p.type in ("colocated", "auto"):  # auto for an sft job: the actor alone, on every device
        if p.pool_sizes:
            raise ConfigError(
                "jaxflow.placement.pool_sizes",
                f"is only used by placement types 'split' and 'custom' (type is {p.type!r})",
            )
        return [("global", n, ROLES)]
    if p.type == "split":
        groups = [tuple(g) for g in SPLIT_GROUPS]
    elif p.type == "custom":
        groups = _custom_groups(cfg)
    else:
        raise ConfigError("jaxflow.placement.type", f"must be one of {', '.join(PLACEMENT_TYPES)}, got {p.type!r}")
    return [(g[0], s, g) for g, s in zip(groups, _group_sizes(cfg, groups))]


def mesh_key(role: str) -> str:
    """The config group holding a role's (training / inference) mesh axes."""
    return "jaxflow.mesh.actor.train" if role == "actor" else f"jaxflow.mesh.{role}"


def mesh_axes(cfg: ConfigDict, role: str) -> dict[str, int]:
    """The role's ``{dp, fsdp, tp}`` as configured (one may be -1)."""
    node = get_value(cfg, mesh_key(role))
    return {a: node[a] for a in ("dp", "fsdp", "tp")}


def pool_size(cfg: ConfigDict, role: str) -> int:
    """Devices in the pool that hosts ``role``."""
    for _, size, roles in placement_groups(cfg):
        if role in roles:
            return size
    raise ConfigError("jaxflow.placement.groups", f"role {role!r} is on no pool")


def mesh_sizes(cfg: ConfigDict, role: str) -> dict[str, int]:
    """The role's mesh axes with -1 filled in; :class:`ConfigError` unless their product is
    the size of the role's pool."""
    key, axes, pool = mesh_key(role), mesh_axes(cfg, role), pool_size(cfg, role)
    text = ",".join(f"{a}={s}" for a, s in axes.items())
    fills = [a for a, s in axes.items() if s == -1]
    if len(fills) > 1 or any(s < 1 and s != -1 for s in axes.values()):
        raise ConfigError(key, f"({text}) axis sizes must be >= 1, with at most one -1 (the rest of the pool)")
    known = math.prod(s for s in axes.values() if s != -1)
    if fills:
        if pool % known:
            raise ConfigError(
                key, f"({text}): the other axes ({known} devices) do not divide the {role}'s pool of {pool} devices"
            )
        axes[fills[0]] = pool // known
    elif known != pool:
        raise ConfigError(
            key,
            f"({text}) is {known} devices, but the {role}'s pool has {pool} ({_devices_text(cfg)}, "
            f"placement {cfg.jaxflow.placement.type})",
        )
    return axes


def data_parallel_size(cfg: ConfigDict, role: str) -> int:
    """Data-parallel ranks of a role's training / inference mesh under its default rules
    (`jaxflow.mesh.data_parallel_size`: ``dp * fsdp``)."""
    rules = DEFAULT_ROLE_RULES[role]
    return mesh_data_parallel_size(get_rules(rules.get("train", rules["infer"])), mesh_sizes(cfg, role))


def model_path(cfg: ConfigDict, role: str) -> str:
    """The configured weights of a role ('' = the jaxflow.model.preset, see the key docs)."""
    if role in ("actor", "ref"):
        return cfg.actor_rollout_ref.model.path
    if role == "critic":
        return cfg.critic.model.path or cfg.actor_rollout_ref.model.path
    if role == "reward":
        return cfg.reward_model.model.path
    if role == "cost":
        return cfg.jaxflow.safe_rlhf.cost_model_path
    raise KeyError(f"unknown role {role!r}; roles are {ROLES}")


def path_key(role: str) -> str:
    """The config key holding a role's model path."""
    return {
        "actor": "actor_rollout_ref.model.path",
        "ref": "actor_rollout_ref.model.path",
        "critic": "critic.model.path",
        "reward": "reward_model.model.path",
        "cost": "jaxflow.safe_rlhf.cost_model_path",
    }[role]


def platform(cfg: ConfigDict) -> str:
    """What the run's models run on: ``cpu``, ``gpu`` or ``tpu`` (the Ray hosts' accelerator,
    else JAX's default backend)."""
    if cfg.jaxflow.backend == "ray":
        return cfg.jaxflow.ray.accelerator
    import jax

    return jax.default_backend()


def resolve_dtypes(param: str, compute: str, role: str, platform: str, frozen: bool = False) -> tuple[str, str]:
    """``(param dtype, compute dtype)`` of a role's model with ``auto`` resolved: on CPU
    float32 for both; on GPU and TPU bfloat16 matmuls, float32 master weights for the trained
    roles and bfloat16 weights for the frozen ones (``frozen``: a trained role's weights under
    LoRA adapters, which are float32 whatever the weights)."""
    accelerator = platform in ("gpu", "tpu")
    if compute == "auto":
        compute = "bfloat16" if accelerator else "float32"
    if param == "auto":
        param = "bfloat16" if accelerator and (frozen or role not in TRAINING_ROLES) else "float32"
    return param, compute


def model_config(cfg: ConfigDict, role: str = "actor") -> Any:
    """The role's :class:`jaxflow.models.ModelConfig` when its shape is known: a preset
    (empty path: ``jaxflow.model.preset``; ``preset:NAME``) with the ``jaxflow.model`` shape
    overrides, or a checkpoint directory's ``config.json``; else None. Dtypes (`resolve_dtypes`),
    layer scanning and remat come from ``jaxflow.model`` either way; the actor's LoRA adapters
    and the critic's (`lora_config`) and, in the train-rollout agreement mode, the actor's
    batch-invariant sums (`with_attention`) are part of its config."""
    import jax.numpy as jnp

    from jaxflow.models import PRESETS, ModelConfig

    m = cfg.jaxflow.model
    lora = lora_config(cfg, role)
    invariant = role == "actor" and cfg.jaxflow.trainer.rollout_agreement
    param_dtype, compute_dtype = resolve_dtypes(m.dtype, m.compute_dtype, role, platform(cfg), lora is not None)
    options = dict(
        param_dtype=getattr(jnp, param_dtype),
        dtype=getattr(jnp, compute_dtype),
        scan_layers=m.scan_layers,
        remat_policy=m.remat_policy,
        lora=lora,
    )
    path = model_path(cfg, role)
    if path and not path.startswith(PRESET_PREFIX):
        config_json = os.path.join(os.path.expanduser(path), "config.json")
        if not os.path.isfile(config_json):
            return None
        return with_attention(ModelConfig.from_json_file(config_json, **options), platform(cfg), invariant)
    preset = path[len(PRESET_PREFIX) :] if path else m.preset
    base = PRESETS[preset]
    shape = {k: m[k] for k in SHAPE_KEYS if m[k]}
    if "hidden_size" in shape or "num_heads" in shape:
        shape["head_dim"] = shape.get("hidden_size", base.hidden_size) // shape.get("num_heads", base.num_heads)
    return with_attention(base.replace(**shape, **options), platform(cfg), invariant)


def with_attention(model: Any, platform: str, batch_invariant: bool = False) -> Any:
    """The model config with cuDNN's fused attention for its forwards without a KV cache on
    GPU where cuDNN takes it (`ModelConfig.cudnn_attention_ok`; measured on an H100: the
    0.5B actor's train step 0.113 -> 0.101 s), jaxflow's own attention elsewhere; with
    ``batch_invariant`` (the actor in the train-rollout agreement mode,
    ``jaxflow.trainer.rollout_agreement``) jaxflow's, with every sum in index order
    (`ModelConfig.batch_invariant`): its forwards and the rollout's decode steps agree bit for
    bit."""
    if batch_invariant:
        return model.replace(attention_impl="xla", batch_invariant=True)
    return model.replace(attention_impl="cudnn" if platform == "gpu" and model.cudnn_attention_ok else "xla")


def checkpoint_dir(cfg: ConfigDict) -> str:
    """``trainer.default_local_dir``, or ``checkpoints/<project_name>/<experiment_name>``."""
    t = cfg.trainer
    return t.default_local_dir or os.path.join("checkpoints", t.project_name, t.experiment_name)


def run_devices(cfg: ConfigDict) -> tuple[Any, ...]:
    """The devices a run's placement is built over: the first ``jaxflow.num_devices`` of
    ``jax.devices()``, or on the Ray backend a `jaxflow.mesh.devices.HostSlot` per device of
    each host of ``jaxflow.ray.devices_per_host`` (the devices live in the workers' processes)."""
    n = cfg.jaxflow.num_devices
    if cfg.jaxflow.backend == "ray":
        from jaxflow.mesh.devices import host_slots

        try:
            return host_slots(n, cfg.jaxflow.ray.devices_per_host)
        except ValueError as e:
            raise ConfigError("jaxflow.ray.devices_per_host", str(e)) from None
    import jax

    available = jax.devices()
    if len(available) < n:
        raise ConfigError(
            "jaxflow.num_devices",
            f"{n} devices requested but only {len(available)} {available[0].platform} devices exist",
        )
    return tuple(available[:n])


def build_placement(cfg: ConfigDict, devices: Sequence[Any] | None = None) -> Any:
    """The run's :class:`jaxflow.mesh.Placement`: the active roles on their pools, with their
    meshes, the actor's generation tp and the model shapes (which picks the k/v variant of
    the hybrid rules and checks that every mesh fits its model).

    ``devices`` defaults to `run_devices`; :func:`validate` passes stand-ins
    (`jaxflow.mesh.devices.FakeDevice`), so a 128-device plan is checked without devices. The
    placement takes the first `placement_size` of them (the rest: the rollout pool,
    `jaxflow.trainer.rollouter`).
    """
    from jaxflow.mesh import MeshSpec, Placement

    if devices is None:
        devices = run_devices(cfg)
    devices = tuple(devices)[: placement_size(cfg)]
    roles = active_roles(cfg)
    groups = [(name, size, tuple(r for r in group if r in roles)) for name, size, group in placement_groups(cfg)]
    meshes = {r: MeshSpec(**mesh_axes(cfg, r)) for r in roles}
    models = {r: model for r in roles if (model := model_config(cfg, r)) is not None}
    return Placement.from_groups(
        groups, devices, meshes=meshes, gen_tp={"actor": cfg.jaxflow.mesh.actor.generate.tp}, models=models
    )
