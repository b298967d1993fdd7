"""``python -m jaxflow.run [--config=NAME|path.py] [--config.key=value ...] [--dry_run]``

Runs an experiment: the RL loop (``jaxflow.job=rl``, the default ``grpo_tiny``), the
supervised warm start (``sft_tiny``), or with ``--dry_run`` the plan and ahead-of-time
compilation of any config on simulated devices. ``--help`` lists the named configs.
On CPU, ``jaxflow.num_devices`` devices are simulated (XLA host platform device count).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# Nothing heavy at import time: a reward function's worker processes (``spawn``) import the
# driver's ``__main__``, this module, each time one starts (and one replaces every worker whose
# sample runs out of time); JAX, Flax and orbax are imported by the functions that use them.

LOG_FILE = "jaxflow.log"
INTERRUPTED = 130  # the exit code of a run stopped by Ctrl-C (128 + SIGINT)
TERMINATED = 143  # the exit code of a run stopped by SIGTERM (128 + SIGTERM)

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


FLAGS = ("--dry_run", "--json=")


def _matches(arg: str, flags: Sequence[str]) -> bool:
    """Whether ``arg`` is one of ``flags`` (a flag ending in ``=`` takes a value)."""
    return any(arg == f or (f.endswith("=") and arg.startswith(f)) for f in flags)


def parse_command(
    argv: Sequence[str], usage: str, flags: Sequence[str], default: str | None = None
) -> tuple[str, list[str], list[str]] | int:
    """``(config name or path, overrides, the command's own arguments)`` of a command line
    (`jaxflow.configs.parse_cli_args`; ``default``: the config without ``--config``), or the
    exit code when there is nothing to run: 0 after printing ``usage`` for ``--help``, 2 after
    saying what is wrong (a ``--config`` without a value, an argument not among ``flags``).
    The CLIs of jaxflow share it."""
    from jaxflow import configs

    try:
        name, overrides, rest = configs.parse_cli_args(argv, default or configs.DEFAULT_CONFIG)
    except configs.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--help" in rest or "-h" in rest:
        print(usage)
        return 0
    unknown = [a for a in rest if not _matches(a, flags)]
    if unknown:
        print(f"error: unknown argument(s) {unknown}\n\n{usage}", file=sys.stderr)
        return 2
    return name, overrides, rest


@dataclasses.dataclass(frozen=True)
class Command:
    """A command line of a jaxflow CLI built on this one's (`load_command`): the config's
    ``name``, the command's own arguments (``rest``), the configured device count, and
    ``prepare``: `jaxflow.configs.prepare.prepare_run` of the config (its keywords)."""

    name: str
    rest: list[str]
    num_devices: int
    prepare: Callable[..., Any]


def load_command(argv: Sequence[str], usage: str, flags: Sequence[str], default: str | None = None) -> Command | int:
    """`parse_command`, then the config loaded with its overrides (not validated: a command
    may plan it for another cluster); an exit code as `parse_command`'s, or 2 after saying
    what is wrong with the config."""
    from jaxflow import configs
    from jaxflow.configs.prepare import prepare_run

    parsed = parse_command(argv, usage, flags, default)
    if isinstance(parsed, int):
        return parsed
    name, overrides, rest = parsed
    try:
        cfg = configs.apply_overrides(configs.get_config(name), overrides)
    except (configs.ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return Command(name, rest, cfg.jaxflow.num_devices, functools.partial(prepare_run, cfg))


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors in what the user gave (config, data, checkpoints, reward function): reported in
    one line, without a traceback."""
    from jaxflow.configs import ConfigError
    from jaxflow.data.dataset import DatasetError
    from jaxflow.models import CheckpointError
    from jaxflow.rewards import RewardFunctionError, UnknownDataSourceError
    from jaxflow.trainer.outputs import RunDirInUseError
    from jaxflow.workers.ray import ClusterError

    return (
        ConfigError,
        ClusterError,
        DatasetError,
        CheckpointError,
        UnknownDataSourceError,
        RewardFunctionError,
        FileNotFoundError,
        FileExistsError,
        RunDirInUseError,
    )


# Orbax's (absl) warnings that are not news on the console (the log file keeps them): an
# exception in one of its threads is raised in the main thread too, where the run reports it in
# one line; a step without orbax's own metadata file (saved before jaxflow wrote one) is healthy.
_ORBAX_NOISE = ("raised an exception", "Metadata file does not exist")


def _not_noise(record: logging.LogRecord) -> bool:
    """False for the records that go to the log file only: those of `_ORBAX_NOISE`, and Ray's
    below ERROR (start-up, token authentication: the run says in one line which cluster it uses)."""
    if record.name == "absl":
        return not any(text in record.getMessage() for text in _ORBAX_NOISE)
    return not ((record.name == "ray" or record.name.startswith("ray.")) and record.levelno < logging.ERROR)


class _NoTraceback(logging.Formatter):
    """Console records without exception tracebacks (those go to the log file)."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def _setup_logging(run_dir: str | None) -> tuple[list[logging.Handler], str | None]:
    """Warnings to the console (one line each, no tracebacks); everything from INFO up, with
    full tracebacks, appended to ``<run_dir>/jaxflow.log``. Returns the handlers added to the
    root logger (console first) and the log file's path."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    console.setFormatter(_NoTraceback("%(levelname)s %(name)s: %(message)s"))
    console.addFilter(_not_noise)
    handlers: list[logging.Handler] = [console]
    path = None
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(os.path.abspath(run_dir), LOG_FILE)
        log_file = logging.FileHandler(path, mode="a", encoding="utf-8")
        log_file.setLevel(logging.INFO)
        log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(log_file)
    for handler in handlers:
        root.addHandler(handler)
    return handlers, path


def _log_unraisable(info: Any) -> None:
    logging.getLogger(__name__).info(
        "unraisable error (%s) in %r",
        info.err_msg or "ignored",
        info.object,
        exc_info=(info.exc_type, info.exc_value, info.exc_traceback),
    )
    if issubclass(info.exc_type, KeyboardInterrupt):
        # Ctrl-C (or SIGTERM) landed where Python cannot raise it (e.g. JAX's garbage-collector
        # callback) and would be lost: deliver it again, to be raised in the main thread's own
        # code. From another thread: called here, in the main thread, the handler would raise
        # inside this hook, where it is lost again (with a traceback on the console).
        import _thread
        import threading

        threading.Thread(target=_thread.interrupt_main, daemon=True).start()


def _run_dir(cfg: Any) -> str | None:
    """Where the run writes (and so its log file goes); None for a dry run."""
    if cfg.jaxflow.dry_run.enable:
        return None
    if cfg.jaxflow.job == "sft":
        from jaxflow.trainer.sft import sft_run_dir

        return sft_run_dir(cfg.jaxflow.sft.output_dir)
    from jaxflow.configs import checkpoint_dir

    return checkpoint_dir(cfg)


def _dry_run(cfg: Any, json_path: str | None) -> None:
    """The run's plan, compiled ahead of time on the simulated devices: the trainer's own start
    (`prepare_run`, `place_run`: the auto-mapper's plan, compiled, for placement auto), then
    the dry run; a Ray run's plan per host too (its programs compile per group mesh, as here)."""
    from jaxflow.configs.prepare import prepare_run
    from jaxflow.plan.dry_run import dry_run, simulated_devices
    from jaxflow.trainer.builders import place_run, ray_config

    devices = simulated_devices(cfg.jaxflow.num_devices, cfg.trainer.experiment_name)
    spec, _, _ = place_run(prepare_run(cfg, devices=devices, with_datasets=False), cfg, verify=True)
    if spec.trainer.backend == "ray":
        from jaxflow.mesh.devices import host_slots
        from jaxflow.workers.ray import describe_hosts

        hosts = spec.placement.on(host_slots(spec.num_devices, spec.ray.devices_per_host))
        print(describe_hosts(hosts, ray_config(spec)), flush=True)
    dry_run(spec, json_path=json_path)


def _train(cfg: Any, json_path: str | None) -> int:
    if cfg.jaxflow.dry_run.enable:
        _dry_run(cfg, json_path)
        return 0
    if cfg.jaxflow.job == "sft":
        from jaxflow.configs.prepare import prepare_run
        from jaxflow.trainer.sft import run_sft

        run_sft(prepare_run(cfg, with_datasets=False), record=cfg)
        return 0

    from jaxflow.trainer.rl import RLTrainer

    RLTrainer(cfg).fit()  # checks the input, places auto, warm start, train; ends with a summary
    return 0


def _asyncio_to_log_file(file_handlers: list[logging.Handler]) -> None:
    """After a failure or an interruption, asyncio's reports of the run's abandoned futures and
    coroutines ("exception was never retrieved", "Task was destroyed but it is pending!",
    "coroutine ... was never awaited": e.g. every write orbax had in flight when the disk
    filled up, or the save a Ctrl-C cut short; some only when the interpreter exits) go to the
    log file alone: the run has said what happened in one line."""
    logging.captureWarnings(True)  # "never awaited" is a RuntimeWarning: to the "py.warnings" logger
    for name in ("asyncio", "py.warnings"):
        log = logging.getLogger(name)
        log.propagate = False
        for handler in file_handlers or [logging.NullHandler()]:
            log.addHandler(handler)  # a closed FileHandler reopens its file to append


def report(e: BaseException, log_path: str | None = None, user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """One line on stderr for a failed run or command (the traceback goes to the log file); the
    exit code: 2 for the user's input or storage (``user_errors``: a command's own), 3 for a
    run stopped by a guard (non-finite steps, a rollout that does not sample the trained
    policy), 1 otherwise."""
    from jaxflow.trainer.guard import NonFiniteError
    from jaxflow.workers.rollout_probe import RolloutMismatchError

    log = logging.getLogger(__name__)
    log.info("the run failed", exc_info=e)
    details = f" (traceback in {log_path})" if log_path else ""
    if isinstance(e, (NonFiniteError, RolloutMismatchError)):
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    if isinstance(e, _user_errors() + tuple(user_errors)):
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxflow.trainer.outputs import storage_error

    storage = storage_error(e)
    if storage is not None:
        print(f"error: {storage}", file=sys.stderr)
        return 2
    print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:500]}{details}", file=sys.stderr)
    return 1


