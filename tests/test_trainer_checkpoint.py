"""Training checkpoints: sharded round trips on the 8-device mesh, retention, resume modes,
interrupted saves, clear errors, one writer per directory."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflow.models as models
from jaxflow.mesh import TRAIN_RULES, state_shardings
from jaxflow.trainer import CheckpointManager, CheckpointMismatchError, DamagedCheckpointError, HostState, is_complete
from jaxflow.trainer.checkpoint import MARKER, SKIP, decode_json, encode_json
from jaxflow.trainer.outputs import RunDirInUseError

REPO = Path(__file__).resolve().parents[1]


def _is_var(x):
    return isinstance(x, nnx.Variable)


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama with random weights, built without compiling an initialiser."""
    cfg = models.get_preset("tiny_llama")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.init_model(cfg)))
    rng = np.random.default_rng(0)
    # host (numpy) values: placing them on a mesh is a plain transfer, no per-array compile
    state = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), abstract)
    return cfg, graphdef, abstract, state


def _targets(abstract_state, mesh):
    shardings = state_shardings(abstract_state, TRAIN_RULES, mesh)
    return jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=s)),
        abstract_state,
        shardings,
        is_leaf=_is_var,
    )


def _small(step: int = 0):
    """A small sharded params tree (two meshes' worth of layouts) and its adamw state."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "fsdp"))
    w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + step
    params = {
        "w": jax.device_put(w, NamedSharding(mesh, P("fsdp", "dp"))),
        "b": jax.device_put(np.full((16,), step, jnp.bfloat16), NamedSharding(mesh, P())),
    }
    return params, optax.adamw(1e-3).init(params)


def _abstract(tree, sharding_fn):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), tree)


def _assert_bit_exact(restored, expected):
    r_leaves, r_def = jax.tree.flatten(restored)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert r_def == e_def
    for r, e in zip(r_leaves, e_leaves):
        assert r.dtype == e.dtype
        np.testing.assert_array_equal(
            np.asarray(jax.device_get(r)).reshape(-1).view(np.uint8),
            np.asarray(jax.device_get(e)).reshape(-1).view(np.uint8),
        )


def test_sharded_round_trip_restores_into_target_shardings(tmp_path, tiny):
    cfg, graphdef, abstract, state = tiny
    mesh_a = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    mesh_b = Mesh(np.array(jax.devices())[::-1].reshape(8, 1), ("fsdp", "tp"))
    actor = jax.device_put(state, state_shardings(state, TRAIN_RULES, mesh_a))
    opt_tx = optax.adam(1e-3)
    pure = jax.tree.map(lambda v: v.get_value(), actor, is_leaf=_is_var)
    # an adam state with non-zero moments, built on the host (no per-shape compiles)
    opt_state = (
        optax.ScaleByAdamState(
            count=jnp.asarray(3, jnp.int32),
            mu=jax.tree.map(lambda x: jax.device_put(np.asarray(x) * 0.5, x.sharding), pure),
            nu=jax.tree.map(lambda x: jax.device_put(np.asarray(x) ** 2, x.sharding), pure),
        ),
        optax.EmptyState(),
    )
    assert jax.tree.structure(opt_state) == jax.tree.structure(jax.eval_shape(opt_tx.init, pure))
    critic, critic_opt = _small(1)
    gen = np.random.default_rng(7)
    gen.standard_normal(3)
    legacy = np.random.RandomState(3)
    host = HostState(
        data_loader={"epoch": 2, "index": 17, "order_seed": 5},
        rng={
            "key": jax.random.key(42),
            "raw": jax.random.PRNGKey(1),
            "np": gen.bit_generator.state,
            "legacy": legacy.get_state(),
        },
        extra={"kl_coef": 0.0123},
        metrics_tail=[{"step": 9, "actor/pg_loss": -0.5}, {"step": 10, "actor/pg_loss": float("nan")}],
    )
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(
            10,
            {
                "actor_params": actor,
                "actor_opt_state": opt_state,
                "critic_params": critic,
                "critic_opt_state": critic_opt,
            },
            host,
        )
        assert ckpt.latest_step() == 10 and is_complete(ckpt.step_dir(10))

    # A fresh manager (new process in real life) restores onto a different mesh layout.
    targets_actor = _targets(abstract, mesh_b)
    opt_target = jax.eval_shape(opt_tx.init, jax.tree.map(lambda v: v.get_value(), targets_actor, is_leaf=_is_var))
    opt_target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh_b, P())), opt_target
    )
    critic_target = _abstract(critic, lambda x: NamedSharding(mesh_b, P(("fsdp", "tp")) if x.ndim else P()))
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        r = ckpt.restore(
            targets={"actor_params": targets_actor, "actor_opt_state": opt_target, "critic_params": critic_target}
        )
    assert r.step == 10 and set(r.arrays) == {"actor_params", "actor_opt_state", "critic_params"}
    restored = r.arrays["actor_params"]
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(targets_actor)):
        assert got.sharding == want.sharding
        # every device holds its own shard only
        assert {s.data.shape for s in got.addressable_shards} == {want.sharding.shard_shape(want.shape)}
    assert jax.tree.leaves(restored)[0].sharding.mesh.devices.size == 8
    _assert_bit_exact(restored, actor)
    _assert_bit_exact(r.arrays["actor_opt_state"], opt_state)
    _assert_bit_exact(r.arrays["critic_params"], critic)
    assert r.arrays["critic_params"]["w"].sharding.spec == P(("fsdp", "tp"))
    assert r.arrays["critic_params"]["b"].dtype == jnp.bfloat16
    # the model rebuilt from the restored state runs on the new layout
    model = nnx.merge(graphdef, restored)
    assert model.cfg == cfg

    h = r.host
    assert h.data_loader == {"epoch": 2, "index": 17, "order_seed": 5}
    assert h.extra["kl_coef"] == 0.0123
    assert h.metrics_tail[0] == {"step": 9, "actor/pg_loss": -0.5} and np.isnan(h.metrics_tail[1]["actor/pg_loss"])
    key = h.rng["key"]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(42)))
    np.testing.assert_array_equal(h.rng["raw"], jax.random.PRNGKey(1))
    resumed = np.random.default_rng()
    resumed.bit_generator.state = h.rng["np"]
    np.testing.assert_array_equal(resumed.standard_normal(4), gen.standard_normal(4))
    legacy2 = np.random.RandomState()
    legacy2.set_state(h.rng["legacy"])
    np.testing.assert_array_equal(legacy2.rand(3), legacy.rand(3))


def test_host_json_encoding_round_trips_and_rejects_objects():
    key = jax.random.key(3, impl="rbg")
    back = decode_json(
        encode_json({"k": key, "t": (1, "a"), "a": np.arange(6, dtype=np.int16).reshape(2, 3), "s": np.float32(1.5)})
    )
    assert str(jax.random.key_impl(back["k"])) == str(jax.random.key_impl(key))
    np.testing.assert_array_equal(jax.random.key_data(back["k"]), jax.random.key_data(key))
    assert back["t"] == (1, "a") and back["s"] == 1.5
    assert back["a"].dtype == np.int16 and back["a"].shape == (2, 3)
    with pytest.raises(TypeError, match="not JSON-able"):
        encode_json({"f": object()})


def test_interval_max_to_keep_and_async(tmp_path):
    params, opt = _small()
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2, async_save=True) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.save(s, {"p": params, "o": opt}, force=(s == 7))]
        ckpt.wait()
        assert saved == [2, 4, 6, 7]
        assert ckpt.all_steps() == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_6", "step_7"]


def test_resume_modes(tmp_path):
    params, _ = _small()
    target = {"p": _abstract(params, lambda x: x.sharding)}
    with CheckpointManager(tmp_path / "run") as ckpt:
        assert ckpt.resume(target) is None  # nothing there yet
        for s in (3, 5):
            ckpt.save(s, {"p": _small(s)[0]}, HostState(data_loader={"i": s}))

    with CheckpointManager(tmp_path / "run", resume_mode="auto") as ckpt:
        r = ckpt.resume(target)
        assert r.step == 5 and r.host.data_loader == {"i": 5}
        _assert_bit_exact(r.arrays["p"], _small(5)[0])

    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(FileExistsError, match=r"already holds checkpoints \(steps \[3, 5\]\); nothing was deleted"):
        CheckpointManager(tmp_path / "run", resume_mode="disable")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before

    # resume_path: a given step dir; later saves go to the manager's own directory
    with CheckpointManager(
        tmp_path / "branch", resume_mode="resume_path", resume_path=tmp_path / "run" / "step_3"
    ) as ckpt:
        r = ckpt.resume(target)
        assert r.step == 3 and r.path == (tmp_path / "run" / "step_3").absolute()
        ckpt.save(4, {"p": params})
        assert ckpt.all_steps() == [4]
    with pytest.raises(FileNotFoundError, match="resume_path .*step_9 does not exist"):
        CheckpointManager(tmp_path / "x", resume_mode="resume_path", resume_path=tmp_path / "run" / "step_9").resume(
            target
        )

    # resuming from step 3 inside the same directory: saving step 4 moves the abandoned step 5
    # aside, intact (never deleted)
    with CheckpointManager(
        tmp_path / "run", resume_mode="resume_path", resume_path=tmp_path / "run" / "step_3"
    ) as ckpt:
        assert ckpt.resume(target).step == 3
        ckpt.save(4, {"p": params})
        assert ckpt.all_steps() == [3, 4]
    (abandoned,) = (tmp_path / "run").glob("step_5.abandoned-*")
    assert not (tmp_path / "run" / "step_5").exists() and (abandoned / MARKER).is_file()
    (tmp_path / "restored").mkdir()
    os.rename(abandoned, tmp_path / "restored" / "step_5")  # what a user does to get it back
    r = CheckpointManager(tmp_path / "restored", read_only=True).restore(targets=target)
    assert r.step == 5
    _assert_bit_exact(r.arrays["p"], _small(5)[0])


_KILLED_SAVE = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from jaxflow.trainer import CheckpointManager, HostState

    ckpt = CheckpointManager(sys.argv[1])
    ckpt.save(1, {"p": {"w": jnp.arange(1000.0)}}, HostState(data_loader={"i": 1}))

    async def hang(self):  # every item is written; killed before the step is committed
        print("WRITING", flush=True)
        time.sleep(600)
    atomicity.AtomicRenameTemporaryPath.finalize = hang
    ckpt.save(2, {"p": {"w": jnp.arange(1000.0) + 1}}, HostState(data_loader={"i": 2}))
""")


