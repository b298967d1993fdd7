"""``python -m jaxflow.run`` in subprocesses, as a user runs it, with real signals: the
helpers of the reliability tests (tests/test_reliability.py, tests/test_ray_backend.py)."""

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[1]

# The tiniest run that exercises the real paths: one device, one layer, 2 prompts x 2 responses.
TINY = [
    "--config=grpo_tiny",
    "--config.actor_rollout_ref.actor.use_kl_loss=false",  # no reference model to compile
    "--config.trainer.test_freq=-1",
    "--config.trainer.val_before_train=false",
    "--config.jaxflow.sft.warm_start_steps=0",
    "--config.data.train_batch_size=2",
    "--config.actor_rollout_ref.rollout.n=2",
    "--config.actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "--config.actor_rollout_ref.actor.ppo_micro_batch_size_per_device=4",
    "--config.jaxflow.data.num_train_examples=8",
    "--config.jaxflow.data.num_val_examples=4",
    "--config.jaxflow.num_devices=1",
    "--config.jaxflow.mesh.actor.train.tp=1",
    "--config.jaxflow.mesh.actor.generate.tp=1",
    "--config.jaxflow.model.num_layers=1",
    "--config.trainer.logger=console,jsonl",
]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: this checkout on the path, no simulated-device count
    (the run chooses its own; conftest's compile flags and the run-wide cache reach it), no Ray
    cluster named (``RAY_ADDRESS`` only when given in ``extra``)."""
    env = {k: v for k, v in child_env().items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def run_cli(args, run_dir, timeout=600, env=None):
    """``python -m jaxflow.run``; ``(exit code, stdout + stderr)``."""
    cmd = [sys.executable, "-m", "jaxflow.run", *args, f"--config.trainer.default_local_dir={run_dir}"]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env or cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (children, their children, ...)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = {int(p) for p in f.read().split()} - found
            except FileNotFoundError:
                continue
            found |= children
            todo.extend(children)
    return found


def dead(pid: int) -> bool:
    """Gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def still_alive(pids, within_s: float = 10.0) -> list[str]:
    """The command lines of ``pids`` still alive ``within_s`` seconds from now (polled)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end and not all(dead(p) for p in pids):
        time.sleep(0.1)
    left = []
    for p in pids:
        if not dead(p):
            try:
                with open(f"/proc/{p}/cmdline") as f:
                    left.append(f"{p}: {f.read().replace(chr(0), ' ')[:200]}")
            except FileNotFoundError:
                pass
    return left


@dataclasses.dataclass
class Stopped:
    """A run stopped by a signal: its exit code, its whole output, and the processes it had
    started (every descendant, taken just before the signal)."""

    code: int
    out: str
    processes: set[int]


def stop_when(args, run_dir, until, stop, env=None, timeout=600) -> Stopped:
    """Runs ``python -m jaxflow.run`` and, as soon as it prints a line starting with ``until``
    (a string) or ``until(run_dir)`` is true (e.g. a save is under way), sends it the signal
    ``stop`` (or calls ``stop()``: something else happens to the run), then waits for it to
    exit."""
    cmd = [sys.executable, "-m", "jaxflow.run", *args, f"--config.trainer.default_local_dir={run_dir}"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True).start()
    seen: list[str] = []

    def reached() -> bool:
        while True:
            try:
                line = lines.get(timeout=0.005)
            except queue.Empty:
                return callable(until) and until(Path(run_dir))
            if line is None:
                raise AssertionError(f"the run ended before {until!r} was reached:\n{''.join(seen)}")
            seen.append(line)
            if isinstance(until, str) and line.startswith(until):
                return True

    try:
        deadline = time.monotonic() + timeout
        while not reached():
            assert time.monotonic() < deadline, f"{until!r} not reached within {timeout} s:\n{''.join(seen)}"
        processes = descendants(proc.pid)
        if callable(stop):
            stop()
        else:
            proc.send_signal(stop)
        proc.wait(timeout=120)
        while (line := lines.get(timeout=60)) is not None:
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Stopped(proc.returncode, "".join(seen), processes)


def saving(run_dir: Path):
    """``until`` of `stop_when`: a save is under way (a temporary step directory that was not
    in ``run_dir`` before, e.g. an earlier run's debris) while a complete checkpoint exists (the
    one a run stopped now names)."""
    debris = set(Path(run_dir).glob("step_*.orbax-checkpoint-tmp*"))
    return lambda run_dir: bool(complete_steps(run_dir) and set(run_dir.glob("step_*.orbax-checkpoint-tmp*")) - debris)


def steps_left(run_dir: Path) -> list[str]:
    """The names of ``run_dir``'s step entries that are neither complete checkpoints nor orbax's
    temporary directories (a save cut short must leave only those)."""
    complete = {f"step_{s}" for s in complete_steps(run_dir)}
    return sorted(
        p.name for p in Path(run_dir).glob("step_*") if p.name not in complete and ".orbax-checkpoint-tmp" not in p.name
    )


def one_line(out: str, prefix: str) -> str:
    """The single line of ``out`` that starts with ``prefix`` (from ``prefix`` on: a signal
    that interrupts a ``print`` between its text and its newline glues the run's last line to
    the stopped one)."""
    lines = [line[line.index(prefix) :] for line in out.splitlines() if prefix in line]
    assert len(lines) == 1, f"{len(lines)} lines with {prefix!r} in:\n{out}"
    return lines[0]


def complete_steps(run_dir: Path) -> list[int]:
    """The steps of ``run_dir``'s complete checkpoints."""
    return sorted(
        int(p.name.split("_")[1])
        for p in Path(run_dir).glob("step_*")
        if p.name.split("_")[1].isdigit() and (p / "jaxflow_checkpoint.json").is_file()
    )


SIGNALS = {signal.SIGINT: (130, "interrupted:"), signal.SIGTERM: (143, "terminated (SIGTERM):")}
