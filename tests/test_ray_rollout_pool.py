"""The Ray backend's rollout pool (`jaxflow.workers.ray.RayRolloutPool`): the actor's
generation on a worker group of its own, fed by a `WeightStream` from the actor's group.

`pool_layout` (no Ray): a run's pool is its last devices as whole hosts, the actor's
generation tp, rules and dtype; what cannot be built is refused with every reason.

One module fixture on this session's Ray instance: grpo_tiny with one layer (`SMALL`),
bfloat16 compute over float32 masters (an accelerator's dtypes: the generation copy is a
cast), the actor's group of 1 process x 2 devices (training fsdp=2 under the hybrid rules,
generation tp=2), and the pool that `RayRolloutPool.from_spec` builds on the run's last 2
devices: 1 process x 2 devices of its own world, tp=2 under the actor's generation rules, in
bfloat16. The pool's role is `tests.stream_roles.FaultyGeneration`: the run's
`GenerationWorker`, which a test can make hold in its sync, and whose weights it reads.

1. Two syncs with a real update (a PPO step) of the actor between them: the pool's weights
   are the actor's training weights cast to bfloat16, bit for bit, each time; the
   StreamReports show the actor's process held its shards plus at most one bucket, the
   pool's its new shards plus one piece in flight, no pool device a whole weight that the
   generation layout splits. (Each group is one process here, whose devices hold the whole
   model between them: that no *process* of a multi-process world ever holds the whole
   model is tests/test_weight_stream_ray.py's, the same stream over 2 + 2 processes.)
2. The pool's ``generate(prompts, step=k)`` equals the actor group's ``generate(prompts,
   step=k)`` on the same weights: the same columns, tokens, masks and uids, the log-probs
   within `LOGP_TOL`.
3. A partial rollout (``trainer.partial_rollout``) parked in the pool's process across a sync
   of the same weights under a new version: the pool's plain ``generate``'s tokens, the
   log-probs within float32 ulps, each token's version the one it was sampled under.
4. The pool's process SIGKILLed in the middle of a sync (issue 23, "a rollouter killed during a
   weight stream"): one `WorkerDied` naming the pool's group within seconds, no process of it
   left, the actor's group unharmed; `RayRolloutPool.restart` then brings a fresh pool,
   bit-exact again.
"""

import dataclasses
import functools
import os
import signal
import threading
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxflow.configs import load_config
from jaxflow.configs.run_spec import describe_run
from jaxflow.data.batch import Batch
from jaxflow.trainer.builders import load_model
from jaxflow.workers.ray import RayBackend, RayConfig, RayRolloutPool, WorkerDied, cluster
from jaxflow.workers.ray.rollout_pool import pool_layout
from tests.cli import still_alive
from tests.stream_roles import FaultyGeneration
from tests.test_placement_invariance import SMALL
from tests.test_weight_sync import bits

OVERRIDES = [
    *SMALL,
    "jaxflow.backend=ray",
    "jaxflow.num_devices=2",
    "jaxflow.ray.devices_per_host=2",
    "jaxflow.placement.type=colocated",
    "jaxflow.mesh.actor.train.tp=1",  # fsdp=2: the pool's tp=2 shards are cut across the actor's
    "jaxflow.mesh.actor.generate.tp=2",
    "data.train_batch_size=4",  # 4 prompts x 4 responses: one on-policy mini-batch
    "actor_rollout_ref.actor.use_kl_loss=False",  # the update needs no reference
    "jaxflow.model.compute_dtype=bfloat16",  # float32 masters, bfloat16 generation: an accelerator's dtypes
]
CONFIG = RayConfig(devices_per_host=2, compile_deadline_s=300, step_deadline_s=120, sync_deadline_s=120)
BUCKET_BYTES = 2**14  # of a ~150 kB model: several buckets, each acknowledged before the next
LOGP_TOL = 0.0  # measured: the pool's tp=2 mesh lays the weights out as the actor's generation mesh does
POOL_DEVICES = 2


