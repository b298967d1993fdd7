"""Runs that do not depend on the cluster's shape, and the train-rollout agreement.

- ``ppo_tiny`` and ``grpo_tiny`` for 3 steps under the split and the colocated placement log the
  same metrics (`experiments.ray_vs_local.compare`, 1e-5 relative): each sample's randomness is
  drawn from (seed, step, prompt id, sample index, token), not from how rows are laid over
  generation replicas. (Local vs Ray, and a checkpoint of 2 processes resumed on 1, are
  `tests/test_ray_backend.py`'s ``test_ray_vs_local_tiny_reports_every_metric_equal``,
  ``test_cli_ray_run_killed_and_restarted_equals_the_local_run`` and
  ``test_a_2_process_checkpoint_resumes_on_1_process``.)
- The agreement metrics (verl's ``training/rollout_probs_diff_*``) against a NumPy transcription
  of verl's, and the agreement mode (``jaxflow.trainer.rollout_agreement``: a batch-invariant
  actor, `jaxflow.models.ordered`): every shipped RL tiny config logs them, and the rollout's
  log-probs are the trainer's bit for bit.
"""

import numpy as np
import pytest

import jaxflow.algos as algos
import jaxflow.iterations as iterations
from experiments import ray_vs_local
from jaxflow.configs import load_config
from jaxflow.configs.run_spec import algorithm_settings
from jaxflow.data.batch import Batch
from jaxflow.iterations.batch_ops import compute_data_metrics, rollout_agreement_metrics

# A reward with signal for an untrained policy (a first character that is a digit one time in
# ten; the second adds half), so advantages are not whitened rounding noise at step 1.
DIGITS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str[:1].isdigit()) + 0.5 * float(solution_str[1:2].isdigit())
"""

SMALL = [
    "jaxflow.sft.warm_start_steps=0",
    "jaxflow.model.num_layers=1",
    "jaxflow.model.hidden_size=64",
    "jaxflow.model.intermediate_size=128",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=4",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_device=4",
    "trainer.test_freq=-1",
    "trainer.val_before_train=False",
    "trainer.logger=['console']",
    "jaxflow.data.num_val_examples=8",
]


def run_steps(config: str, overrides: list[str], steps: int, run_dir) -> list[dict]:
    """``steps`` training steps of ``config`` in this process; each step's metrics."""
    from jaxflow.trainer.rl import RLTrainer

    cfg = load_config(config, [*overrides, f"trainer.default_local_dir={run_dir}"])
    trainer = RLTrainer(cfg)
    try:
        return [{"step": s} | trainer.train_step(s) for s in range(1, steps + 1)]
    finally:
        trainer.close()


def _config_overrides(flags: list[str]) -> list[str]:
    return [f.removeprefix("--config.") for f in flags]


# Steps of each placement run. Step 1 compiles (most of a run's CPU time; later steps ~1.5 CPU-s
# each) and logs one metric more than the others (perf/time_to_first_step_s, a timing); steps 2 on
# log one and the same set (measured for both configs over 5 steps); step 3 starts from a policy
# and optimizer state (ppo_tiny: and a critic) that two updates moved.
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ppo_tiny", "grpo_tiny"])
def test_split_and_colocated_placements_log_the_same_metrics(config, tmp_path):
    reward = tmp_path / "digits.py"
    reward.write_text(DIGITS)
    common = [*SMALL, f"custom_reward_function.path={reward}", "jaxflow.trainer.rollout_agreement=True"]
    runs = {
        p: run_steps(
            config, [*common, *_config_overrides(ray_vs_local.placement_overrides(config, p))], STEPS, tmp_path / p
        )
        for p in ("colocated", "split")
    }
    assert any(r["critic/score/mean"] > 0 for r in runs["colocated"])  # the reward has signal
    # the agreement mode, under both placements: the engine's log-probs are the trainer's bit for bit
    assert max(r["training/rollout_log_probs_diff_max"] for rows in runs.values() for r in rows) == 0.0
    diffs, bad = ray_vs_local.compare(runs["colocated"], runs["split"], 1e-5)
    assert not bad, bad
    assert len(diffs) > STEPS * 20  # every metric of every step was compared
    plain = [
        d for d in diffs if d[2] not in ray_vs_local.CANCELLING and not d[2].startswith(ray_vs_local.ROUNDING_PREFIX)
    ]
    print(f"{config}: largest relative differences split vs colocated {plain[:3]}")


