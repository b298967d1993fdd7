"""The rollout on devices of its own, overlapping the update (``jaxflow.placement.rollout_devices``,
`jaxflow.trainer.rollouter`): against a fake pool, the rollouter keeps `GenerateAhead`'s
schedule while generating in its thread, syncs only after the rollouts in flight, re-raises its
errors in one line and stops with the trainer; through the trainer (8 simulated devices, 4 of
them the pool): the pool samples what the actor would from the same weights and no device holds
the whole model, ``async`` with ``max_staleness=0`` equals ``sync`` bit for bit (PPO and GRPO),
``one_step_off`` logs the same metrics with and without the overlap, each consumed token is
within the bound, and a resumed run regenerates its pending rollout from the same prompts."""

import threading
import time
import types

import jax
import numpy as np
import pytest

from jaxflow.configs import ConfigError, load_config
from jaxflow.trainer.ahead import GenerateAhead, lookahead
from jaxflow.trainer.rollouter import Rollouter, RolloutError
from jaxflow.workers.group import Workers
from tests.test_async_modes import TIMED, _Loader, _to_batch
from tests.test_placement_invariance import DIGITS, SMALL

POOL = ["jaxflow.placement.type=colocated", "jaxflow.placement.rollout_devices=4"]


class _Pool:
    """A rollout pool that records each generate call as (step, prompt batch, weights' version),
    refuses a sync while a generation runs, and lets a test hold (``gate``) or fail (``fail_at``)
    the generation of a step."""

    def __init__(self, gate=None, fail_at=None):
        self.version, self.calls, self.syncs = -1, [], []
        self.gate, self.fail_at = gate, fail_at
        self.generating = threading.Event()
        self.closed = False

    def sync(self, version):
        assert not self.generating.is_set(), "a sync while a generation runs"
        self.syncs.append(version)
        self.version = version
        return {"weight_sync/bytes": 8.0, "timing_s/weight_sync": 0.0}

    def generate(self, prompts, *, step):
        self.generating.set()
        try:
            if self.gate is not None:
                self.gate(step)
            if step == self.fail_at:
                raise ValueError("the engine ran out of pages")
            self.calls.append((step, int(prompts["batch"][0]), self.version))
            responses = np.zeros((len(prompts), 3), np.int32)
            return prompts.update(tensors={"responses": responses, "response_mask": np.ones_like(responses)})
        finally:
            self.generating.clear()

    def rollout_metrics(self):
        return {}

    def generation_seconds(self):
        return {"engine": 0.5}

    def close(self):
        self.closed = True


def _ahead(pool, max_staleness, **kwargs):
    return GenerateAhead(
        lookahead("async", max_staleness), 5, _Loader(), _to_batch, rollouter=Rollouter(pool, **kwargs)
    )


def test_the_rollouter_keeps_the_schedule_and_generates_while_the_step_runs():
    """max_staleness=2 over 5 steps with a pool: the same calls (step, prompt batch, version) and
    staleness as on the actor's devices (tests/test_async_modes.py); steps 2 and 3 generate in
    the thread after step 1's rollout is handed out (held until then); the pool syncs to version
    v before the first rollout of v, never during a generation, and not when nothing is missing."""
    release = threading.Event()
    pool = _Pool(gate=lambda step: step > 1 and release.wait(30))
    ahead = _ahead(pool, 2)
    staleness = []
    try:
        for version, step in enumerate(range(1, 6)):
            prompts, w, metrics = ahead.step(step, Workers(actor=None), version)
            if step == 1:  # step 2's rollout is held in the thread while the step goes on
                assert [r.step for r in ahead.pending] == [2, 3] and not ahead.pending[0].done()
                release.set()
            assert int(w.actor.generate(prompts, step=step)["batch"][0]) == step - 1
            staleness.append(metrics["fully_async/staleness/token_max"])
            assert metrics["weight_sync/bytes"] == (8.0 if step <= 3 else 0.0)
    finally:
        ahead.close()
    assert pool.calls == [(1, 0, 0), (2, 1, 0), (3, 2, 0), (4, 3, 1), (5, 4, 2)]
    assert pool.syncs == [0, 1, 2] and staleness == [0.0, 1.0, 2.0, 2.0, 2.0] and pool.closed