def _spec(overrides: list[str] = OVERRIDES):
    """The run's description with a rollout pool of `POOL_DEVICES` (``jaxflow.placement.
    rollout_devices``, the trainer's key, emulated: the placement covers the first 2 of the
    run's 4 devices, the pool the last 2)."""
    spec = describe_run(load_config("grpo_tiny", overrides))
    return dataclasses.replace(spec, num_devices=spec.num_devices + POOL_DEVICES)


def test_a_runs_pool_is_its_last_hosts_in_the_generation_layout():
    spec = _spec()
    layout = pool_layout(spec, POOL_DEVICES, 2)
    assert layout == dict(
        num_hosts=1,
        model=spec.models["actor"].config,
        mesh="dp=-1,tp=2",
        rules=spec.placement.rules("actor", "generate"),
        rollout=spec.rollout,
        dtype="bfloat16",
    )
    masters = _spec([*OVERRIDES, "jaxflow.model.compute_dtype=float32"])
    assert pool_layout(masters, POOL_DEVICES, 1)["dtype"] == "float32"  # not narrower: the masters'
    assert pool_layout(masters, POOL_DEVICES, 1)["num_hosts"] == 2
    with pytest.raises(
        ValueError,
        match=r"^a rollout pool of 3 devices cannot be built: the placement's 2 devices and the pool's 3 are not "
        r"the run's 4; 3 devices are not whole hosts of 2; the generation tp=2 does not divide 3 devices$",
    ):
        pool_layout(spec, 3, 2)


@pytest.fixture(scope="module")
def run(ray_session):
    """The run's description, the backend, the actor's group and the rollout pool."""
    spec = _spec()
    backend = RayBackend(CONFIG)
    try:
        workers = backend.build_workers(
            spec.placement, actor=functools.partial(load_model, spec.models["actor"]), settings=spec.role_settings
        )
        pool = RayRolloutPool.from_spec(
            spec, backend, workers.actor, devices=POOL_DEVICES, bucket_bytes=BUCKET_BYTES, worker_cls=FaultyGeneration
        )
        yield spec, workers.actor, pool
    finally:
        pids = [pid for group in backend.groups.values() for pid in group.pids]
        backend.shutdown()
    assert still_alive(pids) == []


def _prompts(spec, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, spec.models["actor"].config.vocab_size, (spec.train_batch_size, spec.prompt_length))
    mask = np.ones_like(ids)
    mask[0, :3] = 0  # one left-padded prompt
    return Batch({"prompt_ids": ids.astype(np.int32), "prompt_mask": mask.astype(np.int32)})


