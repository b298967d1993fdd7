"""Experiment configs (ml_collections): named configs, command-line overrides, validation.

``python -m jaxflow.run --config=grpo_tiny --config.actor_rollout_ref.rollout.n=4`` comes down to::

    cfg = configs.load_config("grpo_tiny", ["actor_rollout_ref.rollout.n=4"])   # + validate

- :data:`NAMED`: name -> module of the shipped configs (each defines ``get_config()``);
  ``--config`` also takes a path to a ``.py`` file defining ``get_config()``.
- :func:`get_config`, :func:`apply_overrides` (:mod:`~jaxflow.configs.overrides`),
  :func:`validate` (:mod:`~jaxflow.configs.validate`; raises :class:`ConfigError`).
- :data:`KEY_DOCS`: one line per key (``python -m jaxflow.configs.docs`` prints the table).
- :func:`prepare_run` (:mod:`~jaxflow.configs.prepare`): the config read once into a
  `PreparedRun`: the one typed description of the run (`RunSpec`,
  :mod:`~jaxflow.configs.run_spec`), its tokenizer and prompts, which the trainer, the dry
  run, the SFT job and the auto-mapper consume; nothing below them reads a config.
- Helpers that interpret a config for the run exactly as validation does
  (:mod:`~jaxflow.configs.resolve`):
  :func:`active_roles`, :func:`placement_groups`, :func:`mesh_sizes`,
  :func:`data_parallel_size`, :func:`model_config`, :func:`build_placement`,
  :func:`checkpoint_dir`.

Loading a config imports neither JAX nor the models; :func:`validate` does.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence

from ml_collections import ConfigDict

from jaxflow.configs.base import DEFAULTS, FIELDS, KEY_DOCS, KEY_TYPES, get_base_config
from jaxflow.configs.overrides import ConfigError, apply_overrides, leaf_keys, parse_value
from jaxflow.configs.resolve import (
    active_roles,
    build_placement,
    checkpoint_dir,
    critic_enabled,
    data_parallel_size,
    mesh_sizes,
    model_config,
    placement_groups,
    uses_reference,
)
from jaxflow.configs.validate import validate

DEFAULT_CONFIG = "grpo_tiny"

NAMED: dict[str, str] = {
    name: f"jaxflow.configs.{name}"
    for name in (
        "ppo_tiny",
        "grpo_tiny",
        "grpo_tool_tiny",
        "grpo_code_tiny",
        "dapo_tiny",
        "remax_tiny",
        "rloo_tiny",
        "reinforce_pp_tiny",
        "safe_rlhf_tiny",
        "sft_tiny",
        "ppo_7b",
        "ppo_13b",
        "ppo_34b",
        "ppo_70b",
    )
}


def _from_file(path: str) -> ConfigDict:
    abspath = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abspath):
        raise ConfigError("--config", f"config file not found: {path!r} (resolved to {abspath})")
    module_name = "jaxflow_user_config_" + str(abs(hash(abspath)))
    spec = importlib.util.spec_from_file_location(module_name, abspath)
    if spec is None or spec.loader is None:
        raise ConfigError("--config", f"cannot import {abspath} (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - SystemExit in a config file is its failure too
        del sys.modules[module_name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError("--config", f"importing {abspath} failed: {_one_line(e)}") from e
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError("--config", f"{abspath} defines no get_config() function")
    try:
        return module.get_config()
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError("--config", f"get_config() of {abspath} failed: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def get_config(name_or_path: str = DEFAULT_CONFIG) -> ConfigDict:
    """A named config (see :data:`NAMED`) or the ``get_config()`` of a ``.py`` file, locked
    (no new keys; existing keys may change). Not validated: call :func:`validate`."""
    if name_or_path in NAMED:
        cfg = importlib.import_module(NAMED[name_or_path]).get_config()
    elif name_or_path.endswith(".py") or os.sep in name_or_path or os.path.isfile(name_or_path):
        cfg = _from_file(name_or_path)
    else:
        close = difflib.get_close_matches(name_or_path, list(NAMED), n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(
            "--config",
            f"unknown config {name_or_path!r}; {hint}named configs: {', '.join(NAMED)}; "
            "or give the path of a .py file defining get_config()",
        )
    if not isinstance(cfg, ConfigDict):
        raise ConfigError(
            "--config",
            f"get_config() of {name_or_path!r} returned {type(cfg).__name__}, not an ml_collections.ConfigDict",
        )
    cfg.lock()
    return cfg


def load_config(name_or_path: str = DEFAULT_CONFIG, overrides: Iterable[str] = (), *, check: bool = True) -> ConfigDict:
    """:func:`get_config`, then :func:`apply_overrides`, then (``check``) :func:`validate`."""
    cfg = apply_overrides(get_config(name_or_path), overrides)
    if check:
        validate(cfg)
    return cfg


def parse_cli_args(argv: Sequence[str], default: str = DEFAULT_CONFIG) -> tuple[str, list[str], list[str]]:
    """Splits ``argv`` into ``(config name or path, overrides, other arguments)``.

    Understands ``--config=NAME``, ``--config NAME``, ``--config.key=value`` and
    ``--config.key value``; the config defaults to ``default``.
    """
    name, overrides, rest = default, [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" or arg.startswith("--config.") and "=" not in arg:
            if i + 1 >= len(args):
                raise ConfigError(arg.removeprefix("--").removeprefix("config."), f"{arg} needs a value")
            value, i = args[i + 1], i + 1
            if arg == "--config":
                name = value
            else:
                overrides.append(f"{arg.removeprefix('--config.')}={value}")
        elif arg.startswith("--config="):
            name = arg.removeprefix("--config=")
        elif arg.startswith("--config."):
            overrides.append(arg.removeprefix("--config."))
        else:
            rest.append(arg)
        i += 1
    return name, overrides, rest


def describe_named() -> str:
    """One line per named config (its module docstring's first sentence), for ``--help``."""
    width = max(map(len, NAMED))
    lines = []
    for name, module in NAMED.items():
        doc = (importlib.import_module(module).__doc__ or "").strip()
        first = " ".join(doc.split("\n\n")[0].split())
        lines.append(f"  {name:<{width}}  {first}")
    return "\n".join(lines)


# The typed run description (`jaxflow.configs.run_spec`, `jaxflow.configs.prepare`) imports JAX
# and the workers; it loads on first use, so that reading a config stays cheap.
_LAZY = {
    "ModelSpec": "run_spec",
    "RewardSpec": "run_spec",
    "RunSpec": "run_spec",
    "build_tokenizer": "run_spec",
    "describe_run": "run_spec",
    "PreparedRun": "prepare",
    "prepare_run": "prepare",
}


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"jaxflow.configs.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'jaxflow.configs' has no attribute {name!r}")


__all__ = [
    "DEFAULTS",
    "DEFAULT_CONFIG",
    "FIELDS",
    "KEY_DOCS",
    "KEY_TYPES",
    "NAMED",
    "ConfigError",
    "ModelSpec",
    "PreparedRun",
    "RewardSpec",
    "RunSpec",
    "active_roles",
    "apply_overrides",
    "build_placement",
    "build_tokenizer",
    "checkpoint_dir",
    "critic_enabled",
    "data_parallel_size",
    "describe_named",
    "describe_run",
    "get_base_config",
    "get_config",
    "leaf_keys",
    "load_config",
    "mesh_sizes",
    "model_config",
    "parse_cli_args",
    "parse_value",
    "placement_groups",
    "prepare_run",
    "uses_reference",
    "validate",
]