def test_without_overlap_the_same_rollouts_are_generated_in_the_step():
    pool = _Pool()
    ahead = _ahead(pool, 1, overlap=False)
    try:
        for version, step in enumerate(range(1, 6)):
            ahead.step(step, Workers(actor=None), version)
            assert all(r.done() for r in ahead.pending)
    finally:
        ahead.close()
    assert pool.calls == [(1, 0, 0), (2, 1, 0), (3, 2, 1), (4, 3, 2), (5, 4, 3)]
    assert ahead.rollouter._thread is None  # no thread


def test_a_failed_rollout_is_raised_by_the_trainers_next_wait_in_one_line():
    """The thread fails generating step 3 (during step 2's update): step 3's wait raises it as one
    `RolloutError` line within a second, and nothing is generated after it."""
    pool = _Pool(fail_at=3)
    ahead = _ahead(pool, 1)
    try:
        ahead.step(1, Workers(actor=None), 0)
        ahead.step(2, Workers(actor=None), 1)
        t0 = time.perf_counter()
        with pytest.raises(RolloutError) as e:
            ahead.step(3, Workers(actor=None), 2)
        assert time.perf_counter() - t0 < 5
    finally:
        ahead.close()
    assert str(e.value) == "the rollouter failed generating step 3's rollout: ValueError: the engine ran out of pages"
    assert "\n" not in str(e.value) and pool.calls == [(1, 0, 0), (2, 1, 0)]


@pytest.mark.parametrize("close_timeout_s", [30.0, 0.2])
def test_a_trainer_that_stops_during_a_rollout_stops_the_rollouter(close_timeout_s):
    """The update raises while the thread generates step 2's rollout (step 3's queued): close()
    lets the generation in flight finish, starts nothing after it and joins the thread; a
    generation that outlasts ``close_timeout_s`` is not waited for (the thread is a daemon)."""
    in_flight, release = threading.Event(), threading.Event()

    def gate(step):
        if step == 2:
            in_flight.set()
            release.wait(1.0)

    pool = _Pool(gate=gate)
    ahead = _ahead(pool, 2, close_timeout_s=close_timeout_s)
    ahead.step(1, Workers(actor=None), 0)
    assert in_flight.wait(10)
    thread = ahead.rollouter._thread
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="the update failed"):
        try:
            raise RuntimeError("the update failed")
        finally:
            ahead.close()
    closed_s = time.perf_counter() - t0
    assert thread.daemon and pool.closed
    if close_timeout_s > 1:
        assert closed_s < 5 and not thread.is_alive() and pool.calls == [(1, 0, 0), (2, 1, 0)]
    else:
        assert closed_s < 0.9 and thread.is_alive()  # still in its generation
        thread.join(5)
        assert not thread.is_alive() and (3, 2, 0) not in pool.calls


class _PartialPool(_Pool):
    """A `_Pool` with the partial entry points: a rollout of ``R`` tokens per row, sampled
    ``max_steps`` at a time under the version it is run with. Step ``hold``'s rollout holds at
    its first segment boundary until ``until()`` says a sync is waiting; each sync records the
    rollouts then parked (step, tokens so far)."""

    R = 6

    def __init__(self, hold):
        super().__init__()
        self.hold, self.live, self.parked_at_sync = hold, [], []

    def sync(self, version):
        self.parked_at_sync.append([(p.step, len(p.versions)) for p in self.live if not p.done])
        return super().sync(version)

    def start_partial(self, prompts, *, step, version):
        partial = types.SimpleNamespace(step=step, prompts=prompts, versions=[], done=False, version=version)
        self.live.append(partial)
        return partial

    def run_partial(self, partial, version, *, max_steps, until):
        self.generating.set()
        try:
            partial.version = version
            while not partial.done and not until():
                partial.versions += [version] * min(max_steps, self.R - len(partial.versions))
                partial.done = len(partial.versions) == self.R
                if partial.step == self.hold and len(partial.versions) == max_steps:
                    _wait_for(until)  # a sync is requested while the rollout is in flight
            return partial
        finally:
            self.generating.clear()

    def finish_partial(self, partial):
        prompts = partial.prompts
        self.calls.append((partial.step, int(prompts["batch"][0]), partial.versions[0]))
        responses = np.zeros((len(prompts), self.R), np.int32)
        versions = np.array([partial.versions] * len(prompts), np.int32)
        return prompts.update(
            tensors={"responses": responses, "response_mask": np.ones_like(responses), "token_versions": versions}
        )


