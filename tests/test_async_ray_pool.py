"""The Ray backend's rollout pool through the trainer (``jaxflow.backend=ray`` with
``jaxflow.placement.rollout_devices``): the actor's group on the first host, the pool
(`jaxflow.workers.ray.RayRolloutPool`) a worker group of its own on the last, its generations
called by the `jaxflow.trainer.rollouter.Rollouter` thread while the trainer updates.

One module fixture, two runs of grpo_tiny (`SMALL`, one layer, 8 prompts x 4 responses) in
``one_step_off`` for `STEPS` steps, each through ``fit()``: on the local backend with a
`LocalRolloutPool` (8 simulated devices, the last 4 the pool), and on this session's Ray
instance (``ray_session``) with 1 process x 4 devices for the actor's roles and 1 process x 4
for the pool, and ``jaxflow.ray.max_restarts=1``: the pool's process is SIGKILLed right before
it generates step `KILL_STEP`'s rollout (in the rollouter's thread, during step
``KILL_STEP - 1``'s update). The run restarts every group (the pool's rejoined to the actor's
new group, the pending rollouts discarded) and, with no checkpoint, trains again from step 1.

1. The Ray run logs the local run's metrics, step by step (`experiments.ray_vs_local.compare`
   at 1e-5 relative, with its float32-rounding allowances between the backends; the timings
   and idle fractions, `TIMED`, excluded): the restart lost nothing and repeated nothing.
2. Every consumed token's staleness is within one_step_off's bound (from the per-token
   versions), the weight-sync metrics of each syncing step are present and > 0.
3. The failure restarted the run within 60 s of the kill, and after close no process of any
   group (the pool's before and after the restart included) is left.
"""

import os
import signal
import time

import pytest

from experiments import ray_vs_local
from jaxflow.configs import load_config
from tests.cli import still_alive
from tests.test_async_modes import TIMED
from tests.test_placement_invariance import DIGITS, SMALL

STEPS, KILL_STEP = 3, 3
POOL = [
    "jaxflow.num_devices=8",
    "jaxflow.placement.type=colocated",
    "jaxflow.placement.rollout_devices=4",
    "trainer.mode=one_step_off",
    f"trainer.total_training_steps={STEPS}",
]
RAY = ["jaxflow.backend=ray", "jaxflow.ray.devices_per_host=4", "jaxflow.ray.max_restarts=1"]
RESTART_S = 60.0  # a killed pool is a restart within this


def _kill_before_generating(trainer, step: int, seen: dict) -> None:
    """The pool's process SIGKILLed right before it generates step ``step``'s rollout (once)."""
    pool = trainer.ahead.rollouter.pool
    generate = pool.generate

    def kill_then_generate(prompts, *, step: int):
        if step == KILL_STEP and "killed_at" not in seen:
            os.kill(pool.group.processes.pids[0], signal.SIGKILL)
            seen["killed_at"] = time.monotonic()
        return generate(prompts, step=step)

    pool.generate = kill_then_generate


def _fit(overrides: list[str], run_dir, kill: bool) -> dict:
    """``fit()`` of grpo_tiny: the history, each step's consumed tokens (the last time it ran),
    and on Ray every worker process it started and when the restart began."""
    from jaxflow.trainer.rl import RLTrainer

    trainer = RLTrainer(load_config("grpo_tiny", [*overrides, f"trainer.default_local_dir={run_dir}"]))
    seen: dict = {"consumed": {}, "pids": set()}
    train_step, restart = trainer.train_step, trainer._restart

    def recording_step(step: int):
        metrics = train_step(step)
        seen["consumed"][step] = trainer.ahead.consumed
        if trainer.backend is not None:
            seen["pids"] |= {pid for group in trainer.backend.groups.values() for pid in group.pids}
        return metrics

    def timed_restart(error, restarts):
        seen["restarted"] = (time.monotonic(), error)
        restart(error, restarts)

    trainer.train_step, trainer._restart = recording_step, timed_restart
    if kill:
        _kill_before_generating(trainer, KILL_STEP, seen)
    seen["history"] = trainer.fit()  # closes the trainer (its pool and groups)
    return seen


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("async_ray_pool")
    reward = out / "digits.py"
    reward.write_text(DIGITS)
    common = [*SMALL, *POOL, f"custom_reward_function.path={reward}"]
    return {
        "local": _fit(common, out / "local", kill=False),
        "ray": _fit([*common, *RAY], out / "ray", kill=True),
    }


def _untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in history]


@pytest.mark.slow
def test_the_ray_pool_logs_the_local_pools_metrics_across_a_restart(runs):
    local, ray = runs["local"]["history"], runs["ray"]["history"]
    assert [r["step"] for r in ray] == list(range(1, STEPS + 1))
    assert any(r["critic/score/mean"] > 0 for r in local)  # the reward has signal
    diffs, bad = ray_vs_local.compare(_untimed(local), _untimed(ray), rtol=1e-5)
    assert not bad, bad
    assert len(diffs) > 20 * STEPS
    largest = max(diffs)
    print(f"Ray pool vs local pool, one_step_off, {STEPS} steps: largest relative difference {largest[:3]}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_consumed_tokens_are_within_the_bound_and_every_sync_is_reported(runs, backend):
    run = runs[backend]
    for row in run["history"]:
        step = row["step"]
        staleness = run["consumed"][step].staleness()
        assert staleness.size > 0 and set(staleness.tolist()) == {min(step - 1, 1)}
        assert row["fully_async/staleness/token_max"] == float(staleness.max())
        synced = step < STEPS  # the last step submits nothing, so syncs nothing
        assert (row["weight_sync/bytes"] > 0) == synced and (row["timing_s/weight_sync"] > 0) == synced
    print(f"{backend}: weight sync bytes per step {[r['weight_sync/bytes'] for r in run['history']]}")


@pytest.mark.slow
def test_a_killed_pool_restarts_the_run_and_no_process_is_left(runs):
    from jaxflow.workers.ray import WorkerDied

    run = runs["ray"]
    restarted_at, error = run["restarted"]
    assert isinstance(error, WorkerDied) and error.group == "rollout"
    assert "\n" not in str(error)
    print(f"pool killed: restart began {restarted_at - run['killed_at']:.1f} s after the kill ({error})")
    assert restarted_at - run["killed_at"] < RESTART_S
    assert len(run["pids"]) == 4  # the actor's and the pool's, before and after the restart
    assert still_alive(sorted(run["pids"])) == []
