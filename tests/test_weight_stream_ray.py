"""Weights streamed between two Ray worker groups (`jaxflow.workers.ray.streams.WeightStream`):
a trainer group and a rollout group, each its own `jax.distributed` world of 2 processes x 2
simulated CPU devices, the trainer's weights fsdp=4 under the training rules, the rollout's
tp=4 under the generation rules (every rollout shard is cut from all four training shards,
across both trainer processes). Three syncs, the trainer's weights changed before each: the
rollout's weights equal the trainer's bit for bit every time, and no process (from its own
report, and from JAX's live arrays) ever holds the whole model. A bf16 generation copy is the
cast of the trainer's weights; trees or shapes that differ are refused, naming the leaves.

Faults (the "Faults" of `jaxflow.workers.ray.streams`): a rank of either side that raises as its
sync starts, or whose weights were re-laid out, is raised at once with its group and rank, the
other world stopped and the stream still usable; a target or a source process SIGKILLed in the
middle of a sync (each its own group of 1 process x 2 devices: the only processes these tests
start) is one `WorkerDied` naming it within seconds, the other world's calls back."""

import dataclasses
import os
import signal
import threading
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxflow.workers.ray import RayBackend, RayConfig, WeightStream, cluster
from jaxflow.workers.ray.errors import WorkerDied
from tests.cli import still_alive
from tests.stream_roles import FaultyWeights, StreamedWeights
from tests.test_weight_sync import CFG, bits

BUCKET_BYTES = 2**16  # of a 460 kB model: 8 buckets, each acknowledged before the next
CONFIG = RayConfig(devices_per_host=2, compile_deadline_s=120, step_deadline_s=60, sync_deadline_s=120)


@pytest.fixture(scope="module")
def groups(ray_session):
    """The backend, the trainer's and the rollout's worker groups (2 processes each, their
    own worlds)."""
    backend = RayBackend(CONFIG)
    try:
        trainer = backend.group(
            backend.process_group("stream_trainer", 2),
            StreamedWeights,
            name="trainer",
            cfg=CFG,
            mesh="fsdp=4",
            rules="train",
            seed=1,
        )
        rollout = backend.group(
            backend.process_group("stream_rollout", 2),
            StreamedWeights,
            name="rollout",
            cfg=CFG,
            mesh="tp=4",
            rules="generate",
        )
        yield backend, trainer, rollout
    finally:
        pids = [pid for group in backend.groups.values() for pid in group.pids]
        backend.shutdown()
    assert still_alive(pids) == []  # every group's processes, those the fault tests left too


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_three_syncs_are_bit_exact_and_no_process_holds_the_model(groups):
    _, trainer, rollout = groups
    stream = WeightStream(trainer, rollout, bucket_bytes=BUCKET_BYTES)
    before = _flat(trainer.weights()[0])
    model_bytes = sum(v.nbytes for v in before.values())
    norm_bytes = sum(v.nbytes for k, v in before.items() if "norm" in k)  # the generation rules replicate only norms
    largest_leaf = max(v.nbytes for v in before.values())
    assert stream.model_bytes == model_bytes
    for k in range(1, 4):
        trainer.update(k)
        metrics = stream.sync()
        want, got = _flat(trainer.weights()[0]), _flat(rollout.weights()[0])
        assert want.keys() == got.keys() == before.keys()
        for name in want:
            assert not np.array_equal(want[name], before[name]), name  # the trainer changed it
            np.testing.assert_array_equal(bits(got[name]), bits(want[name]), err_msg=name)
        before = want
        sources, targets = stream.reports[:2], stream.reports[2:]
        assert [(r.side, r.process) for r in stream.reports] == [
            ("source", 0),
            ("source", 1),
            ("target", 0),
            ("target", 1),
        ]
        # each rollout device received exactly its shard: every split weight once, the norms on all 4
        assert metrics["weight_sync/bytes"] == model_bytes + 3 * norm_bytes == sum(r.held_bytes for r in targets)
        assert metrics["weight_sync/model_bytes"] == model_bytes
        assert metrics["weight_sync/seconds"] > 0 and metrics["weight_sync/pieces"] == sum(r.pieces for r in sources)
        # no process of either world held the whole model at any point of the sync (its count),
        # nor a piece larger than its own shard; no rollout device holds a whole split weight
        assert metrics["weight_sync/max_process_bytes"] == max(r.peak_bytes for r in stream.reports) < model_bytes
        assert all(r.largest_piece_bytes <= r.largest_shard_bytes for r in sources)
        assert all(r.peak_bytes <= r.held_bytes + BUCKET_BYTES for r in sources)  # its shards and one bucket
        assert all(r.largest_shard_bytes < largest_leaf for r in targets)
        # measured by JAX in each process after the sync: its live arrays are its shards only
        live = trainer.live_bytes([None] * 2) + rollout.live_bytes([None] * 2)
        assert max(live) < model_bytes, (live, model_bytes)
        print(
            f"sync {k}: {metrics['weight_sync/bytes']:.0f} B in {metrics['weight_sync/seconds']:.3f} s, "
            f"{metrics['weight_sync/pieces']:.0f} pieces; per-process peak {[r.peak_bytes for r in stream.reports]} B, "
            f"live {live} B; whole model {model_bytes} B"
        )