def _wait_for(condition, timeout_s=60.0):
    """Polls ``condition`` until true (a test that would hang fails instead)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        threading.Event().wait(0.002)


def test_a_sync_interrupts_the_rollout_in_flight_which_resumes_under_the_new_weights():
    """one_step_off with partial rollouts of 2-token segments: step 2's rollout (submitted at
    version 0) is in flight when step 2 syncs to version 1; the sync parks it after its first
    segment instead of waiting for it (it has 2 of 6 tokens then), and it resumes under version
    1: its token versions are [0] * 2 + [1] * 4, consumed at version 1 (staleness 1 and 0)."""
    pool = _PartialPool(hold=2)
    ahead = _ahead(pool, 1, partial_segment=2)
    try:
        _, _, first = ahead.step(1, Workers(actor=None), 0)
        prompts, w, second = ahead.step(2, Workers(actor=None), 1)
    finally:
        ahead.close()
    assert pool.syncs == [0, 1] and pool.parked_at_sync == [[], [(2, 2)]]
    np.testing.assert_array_equal(ahead.consumed.token_versions_BxR, [[0, 0, 1, 1, 1, 1]] * len(prompts))
    assert sorted(set(ahead.consumed.staleness().tolist())) == [0, 1]
    assert first["fully_async/partial/interrupted"] == 0 and first["fully_async/partial/older_token_ratio"] == 0
    assert second["fully_async/partial/interrupted"] == 1
    assert second["fully_async/partial/older_token_ratio"] == pytest.approx(2 / 6)
    assert second["fully_async/partial/max_partial_span"] == 1 and second["fully_async/staleness/token_max"] == 1
    assert "token_versions" not in w.actor.generate(prompts, step=2)  # the column leaves the batch


def test_the_rollout_pool_key_is_checked():
    for value, words in [
        (8, "leaves none of the jaxflow.num_devices=8"),
        (3, "not whole groups of jaxflow.mesh.actor.generate.tp=2"),
    ]:
        with pytest.raises(ConfigError, match=f"jaxflow.placement.rollout_devices: {value} .*{words}"):
            load_config("grpo_tiny", [POOL[0], f"jaxflow.placement.rollout_devices={value}"])
    with pytest.raises(ConfigError, match="rollout_devices: 4 devices are not whole hosts of jaxflow.ray.devices_per"):
        load_config("grpo_tiny", [*POOL, "jaxflow.backend=ray", "jaxflow.ray.devices_per_host=8"])
    ray_pool = [*POOL, "jaxflow.backend=ray", "jaxflow.ray.devices_per_host=4"]
    assert load_config("grpo_tiny", [*ray_pool, "trainer.partial_rollout=True"]).trainer.partial_rollout  # on Ray too
    with pytest.raises(ConfigError, match=r"partial_rollout: interrupts a rollout pool's rollouts; set jaxflow.place"):
        load_config("grpo_tiny", ["jaxflow.backend=ray", "trainer.partial_rollout=True"])
    with pytest.raises(ConfigError, match=r"partial_rollout: partial rollouts sample one response per sample"):
        load_config(
            "grpo_tiny", [*POOL, "trainer.partial_rollout=True", "actor_rollout_ref.rollout.multi_turn.enable=True"]
        )
    with pytest.raises(ConfigError, match="rollout_devices: the auto-mapper does not plan a rollout pool"):
        load_config("grpo_tiny", ["jaxflow.placement.rollout_devices=4"])
    with pytest.raises(ConfigError, match=r"pool_sizes: \(4, 4\) add up to 8 devices, but the placement has 4"):
        load_config("grpo_tiny", ["jaxflow.placement.type=split", "jaxflow.placement.pool_sizes=(4,4)", POOL[1]])


# ---------------------------------------------------------------------- through the trainer


def _run(config, overrides, run_dir, steps=5, overlap=True, inspect=None, inspect_at=3, setup=None):
    """``steps`` training steps with a rollout pool; each step's metrics and consumed tokens'
    staleness, and what ``inspect(trainer)`` returns (called after step ``inspect_at``);
    ``setup(trainer)`` runs before the first step."""
    from jaxflow.trainer.rl import RLTrainer

    trainer = RLTrainer(load_config(config, [*overrides, f"trainer.default_local_dir={run_dir}"]))
    trainer.ahead.rollouter.overlap = overlap
    if setup is not None:
        setup(trainer)
    rows, seen = [], None
    try:
        for step in range(1, steps + 1):
            metrics = trainer.train_step(step)
            rows.append({"step": step, **metrics, "staleness": trainer.ahead.consumed.staleness()})
            if step == inspect_at and inspect is not None:
                seen = inspect(trainer)
    finally:
        trainer.close()
    return rows, seen


def _untimed(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMED) and k != "staleness"}


def _next_rollout(trainer):
    """The first pending rollout (step 4's after step 3), once generated: its columns."""
    rollout = trainer.ahead.rollouter.wait(trainer.ahead.pending[0])
    return rollout.step, rollout.version, {k: np.asarray(rollout.batch[k]) for k in ("prompt_ids", "responses")}


def _pool_samples_as_the_actor(trainer):
    """After a sync (after the last step: it moves the run's own syncs), the pool samples what
    the actor samples from the same weights (the same request and rng scheme), and no pool
    device holds the whole model."""
    from jaxflow.iterations import batch_from_prompts

    pool = trainer.ahead.rollouter.pool
    trainer.ahead.rollouter.sync(trainer.policy_version)
    prompts = batch_from_prompts(trainer.val_data.batch(np.arange(4)))
    mine = pool.generate(prompts, step=99)
    actor = trainer.workers.actor.generate(prompts, step=99)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.workers.actor.worker.params))
    held: dict[int, int] = {}
    for x in jax.tree.leaves(pool.params):
        assert x.sharding.device_set == set(pool.gen_mesh.devices.flat)
        for shard in x.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return {
        "same_rows": all(np.array_equal(np.asarray(mine[k]), np.asarray(actor[k])) for k in ("responses", "uid")),
        "log_probs_gap": float(np.abs(np.asarray(mine["rollout_log_probs"]) - actor["rollout_log_probs"]).max()),
        "held_over_model": max(held.values()) / model_bytes,
        "pool_devices": sorted(held),
        "report": pool.last_report,
    }


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    reward = tmp_path_factory.mktemp("reward") / "digits.py"
    reward.write_text(DIGITS)
    return [*SMALL, *POOL, f"custom_reward_function.path={reward}"]


