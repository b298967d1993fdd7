"""Nothing lost, nothing silent: ``python -m jaxflow.run`` in subprocesses, on real files, with
faults and bad input (docs/RELIABILITY.md maps each fault class to the test that checks it).

The runs are the tiniest that exercise the real paths (one device, one layer, 2 prompts x 2
responses, 1-4 steps); several assertions share one run where they check the same directory.
"""

import hashlib
import json
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

REPO = Path(__file__).resolve().parents[1]

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


def run_cli(args, run_dir, timeout=600):
    """``python -m jaxflow.run`` as a user runs it; ``(exit code, stdout + stderr)``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "jaxflow.run", *args, f"--config.trainer.default_local_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, by relative name."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("error:", "stopped:"))]


def test_reruns_keep_checkpoints_and_user_files_and_bad_updates_or_damage_never_cost_a_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Files of the user's that sit where earlier versions wrote the built-in task.
    user_files = {run_dir / "data" / "train.parquet": b"the user's own train file",
                  run_dir / "data" / "test.parquet": b"the user's own test file"}
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
        "error: actor_rollout_ref.actor.optim.lr: must be a finite number, got inf"], out

    # The newest checkpoint is damaged (its array files truncated): the rerun warns in one line naming
    # the step and item, moves it aside and resumes from step 1. There lr=1e39 (valid, but inf in
    # float32) overflows every update: steps 2 and 3 are refused, nothing is saved or pruned, and the
    # run stops with the last good checkpoint intact.
    data_files = [p for p in (run_dir / "step_2" / "actor").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for data_file in data_files:
        data_file.write_bytes(data_file.read_bytes()[:100])  # the array data files, truncated
    code, out = run_cli([*TINY, *keep_two, "--config.trainer.total_training_steps=6",
                         "--config.actor_rollout_ref.actor.optim.lr=1e39",
                         "--config.jaxflow.trainer.max_nonfinite_steps=2"], run_dir)
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


def test_reward_functions_that_cannot_work_stop_the_run_in_one_line(tmp_path):
    # verl's per-dataset signature: refused when loading, before any model is built.
    two_args = _reward_file(tmp_path, "two_args.py", """
        def compute_score(solution_str, ground_truth):
            return float(solution_str == ground_truth)
    """)
    code, out = run_cli([*TINY, f"--config.custom_reward_function.path={two_args}"], tmp_path / "a")
    assert code == 2, out
    (line,) = error_lines(out)
    assert "custom_reward_function: custom reward function compute_score(solution_str, ground_truth)" in line
    assert "jaxflow:" not in out  # stopped before the run was built

    # A file that hangs at import: cut off at the load limit, before any model is built.
    hangs = _reward_file(tmp_path, "hangs.py", """
        import time
        time.sleep(1000)
    """)
    code, out = run_cli([*TINY, f"--config.custom_reward_function.path={hangs}",
                         "--config.jaxflow.reward.load_timeout_s=2"], tmp_path / "b")
    assert code == 2, out
    (line,) = error_lines(out)
    assert "did not finish within 2 s" in line and "hangs.py" in line

    # Fails on every sample: the run stops within the first step, exit 2, one line naming the error.
    raises = _reward_file(tmp_path, "raises.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"answer": solution_str}["answr"]  # a typo: KeyError on every sample
    """)
    code, out = run_cli([*TINY, f"--config.custom_reward_function.path={raises}", "--config.trainer.total_training_steps=3"],
                        tmp_path / "c")
    assert code == 2, out
    (line,) = error_lines(out)
    assert "failed on every sample of a batch (4: 4 errors, 0 timeouts); the first: KeyError: 'answr'" in line
    assert "step 1 |" not in out


def _children(pid):
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


