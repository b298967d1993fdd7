"""HF export of a run: the SFT job's output, the actor at the end of an RL run and in each
checkpoint (trainer.save_hf), and ``python -m jaxflow.export`` for any saved step and role.
transformers loads each export and its logits (values, for the critic) equal jaxflow's on the
parameters the run trained (restored by orbax, not read back through any safetensors file).
An export never replaces anything but an earlier export, and never loses that one."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxflow.trainer.hf_export as hf_export
from jaxflow import configs
from jaxflow.configs.prepare import prepare_run
from jaxflow.configs.run_spec import build_tokenizer
from jaxflow.export import main as export_main
from jaxflow.run import main as run_main
from jaxflow.trainer.checkpoint import MARKER, SKIP, CheckpointManager
from jaxflow.trainer.hf_export import EXPORT_MARKER, abstract_train_state, run_config
from jaxflow.trainer.sft import run_sft
from tests.child_env import child_env
from tests.hf_reference import forward, hf_logits

REPO = Path(__file__).resolve().parents[1]

# A few supervised steps (sft_tiny, 8 devices), greedy accuracy measured at the last one.
SFT = [
    "--config=sft_tiny",
    "--config.jaxflow.sft.steps=4",
    "--config.jaxflow.sft.test_freq=4",
    "--config.jaxflow.sft.batch_size=16",
    "--config.jaxflow.sft.micro_batch_size_per_device=2",
    "--config.jaxflow.data.num_train_examples=64",
    "--config.trainer.logger=console,jsonl",
]

# Two PPO steps (actor and critic) on tiny batches from the SFT output (named by a path relative
# to the working directory), a checkpoint each step with its HF actor.
RUN = [
    "--config=ppo_tiny",
    "--config.trainer.total_training_steps=2",
    "--config.trainer.save_freq=1",
    "--config.trainer.save_hf=true",
    "--config.trainer.test_freq=-1",
    "--config.trainer.val_before_train=false",
    "--config.jaxflow.sft.warm_start_steps=0",
    "--config.data.train_batch_size=8",
    "--config.actor_rollout_ref.rollout.n=2",
    "--config.actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "--config.actor_rollout_ref.actor.ppo_micro_batch_size_per_device=4",
    "--config.critic.ppo_mini_batch_size=8",
    "--config.critic.ppo_micro_batch_size_per_device=2",
    "--config.jaxflow.data.num_train_examples=32",
    "--config.jaxflow.data.num_val_examples=8",
    "--config.trainer.logger=console,jsonl",
]


def _digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """``(output dir, graphdef, trained params, console output)`` of the SFT job, run through the
    function ``python -m jaxflow.run`` calls for ``jaxflow.job=sft``."""
    out = tmp_path_factory.mktemp("sft") / "model"
    name, overrides, _ = configs.parse_cli_args([*SFT, f"--config.jaxflow.sft.output_dir={out}"])
    cfg = configs.get_config(name)
    configs.apply_overrides(cfg, overrides)
    configs.validate(cfg)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        _, graphdef, params = run_sft(prepare_run(cfg, with_datasets=False), record=cfg)
    return out, graphdef, params, console.getvalue()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, sft):
    path = tmp_path_factory.mktemp("run")
    model = os.path.relpath(sft[0])  # relative to this working directory; the saved config makes it absolute
    assert (
        run_main([*RUN, f"--config.actor_rollout_ref.model.path={model}", f"--config.trainer.default_local_dir={path}"])
        == 0
    )
    return path


def _restored(run_dir, role, step):
    """The role's model at ``step``, restored by orbax (not through any safetensors file)."""
    cfg = run_config(run_dir)
    graphdef, abstract = abstract_train_state(prepare_run(cfg, with_datasets=False).spec, role)
    state = CheckpointManager(run_dir, read_only=True).restore(step, targets={role: abstract}).arrays[role]
    return nnx.merge(graphdef, state.params)


