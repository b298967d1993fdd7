"""``python -m jaxflow.run [--config=NAME|path.py] [--config.key=value ...] [--dry_run]``

Runs an experiment: the RL loop (``jaxflow.job=rl``, the default ``grpo_tiny``), the
supervised warm start (``sft_tiny``), or with ``--dry_run`` the plan and ahead-of-time
compilation of any config on simulated devices. ``--help`` lists the named configs.
On CPU, ``jaxflow.num_devices`` devices are simulated (XLA host platform device count).
"""

from __future__ import annotations

import logging
import os
import sys

USAGE = """usage: python -m jaxflow.run [--config=NAME|path/to/config.py] [--config.KEY=VALUE ...] [--dry_run]
                             [--json=PATH]

Runs an RLHF experiment with jaxflow. Without --config the default is grpo_tiny (GRPO on a
built-in task, a few minutes on a laptop CPU). Config keys follow verl's names; see the
README's table, or `python -m jaxflow.configs.docs`.

  --dry_run     print the plan (placement, meshes, bytes per device) and compile the train and
                generate steps ahead of time on a simulated mesh of the configured size;
                allocates no model
  --json=PATH   (with --dry_run) also write the report as JSON

named configs:
"""


def simulate_devices(n: int) -> None:
    """Simulated host devices; read by XLA when the backend starts (after this, before use)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def enable_compilation_cache() -> str:
    """Turn on JAX's persistent compilation cache (``$JAX_COMPILATION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jaxflow/jax`` or ``~/.cache/jaxflow/jax``), so a restarted run loads its
    compiled programs instead of compiling them again. Returns the directory."""
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxflow", "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors in what the user gave (config, data, checkpoints, reward function): reported in
    one line, without a traceback."""
    from jaxflow.configs import ConfigError
    from jaxflow.data.dataset import DatasetError
    from jaxflow.models import CheckpointError
    from jaxflow.rewards.registry import UnknownDataSourceError

    return (ConfigError, DatasetError, CheckpointError, UnknownDataSourceError, FileNotFoundError, FileExistsError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from jaxflow import configs

    try:
        name, overrides, rest = configs.parse_cli_args(argv)
    except configs.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--help" in rest or "-h" in rest:
        print(USAGE + configs.describe_named())
        return 0
    dry_run = "--dry_run" in rest
    json_path = next((a.split("=", 1)[1] for a in rest if a.startswith("--json=")), None)
    unknown = [a for a in rest if a not in ("--dry_run",) and not a.startswith("--json=")]
    if unknown:
        print(f"error: unknown argument(s) {unknown}\n\n{USAGE}{configs.describe_named()}", file=sys.stderr)
        return 2
    try:
        cfg = configs.get_config(name)
        configs.apply_overrides(cfg, overrides)
        if dry_run:
            with cfg.unlocked():
                cfg.jaxflow.dry_run.enable = True
        simulate_devices(cfg.jaxflow.num_devices)
        configs.validate(cfg)
    except (configs.ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    enable_compilation_cache()

    if cfg.jaxflow.dry_run.enable:
        from jaxflow.plan.dry_run import dry_run

        if cfg.jaxflow.backend == "ray":  # the per-host plan; the programs compile as below, per group mesh
            from jaxflow.configs.resolve import build_placement, ray_config, ray_devices
            from jaxflow.workers.ray_backend import describe_hosts

            print(describe_hosts(build_placement(cfg, ray_devices(cfg)), ray_config(cfg)), flush=True)

        dry_run(cfg, json_path=json_path)
        return 0
    if cfg.jaxflow.job == "sft":
        from jaxflow.trainer.sft import run_sft

        try:
            run_sft(cfg)
        except _user_errors() as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    from jaxflow.trainer.guard import NonFiniteError
    from jaxflow.trainer.rl import RLTrainer
    from jaxflow.trainer.sft import warm_start

    try:
        cfg, actor_params = warm_start(cfg)
        RLTrainer(cfg, actor_params=actor_params).fit()  # prints the end-of-run summary
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