def _load(name: str, overrides: list[str], dry_run: bool) -> Any:
    """The config with its overrides (``dry_run``: ``jaxflow.dry_run.enable``), its devices
    simulated (before JAX starts), validated."""
    from jaxflow import configs
    from jaxflow.mesh.devices import simulate_devices

    cfg = configs.apply_overrides(configs.get_config(name), overrides)
    if dry_run:
        with cfg.unlocked():
            cfg.jaxflow.dry_run.enable = True
    num_devices = cfg.get("jaxflow", {}).get("num_devices")  # validated next; absent in a broken config
    if isinstance(num_devices, int) and num_devices > 0:
        simulate_devices(num_devices)
    configs.validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from jaxflow import configs

    parsed = parse_command(argv, USAGE + configs.describe_named(), FLAGS)
    if isinstance(parsed, int):
        return parsed
    name, overrides, rest = parsed
    json_path = next((a.split("=", 1)[1] for a in rest if a.startswith("--json=")), None)
    try:
        cfg = _load(name, overrides, "--dry_run" in rest)
    except (configs.ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = _run_dir(cfg)
    try:
        handlers, log_path = _setup_logging(run_dir)
    except OSError as e:
        from jaxflow.trainer.outputs import storage_error

        print(f"error: {storage_error(e) or e} (the run directory {run_dir})", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("python -m jaxflow.run %s", " ".join(argv))
    # Errors that native threads report as "unraisable" (e.g. tensorstore's callbacks into
    # orbax's closed event loop after the read of a damaged checkpoint was abandoned) go to the
    # log file: the run has already said what matters in one line.
    sys.unraisablehook = _log_unraisable
    # A log file on a full disk must not print a traceback per record ("--- Logging error ---").
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    from jaxflow.configs.resolve import platform
    from jaxflow.mesh.devices import enable_compilation_cache
    from jaxflow.trainer import interrupt

    enable_compilation_cache(platform(cfg))
    interrupt.install()  # a Ctrl-C (or SIGTERM) swallowed by library code still stops the run within a step
    try:
        return _train(cfg, json_path)
    except KeyboardInterrupt:
        logging.getLogger(__name__).info("interrupted", exc_info=True)
        _asyncio_to_log_file(handlers[1:])  # e.g. the orbax save the interruption cut short
        if interrupt.terminated():
            print(f"terminated (SIGTERM): {_checkpoints(run_dir)}", file=sys.stderr)
            return TERMINATED
        print(f"interrupted: {_checkpoints(run_dir)}", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 - every failure becomes one line; the log has the rest
        _asyncio_to_log_file(handlers[1:])
        return report(e, log_path)
    finally:
        logging.raiseExceptions = raise_exceptions
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _checkpoints(run_dir: str | None) -> str:
    if run_dir is None or not os.path.isdir(run_dir):
        return "nothing was saved"
    from jaxflow.trainer.checkpoint import CheckpointManager

    step = CheckpointManager(run_dir, read_only=True).latest_step()
    if step is None:
        return f"no complete checkpoint in {run_dir}"
    return (
        f"the latest complete checkpoint is step {step} in {run_dir} (a save cut short is removed by the "
        "next run, which resumes from it)"
    )


if __name__ == "__main__":
    code = main()
    if code in (INTERRUPTED, TERMINATED):
        # Threads of a checkpoint write cut short may wait forever, or complain while the
        # interpreter shuts down: leave without joining them (our files are closed by now, the
        # worker groups and a Ray instance the run started are stopped).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