@pytest.fixture(scope="module")
def grpo_runs(digits, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_pool")
    return {
        "sync": _run("grpo_tiny", digits, tmp / "sync", inspect=_pool_samples_as_the_actor, inspect_at=5),
        "async0": _run("grpo_tiny", [*digits, "trainer.mode=async", "trainer.max_staleness=0"], tmp / "a0"),
        "off": _run("grpo_tiny", [*digits, "trainer.mode=one_step_off"], tmp / "off", inspect=_next_rollout),
        "off_serial": _run("grpo_tiny", [*digits, "trainer.mode=one_step_off"], tmp / "serial", overlap=False),
        "async2": _run("grpo_tiny", [*digits, "trainer.mode=async", "trainer.max_staleness=2"], tmp / "a2"),
    }


@pytest.mark.slow
def test_the_pool_samples_what_the_actor_would_and_holds_no_whole_model(grpo_runs):
    seen = grpo_runs["sync"][1]
    assert seen["same_rows"] and seen["log_probs_gap"] < 1e-5
    assert seen["pool_devices"] == [4, 5, 6, 7] and seen["held_over_model"] < 1.0
    assert seen["report"].dest_shard_bytes < seen["report"].model_bytes


@pytest.mark.slow
@pytest.mark.parametrize("config", ["grpo_tiny", "ppo_tiny"])
def test_async_with_staleness_0_on_a_pool_is_sync_on_the_pool_bit_for_bit(config, digits, grpo_runs, tmp_path):
    if config == "grpo_tiny":
        sync, asynchronous = grpo_runs["sync"][0], grpo_runs["async0"][0]
    else:
        sync = _run(config, digits, tmp_path / "sync")[0]
        asynchronous = _run(config, [*digits, "trainer.mode=async", "trainer.max_staleness=0"], tmp_path / "a")[0]
    assert any(r["critic/score/mean"] > 0 for r in sync)  # the reward has signal
    for a, b in zip(sync, asynchronous, strict=True):
        assert len(_untimed(a)) > 20 and _untimed(a) == _untimed(b), a["step"]
        assert b["fully_async/staleness/token_max"] == 0.0 and a["weight_sync/bytes"] > 0
        assert 0 <= a["fully_async/trainer/idle_ratio"] <= 1 and 0 <= a["fully_async/rollouter/idle_ratio"] <= 1


@pytest.mark.slow
def test_one_step_off_on_a_pool_logs_the_same_metrics_with_and_without_overlap(grpo_runs):
    off, serial = grpo_runs["off"][0], grpo_runs["off_serial"][0]
    for a, b in zip(off, serial, strict=True):
        assert _untimed(a) == _untimed(b), a["step"]
    assert [r["fully_async/staleness/token_max"] for r in off] == [0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("run,bound", [("off", 1), ("async2", 2)])
def test_every_consumed_token_on_a_pool_is_within_the_bound(grpo_runs, run, bound):
    """Step k consumes tokens of version max(0, k - 1 - bound), read from the per-token versions."""
    for r in grpo_runs[run][0]:
        staleness = r["staleness"]
        assert staleness.size > 0 and set(staleness.tolist()) == {min(r["step"] - 1, bound)}


@pytest.mark.slow
def test_a_resumed_run_on_a_pool_regenerates_its_pending_rollout(digits, grpo_runs, tmp_path):
    """one_step_off on a pool cut after step 2's checkpoint and resumed: step 3 regenerates its
    rollout on the pool (synced to the checkpoint's weights), and step 4's rollout it then
    generates is the uninterrupted run's, bit for bit."""
    from jaxflow.trainer.rl import RLTrainer

    overrides = [
        *digits,
        "trainer.mode=one_step_off",
        "trainer.resume_mode=auto",
        f"trainer.default_local_dir={tmp_path}",
    ]
    cut = RLTrainer(load_config("grpo_tiny", overrides))
    try:
        cut.train_step(1)
        cut.train_step(2)
        cut.save(2, [])
    finally:
        cut.ckpt.close()
        cut.close()
    resumed = RLTrainer(load_config("grpo_tiny", overrides))
    try:
        assert resumed.resume() == 2 and resumed.policy_version == 2 and not resumed.ahead.pending
        resumed.train_step(3)
        got = _next_rollout(resumed)
    finally:
        resumed.ckpt.close()
        resumed.close()
    want = grpo_runs["off"][1]
    assert got[:2] == want[:2] == (4, 2)
    for key in want[2]:
        np.testing.assert_array_equal(got[2][key], want[2][key])


@pytest.mark.slow
def test_an_update_that_fails_with_a_rollout_in_flight_ends_the_run_in_seconds(digits, tmp_path, monkeypatch):
    """fit() of one_step_off on a pool: step 2's update raises while step 3's rollout generates
    on the pool; the error ends the run, the rollouter's thread is joined (not left running)."""
    from jaxflow.trainer.rl import RLTrainer

    cfg = load_config("grpo_tiny", [*digits, "trainer.mode=one_step_off", f"trainer.default_local_dir={tmp_path}"])
    trainer = RLTrainer(cfg)
    pool = trainer.ahead.rollouter.pool
    generate, started, raised_at = pool.generate, threading.Event(), []

    def slow_generate(prompts, *, step):
        if step == 3:
            started.set()
            time.sleep(1.0)  # in flight when the update fails
        return generate(prompts, step=step)

    def failing_update(*args, **kwargs):
        if trainer.completed_steps == 1:
            assert started.wait(30)
            raised_at.append(time.perf_counter())
            raise RuntimeError("injected: the update failed")
        return update(*args, **kwargs)

    monkeypatch.setattr(pool, "generate", slow_generate)
    update = trainer.workers.actor.update
    monkeypatch.setattr(trainer.workers.actor, "update", failing_update, raising=False)
    with pytest.raises(RuntimeError, match="injected: the update failed"):
        trainer.fit()
    assert time.perf_counter() - raised_at[0] < 10  # the generation in flight finished, the thread joined
    thread = trainer.ahead.rollouter._thread
    assert thread is not None and not thread.is_alive() and pool.params is None


def _interrupt_mid_rollout(trainer):
    """One-token segments, and steps 3 and 4's rollouts interrupted after their first token:
    each runs its first segment, then waits for a sync (step j's rollout: step j - 1's, to
    version j - 2), which waits for that first segment. So rollout j's first token is of the
    version it was submitted at (j - 3) and the rest of version j - 2."""
    rollouter = trainer.ahead.rollouter
    pool, sync, run_partial = rollouter.pool, rollouter.sync, rollouter.pool.run_partial
    first_segment = {3: threading.Event(), 4: threading.Event()}
    rollouter.partial_segment = 1

    def step_of(partial):
        return int(partial.prompts.non_tensors["uid"][0].split(":")[0])

    def gated_run(partial, version, *, max_steps, until):
        step = step_of(partial)
        if step in first_segment and not partial.rollout.lengths_N.any():
            partial = run_partial(partial, version, max_steps=max_steps)  # one segment
            first_segment[step].set()
            _wait_for(until)
            return partial
        return run_partial(partial, version, max_steps=max_steps, until=until)

    def gated_sync(version):
        if version + 2 in first_segment:
            assert first_segment[version + 2].wait(120)
        return sync(version)

    pool.run_partial, rollouter.sync = gated_run, gated_sync


@pytest.fixture(scope="module")
def partial_run(digits, tmp_path_factory):
    overrides = [*digits, "trainer.mode=async", "trainer.max_staleness=2", "trainer.partial_rollout=true"]
    return _run("grpo_tiny", overrides, tmp_path_factory.mktemp("partial"), setup=_interrupt_mid_rollout)[0]


@pytest.mark.slow
def test_partial_rollouts_on_a_pool_mix_versions_within_the_bound(partial_run):
    """async, max_staleness=2, partial rollouts: every consumed token is within the bound (from
    its recorded version); steps 3 and 4 consume rollouts interrupted by a sync and resumed
    under the next version (versions k - 3 and k - 2 at version k - 1: staleness 2 and 1),
    interrupted by steps 2 and 3's syncs (a later sync may also find a rollout in flight: step
    4's rollout, resumed during step 3's update, may be interrupted again by step 4's)."""
    for r in partial_run:
        staleness = r["staleness"]
        assert staleness.size > 0 and 0 <= staleness.min() and staleness.max() <= 2
    assert [r["fully_async/partial/interrupted"] for r in partial_run[:3]] == [0, 1, 1]  # later: as timing has it
    assert [set(r["staleness"].tolist()) for r in partial_run[:3]] == [{0}, {1}, {1, 2}]
    # step 4's rollout: version 1, then 2 (and 3 where step 4's sync found it still in flight)
    assert {1, 2} <= set(partial_run[3]["staleness"].tolist())
    for r in partial_run[2:4]:
        assert r["fully_async/partial/max_partial_span"] >= 1 and 0 < r["fully_async/partial/older_token_ratio"] < 1


@pytest.mark.slow
def test_partial_rollouts_without_rollouts_ahead_are_sync_bit_for_bit(digits, grpo_runs, tmp_path):
    """max_staleness=0 leaves no rollout in flight at a sync: nothing to interrupt, and the
    run is the synchronous one on the pool, bit for bit."""
    overrides = [*digits, "trainer.mode=async", "trainer.max_staleness=0", "trainer.partial_rollout=true"]
    rows, _ = _run("grpo_tiny", overrides, tmp_path, steps=3)
    for a, b in zip(grpo_runs["sync"][0][:3], rows, strict=True):
        assert _untimed(a) == _untimed(b), a["step"]
