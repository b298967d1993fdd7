"""``trainer.mode`` one_step_off / async (`jaxflow.trainer.ahead`): the rollouts generated ahead
of their updates, against a hand-worked schedule (fake loader and actor), and through the
trainer: ``async`` with ``max_staleness=0`` logs the synchronous run's metrics bit for bit
(PPO and GRPO), ``one_step_off`` consumes the previous weights' rollouts, a restart generates
the pending rollouts again, and what the run cannot do yet is refused in one line. The Ray
backend's runs of the modes: tests/test_async_ray.py."""

import numpy as np
import pytest

from jaxflow.configs import ConfigError, load_config
from jaxflow.data.batch import Batch
from jaxflow.trainer.ahead import (
    AheadActor,
    ConsumedTokens,
    GenerateAhead,
    Rollout,
    StalenessError,
    check_staleness,
    lookahead,
)
from jaxflow.workers.group import Workers
from tests.test_placement_invariance import DIGITS, SMALL, run_steps

# Metrics that measure time (or follow from it: the idle fractions); the rest is compared.
TIMED = ("timing_s/", "perf/", "fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio")


class _Loader:
    """Prompt batches 0, 1, 2, ... ; its state is the next batch's index."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        self.position += 1
        return self.position - 1

    def state_dict(self):
        return {"position": self.position}


class _Actor:
    """Records each generate call as (step, prompt batch, policy version at the call)."""

    def __init__(self):
        self.version = 0
        self.calls = []

    def generate(self, prompts, *, step=None):
        self.calls.append((step, int(prompts["batch"][0]), self.version))
        responses = np.zeros((len(prompts), 3), np.int32)
        mask = np.array([[1, 1, 0]] * len(prompts), np.int32)
        return prompts.update(
            tensors={"responses": responses, "response_mask": mask},
            non_tensors={"generated": [(step, self.version)] * len(prompts)},
        )

    def generation_seconds(self):
        return [{"engine": 0.5}]

    def rollout_metrics(self):
        return [{}]

    def update(self):
        return "the actor's own"


def _to_batch(index):
    return Batch.from_dict({"batch": [index, index]})


def test_the_schedule_of_rollouts_generated_ahead():
    """max_staleness=2 over 5 steps: step 1 generates steps 1-3 with version 0; step k then
    generates step k+2 with the weights of k-1 updates and consumes step k's rollout (staleness
    min(k-1, 2)); nothing past the last step; the checkpoint position is the first pending
    rollout's prompt batch."""
    loader, actor = _Loader(), _Actor()
    ahead = GenerateAhead(lookahead("async", 2), 5, loader, _to_batch)
    workers = Workers(actor=actor)
    seen = []
    for step in range(1, 6):
        prompts, w, metrics = ahead.step(step, workers, actor.version)
        batch = w.actor.generate(prompts, step=step)
        assert w.actor.update() == "the actor's own" and w.actor.generation_seconds() == [{"engine": 0.5}]
        seen.append((int(prompts["batch"][0]), tuple(int(v) for v in batch.non_tensors["generated"][0]), metrics))
        consumed = ahead.consumed  # the per-token versions of the rollout handed out, at this update's version
        assert consumed.step == step and consumed.version == actor.version
        np.testing.assert_array_equal(
            consumed.token_versions_BxR, np.full((2, 3), batch.non_tensors["generated"][0][1])
        )
        assert ahead.loader_state() == {"position": step}  # before the next pending batch (or the end)
        actor.version += 1  # the update
    assert actor.calls == [(1, 0, 0), (2, 1, 0), (3, 2, 0), (4, 3, 1), (5, 4, 2)]
    assert [s[0] for s in seen] == [0, 1, 2, 3, 4]  # each step's own prompt batch, in order
    assert [s[1] for s in seen] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 2)]
    staleness = [s[2]["fully_async/staleness/token_max"] for s in seen]
    assert staleness == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [s[2]["fully_async/pending_rollouts"] for s in seen] == [2.0, 2.0, 2.0, 1.0, 0.0]
    versions = np.zeros((2, 3), np.int32)
    rollout = Rollout(6, _to_batch(9), _to_batch(9), 0, 0.0, parts={}, probe={}, token_versions_BxR=versions)
    with pytest.raises(ValueError, match="generated ahead for its own prompts"):
        AheadActor(actor, rollout).generate(_to_batch(9), step=7)


