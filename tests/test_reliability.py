"""Nothing lost, nothing silent: ``python -m jaxflow.run`` in subprocesses, on real files, with
faults and bad input (docs/RELIABILITY.md maps each fault class to the test that checks it).

The runs are the tiniest that exercise the real paths (one device, one layer, 2 prompts x 2
responses, 1-4 steps); several assertions share one run where they check the same directory.
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

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


def test_reruns_keep_checkpoints_and_user_files_and_non_finite_updates_never_reach_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Files of the user's that sit where earlier versions wrote the built-in task.
    user_files = {run_dir / "data" / "train.parquet": b"the user's own train file",
                  run_dir / "data" / "test.parquet": b"the user's own test file"}
    for path, data in user_files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    keep_one = ["--config.trainer.save_freq=1", "--config.trainer.max_actor_ckpt_to_keep=1"]
    code, out = run_cli([*TINY, *keep_one, "--config.trainer.total_training_steps=2"], run_dir)
    assert code == 0, out
    assert "train = BUILT-IN task 'addition'" in out and "validation = BUILT-IN task 'addition'" in out
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_2"]
    good = tree_digest(run_dir / "step_2")
    for path, data in user_files.items():
        assert path.read_bytes() == data

    # A fresh run (resume_mode=disable) in that directory is refused in one line; nothing is deleted.
    code, out = run_cli([*TINY, *keep_one, "--config.trainer.total_training_steps=2",
                         "--config.trainer.resume_mode=disable"], run_dir)
    assert code == 2, out
    (line,) = error_lines(out)
    assert "trainer.resume_mode" in line and "nothing was deleted" in line and "step" in line
    assert len(out.strip().splitlines()) == 1, out

    # An infinite learning rate is refused by validation, naming the key.
    code, out = run_cli([*TINY, "--config.actor_rollout_ref.actor.optim.lr=inf"], run_dir)
    assert code == 2 and error_lines(out) == [
        "error: actor_rollout_ref.actor.optim.lr: must be a finite number, got inf"], out

    # lr=1e39 passes validation but is inf in float32: every update overflows the weights. The rerun
    # resumes from step 2, refuses steps 3 and 4, saves nothing, prunes nothing, and stops.
    code, out = run_cli([*TINY, *keep_one, "--config.trainer.total_training_steps=6",
                         "--config.actor_rollout_ref.actor.optim.lr=1e39",
                         "--config.jaxflow.trainer.max_nonfinite_steps=2"], run_dir)
    assert code == 3, out
    assert "resumed from" in out and "step_2" in out
    assert "step 3: not saving a checkpoint after a refused update (latest good checkpoint: step 2)" in out
    assert "actor refused every optimizer step, its params unchanged" in out
    (line,) = error_lines(out)
    assert line.startswith("stopped:") and "last good checkpoint" in line
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_")) == ["step_2"]
    assert tree_digest(run_dir / "step_2") == good
    for path, data in user_files.items():
        assert path.read_bytes() == data