def test_save_killed_mid_write_leaves_previous_checkpoint_usable(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", "the save did not reach the commit point"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("step_2")]
    assert leftovers and all(".orbax-checkpoint-tmp" in n for n in leftovers), leftovers

    target = {"p": {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}}
    reader = CheckpointManager(tmp_path, read_only=True)
    assert reader.all_steps() == [1] and reader.resume_dir() == reader.step_dir(1)
    with CheckpointManager(tmp_path) as ckpt:  # a writer cleans the debris up
        assert not any(p.name.startswith("step_2") for p in tmp_path.iterdir())
        r = ckpt.resume(target)
        assert r.step == 1 and r.host.data_loader == {"i": 1}
        np.testing.assert_array_equal(r.arrays["p"]["w"], np.arange(1000.0))
        assert ckpt.save(2, {"p": {"w": jnp.arange(1000.0) + 1}})
        assert ckpt.all_steps() == [1, 2]


def test_step_without_commit_marker_is_ignored(tmp_path):
    """Killed after orbax renamed the step but before the marker (or a non-atomic copy)."""
    params, _ = _small()
    target = {"p": _abstract(params, lambda x: x.sharding)}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, {"p": _small(1)[0]})
        ckpt.save(2, {"p": _small(2)[0]})
    (tmp_path / "step_2" / MARKER).unlink()
    assert CheckpointManager(tmp_path, read_only=True).latest_step() == 1
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        CheckpointManager(tmp_path, read_only=True).restore(2, targets=target)
    with pytest.raises(FileNotFoundError, match="no .*jaxflow_checkpoint.json"):
        CheckpointManager(
            tmp_path / "other", resume_mode="resume_path", resume_path=tmp_path / "step_2", read_only=True
        ).resume(target)
    with CheckpointManager(tmp_path, max_to_keep=1) as ckpt:
        assert not (tmp_path / "step_2").exists()
        r = ckpt.resume(target)
        assert r.step == 1
        _assert_bit_exact(r.arrays["p"], _small(1)[0])
        ckpt.save(2, {"p": _small(2)[0]})
        assert ckpt.all_steps() == [2]  # max_to_keep=1 removed step 1 only after 2 was complete