def test_a_restart_generates_the_pending_rollouts_again():
    """A restart (`RLTrainer._restart`: fresh workers, the loader back at the checkpoint's
    position) discards the rollouts pending: step 2, run again after the checkpoint of step 1,
    regenerates its rollout and the next one from the prompt batches 1 and 2, with the
    restored weights' version."""
    loader, actor = _Loader(), _Actor()
    ahead = GenerateAhead(lookahead("async", 2), 5, loader, _to_batch)
    workers = Workers(actor=actor)
    ahead.step(1, workers, 0)
    saved = ahead.loader_state()  # step 1's checkpoint
    actor.version = 1
    ahead.step(2, workers, 1)  # generates step 4's rollout; the run then fails
    assert [r.step for r in ahead.pending] == [3, 4]
    ahead.discard_pending()
    assert not ahead.pending and ahead.consumed is None and ahead.loader_state() == {"position": 4}
    loader.position = saved["position"]  # the restart's resume
    actor.calls.clear()
    prompts, _, metrics = ahead.step(2, workers, 1)
    assert int(prompts["batch"][0]) == 1 and actor.calls == [(2, 1, 1), (3, 2, 1), (4, 3, 1)]
    assert metrics["fully_async/staleness/token_max"] == 0.0 and ahead.loader_state() == {"position": 2}


def test_a_consumed_token_beyond_the_bound_stops_the_step():
    """The trainer path's check reads each valid token's version: one token of version 1 in a
    rollout of version 3 consumed at version 4 is staleness 3 > 2; padding (mask 0) of any
    version is ignored; a token newer than the update's weights is refused too."""
    versions_BxR = np.array([[3, 3, 3], [3, 1, 0]], np.int32)
    mask_BxR = np.array([[1, 1, 0], [1, 1, 0]], np.int32)
    with pytest.raises(
        StalenessError, match=r"step 7's update at policy version 4 .* staleness 1..3, outside \[0, 2\]"
    ):
        check_staleness(ConsumedTokens(7, 4, versions_BxR, mask_BxR), 2)
    assert check_staleness(ConsumedTokens(7, 4, versions_BxR, mask_BxR), 3)["fully_async/staleness/token_max"] == 3.0
    mask_BxR[1, 1] = 0
    metrics = check_staleness(ConsumedTokens(7, 4, versions_BxR, mask_BxR), 1)
    assert metrics["fully_async/staleness/token_max"] == 1.0 and metrics["fully_async/staleness/token_mean"] == 1.0
    with pytest.raises(StalenessError, match=r"outside \[0, 1\]"):
        check_staleness(ConsumedTokens(7, 2, versions_BxR, mask_BxR), 1)


def test_modes_and_staleness_are_checked():
    assert lookahead("sync", 3) is None and lookahead("one_step_off", 0) == 1 and lookahead("async", 0) == 0
    with pytest.raises(ValueError, match="unknown trainer.mode 'fast'"):
        lookahead("fast", 1)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        lookahead("async", -1)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["grpo_tiny", "ppo_tiny"])
def test_async_with_staleness_0_is_the_synchronous_run_bit_for_bit(config, tmp_path):
    reward = tmp_path / "digits.py"
    reward.write_text(DIGITS)
    common = [*SMALL, f"custom_reward_function.path={reward}"]
    sync = run_steps(config, common, 5, tmp_path / "sync")
    asynchronous = run_steps(config, [*common, "trainer.mode=async", "trainer.max_staleness=0"], 5, tmp_path / "a")
    assert any(r["critic/score/mean"] > 0 for r in sync)  # the reward has signal
    for a, b in zip(sync, asynchronous, strict=True):
        keys = [k for k in a if not k.startswith(TIMED) and k != "step"]
        assert len(keys) > 20
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
        assert b["fully_async/staleness/token_max"] == 0.0


@pytest.mark.slow
def test_one_step_off_consumes_the_previous_weights_rollouts(tmp_path):
    """Step 1 consumes a rollout of the initial weights (as sync does: the same metrics), steps
    2 and 3 the rollouts of the weights one update back."""
    reward = tmp_path / "digits.py"
    reward.write_text(DIGITS)
    common = [*SMALL, f"custom_reward_function.path={reward}"]
    sync = run_steps("grpo_tiny", common, 1, tmp_path / "sync")
    off = run_steps("grpo_tiny", [*common, "trainer.mode=one_step_off"], 3, tmp_path / "off")
    assert [r["fully_async/staleness/token_max"] for r in off] == [0.0, 1.0, 1.0]
    assert [r["fully_async/count/current_param_version"] for r in off] == [0.0, 1.0, 2.0]
    assert [r["fully_async/pending_rollouts"] for r in off] == [1.0, 1.0, 1.0]  # the run goes on past step 3
    keys = [k for k in sync[0] if not k.startswith(TIMED) and k != "step"]
    assert {k: sync[0][k] for k in keys} == {k: off[0][k] for k in keys}


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_every_consumed_token_is_within_the_staleness_bound(max_staleness, tmp_path):
    """async with max_staleness 1 and 2 through the trainer, 4 steps: each update's consumed
    tokens (their per-token versions, recorded at generation) have staleness in
    ``[0, max_staleness]``, reaching the bound from step ``max_staleness + 1`` on (step k
    consumes the rollout of version ``max(0, k - 1 - max_staleness)`` at version ``k - 1``)."""
    from jaxflow.trainer.rl import RLTrainer

    overrides = [*SMALL, "trainer.mode=async", f"trainer.max_staleness={max_staleness}"]
    trainer = RLTrainer(load_config("grpo_tiny", [*overrides, f"trainer.default_local_dir={tmp_path}"]))
    try:
        for step in range(1, 5):
            metrics = trainer.train_step(step)
            consumed = trainer.ahead.consumed
            staleness = consumed.staleness()
            assert consumed.step == step and consumed.version == step - 1 == trainer.policy_version - 1
            assert consumed.token_versions_BxR.shape == consumed.response_mask_BxR.shape
            assert staleness.size == consumed.response_mask_BxR.sum() > 0
            assert 0 <= staleness.min() and staleness.max() <= max_staleness
            assert set(staleness.tolist()) == {min(step - 1, max_staleness)}
            assert metrics["fully_async/staleness/token_max"] == float(staleness.max())
    finally:
        trainer.close()