def test_a_bf16_generation_copy_is_the_trainers_weights_cast(groups):
    backend, trainer, rollout = groups
    copy = backend.group(
        rollout.processes,
        StreamedWeights,
        name="rollout_bf16",
        cfg=CFG,
        mesh="tp=4",
        rules="generate",
        dtype="bfloat16",
    )
    metrics = WeightStream(trainer, copy).sync()
    want, got = _flat(trainer.weights()[0]), _flat(copy.weights()[0])
    for name in want:
        assert got[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(bits(got[name]), bits(want[name].astype(ml_dtypes.bfloat16)), err_msg=name)
    assert metrics["weight_sync/model_bytes"] == sum(v.nbytes for v in want.values()) // 2


@pytest.mark.parametrize(
    "changed, message",
    [
        (
            dict(num_layers=1),
            r"different trees: only the trainer's has \['model'\]\['layers'\]\[1\]\S+, .* \(\+\d+ more\); "
            r"only the rollout's has nothing",
        ),
        (
            dict(hidden_size=32),
            r"21 of 21 weights differ in shape: \['lm_head'\]\.value is \(64, 256\) in the trainer's world, "
            r"\(32, 256\) in the rollout's, ",
        ),
    ],
)
def test_layouts_that_do_not_match_are_refused(groups, changed, message):
    backend, trainer, rollout = groups
    cfg = dataclasses.replace(CFG, **changed)
    name = f"other_{next(iter(changed))}"
    other = backend.group(rollout.processes, StreamedWeights, name=name, cfg=cfg, mesh="tp=4", rules="generate")
    with pytest.raises(ValueError, match=message):
        WeightStream(trainer, other)
    with pytest.raises(ValueError, match="share one world"):
        WeightStream(rollout, other)


FAULT_S = 10.0  # a fault of a sync is raised within this (the deadlines are 60 s and 120 s)
KILL_S = 3.0  # a kill is raised within this, beyond the backend's watch of the cluster (`LOST_GRACE_S`)


def _assert_bit_exact(source, target) -> None:
    want, got = _flat(source.weights()[0]), _flat(target.weights()[0])
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(bits(got[name]), bits(want[name]), err_msg=name)


RAISED = "test fault: no weights here"


@pytest.mark.parametrize(
    "failing, fault, message",
    [
        ("target", ("raise", RAISED), RAISED),
        ("source", ("raise", RAISED), RAISED),
        (
            "source",
            ("cast", "bfloat16"),
            r"the source's weights are not laid out as when the stream was built: \['lm_head'\]\.value, .* \(\+18 more\) "
            r"changed \(a stream's plan is made for one layout: build a new stream\)",
        ),
    ],
    ids=["target-raises", "source-raises", "source-relaid-out"],
)
def test_a_side_that_raises_stops_the_other_at_once_and_the_stream_goes_on(groups, failing, fault, message):
    """Rank 1 of one side fails as its sync starts: its role raises (``params``), or its
    weights are no longer laid out as the stream's plan (a bf16 cast). The other world's
    processes, waiting for its pieces or acknowledgements, get its error through the transfer
    servers and stop; the driver raises that rank's own error at once, noted with its group and
    rank. Nobody was left waiting: the next sync of the same stream is bit-exact. The roles are
    built in the module's processes (no process started)."""
    backend, trainer, rollout = groups
    name = f"{failing}_{fault[0]}"
    source, target = trainer, None
    if failing == "source":
        source = backend.group(
            trainer.processes, FaultyWeights, name=name, cfg=CFG, mesh="fsdp=4", rules="train", seed=3
        )
    target = backend.group(
        rollout.processes, FaultyWeights, name=f"{name}_target", cfg=CFG, mesh="tp=4", rules="generate"
    )
    stream = WeightStream(source, target, bucket_bytes=BUCKET_BYTES)
    failing_group, other = (source, target) if failing == "source" else (target, source)
    failing_group.arm([None, fault])
    start = time.monotonic()
    with pytest.raises((RuntimeError, ValueError), match=message) as info:
        stream.sync()
    elapsed = time.monotonic() - start
    notes = info.value.__notes__
    name = failing_group.processes.name
    assert notes[0] == f"raised by worker group {name!r} rank 1 during weight stream {stream.key!r}: sync 1"
    # every rank of the other world came back, stopped by the failure
    for rank in range(2):
        assert f"then worker group {other.processes.name!r} rank {rank}: StreamAborted" in notes, notes
    assert elapsed < FAULT_S, elapsed
    print(f"{failing} {fault[0]}: the driver raised after {elapsed:.2f} s")
    stream.sync()
    _assert_bit_exact(source, target)


def _kill_when_held(path, killed: list[float]) -> None:
    """SIGKILLs the process that writes its pid to ``path`` (`FaultyWeights` ``hold``), once
    it does: in the middle of a sync; the time of the kill goes to ``killed``."""
    end = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)
    with open(path) as f:
        pid = int(f.read())
    os.kill(pid, signal.SIGKILL)
    killed.append(time.monotonic())


