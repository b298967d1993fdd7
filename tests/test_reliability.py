"""Nothing lost, nothing silent: ``python -m jaxflow.run`` in subprocesses, on real files, with
faults and bad input (docs/RELIABILITY.md maps each fault class to the test that checks it).

The runs are the tiniest that exercise the real paths (one device, one layer, 2 prompts x 2
responses, 1-4 steps); several assertions share one run where they check the same directory.
"""

import dataclasses
import hashlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jaxflow.run import main
from tests.cli import (
    REPO,
    SIGNALS,
    TINY,
    Stopped,
    cli_env,
    complete_steps,
    descendants,
    one_line,
    run_cli,
    saving,
    steps_left,
    still_alive,
    stop_when,
)


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, by relative name."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("error:", "stopped:"))]


@pytest.mark.slow
def test_reruns_keep_checkpoints_and_user_files_and_bad_updates_or_damage_never_cost_a_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Files of the user's that sit where earlier versions wrote the built-in task.
    user_files = {
        run_dir / "data" / "train.parquet": b"the user's own train file",
        run_dir / "data" / "test.parquet": b"the user's own test file",
    }
    for path, data in user_files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    keep_two = ["--config.trainer.save_freq=1", "--config.trainer.max_actor_ckpt_to_keep=2"]
    code, out = run_cli([*TINY, *keep_two, "--config.trainer.total_training_steps=2"], run_dir)
    assert code == 0, out
    assert "train = BUILT-IN task 'reverse_digits'" in out and "validation = BUILT-IN task 'reverse_digits'" in out
    assert re.search(r"step 2 \|.*reward_errors 0 \| reward_timeouts 0", out), out  # counts on the console line
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_1", "step_2"]
    step_1 = tree_digest(run_dir / "step_1")
    for path, data in user_files.items():
        assert path.read_bytes() == data

    # A fresh run (resume_mode=disable) in that directory is refused in one line; nothing is deleted.
    code, out = run_cli([*TINY, *keep_two, "--config.trainer.resume_mode=disable"], run_dir)
    assert code == 2, out
    (line,) = error_lines(out)
    assert "trainer.resume_mode" in line and "nothing was deleted" in line and "[1, 2]" in line
    assert len(out.strip().splitlines()) == 1, out

    # An infinite learning rate is refused by validation, naming the key.
    code, out = run_cli([*TINY, "--config.actor_rollout_ref.actor.optim.lr=inf"], run_dir)
    assert code == 2 and error_lines(out) == [
        "error: actor_rollout_ref.actor.optim.lr: must be a finite number, got inf"
    ], out

    # The newest checkpoint is damaged (its array files truncated): the rerun warns in one line naming
    # the step and item, moves it aside and resumes from step 1. There lr=1e39 (valid, but inf in
    # float32) overflows every update: steps 2 and 3 are refused, nothing is saved or pruned, and the
    # run stops with the last good checkpoint intact.
    data_files = [p for p in (run_dir / "step_2" / "actor").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for data_file in data_files:
        data_file.write_bytes(data_file.read_bytes()[:100])  # the array data files, truncated
    code, out = run_cli(
        [
            *TINY,
            *keep_two,
            "--config.trainer.total_training_steps=6",
            "--config.actor_rollout_ref.actor.optim.lr=1e39",
            "--config.jaxflow.trainer.max_nonfinite_steps=2",
        ],
        run_dir,
    )
    assert code == 3, out
    (warning,) = [line for line in out.splitlines() if "damaged" in line]
    assert "skipping damaged checkpoint step 2 (item 'actor' cannot be read" in warning
    assert "resuming from step 1" in warning and "Traceback" not in out
    assert "resumed from" in out and "step_1" in out
    assert "step 2: not saving a checkpoint after a refused update (latest good checkpoint: step 1)" in out
    assert "actor refused every optimizer step, its params unchanged" in out
    (line,) = error_lines(out)
    assert line.startswith("stopped:") and "last good checkpoint" in line
    names = sorted(p.name for p in run_dir.glob("step_*"))  # nothing saved, nothing deleted
    assert len(names) == 2 and names[0] == "step_1" and names[1].startswith("step_2.damaged-"), names
    assert tree_digest(run_dir / "step_1") == step_1
    for path, data in user_files.items():
        assert path.read_bytes() == data


def _reward_file(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.slow
def test_reward_functions_that_cannot_work_stop_the_run_in_one_line(tmp_path):
    # verl's per-dataset signature: refused when loading, before any model is built.
    two_args = _reward_file(
        tmp_path,
        "two_args.py",
        """
        def compute_score(solution_str, ground_truth):
            return float(solution_str == ground_truth)
    """,
    )
    code, out = run_cli([*TINY, f"--config.custom_reward_function.path={two_args}"], tmp_path / "a")
    assert code == 2, out
    (line,) = error_lines(out)
    assert "custom_reward_function: custom reward function compute_score(solution_str, ground_truth)" in line
    assert "jaxflow:" not in out  # stopped before the run was built

    # A file that hangs at import: cut off at the load limit, before any model is built.
    hangs = _reward_file(
        tmp_path,
        "hangs.py",
        """
        import time
        time.sleep(1000)
    """,
    )
    code, out = run_cli(
        [*TINY, f"--config.custom_reward_function.path={hangs}", "--config.jaxflow.reward.load_timeout_s=2"],
        tmp_path / "b",
    )
    assert code == 2, out
    (line,) = error_lines(out)
    assert "did not finish within 2 s" in line and "hangs.py" in line

    # Fails on every sample: the run stops within the first step, exit 2, one line naming the error.
    raises = _reward_file(
        tmp_path,
        "raises.py",
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"answer": solution_str}["answr"]  # a typo: KeyError on every sample
    """,
    )
    code, out = run_cli(
        [*TINY, f"--config.custom_reward_function.path={raises}", "--config.trainer.total_training_steps=3"],
        tmp_path / "c",
    )
    assert code == 2, out
    (line,) = error_lines(out)
    assert "failed on every sample of a batch (4: 4 errors, 0 timeouts); the first: KeyError: 'answr'" in line
    assert "step 1 |" not in out


def test_a_hanging_reward_function_is_reported_at_once_and_its_workers_die_with_a_killed_driver(tmp_path):
    marker = tmp_path / "called"
    hang = _reward_file(
        tmp_path,
        "hang.py",
        f"""
        import pathlib, time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            pathlib.Path({str(marker)!r}).touch()
            time.sleep(1000)
    """,
    )
    cmd = [
        sys.executable,
        "-m",
        "jaxflow.run",
        *TINY,
        f"--config.custom_reward_function.path={hang}",
        "--config.jaxflow.reward.timeout_s=1",
        "--config.jaxflow.reward.batch_timeout_s=120",
        f"--config.trainer.default_local_dir={tmp_path / 'run'}",
    ]
    driver = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in driver.stdout], daemon=True).start()
    try:
        seen, called_at = [], None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=0.1))
            except queue.Empty:
                pass
            if called_at is None and marker.exists():
                called_at = time.monotonic()
            if any("timed out on sample" in line for line in seen) or driver.poll() is not None:
                break
        reported_at = time.monotonic()
        assert called_at is not None and any("timed out on sample" in line for line in seen), "".join(seen)
        # Reported when it happens (1 s limit), far inside the 120 s batch deadline.
        assert reported_at - called_at < 30
        children = descendants(driver.pid)  # the reward worker (hanging again) and the resource tracker
        assert children
        driver.kill()  # SIGKILL, as the OOM killer would
        driver.wait()
        assert still_alive(children) == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _jsonl(path, truths):
    path.write_text(
        "".join(
            json.dumps({"prompt": "1+1=", "data_source": "jaxflow/addition", "reward_model": {"ground_truth": t}})
            + "\n"
            for t in truths
        )
    )
    return path


def test_data_and_tokenizers_that_do_not_fit_are_refused_before_training(tmp_path, capsys):
    """In-process ``main`` (the CLI's entry point): these fail before any model is built."""
    base = [*TINY, f"--config.trainer.default_local_dir={tmp_path / 'run'}"]
    cases = []
    # A null ground truth would be compared as the text "None"; a list never equals an answer.
    for name, truths, where in (("null", ["2", None], "line 2"), ("list", [["2", "two"], "2"], "line 1")):
        data = _jsonl(tmp_path / f"{name}.jsonl", truths)
        cases.append(
            (
                [f"--config.data.train_files={data}", f"--config.data.val_files={data}"],
                [f"{data}: {where}: reward_model.ground_truth is", "custom reward function"],
            )
        )
    # An actor checkpoint that ships its own tokenizer, run with the default char tokenizer.
    import jaxflow.models as models
    from jaxflow.data.char_tokenizer import CharTokenizer

    ckpt = tmp_path / "hf_model"
    models.save_pretrained(models.init_model(models.get_preset("tiny_llama", vocab_size=128, num_layers=1)), ckpt)
    CharTokenizer(chars="0123456789+=").save_pretrained(ckpt)
    cases.append(
        (
            [f"--config.actor_rollout_ref.model.path={ckpt}"],
            ["jaxflow.data.tokenizer: is 'char'", "ships its own tokenizer", "jaxflow.data.tokenizer=model"],
        )
    )
    # A tokenizer with more ids than the model has embedding rows.
    big = tmp_path / "big_tokenizer"
    CharTokenizer(chars="".join(chr(c) for c in range(0x100, 0x100 + 200))).save_pretrained(big)
    cases.append(
        (
            [f"--config.jaxflow.data.tokenizer={big}"],
            ["jaxflow.model.vocab_size: 128 is smaller than the tokenizer's 204 ids"],
        )
    )
    cases.append(
        (
            [f"--config.actor_rollout_ref.model.path={ckpt}", f"--config.jaxflow.data.tokenizer={big}"],
            [f"the tokenizer has 204 ids but the actor model {ckpt} has 128 vocabulary rows"],
        )
    )
    # A KV-cache budget below what the rollout needs (found by trying: it failed after the pools
    # were built, naming an internal variable), and a stop id the model can never sample.
    cases.append(
        (
            ["--config.actor_rollout_ref.rollout.max_total_tokens=2"],
            [
                "error: actor_rollout_ref.rollout.max_total_tokens: 2 tokens is below the smallest KV-cache pool "
                "this rollout can run in, 96 tokens per generation replica (a prefill group of 4 prompts of 16 "
                "tokens and one response of 16, in pages of 16)"
            ],
        )
    )
    cases.append(
        (
            ["--config.actor_rollout_ref.rollout.stop_token_ids=[3,128]"],
            ["actor_rollout_ref.rollout.stop_token_ids: [128] are not ids of the actor model's vocabulary (0..127)"],
        )
    )
    for args, messages in cases:
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err, err
        for message in messages:
            assert message in err, (message, err)


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "def get_config():\n    raise RuntimeError('no such cluster')\n",
            "get_config() of {path} failed: RuntimeError: no such cluster",
        ),
        ("import sys\nsys.exit(0)\n", "importing {path} failed: it called sys.exit(0)"),
        ("import sys\ndef get_config():\n    sys.exit(0)\n", "get_config() of {path} failed: it called sys.exit(0)"),
        (
            "from ml_collections import ConfigDict\ndef get_config():\n    return ConfigDict({'data': {'train_batch_size': 4}})\n",
            "keys (e.g. data.train_files, data.val_files, data.prompt_key); build it on jaxflow.configs.base.get_base_config()",
        ),
    ],
)
def test_config_files_that_fail_are_one_line(tmp_path, capsys, body, message):
    path = tmp_path / "my_config.py"
    path.write_text(body)
    assert main([f"--config={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message.format(path=path) in err, err


# ----------------------------------------------------------------------------- signals, resumes
# One PPO run directory (actor + critic, a custom reward function, prompts cut to 3 tokens, a
# checkpoint every step) through three runs stopped by signals; the next test continues in it
# with another experiment.

PPO = [
    "--config=ppo_tiny",
    *TINY[1:],
    "--config.algorithm.use_kl_in_reward=false",  # no reference model to compile
    "--config.critic.ppo_mini_batch_size=2",
    "--config.critic.ppo_micro_batch_size_per_device=4",
    "--config.trainer.save_freq=1",
    "--config.trainer.max_actor_ckpt_to_keep=2",
]
MY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth))
"""


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """The three runs (`Stopped`) and what each left: Ctrl-C as step 2 is saved; resumed, SIGTERM
    during its first step (compiling); resumed, SIGTERM as its first step is saved."""
    tmp = tmp_path_factory.mktemp("stopped")
    reward = tmp / "my_reward.py"
    reward.write_text(MY_REWARD)
    run_dir = tmp / "run"
    args = [
        *PPO,
        "--config.trainer.total_training_steps=100",
        f"--config.custom_reward_function.path={reward}",
        "--config.data.max_prompt_length=3",
        "--config.data.truncation=right",
    ]
    runs = {}
    for name, until, signum in (
        ("ctrl_c_in_save", saving, signal.SIGINT),
        ("sigterm_in_step", "jaxflow: ppo (gae) for", signal.SIGTERM),
        ("sigterm_in_save", saving, signal.SIGTERM),
    ):
        before = complete_steps(run_dir)
        stopped = stop_when(args, run_dir, until(run_dir) if callable(until) else until, signum)
        runs[name] = Interrupted(stopped, before, complete_steps(run_dir), steps_left(run_dir), run_dir)
    return {"run_dir": run_dir, "reward": reward, "runs": runs}


@dataclasses.dataclass
class Interrupted:
    """A run stopped by a signal and the run directory's complete steps before and after it (and
    any step entry that is neither complete nor orbax's temporary directory)."""

    stopped: Stopped
    before: list[int]
    after: list[int]
    odd: list[str]
    run_dir: Path

    def check(self, code: int, prefix: str) -> None:
        """Exit ``code``, one line naming the latest complete checkpoint, no traceback, no
        process of the run alive 10 s later, a resume from where the run before left."""
        out, run_dir = self.stopped.out, self.run_dir
        assert self.stopped.code == code, out
        line = one_line(out, prefix)
        assert f"the latest complete checkpoint is step {self.after[-1]} in {run_dir}" in line, line
        assert "Traceback" not in out and "ERROR" not in out and "Metadata file" not in out, out
        assert self.stopped.processes and still_alive(self.stopped.processes) == []
        assert self.odd == [], self.odd  # a save cut short is never a step
        if self.before:
            step = self.before[-1]
            assert f"resumed from {run_dir / f'step_{step}'} at step {step}" in out, out