def test_what_the_modes_cannot_run_yet_is_refused(tmp_path):
    from jaxflow.trainer.rl import RLTrainer

    cfg = load_config(
        "grpo_tiny",
        [*SMALL, "trainer.mode=one_step_off", "algorithm.adv_estimator=remax", f"trainer.default_local_dir={tmp_path}"],
    )
    with pytest.raises(ConfigError, match="without algorithm.filter_groups"):
        RLTrainer(cfg)


@pytest.mark.slow
def test_a_restart_before_any_checkpoint_starts_over_with_no_rollout_pending(tmp_path):
    """A worker failure that the trainer restarts from (`RLTrainer._restart`, as ``fit`` does on
    a `WorkerGroupError`; a Ray run's ``jaxflow.ray.max_restarts``) during a one_step_off run,
    before any checkpoint: fresh workers, the loader and the policy version back at the start,
    the rollout pending discarded. Step 1 runs again as it first ran (the same metrics, bit for
    bit) and generates step 2's rollout again with the initial weights."""
    from jaxflow.trainer.rl import RLTrainer
    from jaxflow.workers.ray.errors import WorkerDied

    cfg = load_config("grpo_tiny", [*SMALL, "trainer.mode=one_step_off", f"trainer.default_local_dir={tmp_path}"])
    trainer = RLTrainer(cfg)
    try:
        first = trainer.train_step(1)
        trainer.train_step(2)
        assert [(r.step, r.version) for r in trainer.ahead.pending] == [(3, 1)]
        trainer._restart(WorkerDied("rank 1 died during actor.update", "actor", 1), 1)
        assert not trainer.ahead.pending and trainer.policy_version == 0 and trainer.resume() == 0
        again = trainer.train_step(1)
        assert [(r.step, r.version) for r in trainer.ahead.pending] == [(2, 0)]
        keys = [k for k in first if not k.startswith(TIMED)]
        assert len(keys) > 20 and {k: first[k] for k in keys} == {k: again[k] for k in keys}
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_resumed_run_generates_its_pending_rollouts_again_from_the_same_prompts(tmp_path):
    """one_step_off cut after step 2's checkpoint and resumed: step 3 regenerates its rollout
    (the pending one was not saved), and the rollout of step 4 it then generates is the
    uninterrupted run's, bit for bit (the same prompt batch, seed and weights): the loader's
    saved position neither skipped nor repeated a batch."""
    import numpy as np

    from jaxflow.trainer.rl import RLTrainer

    def trainer(run_dir):
        overrides = [*SMALL, "trainer.mode=one_step_off", "trainer.resume_mode=auto"]
        return RLTrainer(load_config("grpo_tiny", [*overrides, f"trainer.default_local_dir={run_dir}"]))

    def run(t, steps, save_at=None):
        try:
            for s in steps:
                t.train_step(s)
            if save_at is not None:
                t.save(save_at, [])
            return t.ahead.pending[0] if t.ahead.pending else None
        finally:
            t.ckpt.close()
            t.close()

    want = run(trainer(tmp_path / "whole"), (1, 2, 3))
    run(trainer(tmp_path / "cut"), (1, 2), save_at=2)
    resumed = trainer(tmp_path / "cut")
    assert resumed.resume() == 2 and resumed.policy_version == 2 and not resumed.ahead.pending
    got = run(resumed, (3,))
    assert got.step == want.step == 4 and got.version == want.version == 2
    for key in ("prompt_ids", "responses", "rollout_log_probs"):
        np.testing.assert_array_equal(np.asarray(got.batch[key]), np.asarray(want.batch[key]))