def test_mismatched_targets_name_the_key_and_shapes(tmp_path):
    params, opt = _small()
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, {"p": params, "o": opt})
        bad_shape = {"p": {"w": jax.ShapeDtypeStruct((64, 8), jnp.float32), "b": params["b"]}}
        with pytest.raises(
            CheckpointMismatchError,
            match=r"'p' key 'w' has shape \(64, 16\) in the checkpoint "
            r"but the target expects \(64, 8\)",
        ):
            ckpt.restore(targets=bad_shape)
        with pytest.raises(CheckpointMismatchError, match="key 'b' .* that the restore target lacks"):
            ckpt.restore(targets={"p": {"w": params["w"]}})
        with pytest.raises(CheckpointMismatchError, match="key 'extra' .* that the checkpoint lacks"):
            ckpt.restore(targets={"p": {**params, "extra": jax.ShapeDtypeStruct((2,), jnp.float32)}})
        with pytest.raises(CheckpointMismatchError, match=r"no item 'critic_params' \(has \['o', 'p'\]\)"):
            ckpt.restore(targets={"critic_params": params})
        with pytest.raises(FileNotFoundError, match="no checkpoint for step 7"):
            ckpt.restore(7, targets={"p": params})


def test_one_writer_per_directory_and_skipped_leaves_are_not_read(tmp_path):
    params, opt = _small()
    with CheckpointManager(tmp_path, max_to_keep=1) as ckpt:
        ckpt.save(1, {"p": params, "o": opt, "s": {"params": params, "opt": opt}})
        # Another run's save in progress: a second writer is refused before its start-up clean-up
        # could take it for debris; readers are welcome.
        in_progress = tmp_path / "step_2.orbax-checkpoint-tmp-1234"
        in_progress.mkdir()
        busy = rf"{tmp_path} is in use by another jaxflow run \(pid {os.getpid()}\)"
        with pytest.raises(RunDirInUseError, match=busy):
            CheckpointManager(tmp_path)
        assert in_progress.is_dir()
        assert CheckpointManager(tmp_path, read_only=True).all_steps() == [1]
        # Only the parameters: the optimizer state's leaves are SKIP, left unread (a whole item, or
        # part of one).
        skip_opt = jax.tree.map(lambda _: SKIP, opt)
        r = ckpt.restore(targets={"p": params, "o": skip_opt, "s": {"params": params, "opt": skip_opt}})
        _assert_bit_exact(r.arrays["p"], params)
        _assert_bit_exact(r.arrays["s"]["params"], params)
        for skipped in (r.arrays["o"], r.arrays["s"]["opt"]):
            assert jax.tree.leaves(skipped) and all(x is SKIP for x in jax.tree.leaves(skipped))
    with CheckpointManager(tmp_path) as ckpt:  # closed: the directory is free again
        assert ckpt.all_steps() == [1] and not in_progress.exists()


