"""Weights streamed between two Ray worker groups (`jaxflow.workers.ray.streams.WeightStream`):
a trainer group and a rollout group, each its own `jax.distributed` world of 2 processes x 2
simulated CPU devices, the trainer's weights fsdp=4 under the training rules, the rollout's
tp=4 under the generation rules (every rollout shard is cut from all four training shards,
across both trainer processes). Three syncs, the trainer's weights changed before each: the
rollout's weights equal the trainer's bit for bit every time, and no process (from its own
report, and from JAX's live arrays) ever holds the whole model. A bf16 generation copy is the
cast of the trainer's weights; trees or shapes that differ are refused, naming the leaves."""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxflow.workers.ray import RayBackend, RayConfig, WeightStream
from tests.stream_roles import StreamedWeights
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
        backend.shutdown()


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
