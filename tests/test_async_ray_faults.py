"""Faults of the asynchronous modes (issue 23, item 7): a trainer killed mid-update.

``grpo_tiny`` with ``trainer.mode=async`` and ``max_staleness=1``, the CLI's tiniest run
(`tests.cli.TINY`: one device, 2 prompts x 2 responses, one layer), 3 steps with a checkpoint
after each; the actor's update of step 2 ends from inside:

* on the Ray backend (one worker process; ``jaxflow.ray.max_restarts=1``), the process is
  SIGKILLed inside ``ActorWorker.update`` once its optimizer steps ran (`tests.ray_toy.KillSwitch`):
  the run logs a restart, fresh processes resume from step 1's checkpoint and finish the run;
* on the local backend, the update raises: the run (``python -m jaxflow.run``, in this process)
  ends in one line, and a second run resumes from step 1's checkpoint.

Either way each step's update consumes, once, the prompt batch that an uninterrupted run
consumes at that step (the loader's batches in order, as `tests.test_async_modes` checks the
schedule); the rollout of step 3 that the failed attempt generated ahead (with the weights of
version 1) is discarded, never consumed: the resumed run generates it again; every consumed
token's staleness is within the bound; the checkpoint holds the policy version and the
loader's position before the first pending rollout.

The schedule (policy version ``v`` = updates so far; rollout ``k`` of prompt batch ``k``):
step 1 generates rollouts 1 and 2 with v0 and consumes 1 (staleness 0); checkpoint 1 (v1, the
loader before batch 2); step 2 generates rollout 3 with v1, consumes 2 (staleness 1) and dies
in its update. The resumed run (v1) generates rollouts 2 and 3, step 2 consumes 2 (staleness
0), step 3 consumes 3 at v2 (staleness 1).
"""

import copy
import functools
import logging
import os
import time

import pytest

from jaxflow.configs import load_config
from jaxflow.trainer import ahead as ahead_module
from jaxflow.trainer.ahead import GenerateAhead
from tests.cli import TINY, still_alive

STEPS, KILL_STEP = 3, 2
RUN = [
    *(a.removeprefix("--config.") for a in TINY if a.startswith("--config.")),
    "trainer.logger=['console']",
    "trainer.mode=async",
    "trainer.max_staleness=1",
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=1",
]
# Per attempt of a step: (step, policy version of its update, version of the tokens it consumed,
# which generated rollout it consumed: its index in the order of generation).
# Generated: rollouts 1, 2 (v0), 3 (v1, by the failed attempt; discarded), 2, 3 (v1, resumed).
WANT_ATTEMPTS = [(1, 0, 0, 0), (2, 1, 0, 1), (2, 1, 1, 3), (3, 2, 1, 4)]
WANT_GENERATED = [(1, 0), (2, 0), (3, 1), (2, 1), (3, 1)]


class Schedule:
    """What `GenerateAhead` does in this process (class-level wrappers, ``install``): each
    rollout generated ``(step, version, rollout)``, each step's attempt (its prompt rows'
    dataset indices and the tokens it consumed) and the loader's first ``STEPS`` batches as an
    uninterrupted run consumes them (a copy of the loader at the start of the first step).
    ``before_step(step, workers)`` runs before each step's rollouts are generated."""

    def __init__(self, before_step=lambda step, workers: None):
        self.before_step = before_step
        self.generated, self.attempts, self.uninterrupted = [], [], None

    def install(self, monkeypatch) -> None:
        step_fn, generate_fn = GenerateAhead.step, ahead_module.generate_rollout

        def step(ahead, step, workers, version):
            if self.uninterrupted is None:
                loader = copy.deepcopy(ahead.loader)
                self.uninterrupted = [_indices(ahead.to_batch(next(loader))) for _ in range(STEPS)]
            self.before_step(step, workers)
            prompts, seen, metrics = step_fn(ahead, step, workers, version)
            self.attempts.append((step, _indices(prompts), ahead.consumed))
            return prompts, seen, metrics

        def generate(step, prompts, version, actor):
            rollout = generate_fn(step, prompts, version, actor)
            self.generated.append((step, version, rollout))
            return rollout

        monkeypatch.setattr(GenerateAhead, "step", step)
        monkeypatch.setattr(ahead_module, "generate_rollout", generate)

    def check(self) -> None:
        """The attempts and generations are `WANT_ATTEMPTS` and `WANT_GENERATED`; each step's
        last attempt consumed the uninterrupted run's batch of that step, the cut attempt the
        same batch as its rerun; every consumed token's staleness is in [0, 1]."""
        assert [(s, v) for s, v, _ in self.generated] == WANT_GENERATED
        rows = [r.token_versions_BxR for _, _, r in self.generated]
        got = []
        for step, _, consumed in self.attempts:
            (which,) = [i for i, r in enumerate(rows) if r is consumed.token_versions_BxR]
            staleness = consumed.staleness()
            assert staleness.size and staleness.min() == staleness.max() and 0 <= staleness.max() <= 1
            got.append((step, consumed.version, consumed.version - int(staleness.max()), which))
        assert got == WANT_ATTEMPTS
        last = {step: indices for step, indices, _ in self.attempts}
        assert [last[s] for s in range(1, STEPS + 1)] == self.uninterrupted
        assert self.attempts[1][1] == self.attempts[2][1]  # the cut step's batch, consumed again
        assert len({i for batch in self.uninterrupted for i in batch}) == sum(map(len, self.uninterrupted))


def _indices(prompts) -> tuple[int, ...]:
    """A prompt batch's rows as dataset row numbers."""
    return tuple(int(i) for i in prompts["index"])


def _checkpoint_host(run_dir, step: int) -> dict:
    """The host state of the checkpoint of ``step`` as saved (its JSON file)."""
    import json

    return json.loads((run_dir / f"step_{step}" / "host" / "metadata").read_text())