def test_ctrl_c_and_sigterm_in_a_step_or_a_save_are_one_line_and_the_next_run_resumes(stopped_runs):
    """Exit 130 (Ctrl-C) or 143 (SIGTERM, as SLURM, Kubernetes and ``timeout`` stop jobs), one
    line naming the last complete checkpoint, no traceback, no process of the run (its reward
    workers) alive 10 s later; the save cut short is never a step, and the next run resumes from
    the last complete one (the last run's: in the next test). The start-up lines name the custom
    reward function and the prompts cut to 3 tokens (loudly: all of them); healthy checkpoints
    give no orbax warnings."""
    runs = stopped_runs["runs"]
    runs["ctrl_c_in_save"].check(*SIGNALS[signal.SIGINT])
    runs["sigterm_in_step"].check(*SIGNALS[signal.SIGTERM])
    runs["sigterm_in_save"].check(*SIGNALS[signal.SIGTERM])
    assert runs["sigterm_in_step"].after == runs["sigterm_in_step"].before  # stopped before a save
    run_dir = stopped_runs["run_dir"]
    assert (run_dir / "step_1" / "_CHECKPOINT_METADATA").is_file()  # orbax's own: it never warns
    first = runs["ctrl_c_in_save"].stopped.out
    assert f"reward: custom function compute_score() from {stopped_runs['reward']}" in first
    assert (
        "train = BUILT-IN task 'addition' (train split, 8 prompts, 8 truncated to 3 tokens (data.truncation=right)"
        in first
    )
    assert (
        "WARNING jaxflow.trainer.rl: 8 of the 8 training prompts (100%) are longer than data.max_prompt_length=3"
        in first
    )
    assert "4 of the 4 validation prompts (100%)" in first
    assert "KeyboardInterrupt" in (run_dir / "jaxflow.log").read_text()  # the details are in the log