def _flat(tree) -> dict[str, np.ndarray]:
    """Leaf path -> array, for an ``nnx.State`` (``.value`` leaves) and a pure dict alike."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p).removesuffix(".value"): np.asarray(v) for p, v in leaves}


def _assert_pool_holds_the_actors_weights(actor, pool) -> tuple[dict, dict]:
    """The pool's weights are the actor's training weights cast to the generation dtype, bit
    for bit; returns the actor's (float32 masters) and the pool's."""
    masters, got = _flat(actor.get_train_state()[0].params), _flat(pool.group.weights()[0])
    assert masters.keys() == got.keys()
    for name, master in masters.items():
        assert master.dtype == np.float32 and got[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(bits(got[name]), bits(master.astype(ml_dtypes.bfloat16)), err_msg=name)
    return masters, got


def _update(spec, actor, step: int) -> None:
    """One PPO step of the actor on its own on-policy rollout, with random advantages."""
    rows = actor.generate(_prompts(spec, step), sampling="train", step=step)
    advantages = np.random.default_rng(step).normal(size=rows["response_mask"].shape).astype(np.float32)
    metrics = actor.update(rows.update(tensors={"advantages": advantages}), step=step)
    assert np.isfinite(metrics["actor/pg_loss"]).all()


def test_syncs_are_bit_exact_after_updates(run):
    spec, actor, pool = run
    assert pool.version == -1
    with pytest.raises(RuntimeError, match="rollout pool 'rollout' holds no weights: sync it first"):
        pool.generate(_prompts(spec), step=1)
    before = None
    for version in range(2):
        if version:
            _update(spec, actor, version)
        metrics = pool.sync(version)
        assert pool.version == version
        masters, held = _assert_pool_holds_the_actors_weights(actor, pool)
        if before is not None:
            changed = [name for name in masters if not np.array_equal(masters[name], before[name])]
            assert len(changed) == len(masters), sorted(set(masters) - set(changed))  # the update moved every weight
        before = masters
        model_bytes = sum(v.nbytes for v in held.values())  # one copy in bfloat16
        largest_leaf = max(v.nbytes for v in held.values())
        assert set(metrics) == {"weight_sync/bytes", "timing_s/weight_sync"}
        (source,), (target,) = pool.stream.reports[:1], pool.stream.reports[1:]
        # the pool's devices received exactly their shards (the norms, replicated, on both)
        assert metrics["weight_sync/bytes"] == target.held_bytes == source.bytes > model_bytes
        assert pool.last_sync["weight_sync/model_bytes"] == model_bytes
        assert source.peak_bytes <= source.held_bytes + BUCKET_BYTES  # its shards and one bucket
        assert source.largest_piece_bytes <= source.largest_shard_bytes
        assert target.peak_bytes <= target.held_bytes + target.largest_piece_bytes  # its shards, one piece in flight
        assert target.largest_shard_bytes < largest_leaf  # no pool device holds a split weight whole
        print(
            f"sync {version}: {metrics['weight_sync/bytes']:.0f} B in {metrics['timing_s/weight_sync']:.3f} s "
            f"({pool.last_sync['weight_sync/pieces']:.0f} pieces); actor process held {source.held_bytes} B, "
            f"peak {source.peak_bytes} B; pool process held {target.held_bytes} B, peak {target.peak_bytes} B; "
            f"whole model {model_bytes} B in bfloat16"
        )


def test_the_pool_generates_what_the_actor_generates(run):
    spec, actor, pool = run
    pool.sync(7)
    _assert_pool_holds_the_actors_weights(actor, pool)
    prompts = _prompts(spec, seed=1)
    want = actor.generate(prompts, sampling="train", step=7)
    got = pool.generate(prompts, step=7)
    assert sorted(got.tensors) == sorted(want.tensors) and got.non_tensors.keys() == want.non_tensors.keys()
    assert got.meta == want.meta
    for key in want.tensors:
        if key != "rollout_log_probs":
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)
    assert list(got.non_tensors["uid"]) == list(want.non_tensors["uid"])
    mask = np.asarray(want["response_mask"]) > 0
    difference = np.abs(np.asarray(got["rollout_log_probs"]) - np.asarray(want["rollout_log_probs"]))[mask]
    print(f"rollout log-probs: largest difference {difference.max():.3g} over {mask.sum()} tokens")
    assert difference.max() <= LOGP_TOL
    assert set(pool.generation_seconds()) == {"reshard", "engine", "post"}
    assert pool.rollout_metrics() == {}  # single-turn, no probe


SEGMENT = 2  # tokens per row before the sync that interrupts the partial rollout
ULPS = 64  # tests/test_partial_rollouts.py: re-prefilled keys and values vs the decode steps' (float32 ulps)


def test_a_partial_rollout_is_parked_in_the_pool_across_a_sync(run):
    """``trainer.partial_rollout`` on Ray: a partial rollout of step 9 runs one segment of
    `SEGMENT` tokens per row under version 9, stays parked in the pool's process (holding no
    weights) across a sync of the same weights as version 10, and runs to its end: the tokens
    are the pool's plain ``generate(prompts, step=9)``'s, the log-probs within `ULPS` float32
    ulps, the first `SEGMENT` tokens of each row record version 9 and the rest version 10."""
    spec, actor, pool = run
    pool.sync(9)
    prompts = _prompts(spec, seed=2)
    want = pool.generate(prompts, step=9)
    handle = pool.start_partial(prompts, step=9, version=9)
    handle = pool.run_partial(handle, 9, max_steps=SEGMENT, until=lambda: False)
    assert (handle.step, handle.version, handle.done) == (9, 9, False)
    assert pool.group.partial_parked() == [{9: False}]  # parked, holding no weights
    pool.sync(10)  # the same weights, a new version: the stream frees the old copy
    _assert_pool_holds_the_actors_weights(actor, pool)
    assert pool.run_partial(handle, 10, max_steps=SEGMENT, until=lambda: True) is handle  # a sync waits: no segment
    while not handle.done:
        handle = pool.run_partial(handle, 10, max_steps=None)
    got = pool.finish_partial(handle)
    assert pool.group.partial_parked() == [{}]
    assert sorted(got.tensors) == sorted([*want.tensors, "token_versions"]) and got.meta == want.meta
    for key in want.tensors:
        if key != "rollout_log_probs":
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)
    assert list(got.non_tensors["uid"]) == list(want.non_tensors["uid"])
    mask = np.asarray(want["response_mask"]) > 0
    difference = np.abs(np.asarray(got["rollout_log_probs"]) - np.asarray(want["rollout_log_probs"]))[mask]
    print(f"partial rollout log-probs: largest difference {difference.max():.3g} over {mask.sum()} tokens")
    np.testing.assert_allclose(
        np.asarray(got["rollout_log_probs"]), np.asarray(want["rollout_log_probs"]), rtol=ULPS * 2.0**-23, atol=0
    )
    versions = np.where(np.arange(mask.shape[1]) < SEGMENT, 9, 10)[None, :]
    np.testing.assert_array_equal(np.where(mask, np.asarray(got["token_versions"]), -1), np.where(mask, versions, -1))
    assert (mask.sum(1) > SEGMENT).any()  # some rows went on under version 10


def _kill_when_held(path, killed: list[float]) -> None:
    """SIGKILLs the process that writes its pid to ``path`` (`ArmedParams` ``hold``), once it
    does: in the middle of a sync; the time of the kill goes to ``killed``."""
    end = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)
    with open(path) as f:
        pid = int(f.read())
    os.kill(pid, signal.SIGKILL)
    killed.append(time.monotonic())


KILL_S = 3.0  # a kill is raised within this, beyond the backend's watch of the cluster (`LOST_GRACE_S`)


def test_a_pool_killed_during_a_sync_is_one_error_and_restarts(run, tmp_path, monkeypatch):
    """The pool's process holds in its sync (its first read of its weights, while the actor's
    process waits for its acknowledgements) and is SIGKILLed there. The sync raises one
    `WorkerDied` naming the pool's group within seconds of the kill: the backend's watch that
    the cluster itself is still there (`LOST_GRACE_S`, 5 s by default, most of a run's time to
    this error) is cut to 0.5 s, so what is measured is the stream's own. No process of the
    pool is left; the actor's group still answers; the pool refuses to generate until
    `RayRolloutPool.restart` (a fresh group, stream and sync), after which it is bit-exact."""
    monkeypatch.setattr(cluster, "LOST_GRACE_S", 0.5)
    spec, actor, pool = run
    pids = pool.group.processes.pids
    hold, killed = str(tmp_path / "held"), []
    pool.group.arm([("hold", hold)])
    killer = threading.Thread(target=_kill_when_held, args=(hold, killed))
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(
            WorkerDied,
            match=rf"worker group 'rollout' rank 0 \(pid {pids[0]}\) died during weight stream 'actor->rollout': "
            rf"sync {pool.stream.syncs + 1}",
        ) as info:
            pool.sync(8)
    finally:
        killer.join()
    raised = time.monotonic()
    assert (info.value.group, info.value.rank) == (pool.name, 0)
    assert "then worker group 'global' rank 0: StreamAborted" in info.value.__notes__  # the actor came back
    assert raised - killed[0] < 0.5 + KILL_S and raised - start < 60, (raised - killed[0], killed[0] - start)
    print(f"pool killed: the driver raised {raised - killed[0]:.2f} s after the kill")
    assert still_alive(pids) == []
    assert pool.version == -1
    with pytest.raises(RuntimeError, match="holds no weights"):
        pool.generate(_prompts(spec), step=8)
    assert actor.params_finite() == [True]  # the actor's group answers
    t0 = time.monotonic()
    metrics = pool.restart(8)
    print(f"restart and sync: {time.monotonic() - t0:.1f} s, {metrics['weight_sync/bytes']:.0f} B")
    assert pool.version == 8 and pool.group.processes.pids != pids
    _assert_pool_holds_the_actors_weights(actor, pool)
