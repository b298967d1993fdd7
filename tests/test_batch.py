"""Batch: construction, column ops, union, row ops, padding and placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.data.batch import Batch, assert_batch_equal


def make(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return Batch.from_dict(
        tensors={
            "responses": rng.integers(0, 100, size=(n, 5)).astype(np.int32),
            "old_log_probs": rng.normal(size=(n, 5)).astype(np.float32),
        },
        non_tensors={
            "uid": [f"p{i}" for i in range(n)],
            "ground_truth": [str(i * i) for i in range(n)],
        },
        meta={"temperature": 1.0},
    )


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))


# ---------------------------------------------------------------- construction
def test_from_dict_converts_lists():
    b = Batch.from_dict(
        tensors={"x": [[1, 2], [3, 4]], "y": [0.5, 1.5]},
        non_tensors={
            "text": ["a", "bb"],
            "ragged": [[1, 2, 3], [4]],
            "same_len": [[1, "a"], [2, "b"]],
            "gid": [7, 7],
        },
        meta={"step": 3},
    )
    assert len(b) == 2
    np.testing.assert_array_equal(b["x"], np.array([[1, 2], [3, 4]]))
    assert b["x"].dtype.kind == "i" and b["y"].dtype.kind == "f"
    assert b["text"].dtype == object and list(b["text"]) == ["a", "bb"]
    assert b["ragged"].dtype == object and b["ragged"].shape == (2,)
    assert b["ragged"][0] == [1, 2, 3] and b["ragged"][1] == [4]
    assert b["same_len"].shape == (2,) and b["same_len"][1] == [2, "b"]
    np.testing.assert_array_equal(b["gid"], np.array([7, 7]))
    assert b.meta == {"step": 3}


def test_from_dict_rejects_non_numeric_tensor_and_scalar_non_tensor():
    with pytest.raises(TypeError, match="tensor column 'name' is not numeric"):
        Batch.from_dict(tensors={"name": ["a", "b"]})
    with pytest.raises(TypeError, match="non-tensor column 'src'.*meta"):
        Batch.from_dict(non_tensors={"src": "gsm8k"})
    with pytest.raises(ValueError, match="column 'x' is a scalar"):
        Batch(tensors={"x": np.zeros(())})
    with pytest.raises(ValueError, match="column .y. is a scalar"):
        Batch.from_dict(tensors={"y": 1.0})


def test_constructor_checks_leading_dim_and_names_columns():
    with pytest.raises(ValueError, match=r"column 'b' has leading dimension 3 but column 'a' has"):
        Batch(tensors={"a": np.zeros((4, 2)), "b": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"column 's' has leading dimension 2 but column 'a' has"):
        Batch(tensors={"a": np.zeros((4,))}, non_tensors={"s": np.array(["x", "y"], dtype=object)})
    with pytest.raises(TypeError, match="must be a numpy or jax array"):
        Batch(tensors={"a": [1, 2]})
    with pytest.raises(ValueError, match=r"\['a'\] are both tensors and non_tensors"):
        Batch(tensors={"a": np.zeros(2)}, non_tensors={"a": np.zeros(2)})


def test_access():
    b = make()
    assert len(b) == 6
    assert b.keys() == ["responses", "old_log_probs", "uid", "ground_truth"]
    assert "uid" in b and "responses" in b and "temperature" not in b
    assert b["uid"][2] == "p2"
    with pytest.raises(KeyError, match="no column 'values'"):
        b["values"]
    with pytest.raises(TypeError, match=r"b\[i:i\+1\]"):
        b[0]
    with pytest.raises(TypeError, match="not iterable"):
        list(b)
    assert len(Batch(meta={"a": 1})) == 0


# ---------------------------------------------------------------- column ops
def test_select_pop_rename():
    b = make()
    s = b.select(tensor_keys=["responses"], non_tensor_keys=[], meta_keys=None)
    assert s.keys() == ["responses"] and s.meta == {"temperature": 1.0}
    assert s["responses"] is b["responses"]
    with pytest.raises(KeyError, match=r"\['values'\] not in batch"):
        b.select(tensor_keys=["values"])

    with pytest.raises(KeyError):  # atomic: nothing removed when one key is missing
        b.pop(tensor_keys=["responses", "nope"])
    assert "responses" in b
    popped = b.pop(tensor_keys=["responses"], meta_keys=["temperature"])
    assert popped.keys() == ["responses"] and popped.meta == {"temperature": 1.0}
    assert b.keys() == ["old_log_probs", "uid", "ground_truth"] and b.meta == {}

    r = b.rename({"old_log_probs": "ref_log_prob", "uid": "group"})
    assert r.keys() == ["ref_log_prob", "group", "ground_truth"]
    assert r["ref_log_prob"] is b["old_log_probs"]
    with pytest.raises(ValueError, match="ground_truth"):
        b.rename({"uid": "ground_truth"})
    with pytest.raises(KeyError, match="missing"):
        b.rename({"missing": "x"})


def test_update_overwrites():
    b = make()
    new = np.zeros((6, 5), np.float32)
    u = b.update(tensors={"old_log_probs": new, "values": new}, meta={"temperature": 0.5})
    assert u["old_log_probs"] is new and "values" in u and u.meta["temperature"] == 0.5
    assert b.meta["temperature"] == 1.0 and b["old_log_probs"] is not new


# ---------------------------------------------------------------- union
def test_union_merges_and_accepts_equal_shared_keys():
    a = make()
    b = Batch.from_dict(
        tensors={"values": np.arange(6.0), "responses": a["responses"].copy()},
        non_tensors={"uid": [f"p{i}" for i in range(6)]},
        meta={"temperature": 1.0, "step": 2},
    )
    c = a | b
    assert c.keys() == ["responses", "old_log_probs", "values", "uid", "ground_truth"]
    np.testing.assert_array_equal(c["values"], np.arange(6.0))
    assert c.meta == {"temperature": 1.0, "step": 2}
    # |= rebinds without mutating the original object
    d = a
    d |= b
    assert "values" in d and "values" not in a


def test_union_conflicts_name_the_key():
    a = make()
    other = a["responses"].copy()
    other[3, 1] += 1
    with pytest.raises(ValueError, match="conflict on tensor key 'responses'"):
        a | Batch(tensors={"responses": other})
    with pytest.raises(ValueError, match="conflict on tensor key 'responses'"):  # dtype differs
        a | Batch(tensors={"responses": a["responses"].astype(np.int64)})
    uid = a["uid"].copy()
    uid[0] = "other"
    with pytest.raises(ValueError, match="conflict on non-tensor key 'uid'"):
        a | Batch(non_tensors={"uid": uid})
    with pytest.raises(ValueError, match="conflict on meta key 'temperature'"):
        a | Batch(meta={"temperature": 0.7})
    with pytest.raises(ValueError, match="different sizes: 6 rows vs 4 rows"):
        a | Batch(tensors={"values": np.zeros(4)})
    with pytest.raises(ValueError, match="both tensors and non_tensors"):
        a | Batch(tensors={"uid": np.zeros(6)})


def test_union_with_device_arrays_compares_values():
    a = make()
    dev = a.to_device()
    assert isinstance(dev["responses"], jax.Array)
    merged = a | dev  # equal values on host and device
    assert merged["responses"] is a["responses"]
    bad = dev.update(tensors={"responses": dev["responses"] + 1})
    with pytest.raises(ValueError, match="'responses'"):
        a | bad


# ---------------------------------------------------------------- row ops
def test_repeat_interleave_and_tile():
    b = Batch.from_dict(
        tensors={"x": np.array([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"s": ["a", "b", "c"]},
        meta={"m": 1},
    )
    r = b.repeat(2, interleave=True)
    np.testing.assert_array_equal(r["x"], np.array([[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]))
    assert list(r["s"]) == ["a", "a", "b", "b", "c", "c"]
    t = b.repeat(2, interleave=False)
    np.testing.assert_array_equal(t["x"], np.array([[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]]))
    assert list(t["s"]) == ["a", "b", "c", "a", "b", "c"]
    assert r.meta == {"m": 1}
    jr = b.to_device().repeat(3)
    assert isinstance(jr["x"], jax.Array)
    np.testing.assert_array_equal(np.asarray(jr["x"]), np.repeat(b["x"], 3, axis=0))


def test_chunk_concat_round_trip():
    b = make(n=6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    np.testing.assert_array_equal(parts[1]["responses"], b["responses"][2:4])
    assert list(parts[2]["uid"]) == ["p4", "p5"]
    assert_batch_equal(Batch.concat(parts), b)
    assert [len(p) for p in b.split(4)] == [4, 2]
    assert_batch_equal(Batch.concat(b.split(4)), b)
    with pytest.raises(ValueError, match="batch of 6 rows into 4 equal chunks"):
        b.chunk(4)
    with pytest.raises(ValueError, match=r"batch 1 has tensor keys \['responses'\]"):
        Batch.concat([b, b.select(tensor_keys=["responses"])])
    with pytest.raises(ValueError, match="column 'x'"):
        Batch.concat([Batch(tensors={"x": np.zeros((2, 3))}), Batch(tensors={"x": np.zeros((2, 4))})])


def test_concat_device_and_mixed():
    b = make(n=4)
    dev = b.to_device()
    both = Batch.concat([dev[:2], dev[2:]])
    assert isinstance(both["responses"], jax.Array)
    assert_batch_equal(both.to_host(), b)
    mixed = Batch.concat([b[:2], dev[2:]])
    assert_batch_equal(mixed.to_host(), b)


def test_slice_and_index_arrays():
    b = make(n=6)
    s = b[1:4]
    np.testing.assert_array_equal(s["responses"], b["responses"][1:4])
    assert list(s["uid"]) == ["p1", "p2", "p3"]
    idx = np.array([5, 0, -1])
    g = b[idx]
    np.testing.assert_array_equal(g["old_log_probs"], b["old_log_probs"][[5, 0, 5]])
    assert list(g["uid"]) == ["p5", "p0", "p5"]
    mask = np.array([True, False, True, False, False, True])
    np.testing.assert_array_equal(b[mask]["responses"], b["responses"][[0, 2, 5]])
    dev = b.to_device()  # jax would clamp out-of-range gathers; Batch refuses them
    with pytest.raises(IndexError, match="out of range"):
        dev[np.array([6])]
    picked = dev[jnp.array([4, 1])]["responses"]
    np.testing.assert_array_equal(np.asarray(picked), b["responses"][[4, 1]])
    with pytest.raises(IndexError, match="boolean mask of length 2"):
        b[np.array([True, False])]
    assert len(b[np.array([], dtype=np.int64)]) == 0 and len(b[[]]) == 0


@pytest.mark.parametrize("n,k", [(10, 4), (7, 8), (3, 8), (8, 4), (1, 3)])
def test_pad_to_multiple_and_unpad(n, k):
    b = make(n=n)
    padded, pad = b.pad_to_multiple(k)
    expected_pad = (-n) % k
    assert pad == expected_pad and len(padded) == n + expected_pad and len(padded) % k == 0
    rows = np.concatenate([np.arange(n), np.arange(expected_pad) % n])  # first rows, cycling
    np.testing.assert_array_equal(padded["responses"], b["responses"][rows])
    assert list(padded["uid"]) == [f"p{i}" for i in rows]
    assert_batch_equal(padded.unpad(pad), b)
    with pytest.raises(ValueError, match="pad_size must be in"):
        padded.unpad(len(padded) + 1)


def test_shuffle_and_permute():
    b = make(n=8)
    s1, s2 = b.shuffle(3), b.shuffle(3)
    assert_batch_equal(s1, s2)
    perm = np.random.default_rng(3).permutation(8)
    np.testing.assert_array_equal(s1["responses"], b["responses"][perm])
    assert list(s1["uid"]) == [f"p{i}" for i in perm]
    assert_batch_equal(s1.permute(np.argsort(perm)), b)
    with pytest.raises(ValueError, match="permutation of range"):
        b.permute([0, 0, 1, 2, 3, 4, 5, 6])


def test_assert_batch_equal_names_key():
    b = make()
    assert b.equals(b.copy())
    other = b.update(non_tensors={"ground_truth": ["x"] * 6})
    with pytest.raises(AssertionError, match="non-tensor 'ground_truth' differs"):
        assert_batch_equal(b, other)
    assert not b.equals(other)
    assert not b.equals(b.select(tensor_keys=["responses"]))


# ---------------------------------------------------------------- placement
def test_to_device_one_sharding(mesh):
    b = make(n=8)
    d = b.to_device(NamedSharding(mesh, P("dp")))
    for k in ("responses", "old_log_probs"):
        x = d[k]
        assert isinstance(x, jax.Array)
        assert x.sharding.spec == P("dp")
        assert len(x.addressable_shards) == 8
        for shard in x.addressable_shards:
            assert shard.data.shape == (2, 5)
            np.testing.assert_array_equal(np.asarray(shard.data), b[k][shard.index])
    assert d["uid"] is b["uid"] and isinstance(d["uid"], np.ndarray)
    back = d.to_host()
    assert isinstance(back["responses"], np.ndarray)
    assert_batch_equal(back, b)


def test_to_device_per_column_sharding(mesh):
    b = make(n=8)

    def sharding(name, x):
        spec = P("dp", "tp") if name == "old_log_probs" and x.shape[1] % 2 == 0 else P("dp")
        return NamedSharding(mesh, spec)

    b = b.update(tensors={"old_log_probs": np.ones((8, 6), np.float32)})
    d = b.to_device(sharding)
    assert d["responses"].sharding.spec == P("dp")
    assert {s.data.shape for s in d["responses"].addressable_shards} == {(2, 5)}
    assert d["old_log_probs"].sharding.spec == P("dp", "tp")
    assert {s.data.shape for s in d["old_log_probs"].addressable_shards} == {(2, 3)}


def test_to_device_error_names_column(mesh):
    b = make(n=6)
    with pytest.raises(ValueError, match="cannot place tensor column 'responses'"):
        b.to_device(NamedSharding(mesh, P("dp")))
    padded, pad = b.pad_to_multiple(4)
    d = padded.to_device(NamedSharding(mesh, P("dp")))
    assert pad == 2 and {s.data.shape for s in d["responses"].addressable_shards} == {(2, 5)}