def _digest_without_log(run_dir):
    """What a run directory holds, but the log (every run appends to it) and the lock (its holder's pid)."""
    return {k: v for k, v in tree_digest(run_dir).items() if k not in ("jaxflow.log", ".jaxflow.lock")}


def test_another_experiment_is_refused_and_each_step_exports_with_its_own_config(stopped_runs, tmp_path, capsys):
    """GRPO pointed at the PPO directory: refused in one line naming the differences, nothing
    changed. With jaxflow.trainer.resume_other_experiment=true it resumes PPO's latest step k
    (its actor; the resume after the last SIGTERM of the previous test) and saves GRPO's step
    k + 1, whose config.json replaces PPO's; the export still reads each step as it was saved
    (step k has a critic, step k + 1 none) and names the step it took; an export to a full disk
    is one line."""
    from jaxflow.export import main as export_main

    run_dir = stopped_runs["run_dir"]
    before, k = _digest_without_log(run_dir), complete_steps(run_dir)[-1]
    grpo = [*TINY, f"--config.trainer.total_training_steps={k + 1}", "--config.trainer.save_freq=1"]
    code, out = run_cli(grpo, run_dir)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    line = one_line(out, "error:")
    assert line.startswith(
        f"error: trainer.default_local_dir: {run_dir / f'step_{k}'} is a checkpoint of another experiment ("
    )
    for difference in (
        "algorithm ppo (gae) there, grpo (grpo) here",
        "roles actor, critic there, actor here",
        "task built-in addition there, built-in reverse_digits here",
        "critic model model_type=llama",
    ):
        assert difference in line, (difference, line)
    assert "nothing was changed" in line and "jaxflow.trainer.resume_other_experiment=true" in line
    assert _digest_without_log(run_dir) == before

    code, out = run_cli([*grpo, "--config.jaxflow.trainer.resume_other_experiment=true"], run_dir)
    assert code == 0, out
    assert f"resumed from {run_dir / f'step_{k}'} at step {k}" in out and complete_steps(run_dir)[-2:] == [k, k + 1]
    assert json.loads((run_dir / "config.json").read_text())["algorithm"]["adv_estimator"] == "grpo"

    def export(*args):
        code = export_main(["--checkpoint", str(run_dir), *args])
        captured = capsys.readouterr()
        return code, captured.out.strip(), captured.err.strip()

    code, _, err = export("--role", "critic", "--out", str(tmp_path / "critic"))
    assert code == 2 and err == f"error: step {k + 1} of {run_dir}: the run has no critic (its roles: actor)", err
    code, out, _ = export("--role", "critic", "--step", str(k), "--out", str(tmp_path / "critic"))
    assert code == 0 and out == f"wrote {tmp_path / 'critic'}: the critic of step {k} (as asked) of {run_dir}", out
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["architectures"] == [
        "LlamaForTokenClassification"
    ]
    code, out, _ = export("--out", str(tmp_path / "actor"))
    assert code == 0 and out.endswith(f"the actor of step {k + 1} (the latest complete step) of {run_dir}"), out

    if _unshare_works():  # an export to a disk that fills up: one line, exit 2, nothing left behind
        full = tmp_path / "full"
        export_args = ["jaxflow.export", "--checkpoint", str(run_dir), "--step", str(k), "--out", str(full / "export")]
        code, out, left = run_on_tmpfs(export_args, full, "size=64k", listed=full)
        assert code == 2, out
        assert re.fullmatch(
            rf"error: cannot write {full}/\S+: No space left on device \(is the disk full\?\)", out.strip()
        ), out
        assert left == [], left


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_on_tmpfs(module_args, mount: Path, options: str, listed: Path, timeout=600):
    """``python -m MODULE ARGS...`` (``module_args``) with a tmpfs (``mount -o options``:
    ``size=512k`` is a disk that fills up, ``ro`` a read-only one) mounted at ``mount``, in a
    private mount namespace (``unshare``: the mount is the command's alone and goes away with
    it). ``(exit code, output, what is left in the directory listed)``."""
    if not _unshare_works():
        pytest.skip("needs `unshare -rm` (user and mount namespaces) to mount a small or read-only tmpfs")
    mount.mkdir(parents=True, exist_ok=True)
    script = (
        'mount -t tmpfs -o "$1" tmpfs "$0" || exit 99; shift; "$@"; rc=$?; echo "LEFT:"; '
        f"ls -a {listed} 2>/dev/null; exit $rc"
    )
    cmd = ["unshare", "-rm", "sh", "-c", script, str(mount), options, sys.executable, "-m", *module_args]
    proc = subprocess.run(
        cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    out, _, left = proc.stdout.rpartition("LEFT:\n")
    return proc.returncode, out, sorted(set(left.split()) - {".", ".."})


def run_cli_on_tmpfs(args, mount: Path, options: str):
    """`run_on_tmpfs` of ``python -m jaxflow.run`` writing its run directory ``<mount>/run``."""
    run_dir = mount / "run"
    return run_on_tmpfs(
        ["jaxflow.run", *args, f"--config.trainer.default_local_dir={run_dir}"], mount, options, listed=run_dir
    )


def test_a_full_disk_or_a_read_only_directory_is_one_line(tmp_path):
    # A read-only file system: refused before anything is built.
    code, out, _ = run_cli_on_tmpfs([*TINY, "--config.trainer.total_training_steps=1"], tmp_path / "ro", "ro")
    assert code == 2, out
    (line,) = error_lines(out)
    assert (
        line == f"error: cannot write {tmp_path / 'ro' / 'run'}: Read-only file system (the run directory "
        f"{tmp_path / 'ro' / 'run'})"
    ), line
    assert len(out.strip().splitlines()) == 1, out

    # A disk that fills up while the first checkpoint is written (512 KiB: the logs and the
    # config fit, the actor's arrays do not): one line naming the file and the cause, no
    # traceback, no error records of orbax's threads; the cut-short save is never a complete step.
    code, out, left = run_cli_on_tmpfs(
        [*TINY, "--config.trainer.total_training_steps=1", "--config.trainer.save_freq=1"],
        tmp_path / "full",
        "size=512k",
    )
    assert code == 2, out
    (line,) = error_lines(out)
    assert re.fullmatch(
        rf"error: cannot write {tmp_path / 'full' / 'run'}/step_1\.orbax-checkpoint-tmp\S*/\S+: "
        r"No space left on device \(is the disk full\?\)",
        line,
    ), line
    assert "Traceback" not in out and "ERROR" not in out, out
    assert "step 1 |" in out and "step_1" not in left and "jaxflow.log" in left, left


def test_an_internal_error_is_one_line_with_the_traceback_in_the_log(tmp_path, capsys, monkeypatch):
    """Anything that is neither the user's input nor storage (a bug): exit 1, one line naming the
    exception and the log file, which has the traceback."""
    import jaxflow.trainer.rl as rl

    class Broken:
        def __init__(self, cfg):
            raise ZeroDivisionError("a bug deep inside")

    monkeypatch.setattr(rl, "RLTrainer", Broken)
    run_dir = tmp_path / "run"
    assert main([*TINY, f"--config.trainer.default_local_dir={run_dir}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: ZeroDivisionError: a bug deep inside (traceback in {run_dir / 'jaxflow.log'})"), err
    log = (run_dir / "jaxflow.log").read_text()
    assert "Traceback (most recent call last)" in log and "raise ZeroDivisionError" in log


def test_every_float_key_refuses_nan_and_inf():
    """Walks the FIELDS table: each key holding floats (alone, in a tuple, or optional) refuses
    NaN and +-Inf in one line naming it."""
    from jaxflow import configs
    from jaxflow.configs.base import FIELDS, KEY_TYPES

    float_keys = [
        key
        for key, *_ in FIELDS
        if KEY_TYPES[key][0] is float or (KEY_TYPES[key][0] in (tuple, list) and key.endswith(".betas"))
    ]
    assert len(float_keys) > 30 and "actor_rollout_ref.actor.optim.lr" in float_keys
    for key in float_keys:
        for bad in (float("nan"), float("inf"), float("-inf")):
            cfg = configs.get_config("grpo_tiny")
            *parents, leaf = key.split(".")
            node = cfg
            for name in parents:
                node = node[name]
            node[leaf] = (0.9, bad) if key.endswith(".betas") else bad
            with pytest.raises(configs.ConfigError) as e:
                configs.validate(cfg)
            assert f"{key}: must be a finite number, got" in str(e.value), (key, bad, str(e.value))


def test_a_warm_start_that_cannot_draw_its_batch_is_refused_by_validation(tmp_path, capsys):
    """Found by trying: this passed validation and then failed inside the warm start (exit 1)."""
    assert (
        main([*TINY, "--config.jaxflow.sft.warm_start_steps=2", f"--config.trainer.default_local_dir={tmp_path}"]) == 2
    )
    assert capsys.readouterr().err.strip() == (
        "error: jaxflow.sft.batch_size: 64 demonstrations per step, but jaxflow.data.num_train_examples draws only 8"
    )


def test_save_refuses_non_finite_params(tmp_path):
    """``RLTrainer.save`` is the last line of defence: a train state holding NaN is never written
    (and so never prunes a good checkpoint)."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from jaxflow.trainer.checkpoint import CheckpointManager
    from jaxflow.trainer.guard import NonFiniteError
    from jaxflow.trainer.rl import RLTrainer
    from jaxflow.workers import TrainState
    from jaxflow.workers.checkpoint_io import abstract_tree, restore_item, save_item
    from jaxflow.workers.train_state import tree_all_finite

    state = TrainState(params={"w": jnp.array([1.0, jnp.nan])}, opt_state=(), step=jnp.zeros((), jnp.int32))
    # The actor's worker group as the trainer calls it (one answer per process), writing for real.
    actor = SimpleNamespace(
        params_finite=lambda: [bool(tree_all_finite(state.params))],
        save_train_state=lambda path: [save_item(path, state)],
        restore_train_state=lambda path: [restore_item(path, state)],
        abstract_train_state=lambda: [abstract_tree(state)],
    )
    trainer = object.__new__(RLTrainer)  # the method under test needs only its workers and checkpoints
    trainer.workers = SimpleNamespace(actor=actor, critic=None)
    with CheckpointManager(tmp_path) as trainer.ckpt:
        with pytest.raises(
            NonFiniteError,
            match=r"step 3: the actor parameters hold NaN or Inf; not saving them "
            r"\(latest good checkpoint: step None\)",
        ):
            trainer.save(3, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".jaxflow.lock"]


def test_user_meshes_that_the_auto_mapper_replaces_are_said_in_one_line(caplog):
    from jaxflow import configs
    from jaxflow.automap import auto_place
    from jaxflow.configs.overrides import with_values
    from jaxflow.configs.prepare import prepare_run
    from jaxflow.configs.validate import warn_ignored_under_auto

    def resolve_placement(cfg, log):  # the config a run records once the auto-mapper placed it
        prepared = prepare_run(cfg, with_datasets=False)
        return with_values(cfg, auto_place(prepared.spec, prepared.devices, log=log).overrides())

    cfg = configs.get_config("grpo_tiny")
    configs.apply_overrides(cfg, ["jaxflow.mesh.actor.train.tp=8", "jaxflow.mesh.actor.generate.tp=8"])
    configs.validate(cfg)
    resolved = resolve_placement(cfg, log=None)
    assert resolved.jaxflow.mesh.actor.train.tp != 8  # the plan's choice for the tiny model
    with caplog.at_level(logging.WARNING):
        ignored = warn_ignored_under_auto(cfg, resolved)
    assert sorted(i.split("=")[0] for i in ignored) == ["jaxflow.mesh.actor.generate.tp", "jaxflow.mesh.actor.train.tp"]
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "jaxflow.mesh.actor.train.tp=8 (auto: " in message
    assert "set jaxflow.placement.type=colocated" in message
    # The base config's own meshes are the plan's to choose: nothing is reported.
    plain = configs.get_config("grpo_tiny")
    assert warn_ignored_under_auto(plain, resolve_placement(plain, log=None)) == []


def _summary_seconds(line: str) -> int:
    """Whole seconds of ``done in 1m05s: ...``."""
    m = re.search(r"done in (?:(\d+)m)?(\d+)s", line)
    return int(m.group(1) or 0) * 60 + int(m.group(2))


@pytest.mark.slow
def test_a_rerun_without_checkpoints_keeps_the_previous_outputs(tmp_path):
    """The default save_freq=-1 writes no checkpoints, so a rerun starts afresh: the outputs of
    the run before (metrics, TensorBoard events, plot, HF export, warm start, config) are moved
    into previous-<time>/, byte for byte. Each run ends with a summary whose wall time covers
    the whole run (its supervised warm start included)."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "--config.trainer.total_training_steps=1",
        "--config.jaxflow.sft.warm_start_steps=2",
        "--config.jaxflow.sft.batch_size=4",
        "--config.jaxflow.sft.micro_batch_size_per_device=4",
        "--config.jaxflow.sft.test_freq=-1",
        "--config.trainer.logger=console,jsonl,tensorboard",
    ]
    code, out = run_cli(args, run_dir)
    assert code == 0, out
    outputs = [
        "config.json",
        "hf_actor",
        "metrics.jsonl",
        "metrics.png",
        "sft_warm_start",
        "sft_warm_start_run",
        "tensorboard",
    ]
    assert all((run_dir / name).exists() for name in outputs)
    first = {
        name: tree_digest(run_dir / name)
        if (run_dir / name).is_dir()
        else hashlib.sha256((run_dir / name).read_bytes()).hexdigest()
        for name in outputs
    }
    # The summary's clock started with the run: it covers the warm start (its own summary) and the steps.
    rl_done = next(line for line in out.splitlines() if line.startswith("done in"))
    sft_done = next(line for line in out.splitlines() if line.startswith("sft done in"))
    step_s = sum(json.loads(line)["timing_s/step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert _summary_seconds(rl_done) >= _summary_seconds(sft_done) + step_s - 1, (rl_done, sft_done, step_s)
    assert "auto-mapper's plan replaced" not in out  # TINY's meshes are the plan's: no false alarm
    # The auto-mapper chose the placement: its predicted step time stands beside the measured one.
    assert re.search(r"\n  step time: median [\d.]+ s \(measured, 1 step\) vs [\d.]+ s predicted \(auto-mapper, ", out)

    code, out = run_cli(args, run_dir)
    assert code == 0, out
    (moved,) = [line for line in out.splitlines() if "moved the previous run's" in line]
    (previous,) = run_dir.glob("previous-*")
    assert moved.endswith(f"to {previous} (nothing was deleted)")
    for name, digest in first.items():
        kept = previous / name
        assert (tree_digest(kept) if kept.is_dir() else hashlib.sha256(kept.read_bytes()).hexdigest()) == digest, name
        assert (run_dir / name).exists(), name  # and the new run wrote its own
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_run_never_writes_over_what_is_not_its_own_and_one_run_per_directory(tmp_path, capsys):
    """In-process ``main``: both are refused before any model is built."""
    from jaxflow.trainer.outputs import RunDirLock

    # A config.json of the user's where the run would write its own (e.g. default_local_dir=.).
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"architectures": ["MyModel"]}')
    assert main([*TINY, f"--config.trainer.default_local_dir={mine}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {mine / 'config.json'} exists and is not a jaxflow run config") and "\n" not in err
    assert (mine / "config.json").read_text() == '{"architectures": ["MyModel"]}'
    assert sorted(p.name for p in mine.iterdir()) == [".jaxflow.lock", "config.json", "jaxflow.log"]

    # Another run holds the directory.
    busy = tmp_path / "busy"
    with RunDirLock(busy):
        assert main([*TINY, f"--config.trainer.default_local_dir={busy}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {busy} is in use by another jaxflow run (pid {os.getpid()}); wait for it to end, or give "
        "this run another directory (trainer.default_local_dir)"
    ), err


def test_asyncio_reports_of_a_failed_run_go_to_the_log_file(tmp_path):
    """A failed save leaves orbax's in-flight writes as futures whose exceptions nobody
    retrieves; asyncio reports each when it is collected, sometimes only at interpreter exit,
    through whatever root handler a library configured (seen in CI: "ERROR:asyncio:Future
    exception was never retrieved" and a traceback per write after the one-line disk-full
    error). After a failure they go to the run's log file only."""
    log = tmp_path / "jaxflow.log"
    script = textwrap.dedent(f"""
        import asyncio, logging
        from jaxflow.run import _asyncio_to_log_file
        logging.basicConfig()  # a library's root handler on stderr
        handler = logging.FileHandler({str(log)!r}, mode="a")
        _asyncio_to_log_file([handler])
        handler.close()  # main() closes its handlers before the interpreter exits
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(ValueError("No space left on device"))
        del future  # collected: asyncio logs "exception was never retrieved"
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "never retrieved" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "Future exception was never retrieved" in log.read_text()


def test_an_interrupted_saves_abandoned_tasks_are_reported_in_the_log_file(tmp_path):
    """A Ctrl-C during a save leaves orbax's save task pending and its coroutines never awaited;
    at exit asyncio reports "Task was destroyed but it is pending!" and Python warns "coroutine
    ... was never awaited" (seen in CI after the one-line "interrupted:"). After an
    interruption both go to the run's log file only."""
    log = tmp_path / "jaxflow.log"
    script = textwrap.dedent(f"""
        import asyncio, gc, logging
        from jaxflow.run import _asyncio_to_log_file
        logging.basicConfig()  # a library's root handler on stderr
        handler = logging.FileHandler({str(log)!r}, mode="a")
        _asyncio_to_log_file([handler])
        handler.close()
        async def save():
            await asyncio.sleep(3600)
        loop = asyncio.new_event_loop()
        task = loop.create_task(save())
        loop.run_until_complete(asyncio.sleep(0))  # the save started, then the interruption
        loop.close()
        del task, loop
        save()  # a coroutine made and never awaited
        gc.collect()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    text = log.read_text()
    assert "Task was destroyed but it is pending!" in text and "was never awaited" in text, text
