"""The runner end to end (``python -m jaxflow.run`` in subprocesses, as a user runs it):
resuming after SIGKILL reproduces the uninterrupted run; a user reward function that raises
or hangs does not stop training; bad input is one clear error."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxflow.run import main
from tests.child_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A short GRPO run: small batches, no warm start, no validation, a checkpoint every step.
SHORT = [
    "--config=grpo_tiny",
    "--config.trainer.total_training_steps=5",
    "--config.trainer.save_freq=1",
    "--config.trainer.test_freq=-1",
    "--config.trainer.val_before_train=false",
    "--config.trainer.resume_mode=auto",
    "--config.jaxflow.sft.warm_start_steps=0",
    "--config.data.train_batch_size=8",
    "--config.actor_rollout_ref.rollout.n=4",
    "--config.actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "--config.actor_rollout_ref.actor.ppo_micro_batch_size_per_device=4",
    "--config.jaxflow.data.num_train_examples=64",
    "--config.jaxflow.data.num_val_examples=16",
    "--config.trainer.logger=console,jsonl",
]
# Wall-clock and throughput differ between runs; everything else must not.
TIMING = ("timing_s/", "perf/")


def _run(args, run_dir, **kwargs):
    env = child_env()
    cmd = [sys.executable, "-m", "jaxflow.run", *args, f"--config.trainer.default_local_dir={run_dir}"]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs
    )


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _comparable(record):
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(TIMING)}


@pytest.mark.slow
def test_sigkill_then_auto_resume_ends_like_an_uninterrupted_run(tmp_path):
    reference = _run(SHORT, tmp_path / "reference")
    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out

    killed_dir = tmp_path / "killed"
    # Kill once 2..4 steps are logged: step k's checkpoint is complete before step k+1 is logged,
    # so at least one checkpoint exists (the one being written may be cut short: that is the point).
    kill_after = int(np.random.default_rng(int.from_bytes(os.urandom(4), "little")).integers(2, 5))
    proc = _run(SHORT, killed_dir)
    jsonl = killed_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if jsonl.exists() and len(jsonl.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    resumed = _run(SHORT, killed_dir)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resumed from" in out

    expected = [_comparable(r) for r in _records(tmp_path / "reference")]
    got = [_comparable(r) for r in _records(killed_dir)]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert got == expected  # the same metrics, bit for bit, including the final step's


USER_REWARD = textwrap.dedent("""
    import time
    import zlib

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # About an eighth of the distinct samples fail and an eighth hang (a stable hash of
        # the sample), so both kinds occur whatever the untrained model answers, and the
        # failures stay under jaxflow.reward.max_failure_fraction.
        kind = zlib.crc32(f"{solution_str}|{ground_truth}".encode()) % 8
        if kind == 0:
            raise RuntimeError("this reward function fails on some answers")
        if kind == 1:
            time.sleep(1000)  # hangs
        return float(solution_str.strip() == ground_truth)
""")


@pytest.mark.slow
def test_a_reward_function_that_raises_or_hangs_does_not_stop_training(tmp_path):
    """Two steps of `SHORT` (its placement, so every program but the train step, whose cosine
    schedule spans 2 steps instead of 5, loads from the compilation cache that the SIGKILL
    test's runs filled) with a reward function that raises on some samples and hangs on others
    (picked by a hash of the sample: both kinds occur whatever the untrained model answers, and
    the samples do not depend on the layout, tests/test_placement_invariance.py): both steps
    complete, counting errors and timeouts, with finite scores."""
    reward = tmp_path / "reward.py"
    reward.write_text(USER_REWARD)
    args = [a for a in SHORT if "total_training_steps" not in a] + [
        "--config.trainer.total_training_steps=2",
        f"--config.custom_reward_function.path={reward}",
        "--config.jaxflow.reward.timeout_s=0.5",
        "--config.trainer.save_freq=-1",
    ]
    proc = _run(args, tmp_path / "run")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["reward/num_errors"] for r in records) > 0
    assert sum(r["reward/num_timeouts"] for r in records) > 0
    assert all(np.isfinite(r["critic/score/mean"]) for r in records)


def test_the_cli_module_imports_nothing_heavy():
    """A reward function's worker processes (``spawn``) import the driver's ``__main__``,
    ``jaxflow.run``, whenever one starts or replaces a worker that ran out of time: importing
    it must not import JAX (about 2 s of CPU each time)."""
    script = "import sys, jaxflow.run; print(sorted({'jax', 'flax', 'optax', 'orbax'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.data.max_prompt_lenght=8"], "data.max_prompt_lenght"),
        (["--config.data.max_prompt_length=eight"], "data.max_prompt_length"),
        (["--config=no_such_config"], "no_such_config"),
        (["--config.custom_reward_function.path=/nonexistent/reward.py"], "/nonexistent/reward.py"),
        (["--config.algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator"),
        (["--unknown_flag"], "--unknown_flag"),
    ],
)
def test_bad_arguments_are_one_clear_error(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


def test_bad_data_is_one_clear_error(tmp_path, capsys):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(
        json.dumps({"question": "1+1=", "data_source": "jaxflow/addition", "reward_model": {"ground_truth": "2"}})
        + "\n"
    )
    args = [
        f"--config.data.train_files={rows}",
        f"--config.data.val_files={rows}",
        f"--config.trainer.default_local_dir={tmp_path / 'run'}",
        "--config.jaxflow.sft.warm_start_steps=0",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'prompt'" in err and "prompts.jsonl" in err


def test_help_lists_the_named_configs(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in (
        "ppo_tiny",
        "grpo_tiny",
        "remax_tiny",
        "rloo_tiny",
        "reinforce_pp_tiny",
        "safe_rlhf_tiny",
        "sft_tiny",
        "ppo_7b",
        "ppo_70b",
    ):
        assert name in out