def _prompt_batch(hf_dir):
    """Two left-padded prompts, tokenized by the exported tokenizer through transformers."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    rows = [tok(text)["input_ids"] for text in ("rev:4071=", "rev:52=")]
    width = max(map(len, rows))
    ids = np.array([[tok.pad_token_id] * (width - len(r)) + r for r in rows], np.int32)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int32)
    return ids, mask


def _assert_lm_matches(hf_dir, model):
    ids, mask = _prompt_batch(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ref = hf_logits(hf, ids, mask)
    ours = np.asarray(forward(model, ids, mask))
    on = mask.astype(bool)
    assert np.abs(ours - ref)[on].max() <= 1e-4


@pytest.mark.slow
def test_the_end_of_run_and_checkpoint_exports_load_in_transformers(run_dir):
    final = _restored(run_dir, "actor", 2)
    _assert_lm_matches(run_dir / "hf_actor", final)
    _assert_lm_matches(run_dir / "step_2" / "hf_actor", final)
    first = _restored(run_dir, "actor", 1)
    _assert_lm_matches(run_dir / "step_1" / "hf_actor", first)
    # the tokenizer travels with the weights and encodes as jaxflow's does
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "hf_actor")
    ours = build_tokenizer(run_config(run_dir))
    assert tok("rev:4071=")["input_ids"] == ours.encode("rev:4071=")
    assert tok.eos_token_id == ours.eos_token_id


def test_an_sft_run_writes_an_export_that_transformers_loads_and_ends_with_a_summary(sft):
    out, graphdef, params, console = sft
    _assert_lm_matches(out, nnx.merge(graphdef, params))
    assert (out / EXPORT_MARKER).is_file()
    summary = console[console.index("sft done in") :].splitlines()
    assert summary[0].endswith("4 steps (1 -> 4)"), console
    assert summary[1].startswith("  training loss (sft/loss):") and "(first) ->" in summary[1]
    assert summary[2].startswith("  held-out accuracy (sft/val_accuracy):") and "(last, step 4)" in summary[2]
    assert f"HF export  {out}" in console


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # lr=1e39 in float32
def test_sft_stops_on_a_refused_update_and_never_writes_over_what_is_not_its_export(sft, tmp_path, capsys):
    out = sft[0]
    before = _digest(out)
    # lr=1e39 is finite, but the first update overflows float32: refused, the job stops (exit 3),
    # the previous output stays byte for byte.
    assert run_main([*SFT, "--config.jaxflow.sft.lr=1e39", f"--config.jaxflow.sft.output_dir={out}"]) == 3
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("stopped: sft step 1: the update was refused") and f"{out} is unchanged" in line, line
    assert _digest(out) == before
    # A directory of the user's is refused before training, untouched.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert run_main([*SFT, f"--config.jaxflow.sft.output_dir={mine}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {mine} is not empty and is not a jaxflow HF export"), line
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


def test_export_cli_from_another_directory_converts_any_step_and_role(run_dir, tmp_path, capsys):
    """``python -m jaxflow.export`` as a user runs it, in another working directory than the
    run's (whose actor was named by a relative path)."""
    env = child_env()
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxflow.export",
            "--checkpoint",
            os.path.relpath(run_dir, tmp_path),
            "--step",
            "1",
            "--out",
            "actor1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("wrote"), proc.stdout + proc.stderr
    _assert_lm_matches(tmp_path / "actor1", _restored(run_dir, "actor", 1))

    assert export_main(["--checkpoint", str(run_dir), "--role", "critic", "--out", str(tmp_path / "critic")]) == 0
    critic = _restored(run_dir, "critic", 2)
    ids, mask = _prompt_batch(tmp_path / "critic")
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        tmp_path / "critic", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[..., 0].numpy()
    ours = np.asarray(forward(critic, ids, mask))
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4
    assert np.abs(ours).max() > 0  # the critic trained for two steps: its head is not the zero init


