"""``trainer.mode`` one_step_off / async on the Ray backend (`jaxflow.trainer.ahead` over Ray
worker groups): the local backend's schedule, the rollouts generated ahead by the actor's
group and consumed by the update after them on the same devices.

One module fixture makes every Ray run of the file on this session's Ray instance
(``ray_session``): for ``grpo_tiny`` and ``ppo_tiny``, ``sync`` and ``async`` with
``max_staleness=0`` for 5 steps each, and ``grpo_tiny`` with ``async`` and
``max_staleness=1`` for 3 steps (staleness 1 from step 2 on): 5 Ray runs (grpo_tiny's with
the rollout probe on). Each is colocated
on one Ray worker process of 8 simulated devices, with 8 prompts x 4 responses and one layer
(`SMALL`). One process, because every process compiles every program (measured on the 2-core
machine: a 5-step grpo_tiny run's worker CPU 31 s on 1 process x 8 devices, 57 s on 2 x 4),
and what is tested here is the controller's: the rollouts generated ahead go through the
same `RayWorkerGroup` dispatch for any process count (several processes against the local
backend: tests/test_ray_backend.py).
"""

import numpy as np
import pytest

from experiments import ray_vs_local
from jaxflow.configs import load_config
from jaxflow.workers.rollout_probe import METRIC as PROBE_METRIC
from tests.test_placement_invariance import DIGITS, SMALL

RAY = [
    "jaxflow.backend=ray",
    "jaxflow.num_devices=8",
    "jaxflow.ray.devices_per_host=8",
    "jaxflow.placement.type=colocated",
]
# grpo_tiny's runs with the rollout probe, so that the actor group's report of each rollout
# (`ActorWorker.rollout_metrics`: rollout/probe_tv) is one of the metrics compared.
CONFIGS = {"grpo_tiny": ["jaxflow.rollout_probe.enable=on"], "ppo_tiny": []}
EQUAL_STEPS, STALE_STEPS = 5, 3


def _run(config: str, overrides: list[str], steps: int, run_dir) -> tuple[list[dict], list]:
    """``steps`` training steps of ``config`` on the Ray backend in this process: each step's
    metrics and, with rollouts generated ahead, the tokens its update consumed
    (`jaxflow.trainer.ahead.ConsumedTokens`: their recorded versions)."""
    from jaxflow.trainer.rl import RLTrainer

    trainer = RLTrainer(load_config(config, [*overrides, f"trainer.default_local_dir={run_dir}"]))
    try:
        rows, consumed = [], []
        for step in range(1, steps + 1):
            rows.append({"step": step} | trainer.train_step(step))
            consumed.append(None if trainer.ahead is None else trainer.ahead.consumed)
        return rows, consumed
    finally:
        trainer.close()


def _synchronous_metrics(rows: list[dict]) -> list[dict]:
    """The rows without the metrics of generating ahead (``fully_async/*``,
    ``timing_s/gen_ahead``)."""
    return [{k: v for k, v in r.items() if not k.startswith(("fully_async/", "timing_s/gen_ahead"))} for r in rows]