def test_train_state_round_trips(tmp_path, tiny):
    """The trainer's own object: a TrainState (dataclass node) holding an nnx.State with the
    integer keys of unrolled layers and a chained optax state."""
    from jaxflow.workers import OptimConfig, create_train_state, make_optimizer

    _, _, _, state = tiny
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    tx, _ = make_optimizer(OptimConfig(lr=1e-3))
    train_state, _ = create_train_state(state, state_shardings(state, TRAIN_RULES, mesh), tx, mesh)
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, {"actor": train_state})
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), train_state)
        restored = ckpt.restore(targets={"actor": target})
    _assert_bit_exact(restored.arrays["actor"], train_state)
    for r, e in zip(jax.tree.leaves(restored.arrays["actor"]), jax.tree.leaves(train_state)):
        assert r.sharding == e.sharding


def test_damaged_newest_checkpoint_falls_back_in_one_line(tmp_path, caplog):
    params, _ = _small()
    target = {"p": _abstract(params, lambda x: x.sharding)}
    with CheckpointManager(tmp_path) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, {"p": _small(s)[0]}, HostState(data_loader={"i": s}))
    # step 3: its host file truncated; step 2: its array data files truncated
    host = tmp_path / "step_3" / "host" / "metadata"
    host.write_bytes(host.read_bytes()[:10])
    for data in (p for p in (tmp_path / "step_2" / "p").rglob("*") if p.is_file() and p.parent.name == "d"):
        data.write_bytes(data.read_bytes()[:20])  # the array data files

    with pytest.raises(
        DamagedCheckpointError,
        match=r"step_3 is damaged: item 'host' cannot be read .*; resume from "
        r"an earlier step",
    ) as e:
        CheckpointManager(tmp_path, resume_mode="resume_path", resume_path=tmp_path / "step_3", read_only=True).resume(
            target
        )
    assert "\n" not in str(e.value)

    with caplog.at_level(logging.WARNING, logger="jaxflow.trainer.checkpoint"):
        with CheckpointManager(tmp_path, resume_mode="auto") as ckpt:
            r = ckpt.resume(target)
    assert r.step == 1 and r.host.data_loader == {"i": 1}
    _assert_bit_exact(r.arrays["p"], _small(1)[0])
    warnings = [
        rec.getMessage()
        for rec in caplog.records
        if rec.name == "jaxflow.trainer.checkpoint" and rec.levelno >= logging.WARNING
    ]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert "step 3 (item 'host'" in warnings[0] and "step 2 (item 'p'" in warnings[1]
    names = sorted(p.name.split("-")[0] for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert names == ["step_1", "step_2.damaged", "step_3.damaged"]  # moved aside, not deleted