def _check_checkpoints(run_dir, schedule: Schedule) -> None:
    """Checkpoint ``s`` holds policy version ``s`` and the loader before batch ``s + 1`` (the
    first pending rollout's, generated again on resume); after the last step nothing is
    pending: the loader is past the 3 batches consumed."""
    batch = len(schedule.uninterrupted[0])
    for step, loader_rows in ((1, batch), (2, 2 * batch), (3, 3 * batch)):
        host = _checkpoint_host(run_dir, step)
        assert host["extra"]["policy_version"] == step
        assert (host["data_loader"]["epoch"], host["data_loader"]["index"]) == (0, loader_rows), (step, host)


class _Records(logging.Handler):
    """The log records of the ``jaxflow`` loggers (INFO and up) while installed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger = logging.getLogger("jaxflow")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)

    def starting(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.msg.startswith(text)]


@pytest.fixture(scope="module")
def ray_killed(ray_session, tmp_path_factory):
    """The Ray run killed inside step 2's update and restarted: its `Schedule`, history, log
    records, run directory, the killed world's pids and the wall times of the kill
    (``time.time()``, written by the dying process) and of the run's end."""
    from jaxflow.trainer.rl import RLTrainer
    from jaxflow.workers.ray.backend import RayWorkerGroup
    from tests.ray_toy import KillSwitch

    out = tmp_path_factory.mktemp("async_ray_faults")
    stamp, armed = out / "killed_at", []

    def arm(step, workers):
        if step == KILL_STEP and not armed:
            processes = workers.actor.processes
            switch = RayWorkerGroup(processes, "kill", KillSwitch, processes.build("kill", KillSwitch, {}))
            armed.append((switch.arm(str(stamp)), list(processes.pids)))

    schedule = Schedule(arm)
    overrides = ["jaxflow.backend=ray", "jaxflow.ray.devices_per_host=1", "jaxflow.ray.max_restarts=1"]
    cfg = load_config("grpo_tiny", [*RUN, *overrides, f"trainer.default_local_dir={out / 'run'}"])
    with pytest.MonkeyPatch.context() as monkeypatch, _Records() as records:
        schedule.install(monkeypatch)
        history = RLTrainer(cfg).fit()
        ended = time.time()
    (killed_pids,) = [pids for _, pids in armed]
    return {
        "schedule": schedule,
        "history": history,
        "records": records,
        "run_dir": out / "run",
        "killed_pids": killed_pids,
        "killed_at": float(stamp.read_text()),
        "ended": ended,
    }


@pytest.mark.slow
def test_a_ray_trainer_killed_mid_update_restarts_within_60_s_and_leaves_no_process(ray_killed):
    """The kill is logged as a worker failure naming the update, with a restart from step 1's
    checkpoint, within 60 s of the kill; the restarted run finishes all 3 steps, each logged
    once; no process of either world is left once the run is over."""
    records = ray_killed["records"]
    (restart,) = records.starting("worker failure")
    message = restart.getMessage()
    assert "died during actor.update" in message and "restart 1/1" in message, message
    assert message.endswith("resuming from checkpoint step 1"), message
    to_restart, to_end = restart.created - ray_killed["killed_at"], ray_killed["ended"] - ray_killed["killed_at"]
    load = os.getloadavg()
    print(f"kill -> restart logged {to_restart:.1f} s, kill -> run over {to_end:.1f} s (load average {load})")
    assert 0 < to_restart <= 60
    assert [h["step"] for h in ray_killed["history"]] == [1, 2, 3]
    started = [r.args[2] for r in records.starting("worker group %r started")]
    assert len(started) == 2 and started[0] == ray_killed["killed_pids"]
    assert still_alive(started[0] + started[1]) == []


@pytest.mark.slow
def test_a_ray_restart_consumes_every_prompt_batch_once_and_discards_the_dead_rollouts(ray_killed):
    """`Schedule.check`: the restarted run consumes the uninterrupted run's batches, the cut
    step's again and no other twice, none lost, not the failed attempt's rollout generated
    ahead; staleness within the bound."""
    ray_killed["schedule"].check()


@pytest.mark.slow
def test_a_ray_restarts_checkpoints_hold_the_policy_version_and_the_loader_position(ray_killed):
    _check_checkpoints(ray_killed["run_dir"], ray_killed["schedule"])


@pytest.mark.slow
def test_a_local_update_that_raises_ends_the_run_in_one_line_and_a_resumed_run_consumes_the_rest(
    tmp_path, monkeypatch, capsys
):
    """Local backend: an exception inside step 2's ``ActorWorker.update`` ends the run in one
    line on stderr (exit code 1), step 1's checkpoint complete; a second run resumes from it
    and consumes exactly batches 2 and 3 (`Schedule.check` over both runs)."""
    from jaxflow.run import main
    from jaxflow.workers.actor import ActorWorker

    update, raised = ActorWorker.update, []

    @functools.wraps(update)  # keeps the registered protocol
    def update_that_raises(worker, *args, **kwargs):
        out = update(worker, *args, **kwargs)
        if kwargs.get("step") == KILL_STEP and not raised:
            raised.append(True)
            raise RuntimeError("the trainer died inside its update")
        return out

    monkeypatch.setattr(ActorWorker, "update", update_that_raises)
    schedule = Schedule()
    schedule.install(monkeypatch)
    args = ["--config=grpo_tiny", *(f"--config.{a}" for a in RUN), f"--config.trainer.default_local_dir={tmp_path}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: RuntimeError: the trainer died inside its update") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1"]
    assert main(args) == 0, capsys.readouterr().err
    schedule.check()
    _check_checkpoints(tmp_path, schedule)
