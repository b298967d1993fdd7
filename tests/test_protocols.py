"""Transfer protocols: dispatch/collect per rank, the single-program path, the registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.data.batch import Batch, assert_batch_equal
from jaxflow.workers import LocalWorkerGroup
from jaxflow.workers import protocols as proto
from jaxflow.workers.protocols import (
    ALL_TO_ALL,
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    ONE_TO_ALL,
    Dispatched,
    WorkerGroupInfo,
    call_spmd,
    dispatch_method,
    get_protocol,
    method_protocol,
    pad_for_dp,
    reduce_metrics,
    register,
    register_protocol,
    unpad,
)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))


def make(n, seed=0):
    rng = np.random.default_rng(seed)
    return Batch.from_dict(
        tensors={"responses": rng.integers(-50, 50, size=(n, 6)).astype(np.int32)},
        non_tensors={"uid": [f"p{i}" for i in range(n)]},
        meta={"step": 1},
    )


# ------------------------------------------------------------- group info
def test_worker_group_info_defaults_and_validation():
    info = WorkerGroupInfo(world_size=8, dp_size=4)
    assert info.dp_rank_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert info.collect_ranks == (0, 2, 4, 6)
    custom = WorkerGroupInfo(world_size=4, dp_size=2, dp_rank_of=(0, 1, 0, 1), collect_ranks=(2, 3))
    assert custom.collect_ranks == (2, 3)
    with pytest.raises(ValueError, match="not a multiple of dp_size"):
        WorkerGroupInfo(world_size=6, dp_size=4)
    with pytest.raises(ValueError, match="every shard"):
        WorkerGroupInfo(world_size=4, dp_size=2, dp_rank_of=(0, 0, 0, 0))
    with pytest.raises(ValueError, match="collect_ranks"):
        WorkerGroupInfo(world_size=4, dp_size=2, dp_rank_of=(0, 1, 0, 1), collect_ranks=(1, 3))


def test_from_mesh_shards_match_named_sharding(mesh):
    info = WorkerGroupInfo.from_mesh(mesh, ["dp"])
    assert (info.world_size, info.dp_size) == (8, 4)
    assert info.dp_rank_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert WorkerGroupInfo.from_mesh(mesh, ["tp"]).dp_rank_of == (0, 1) * 4
    assert WorkerGroupInfo.from_mesh(mesh, []).dp_size == 1
    with pytest.raises(ValueError, match="not mesh axes"):
        WorkerGroupInfo.from_mesh(mesh, ["fsdp"])

    # Rank r is mesh.devices.flat[r]; the rows NamedSharding puts on that device are exactly
    # the chunk that the per-rank split gives rank r, for any choice/order of dp axes.
    b = make(8)
    mesh_t = Mesh(np.array(jax.devices()).reshape(2, 4), ("tp", "dp"))
    for m, axes in [(mesh, ("dp",)), (mesh, ("dp", "tp")), (mesh, ("tp", "dp")), (mesh_t, ("dp",))]:
        info = WorkerGroupInfo.from_mesh(m, axes)
        chunks = b.chunk(info.dp_size)
        x = jax.device_put(b["responses"], NamedSharding(m, P(axes)))
        on_device = {s.device: np.asarray(s.data) for s in x.addressable_shards}
        for r, dev in enumerate(m.devices.flat):
            np.testing.assert_array_equal(on_device[dev], chunks[info.dp_rank_of[r]]["responses"])


# ------------------------------------------------------------- registry
def test_registry_and_decorator():
    for name in (ONE_TO_ALL, DP_COMPUTE, DP_COMPUTE_METRIC, ALL_TO_ALL):
        assert get_protocol(name).name == name
    with pytest.raises(KeyError, match=r"protocol 'dp_compte'; registered: \[.*'dp_compute'"):
        get_protocol("dp_compte")
    with pytest.raises(ValueError, match="already registered"):
        register_protocol(DP_COMPUTE, lambda *a: [], lambda *a: None)
    with pytest.raises(KeyError, match="unknown protocol"):
        register("nope")

    class Worker:
        @register(DP_COMPUTE)
        def log_probs(self, batch):
            return batch

        @register(get_protocol(ONE_TO_ALL))
        def init_model(self):
            return "ok"

        def plain(self):
            pass

    w = Worker()
    assert method_protocol(w.log_probs) is get_protocol(DP_COMPUTE)
    assert method_protocol(Worker.init_model).name == ONE_TO_ALL
    assert method_protocol(w.plain) is None
    assert w.init_model() == "ok"  # the decorator does not wrap


# ------------------------------------------------------------- one-to-all
def test_one_to_all():
    info = WorkerGroupInfo(world_size=4, dp_size=2)
    b = make(3)
    seen = []

    def fn(batch, scale, *, tag):
        seen.append((batch, scale, tag))
        return len(seen)

    out = dispatch_method(info, ONE_TO_ALL, fn, b, 2.0, tag="x")
    assert out == [1, 2, 3, 4]
    assert all(s[0] is b and s[1] == 2.0 and s[2] == "x" for s in seen)
    assert call_spmd(info, ONE_TO_ALL, fn, b, 3.0, tag="y") == [5]


# ------------------------------------------------------------- dp compute
def test_dp_compute_split_pad_and_collect():
    info = WorkerGroupInfo(world_size=8, dp_size=4)
    b = make(10)
    extra = make(10, seed=1).rename({"responses": "values", "uid": "uid2"})
    calls = []

    def fn(batch, scale, *, other):
        calls.append((batch, scale, other))
        if len(calls) % 2 == 0:  # not a collect rank: its output must be ignored
            return Batch(tensors={"out": np.full(len(batch), -999, np.int32)}, meta={"step": 1})
        out = batch["responses"].sum(axis=1) * scale + other["values"][:, 0]
        return Batch.from_dict(tensors={"out": out}, non_tensors={"uid": batch["uid"]}, meta=batch.meta)

    result = dispatch_method(info, DP_COMPUTE, fn, b, 3, other=extra)
    # 10 rows padded to 12 (rows 0, 1 repeated), 3 per shard; ranks 2d and 2d+1 read shard d.
    padded_rows = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1])
    for r, (batch, scale, other) in enumerate(calls):
        rows = padded_rows[3 * (r // 2) : 3 * (r // 2) + 3]
        np.testing.assert_array_equal(batch["responses"], b["responses"][rows])
        np.testing.assert_array_equal(other["values"], extra["values"][rows])
        assert scale == 3
    expected = b["responses"].sum(axis=1) * 3 + extra["values"][:, 0]
    assert len(result) == 10
    np.testing.assert_array_equal(result["out"], expected)
    assert list(result["uid"]) == list(b["uid"]) and result.meta == {"step": 1}


def test_dp_compute_errors():
    info = WorkerGroupInfo(world_size=2, dp_size=2)
    with pytest.raises(TypeError, match="at least one Batch argument"):
        dispatch_method(info, DP_COMPUTE, lambda x: x, 3)
    with pytest.raises(ValueError, match="differ in size"):
        dispatch_method(info, DP_COMPUTE, lambda a, b: a, make(4), make(6))
    with pytest.raises(TypeError, match=r"rank 0 \(shard 0\) returned dict"):
        dispatch_method(info, DP_COMPUTE, lambda a: {"x": 1}, make(4))
    assert dispatch_method(info, DP_COMPUTE, lambda a: None, make(4)) is None


def test_dp_compute_shard_multiple():
    info = WorkerGroupInfo(world_size=2, dp_size=2, shard_multiple=4)
    b = make(10)
    sizes = []

    def fn(batch):
        sizes.append(len(batch))
        return batch.select(tensor_keys=["responses"], non_tensor_keys=[])

    out = dispatch_method(info, DP_COMPUTE, fn, b)
    assert sizes == [8, 8]  # 10 -> 16 rows, 8 per shard (a multiple of 4)
    np.testing.assert_array_equal(out["responses"], b["responses"])


@pytest.mark.parametrize("n", [10, 8, 3])
def test_per_rank_split_equals_whole_batch_spmd(mesh, n):
    """Local backend: one jitted program on the padded batch sharded over dp, then unpad,
    equals the per-rank split -> compute -> concat -> unpad path (row-wise function)."""
    info = WorkerGroupInfo.from_mesh(mesh, ["dp"])
    b = make(n)
    expected = b["responses"].sum(axis=1)  # exact: int32

    @jax.jit
    def row_sums(responses_BxL):
        return responses_BxL.sum(axis=1), responses_BxL * 2

    def per_rank(batch):
        s, d = row_sums(batch["responses"])
        return Batch(tensors={"row_sum": s, "doubled": d})

    shardings = NamedSharding(mesh, P("dp"))
    placed = {}

    def whole(batch):
        batch = batch.to_device(shardings)
        s, d = row_sums(batch["responses"])
        placed["spec"] = s.sharding.spec
        placed["shards"] = {sh.data.shape for sh in s.addressable_shards}
        return Batch(tensors={"row_sum": s, "doubled": d})

    split = dispatch_method(info, DP_COMPUTE, per_rank, b)
    spmd = call_spmd(info, DP_COMPUTE, whole, b)
    padded, pad = pad_for_dp(b, info.dp_size)
    manual = unpad(whole(padded), pad)

    assert pad == (-n) % 4
    assert placed["spec"] == P("dp")
    assert placed["shards"] == {(len(padded) // 4,)}
    for out in (split, spmd, manual):
        assert len(out) == n
        np.testing.assert_array_equal(np.asarray(out["row_sum"]), expected)
        np.testing.assert_array_equal(np.asarray(out["doubled"]), b["responses"] * 2)
    assert_batch_equal(split.to_host(), spmd.to_host())


def test_unpad_structures():
    x = np.arange(5)
    assert unpad(x, 0) is x
    np.testing.assert_array_equal(unpad(jnp.arange(5), 2), np.arange(3))
    out = unpad({"a": (np.arange(4), [np.arange(4)]), "b": None}, 1)
    np.testing.assert_array_equal(out["a"][1][0], np.arange(3))
    assert out["b"] is None
    with pytest.raises(TypeError, match="str"):
        unpad("abc", 1)


# ------------------------------------------------------------- dp metrics
def test_dp_compute_metric_and_reduce():
    info = WorkerGroupInfo(world_size=4, dp_size=2)
    b = make(6)  # 3 rows per shard, no padding

    def fn(batch):
        mean_sum = float(batch["responses"].sum(axis=1).mean())
        return {"mean_sum": mean_sum, "per_mb": [1.0, len(batch)]}

    metrics = dispatch_method(info, DP_COMPUTE_METRIC, fn, b)
    sums = b["responses"].sum(axis=1)
    assert metrics == [
        {"mean_sum": float(sums[:3].mean()), "per_mb": [1.0, 3]},
        {"mean_sum": float(sums[3:].mean()), "per_mb": [1.0, 3]},
    ]
    reduced = reduce_metrics(metrics)
    assert reduced == {"mean_sum": np.mean([sums[:3].mean(), sums[3:].mean()]), "per_mb": 2.0}
    whole = call_spmd(info, DP_COMPUTE_METRIC, fn, b)
    assert whole == [{"mean_sum": float(sums.mean()), "per_mb": [1.0, 6]}]
    assert reduce_metrics([{"a": jnp.float32(1.0)}, {"a": np.array([2.0, 3.0])}]) == {"a": 2.0}


# ------------------------------------------------------------- all-to-all
def test_all_to_all():
    info = WorkerGroupInfo(world_size=3, dp_size=1)
    out = dispatch_method(info, ALL_TO_ALL, lambda a, *, k: (a, k), [1, 2, 3], k=["x", "y", "z"])
    assert out == [(1, "x"), (2, "y"), (3, "z")]
    with pytest.raises(ValueError, match=r"args\[0\] must be a list .* rank \(3\), got list of 2"):
        dispatch_method(info, ALL_TO_ALL, lambda a: a, [1, 2])
    with pytest.raises(ValueError, match="no single-program form"):
        call_spmd(info, ALL_TO_ALL, lambda a: a, [1, 2, 3])


def test_dispatch_length_is_checked():
    info = WorkerGroupInfo(world_size=2, dp_size=1)
    bad = register_protocol("test_bad_len", lambda i, a, k: [(a, k)], lambda i, o, s: o, override=True)
    with pytest.raises(ValueError, match="dispatched 1 inputs for 2 ranks"):
        dispatch_method(info, bad, lambda: None)


# ------------------------------------------------------------- custom protocol
def _by_group_dispatch(info, args, kwargs):
    """All rows of a `uid` group go to the same dp shard (groups dealt round-robin)."""
    (batch,) = args
    uids = batch["uid"]
    groups = list(dict.fromkeys(uids))  # first-appearance order
    shard_of_group = {g: i % info.dp_size for i, g in enumerate(groups)}
    shard_of_row = np.array([shard_of_group[u] for u in uids])
    rows = [np.flatnonzero(shard_of_row == d) for d in range(info.dp_size)]
    shards = [batch[r] for r in rows]
    inputs = tuple(((shards[d],), dict(kwargs)) for d in info.dp_rank_of)
    return Dispatched(inputs, state=rows)


def _by_group_collect(info, outputs, rows):
    picked = [outputs[r] for r in info.collect_ranks]
    order = np.concatenate(rows)
    return Batch.concat(picked).permute(np.argsort(order))


def test_custom_group_protocol():
    by_group = register_protocol("test_by_group", _by_group_dispatch, _by_group_collect, override=True)
    assert get_protocol("test_by_group") is by_group
    info = WorkerGroupInfo(world_size=4, dp_size=2)
    rng = np.random.default_rng(0)
    prompts = Batch.from_dict(non_tensors={"uid": ["a", "b", "c", "d", "e"]})
    scores = Batch.from_dict(tensors={"score": rng.integers(0, 10, 15).astype(np.float64)})
    b = prompts.repeat(3) | scores
    b = b.shuffle(1)
    seen = []

    def group_centred(batch):  # needs whole groups: score - mean(score of its group)
        seen.append(set(batch["uid"]))
        u, inv = np.unique(batch["uid"].astype(str), return_inverse=True)
        means = np.bincount(inv, weights=batch["score"]) / np.bincount(inv)
        adv = batch["score"] - means[inv]
        return Batch(tensors={"adv": adv}, non_tensors={"uid": batch["uid"]})

    out = dispatch_method(info, "test_by_group", group_centred, b)
    assert seen[0] == seen[1] and seen[2] == seen[3]  # tp peers read the same shard
    assert seen[0].isdisjoint(seen[2]) and seen[0] | seen[2] == set("abcde")
    uids = b["uid"].astype(str)
    expected = b["score"] - np.array([b["score"][uids == u].mean() for u in uids])
    np.testing.assert_array_equal(out["adv"], expected)
    assert list(out["uid"]) == list(b["uid"])
    assert proto.get_protocol(by_group) is by_group


# ------------------------------------------------------------- both backends
# The protocols through worker groups, computing on devices: the local backend (one process,
# the 8 devices as a dp=4 x tp=2 mesh) and the Ray backend (4 processes x 2 devices, one
# jax.distributed world). Every result is checked against NumPy on the padded batch.

_RAY_CONFIG = dict(
    devices_per_host=2, compile_deadline_s=120, step_deadline_s=60, sync_deadline_s=120, schedule_timeout_s=10
)


@pytest.fixture(scope="module")
def toy_groups(request):
    from tests.ray_toy import Toy

    groups = {"local": LocalWorkerGroup(Toy, name="toy", mesh="dp=4,tp=2")}
    yield groups
    if "ray" in groups:
        groups["ray"].processes.shutdown()


@pytest.fixture(params=["local", "ray"])
def toy(request, toy_groups):
    if request.param == "ray" and "ray" not in toy_groups:
        request.getfixturevalue("ray_session")
        from jaxflow.workers.ray import ProcessGroup, RayConfig, RayWorkerGroup
        from tests.ray_toy import Toy

        processes = ProcessGroup("toy_protocols", 4, RayConfig(**_RAY_CONFIG))
        toy_groups["ray"] = RayWorkerGroup(processes, "toy", Toy, processes.build("toy", Toy, {"mesh": "dp=4,tp=2"}))
    return toy_groups[request.param]


def _xs(n):
    return Batch.from_dict(
        {"x": np.arange(1, n + 1, dtype=np.float32)}, {"uid": [f"u{i}" for i in range(n)]}, {"step": 3}
    )


def test_groups_dp_compute_on_devices(toy):
    before = toy.processes.io_stats() if hasattr(toy, "processes") else None
    b = _xs(10)
    out = toy.double(b)  # padded to 12 rows for dp=4 (rows 0, 1 again), one program, unpadded
    padded = np.concatenate([b["x"], b["x"][:2]])
    np.testing.assert_array_equal(np.asarray(out["y"]), 2 * b["x"])
    np.testing.assert_array_equal(np.asarray(out["cumsum"]), np.cumsum(padded)[:10])
    assert list(out["uid"]) == list(b["uid"]) and out.meta == {"step": 3}
    assert toy.rows_seen()[0][-1] == 12
    if before is not None:  # each process received only its shard's rows: 3 of the 12 padded rows
        after = toy.processes.io_stats()
        assert [a["row_bytes"] - b0["row_bytes"] for a, b0 in zip(after, before)] == [3 * 4] * 4


def test_groups_dp_compute_metric_on_devices(toy):
    b = _xs(6)  # padded to 8: the padding copies (rows 0, 1) are seen by the metric
    assert toy.stats(b) == {"mean_x": pytest.approx(np.mean([1, 2, 3, 4, 5, 6, 1, 2]), rel=1e-6)}


def test_groups_dp_compute_repeat_on_devices(toy):
    b = _xs(6)
    out = toy.rollout(b)  # 6 -> 8 rows padded, 24 outputs; the padding rows' 6 removed
    assert len(out) == 18
    np.testing.assert_array_equal(np.asarray(out["x"]), np.repeat(b["x"], 3))
    np.testing.assert_array_equal(np.asarray(out["sample"]), np.tile(np.arange(3), 6))
    np.testing.assert_array_equal(out["uid"], np.repeat(b["uid"], 3))


def test_groups_dp_train_on_devices(toy):
    with pytest.raises(ValueError, match="does not split evenly"):
        toy.train(_xs(6))  # 6 rows on 4 shards: a training step never trains on padding copies
    x = np.arange(1, 9, dtype=np.float32)
    assert toy.train(_xs(8)) == {"rows": 8.0, "sum_sq": pytest.approx(float(np.sum(x * x))), "max": 8.0}


def test_groups_one_to_all_and_registry(toy):
    assert toy.methods() == ["busy", "double", "fail", "hello", "rollout", "rows_seen", "stats", "train", "whoami"]
    with pytest.raises(AttributeError, match="no registered method 'not_registered'"):
        toy.not_registered()
    assert toy.hello("you") == ["hi you"]


def test_row_split_by_process():
    """Which rows each process receives: its devices' data-parallel shards, in order (a shard
    goes to every process that holds a device of it)."""
    from types import SimpleNamespace

    from jaxflow.workers.host_transfer import RowSplit, split_rows

    def mesh(shape, names):  # 4 processes x 2 devices, process-major as in a jax.distributed world
        devices = np.array([SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]).reshape(shape)
        return SimpleNamespace(devices=devices, axis_names=names)

    b = make(16)
    dp8 = RowSplit.from_mesh(mesh((8,), ("dp",)), ["dp"], 4)  # each process holds 2 shards
    assert dp8 == RowSplit(8, ((0, 1), (2, 3), (4, 5), (6, 7)))
    tp4 = RowSplit.from_mesh(mesh((2, 4), ("dp", "tp")), ["dp"], 4)  # tp spans 2 processes
    assert tp4 == RowSplit(2, ((0,), (0,), (1,), (1,)))
    args, kwargs, rows = split_rows(tp4, (b, 3), {"other": b})
    assert args[1] == 3 and args[0].num_rows == 16 and args[0].slot == 0 and kwargs["other"].slot == 1
    assert list(args[0].non_tensors["uid"]) == list(b["uid"])  # host columns go whole, once
    for p, first in enumerate([0, 0, 8, 8]):
        for slot in (0, 1):
            np.testing.assert_array_equal(rows[p][slot]["responses"], b["responses"][first : first + 8])
    with pytest.raises(ValueError, match="10 rows do not split into 8"):
        dp8.split(make(10))