def _assert_same_metrics(sync: list[dict], asynchronous: list[dict]) -> tuple[float, tuple]:
    """Asserts that the asynchronous run logged the synchronous run's metrics, step by step:
    the same keys beside those of generating ahead (the generation's parts ``timing_s/gen_*``
    and the rollout's own metrics included: the actor group's report of the rollout reached the
    step that consumed it), every value but the timings within 1e-5 relative, no absolute
    slack (both runs on the same backend and process count: none of the cross-backend
    allowances of `experiments.ray_vs_local.compare` applies). Returns the largest relative
    difference and where it is, ``(step, metric)`` (none if 0)."""
    assert _synchronous_metrics(sync) == sync
    largest = (0.0, ())
    for a, b in zip(sync, _synchronous_metrics(asynchronous), strict=True):
        assert set(a) == set(b), set(a) ^ set(b)
        keys = sorted(k for k in a if not k.startswith(ray_vs_local.TIMING_PREFIXES))
        want, got = np.array([a[k] for k in keys]), np.array([b[k] for k in keys])
        assert len(keys) > 20 and want.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0, err_msg=f"step {a['step']}: {keys}")
        relative = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
        if relative.max() > largest[0]:
            largest = (float(relative.max()), (a["step"], keys[int(relative.argmax())]))
    return largest


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """``{(config, mode): (metrics per step, consumed tokens per step)}`` for the modes
    ``sync``, ``async_s0`` (async, max_staleness=0) and, for grpo_tiny, ``async_s1``."""
    out = tmp_path_factory.mktemp("async_ray")
    reward = out / "digits.py"
    reward.write_text(DIGITS)
    common = [*SMALL, *RAY, f"custom_reward_function.path={reward}"]
    modes = {
        "sync": ([], EQUAL_STEPS),
        "async_s0": (["trainer.mode=async", "trainer.max_staleness=0"], EQUAL_STEPS),
        "async_s1": (["trainer.mode=async", "trainer.max_staleness=1"], STALE_STEPS),
    }
    results = {}
    for config, own in CONFIGS.items():
        for mode, (extra, steps) in modes.items():
            if mode == "async_s1" and config != "grpo_tiny":
                continue
            results[config, mode] = _run(config, [*common, *own, *extra], steps, out / f"{config}_{mode}")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("config", ["grpo_tiny", "ppo_tiny"])
def test_async_with_staleness_0_is_the_synchronous_run_on_ray(runs, config):
    """async with max_staleness=0 on Ray logs the synchronous Ray run's metrics, 5 steps
    (`_assert_same_metrics`: 1e-5 relative), each step consuming tokens of its own update's
    version."""
    (sync, _), (asynchronous, consumed) = runs[config, "sync"], runs[config, "async_s0"]
    assert any(r["critic/score/mean"] > 0 for r in sync)  # the reward has signal
    assert all((PROBE_METRIC in r) == (config == "grpo_tiny") for r in asynchronous)
    largest = _assert_same_metrics(sync, asynchronous)
    print(f"{config} on Ray: largest relative difference sync vs async (max_staleness=0) {largest}")
    for step, (row, tokens) in enumerate(zip(asynchronous, consumed, strict=True), start=1):
        assert tokens.step == step and tokens.version == step - 1
        assert row["fully_async/staleness/token_max"] == 0.0 and tokens.staleness().max() == 0
        assert row["fully_async/count/current_param_version"] == step - 1


@pytest.mark.slow
def test_every_consumed_token_is_within_the_staleness_bound_on_ray(runs):
    """async with max_staleness=1 on Ray, 3 steps: step 1 consumes the initial weights' rollout
    (the synchronous run's step), steps 2 and 3 the rollouts of the weights one update back;
    every consumed token's staleness (from its recorded version) is in [0, 1] and the
    ``fully_async/*`` metrics say so."""
    (rows, consumed), (sync, _) = runs["grpo_tiny", "async_s1"], runs["grpo_tiny", "sync"]
    staleness_max = []
    for step, (row, tokens) in enumerate(zip(rows, consumed, strict=True), start=1):
        staleness = tokens.staleness()
        staleness_max.append(int(staleness.max()))
        assert tokens.step == step and tokens.version == step - 1
        assert tokens.token_versions_BxR.shape == tokens.response_mask_BxR.shape
        assert staleness.size == tokens.response_mask_BxR.sum() > 0
        assert set(staleness.tolist()) == {min(step - 1, 1)}
        assert row["fully_async/staleness/token_max"] == float(staleness.max())
        assert row["fully_async/staleness/token_mean"] == float(np.mean(staleness))
        assert row["fully_async/count/current_param_version"] == step - 1
        assert row["fully_async/pending_rollouts"] == 1.0  # the run goes on past step 3
    _assert_same_metrics(sync[:1], rows[:1])
    print(f"grpo_tiny on Ray, async max_staleness=1: consumed staleness max per step {staleness_max}")