def _dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_hanging_reward_function_is_reported_at_once_and_its_workers_die_with_a_killed_driver(tmp_path):
    marker = tmp_path / "called"
    hang = _reward_file(tmp_path, "hang.py", f"""
        import pathlib, time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            pathlib.Path({str(marker)!r}).touch()
            time.sleep(1000)
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "jaxflow.run", *TINY, f"--config.custom_reward_function.path={hang}",
           "--config.jaxflow.reward.timeout_s=1", "--config.jaxflow.reward.batch_timeout_s=120",
           f"--config.trainer.default_local_dir={tmp_path / 'run'}"]
    driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        children = _children(driver.pid)  # the reward worker (hanging again) and the resource tracker
        assert children
        driver.kill()  # SIGKILL, as the OOM killer would
        driver.wait()
        deadline = time.monotonic() + 10
        while not all(_dead(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_dead(p) for p in children), [p for p in children if not _dead(p)]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _jsonl(path, truths):
    path.write_text("".join(json.dumps({"prompt": "1+1=", "data_source": "jaxflow/addition",
                                        "reward_model": {"ground_truth": t}}) + "\n" for t in truths))
    return path


def test_data_and_tokenizers_that_do_not_fit_are_refused_before_training(tmp_path, capsys):
    """In-process ``main`` (the CLI's entry point): these fail before any model is built."""
    base = [*TINY, f"--config.trainer.default_local_dir={tmp_path / 'run'}"]
    cases = []
    # A null ground truth would be compared as the text "None"; a list never equals an answer.
    for name, truths, where in (("null", ["2", None], "line 2"), ("list", [["2", "two"], "2"], "line 1")):
        data = _jsonl(tmp_path / f"{name}.jsonl", truths)
        cases.append(([f"--config.data.train_files={data}", f"--config.data.val_files={data}"],
                      [f"{data}: {where}: reward_model.ground_truth is", "custom reward function"]))
    # An actor checkpoint that ships its own tokenizer, run with the default char tokenizer.
    import jaxflow.models as models
    from jaxflow.data.char_tokenizer import CharTokenizer

    ckpt = tmp_path / "hf_model"
    models.save_pretrained(models.init_model(models.get_preset("tiny_llama", vocab_size=128, num_layers=1)), ckpt)
    CharTokenizer(chars="0123456789+=").save_pretrained(ckpt)
    cases.append(([f"--config.actor_rollout_ref.model.path={ckpt}"],
                  ["jaxflow.data.tokenizer: is 'char'", "ships its own tokenizer", "jaxflow.data.tokenizer=model"]))
    # A tokenizer with more ids than the model has embedding rows.
    big = tmp_path / "big_tokenizer"
    CharTokenizer(chars="".join(chr(c) for c in range(0x100, 0x100 + 200))).save_pretrained(big)
    cases.append(([f"--config.jaxflow.data.tokenizer={big}"],
                  ["jaxflow.model.vocab_size: 128 is smaller than the tokenizer's 204 ids"]))
    cases.append(([f"--config.actor_rollout_ref.model.path={ckpt}", f"--config.jaxflow.data.tokenizer={big}"],
                  [f"the tokenizer has 204 ids but the actor model {ckpt} has 128 vocabulary rows"]))
    for args, messages in cases:
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err, err
        for message in messages:
            assert message in err, (message, err)


@pytest.mark.parametrize("body, message", [
    ("def get_config():\n    raise RuntimeError('no such cluster')\n",
     "get_config() of {path} failed: RuntimeError: no such cluster"),
    ("import sys\nsys.exit(0)\n", "importing {path} failed: it called sys.exit(0)"),
    ("import sys\ndef get_config():\n    sys.exit(0)\n", "get_config() of {path} failed: it called sys.exit(0)"),
    ("from ml_collections import ConfigDict\ndef get_config():\n    return ConfigDict({'data': {'train_batch_size': 4}})\n",
     "keys (e.g. data.train_files, data.val_files, data.prompt_key); build it on jaxflow.configs.base.get_base_config()"),
])
def test_config_files_that_fail_are_one_line(tmp_path, capsys, body, message):
    path = tmp_path / "my_config.py"
    path.write_text(body)
    assert main([f"--config={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message.format(path=path) in err, err


def test_ctrl_c_during_a_save_exits_in_one_line_and_the_next_run_resumes(tmp_path):
    """A model large enough that each save (~400 MB with Adam's moments) outlasts a training
    step, so the SIGINT lands while a step is being written."""
    run_dir = tmp_path / "run"
    big = ["--config.jaxflow.model.hidden_size=1024", "--config.jaxflow.model.intermediate_size=4096",
           "--config.jaxflow.model.num_layers=2", "--config.trainer.save_freq=1",
           "--config.trainer.max_actor_ckpt_to_keep=2"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "jaxflow.run", *TINY, *big, "--config.trainer.total_training_steps=100",
           f"--config.trainer.default_local_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        saving = None
        while saving is None and time.monotonic() < deadline and proc.poll() is None:
            saving = next((p.name for p in run_dir.glob("step_*.orbax-checkpoint-tmp*")), None)
            time.sleep(0.005)
        assert saving is not None, "no save was seen in progress"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "ERROR" not in out, out
    (line,) = [line for line in out.splitlines() if line.startswith("interrupted:")]
    complete = sorted(int(p.name.split("_")[1]) for p in run_dir.glob("step_*") if p.name.split("_")[1].isdigit()
                      and (p / "jaxflow_checkpoint.json").exists())
    if complete:
        assert f"the latest complete checkpoint is step {complete[-1]}" in line, (line, complete)
    # The log file has the details the console left out.
    assert "KeyboardInterrupt" in (run_dir / "jaxflow.log").read_text()


def test_a_full_disk_is_one_line(tmp_path):
    """The run directory's config.json is a link to /dev/full: every write to it fails with
    ENOSPC, as on a full disk."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").symlink_to("/dev/full")
    code, out = run_cli([*TINY, "--config.trainer.total_training_steps=1"], run_dir)
    assert code == 2, out
    (line,) = error_lines(out)
    assert line.startswith("error: cannot write") and "No space left on device (is the disk full?)" in line, line
    assert "Traceback" not in out
    assert "OSError" in (run_dir / "jaxflow.log").read_text() or "No space" in (run_dir / "jaxflow.log").read_text()
