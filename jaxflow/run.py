"""``python -m jaxflow.run [--config=NAME|path.py] [--config.key=value ...] [--dry_run]``

Runs an experiment: the RL loop (``jaxflow.job=rl``, the default ``ppo_tiny``), the
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

Runs an RLHF experiment with jaxflow. Without --config the default is ppo_tiny (PPO on a
built-in task, a few minutes on a laptop CPU). Config keys follow verl's names; see the
README's table, or `python -m jaxflow.configs.docs`.

  --dry_run     print the plan (placement, meshes, bytes per device) and compile the train and
                generate steps ahead of time on a simulated mesh of the configured size;
                allocates no model
  --json=PATH   (with --dry_run) also write the report as JSON

named configs:
"""


def _simulate_devices(n: int) -> None:
    """Simulated host devices; read by XLA when the backend starts (after this, before use)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


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
        _simulate_devices(cfg.jaxflow.num_devices)
        configs.validate(cfg)
    except (configs.ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if cfg.jaxflow.dry_run.enable:
        from jaxflow.plan.dry_run import dry_run

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
        history = RLTrainer(cfg, actor_params=actor_params).fit()
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    scores = [h["critic/score/mean"] for h in history if "critic/score/mean" in h]
    if scores:
        print(f"done: critic/score/mean {scores[0]:.3f} (first step) -> {scores[-1]:.3f} (last step)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