def test_export_cli_errors_are_one_line(run_dir, tmp_path, capsys):
    assert export_main(["--checkpoint", str(run_dir), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "step 7" in err
    assert export_main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "config.json" in capsys.readouterr().err
    # A run from another jaxflow version: its step records no config (the run's config.json is
    # read) and that config lacks a key.
    old = tmp_path / "old_run"
    shutil.copytree(run_dir / "step_1", old / "step_1")
    marker = json.loads((old / "step_1" / MARKER).read_text())
    (old / "step_1" / MARKER).write_text(json.dumps({k: marker[k] for k in ("format", "step", "items", "time")}))
    config = json.loads((run_dir / "config.json").read_text())
    del config["jaxflow"]["num_devices"]
    (old / "config.json").write_text(json.dumps(config))
    assert export_main(["--checkpoint", str(old), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the config of {old} (its config.json, or the step's") and err.count("\n") == 1, err
    assert "lacks a key this jaxflow reads" in err
    assert not (tmp_path / "x").exists()


def test_an_export_replaces_only_an_earlier_export_and_never_loses_it(run_dir, tmp_path, monkeypatch, capsys):
    def export(out, step=1):
        code = export_main(["--checkpoint", str(run_dir), "--step", str(step), "--out", str(out)])
        return code, capsys.readouterr().err.strip()

    # The run directory, a directory holding it, a directory of the user's (also as "."): refused
    # in one line before anything is read; nothing there changes.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    run_before = _digest(run_dir)
    for out, message in (
        (run_dir, "holds the run directory"),
        (run_dir.parent, "holds the run directory"),
        (mine, "is not empty and is not a jaxflow HF export"),
    ):
        code, err = export(out)
        assert code == 2 and err.startswith("error: ") and message in err and "\n" not in err, err
    monkeypatch.chdir(mine)
    code, err = export(".")
    assert code == 2 and "is not empty and is not a jaxflow HF export" in err, err
    assert _digest(run_dir) == run_before and _digest(mine) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}

    # An earlier export is replaced; a file of the user's put into it stops that. Only the
    # parameters are read from the checkpoint (the optimizer state's leaves are SKIP).
    out = tmp_path / "export"
    seen = []
    real_restore = CheckpointManager.restore

    def spy(self, step=None, *, targets=None, path=None):
        seen.append(targets)
        return real_restore(self, step, targets=targets, path=path)

    monkeypatch.setattr(CheckpointManager, "restore", spy)
    assert export(out, step=1)[0] == 0
    monkeypatch.setattr(CheckpointManager, "restore", real_restore)
    (state,) = [t["actor"] for t in seen]
    assert all(leaf is SKIP for leaf in jax.tree.leaves(state.opt_state)) and state.step is SKIP
    assert not any(leaf is SKIP for leaf in jax.tree.leaves(state.params))
    step_1 = _digest(out)
    assert export(out, step=2)[0] == 0
    _assert_lm_matches(out, _restored(run_dir, "actor", 2))
    (out / "README.md").write_text("my notes")
    code, err = export(out, step=1)
    assert code == 2 and "also holds files it did not write (README.md)" in err, err
    (out / "README.md").unlink()
    step_2 = _digest(out)

    # Ctrl-C while the new export is written: the earlier one stays, no debris.
    real_save = hf_export.models.save_pretrained

    def interrupted_save(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_export.models, "save_pretrained", interrupted_save)
    assert export(out, step=1)[0] == 130
    assert _digest(out) == step_2 and sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]
    monkeypatch.setattr(hf_export.models, "save_pretrained", real_save)

    # Ctrl-C between moving the old export aside and renaming the new one in: deferred until
    # both renames are done, so the new export is in place.
    real_replace = os.replace
    calls = []

    def replace_then_ctrl_c(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        if Path(dst).parent == tmp_path:  # the export's renames (not, e.g., the compilation cache's)
            calls.append(Path(dst).name)
            if Path(dst).name.startswith(".export.old-"):
                signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(hf_export.os, "replace", replace_then_ctrl_c)
    assert export(out, step=1)[0] == 130 and calls == [f".export.old-{os.getpid()}", "export"], calls
    monkeypatch.setattr(hf_export.os, "replace", real_replace)
    assert _digest(out) == step_1 and sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]

    # Killed (SIGKILL) between the two renames: the old export waits beside it; the next export
    # puts it back first, so even a failing one leaves it in place, and removes dead writers' debris.
    dead = 99_999_999  # above any pid the kernel hands out
    os.rename(out, tmp_path / f".export.old-{dead}")
    (tmp_path / f".export.tmp-{dead}").mkdir()

    def failing_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export.models, "save_pretrained", failing_save)
    code, err = export(out, step=2)
    assert code == 2 and "No space left on device" in err
    assert _digest(out) == step_1 and sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]