def verl_rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask):
    """verl's ray trainer's ``training/rollout_probs_diff_*`` (torch: exp, abs, masked_select,
    max / mean / std with Bessel's correction), transcribed to NumPy float64."""
    rollout_probs, actor_probs = np.exp(rollout_log_probs), np.exp(old_log_probs)
    diff = np.abs(rollout_probs - actor_probs)[response_mask.astype(bool)]
    return {
        "training/rollout_probs_diff_max": diff.max(),
        "training/rollout_probs_diff_mean": diff.mean(),
        "training/rollout_probs_diff_std": diff.std(ddof=1),
    }


def test_agreement_metrics_are_verls_on_ragged_masks():
    rng = np.random.default_rng(0)
    B, R = 6, 9
    mask = (np.arange(R)[None, :] < rng.integers(1, R + 1, size=(B, 1))).astype(np.int32)
    old = np.log(rng.uniform(0.01, 1.0, (B, R))).astype(np.float32)
    rollout = (old + rng.normal(scale=0.05, size=(B, R))).astype(np.float32)
    rollout[mask == 0] = 123.0  # padding never counts
    got = rollout_agreement_metrics(old, rollout, mask)
    want = verl_rollout_probs_diff(rollout.astype(np.float64), old.astype(np.float64), mask)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    m = mask > 0
    lp_r, lp_t = rollout.astype(np.float64)[m], old.astype(np.float64)[m]
    assert got["training/rollout_log_probs_diff_max"] == pytest.approx(np.abs(lp_r - lp_t).max(), rel=1e-12)
    assert got["training/rollout_log_probs_diff_mean"] == pytest.approx(np.abs(lp_r - lp_t).mean(), rel=1e-12)
    assert got["training/rollout_kl"] == pytest.approx(np.mean(lp_r - lp_t), rel=1e-12)
    # every step's data metrics carry them when both log-probs are in the batch
    batch = Batch.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    assert compute_data_metrics(batch)["training/rollout_probs_diff_max"] == got["training/rollout_probs_diff_max"]
    assert "training/rollout_kl" not in compute_data_metrics(Batch.from_dict({"response_mask": mask}))


# ppo_tiny and grpo_tiny run the agreement mode in the placement test above; these are the other
# ways a step scores its rollout (dynamic sampling; ReMax's greedy baseline). RLOO and REINFORCE++
# are ppo_iteration with another estimator, as grpo_tiny; Safe-RLHF scores as ppo_tiny (all seven
# RL tiny configs at their shipped model size: <= 9.5e-7, measured on CPU).
OTHER_RL_TINY = ["dapo_tiny", "remax_tiny"]


@pytest.mark.slow
@pytest.mark.parametrize("config", OTHER_RL_TINY)
def test_agreement_mode_logs_log_probs_equal_bit_for_bit(config, tmp_path):
    """One step of each config (one small layer; dapo_tiny's dynamic sampling with the digit
    reward, which has signal for an untrained policy) with ``jaxflow.trainer.rollout_agreement``:
    the trainer's log-probs of the sampled tokens are the rollout engine's bit for bit (the
    acceptance asks <= 1e-6)."""
    reward = tmp_path / "digits.py"
    reward.write_text(DIGITS)
    overrides = [*SMALL, "jaxflow.trainer.rollout_agreement=True"]
    if config == "dapo_tiny":
        overrides.append(f"custom_reward_function.path={reward}")
    (row,) = run_steps(config, overrides, 1, tmp_path / "run")
    assert row["training/rollout_log_probs_diff_max"] == 0.0, row["training/rollout_log_probs_diff_max"]
    assert row["training/rollout_kl"] == 0.0
    assert row["training/rollout_probs_diff_max"] == 0.0


def test_agreement_mode_scores_the_trainers_log_probs_where_an_on_policy_update_would_not():
    grpo = algos.AlgorithmConfig(adv_estimator="grpo")
    assert not iterations.rollout_scores_old_log_probs(algos.AlgorithmSettings(grpo))
    assert iterations.rollout_scores_old_log_probs(algos.AlgorithmSettings(grpo, rollout_agreement=True))
    cfg = load_config("grpo_tiny", ["jaxflow.trainer.rollout_agreement=True"])
    assert algorithm_settings(cfg).rollout_agreement
