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
from typing import Any

from jaxflow.mesh.devices import enable_compilation_cache, simulate_devices

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


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors in what the user gave (config, data, checkpoints, reward function): reported in
    one line, without a traceback."""
    from jaxflow.configs import ConfigError
    from jaxflow.data.dataset import DatasetError
    from jaxflow.models import CheckpointError
    from jaxflow.rewards import RewardFunctionError, UnknownDataSourceError
    from jaxflow.trainer.outputs import RunDirInUseError
    from jaxflow.workers.ray_backend import ClusterError

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

        return sft_run_dir(cfg)
    from jaxflow.configs import checkpoint_dir

    return checkpoint_dir(cfg)


def _train(cfg: Any, json_path: str | None) -> int:
    if cfg.jaxflow.dry_run.enable:
        from jaxflow.automap import resolve_placement
        from jaxflow.configs.validate import warn_ignored_under_auto
        from jaxflow.plan.dry_run import dry_run

        given, cfg = cfg, resolve_placement(cfg)  # jaxflow.placement.type=auto (the default): the auto-mapper's plan
        warn_ignored_under_auto(given, cfg)
        if cfg.jaxflow.backend == "ray":  # the per-host plan; the programs compile as below, per group mesh
            from jaxflow.configs.resolve import build_placement, ray_config, ray_devices
            from jaxflow.workers.ray_backend import describe_hosts

            print(describe_hosts(build_placement(cfg, ray_devices(cfg)), ray_config(cfg)), flush=True)

        from jaxflow.configs.run_spec import build_tokenizer, data_spec
        from jaxflow.trainer.builders import count_train_prompts

        # Epoch mode sizes the schedules by the training files' prompts, as the run does.
        prompts = (
            None if cfg.trainer.total_training_steps else count_train_prompts(data_spec(cfg), build_tokenizer(cfg))
        )
        dry_run(cfg, json_path=json_path, num_train_prompts=prompts)
        return 0
    if cfg.jaxflow.job == "sft":
        from jaxflow.trainer.sft import run_sft

        run_sft(cfg)
        return 0

    from jaxflow.trainer.rl import RLTrainer

    RLTrainer(cfg).fit()  # checks the input, resolves placement auto, warm start, train; ends with a summary
    return 0


def _asyncio_to_log_file(file_handlers: list[logging.Handler]) -> None:
    """After a failure, asyncio's reports of the failed run's futures ("exception was never
    retrieved", e.g. every write orbax had in flight when the disk filled up, some only when
    the interpreter exits) go to the log file alone: the run says what failed in one line."""
    log = logging.getLogger("asyncio")
    log.propagate = False
    for handler in file_handlers or [logging.NullHandler()]:
        log.addHandler(handler)  # a closed FileHandler reopens its file to append


def _report(e: BaseException, log_path: str | None) -> int:
    """One line on stderr for a failed run (the traceback goes to the log file); the exit code:
    2 for the user's input or storage, 3 for a run stopped by a guard (non-finite steps, a
    rollout that does not sample the trained policy), 1 otherwise."""
    from jaxflow.trainer.guard import NonFiniteError
    from jaxflow.workers.rollout_probe import RolloutMismatchError

    log = logging.getLogger(__name__)
    log.info("the run failed", exc_info=e)
    details = f" (traceback in {log_path})" if log_path else ""
    if isinstance(e, (NonFiniteError, RolloutMismatchError)):
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    if isinstance(e, _user_errors()):
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxflow.trainer.outputs import storage_error

    storage = storage_error(e)
    if storage is not None:
        print(f"error: {storage}", file=sys.stderr)
        return 2
    print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:500]}{details}", file=sys.stderr)
    return 1


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
        num_devices = cfg.get("jaxflow", {}).get("num_devices")  # validated next; absent in a broken config
        if isinstance(num_devices, int) and num_devices > 0:
            simulate_devices(num_devices)
        configs.validate(cfg)
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
    enable_compilation_cache()
    from jaxflow.trainer import interrupt

    interrupt.install()  # a Ctrl-C (or SIGTERM) swallowed by library code still stops the run within a step
    try:
        return _train(cfg, json_path)
    except KeyboardInterrupt:
        logging.getLogger(__name__).info("interrupted", exc_info=True)
        if interrupt.terminated():
            print(f"terminated (SIGTERM): {_checkpoints(run_dir)}", file=sys.stderr)
            return TERMINATED
        print(f"interrupted: {_checkpoints(run_dir)}", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 - every failure becomes one line; the log has the rest
        _asyncio_to_log_file(handlers[1:])
        return _report(e, log_path)
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
