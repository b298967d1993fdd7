"""HF export of a run: the actor at the end of the run and in each checkpoint (trainer.save_hf),
and ``python -m jaxflow.export`` for any saved step and role. transformers loads each export and
its logits (values, for the critic) equal jaxflow's on the parameters restored by orbax."""

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxflow.configs.run_spec import build_tokenizer
from jaxflow.export import main as export_main
from jaxflow.run import main as run_main
from jaxflow.trainer.checkpoint import CheckpointManager
from jaxflow.trainer.hf_export import abstract_train_state, run_config
from tests.hf_reference import hf_logits

# Two PPO steps (actor and critic) on tiny batches, a checkpoint each step with its HF actor.
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


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    assert run_main([*RUN, f"--config.trainer.default_local_dir={path}"]) == 0
    return path


def _restored(run_dir, role, step):
    """The role's model at ``step``, restored by orbax (not through any safetensors file)."""
    cfg = run_config(run_dir)
    graphdef, abstract = abstract_train_state(cfg, role, build_tokenizer(cfg))
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
    ours = np.asarray(model(ids, attention_mask=mask))
    on = mask.astype(bool)
    assert np.abs(ours - ref)[on].max() <= 1e-4


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


def test_export_cli_converts_any_step_and_role(run_dir, tmp_path, capsys):
    assert export_main(["--checkpoint", str(run_dir), "--step", "1", "--out", str(tmp_path / "actor1")]) == 0
    assert "wrote" in capsys.readouterr().out
    _assert_lm_matches(tmp_path / "actor1", _restored(run_dir, "actor", 1))

    assert export_main(["--checkpoint", str(run_dir), "--role", "critic", "--out", str(tmp_path / "critic")]) == 0
    critic = _restored(run_dir, "critic", 2)
    ids, mask = _prompt_batch(tmp_path / "critic")
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        tmp_path / "critic", attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[..., 0].numpy()
    ours = np.asarray(critic(ids, attention_mask=mask))
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4
    assert np.abs(ours).max() > 0  # the critic trained for two steps: its head is not the zero init


def test_export_cli_errors_are_one_line(run_dir, tmp_path, capsys):
    assert export_main(["--checkpoint", str(run_dir), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "step 7" in err
    assert export_main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "config.json" in capsys.readouterr().err