@pytest.mark.parametrize("victim", ["target", "source"])
def test_a_process_killed_during_a_sync_is_one_error_naming_it(groups, tmp_path, victim, monkeypatch):
    """The victim (a group of 1 process x 2 devices, its own world) is SIGKILLed while the
    sync is under way: its process holds in its role's ``params`` as its sync starts, and the
    other world (the module's 2-process group) is waiting for its pieces or acknowledgements.
    Within seconds the sync raises `WorkerDied` naming the victim's group and rank (no
    deadline passed); every process of the other world came back (its pull failed on the
    closed connection) and it still answers; no process of the victim's group is left. The
    backend's watch for the cluster itself going away after a death (`LOST_GRACE_S`, 5 s, most
    of a run's time to this error; tested in tests/test_ray_backend.py) is cut to 0.5 s here:
    what is measured is the stream's own."""
    monkeypatch.setattr(cluster, "LOST_GRACE_S", 0.5)
    backend, trainer, rollout = groups
    processes = backend.process_group(f"killed_{victim}", 1)
    if victim == "target":
        source = trainer
        target = backend.group(processes, FaultyWeights, name="killed_target", cfg=CFG, mesh="tp=2", rules="generate")
        dying, other = target, source
    else:
        source = backend.group(
            processes, FaultyWeights, name="killed_source", cfg=CFG, mesh="fsdp=2", rules="train", seed=4
        )
        target = backend.group(
            rollout.processes, StreamedWeights, name="target_of_killed", cfg=CFG, mesh="tp=4", rules="generate"
        )
        dying, other = source, target
    stream = WeightStream(source, target, bucket_bytes=BUCKET_BYTES)
    hold, killed = str(tmp_path / "held"), []
    dying.arm([("hold", hold)])
    killer = threading.Thread(target=_kill_when_held, args=(hold, killed))
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(
            WorkerDied,
            match=rf"worker group 'killed_{victim}' rank 0 \(pid {processes.pids[0]}\) died during "
            rf"weight stream '{stream.key}': sync 1",
        ) as info:
            stream.sync()
    finally:
        killer.join()
    raised = time.monotonic()
    assert (info.value.group, info.value.rank) == (f"killed_{victim}", 0)
    for rank in range(2):  # the other world's calls came back: none is left waiting
        assert f"then worker group {other.processes.name!r} rank {rank}: StreamAborted" in info.value.__notes__
    assert raised - killed[0] < 0.5 + KILL_S, (raised - killed[0], killed[0] - start)
    print(f"{victim} killed: the driver raised {raised - killed[0]:.2f} s after the kill")
    assert still_alive(processes.pids) == []
    other.live_bytes([None] * 2)  # the surviving world answers
    with pytest.raises(RuntimeError, match=f"worker group 'killed_{victim}' is stopped"):
        stream.sync()
