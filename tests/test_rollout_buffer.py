"""The version-keyed rollout buffer (issue 23, item 4): staleness and version spans against
hand-written NumPy values, drop vs wait, whole groups, oldest-version-first order, counts,
verl's metric names, the checkpoint round trip, and put/take from two threads."""

import pickle
import threading
import time

import numpy as np
import pytest

from jaxflow.data.batch import Batch
from jaxflow.trainer import rollout_buffer as rb
from jaxflow.trainer.rollout_buffer import (
    BufferClosedError,
    BufferFullError,
    BufferTimeoutError,
    RolloutBuffer,
    RolloutGroup,
    StaleGroupError,
    consumed_token_metrics,
)

R = 4  # response length


def make_group(uid, versions_NxR, lengths_N=None, scores_N=None, failed=False):
    """A group of n rows (one prompt ``uid``); row i has ``lengths_N[i]`` valid tokens."""
    versions_NxR = np.asarray(versions_NxR, np.int32)
    n = versions_NxR.shape[0]
    lengths_N = np.full(n, R) if lengths_N is None else np.asarray(lengths_N)
    mask_NxR = (np.arange(R)[None, :] < lengths_N[:, None]).astype(np.int32)
    scores_N = np.zeros(n, np.float32) if scores_N is None else np.asarray(scores_N, np.float32)
    rows = Batch.from_dict(
        {
            "responses": (np.arange(n * R).reshape(n, R) + 7) * mask_NxR,
            "response_mask": mask_NxR,
            "old_log_probs": -np.ones((n, R), np.float32),
            "token_level_scores": np.zeros((n, R), np.float32) + scores_N[:, None] * (np.arange(R) == 0),
        },
        {"uid": [uid] * n},
    )
    return RolloutGroup(rows, versions_NxR, failed=failed)


def one_version(uid, version, n=2):
    return make_group(uid, np.full((n, R), version))


def uids(batch):
    return list(batch.non_tensors["uid"])


# --------------------------------------------------------------------------- bad input
def test_group_rejects_bad_input():
    with pytest.raises(ValueError, match="token_versions has shape \\(2, 3\\) but responses has \\(2, 4\\)"):
        RolloutGroup(one_version("a", 0).rows, np.zeros((2, 3), np.int32))
    with pytest.raises(TypeError, match="must be integers"):
        RolloutGroup(one_version("a", 0).rows, np.zeros((2, R), np.float32))
    mixed = Batch.concat([one_version("a", 0).rows, one_version("b", 0).rows])
    with pytest.raises(ValueError, match="several uids"):
        RolloutGroup(mixed, np.zeros((4, R), np.int32))
    with pytest.raises(ValueError, match=">= 0"):
        make_group("a", [[0, -1, 0, 0]])
    with pytest.raises(ValueError, match="no valid response token"):
        make_group("a", [[0, 0, 0, 0]], lengths_N=[0])
    with pytest.raises(ValueError, match="needs the tensor column 'response_mask'"):
        RolloutGroup(Batch.from_dict({"responses": np.zeros((1, R), np.int32)}), np.zeros((1, R), np.int32))


def test_buffer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        RolloutBuffer(max_staleness=-1)
    with pytest.raises(ValueError, match="unknown staleness policy 'lifo'"):
        RolloutBuffer(max_staleness=1, policy="lifo")
    buf = RolloutBuffer(max_staleness=1, capacity_groups=3)
    with pytest.raises(ValueError, match="num_groups >= 1"):
        buf.take(0, current_version=0)
    with pytest.raises(ValueError, match="can never succeed"):
        buf.take(4, current_version=0)
    with pytest.raises(TypeError, match="RolloutGroup"):
        buf.put(one_version("a", 0).rows)
    buf.take(1, current_version=3)
    with pytest.raises(ValueError, match="older than the version 3"):
        buf.take(1, current_version=2)


# ---------------------------------------------------------------------- the maths
def test_consumed_token_metrics_by_hand():
    versions_BxR = np.array([[3, 3, 4, 9], [2, 4, 5, 5], [5, 5, 0, 0]], np.int32)
    mask_BxR = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
    m = consumed_token_metrics(versions_BxR, mask_BxR, current_version=5)
    # staleness of valid tokens: [2, 2, 1], [3, 1, 0, 0], [0, 0] -> sum 9 over 9 tokens
    assert m[rb.TOKEN_STALENESS_MEAN] == 1.0
    assert m[rb.TOKEN_STALENESS_MAX] == 3.0
    # spans: 4 - 3 = 1, 5 - 2 = 3, 5 - 5 = 0 (the padding's 9 and 0 are ignored)
    assert m[rb.PARTIAL_NUM] == 2.0
    assert m[rb.PARTIAL_RATIO] == pytest.approx(2 / 3, abs=0, rel=1e-12)
    assert m[rb.MAX_PARTIAL_SPAN] == 3.0
    assert m[rb.MEAN_PARTIAL_SPAN] == pytest.approx(4 / 3, abs=0, rel=1e-12)


def test_group_staleness_is_its_oldest_valid_token():
    g = make_group("a", [[1, 2, 7, 7], [3, 3, 3, 3]], lengths_N=[2, 4])  # 7s are padding
    assert g.oldest_version == 1
    buf = RolloutBuffer(max_staleness=2, policy="wait")
    buf.put(g)
    assert buf.take(1, current_version=4).status == "stale"  # 4 - 1 = 3 > 2
    buf2 = RolloutBuffer(max_staleness=3, policy="wait")
    buf2.put(g)
    assert buf2.take(1, current_version=4).status == "ok"  # 4 - 1 = 3 <= 3


# ------------------------------------------------------------------ order, groups
def test_oldest_version_first_then_fifo_whole_groups():
    buf = RolloutBuffer(max_staleness=5)
    for uid, version in [("a", 2), ("b", 1), ("c", 2), ("d", 1)]:
        assert buf.put(one_version(uid, version))
    assert (buf.depth_groups, buf.depth_samples) == (4, 8)
    first = buf.take(2, current_version=2)
    assert first.status == "ok" and first.reason == ""
    assert uids(first.batch) == ["b", "b", "d", "d"]
    np.testing.assert_array_equal(first.batch["token_versions"], np.ones((4, R), np.int32))
    assert first.batch["token_versions"].dtype == np.int32
    second = buf.take(2, current_version=2)
    assert uids(second.batch) == ["a", "a", "c", "c"]
    np.testing.assert_array_equal(second.batch["responses"][:2], one_version("a", 2).rows["responses"])
    assert (buf.depth_groups, buf.depth_samples) == (0, 0)


def test_groups_of_different_sizes_stay_whole():
    buf = RolloutBuffer(max_staleness=0)
    buf.put(one_version("a", 0, n=3))
    buf.put(one_version("b", 0, n=1))
    out = buf.take(2, current_version=0)
    assert uids(out.batch) == ["a", "a", "a", "b"]
    assert buf.take(1, current_version=0).status == "short"


# --------------------------------------------------------------------- drop / wait
def test_drop_discards_stale_groups_and_owes_replacements():
    buf = RolloutBuffer(max_staleness=1, policy="drop")
    buf.put(make_group("partial", [[0, 0, 2, 2], [2, 2, 2, 2]]))  # oldest token: version 0
    buf.put(one_version("old", 0))
    buf.put(one_version("one", 1))
    buf.put(one_version("two", 2))
    out = buf.take(2, current_version=2)  # 2 - 0 = 2 > 1: "partial" and "old" are stale
    assert uids(out.batch) == ["one", "one", "two", "two"]
    assert buf.counts.stale_dropped == 2 and buf.replacements_needed == 2
    assert out.metrics[rb.DROPPED_STALE] == 2.0 and out.metrics[rb.REPLACEMENTS_NEEDED] == 2.0
    # already stale when put: counted at once
    assert buf.put(one_version("late", 0)) is False
    assert buf.counts.stale_dropped == 3 and buf.replacements_needed == 3
    assert buf.put(one_version("new", 2), replaces=True)
    assert buf.replacements_needed == 2 and buf.counts.replaced == 1
    short = buf.take(2, current_version=2)
    assert short.batch is None and short.status == "short"
    assert "1 of the 2 group(s)" in short.reason and "2 replacement(s) owed" in short.reason
    buf.put(one_version("new2", 2), replaces=True)
    buf.put(one_version("new3", 2), replaces=True)
    with pytest.raises(ValueError, match="no replacement is owed"):
        buf.put(one_version("extra", 2), replaces=True)
    assert uids(buf.take(3, current_version=2).batch) == ["new"] * 2 + ["new2"] * 2 + ["new3"] * 2


def test_wait_never_drops_and_says_why():
    buf = RolloutBuffer(max_staleness=1, policy="wait")
    buf.put(one_version("old", 0))
    buf.put(one_version("fresh", 2))
    out = buf.take(1, current_version=2)
    assert out.batch is None and out.status == "stale"
    assert "staleness 2 > max_staleness=1" in out.reason and "1 stale group(s)" in out.reason
    assert buf.depth_groups == 2 and buf.counts.stale_dropped == 0 and buf.replacements_needed == 0
    with pytest.raises(StaleGroupError, match="policy 'wait' at put"):
        buf.put(one_version("late", 0))  # stale for the version already seen
    assert buf.counts.put == 2  # the refused put is not counted
    with pytest.raises(BufferTimeoutError, match="staleness 2 > max_staleness=1"):
        buf.take(1, current_version=2, timeout_s=0.05)
    short = RolloutBuffer(max_staleness=1, policy="wait")
    short.put(one_version("a", 0))
    res = short.take(2, current_version=1)
    assert res.status == "short" and res.batch is None and short.depth_groups == 1


# ---------------------------------------------------------------- filtered, failed
def test_filtered_and_failed_groups_are_counted_and_replaced():
    def not_all_same(rows):  # DAPO's filter: a group whose rewards all agree teaches nothing
        return np.unique(rows["token_level_scores"].sum(axis=1)).size > 1

    buf = RolloutBuffer(max_staleness=0, keep=not_all_same)
    assert buf.put(make_group("same", np.zeros((2, R)), scores_N=[1, 1])) is False
    assert buf.put(make_group("mixed", np.zeros((2, R)), scores_N=[0, 1])) is True
    assert buf.put(make_group("broken", np.zeros((2, R)), lengths_N=[0, 0], failed=True)) is False
    assert (buf.counts.filtered, buf.counts.failed, buf.replacements_needed) == (1, 1, 2)
    assert buf.put(make_group("again", np.zeros((2, R)), scores_N=[1, 0]), replaces=True)
    m = buf.metrics()
    assert (m[rb.FILTERED], m[rb.FAILED], m[rb.REPLACED], m[rb.REPLACEMENTS_NEEDED]) == (1.0, 1.0, 1.0, 1.0)
    assert (m[rb.QUEUE_GROUPS], m[rb.QUEUE_SAMPLES]) == (2.0, 4.0)
    assert uids(buf.take(2, current_version=0).batch) == ["mixed", "mixed", "again", "again"]


# ------------------------------------------------------------------------- metrics
def test_take_metrics_use_verls_names():
    buf = RolloutBuffer(max_staleness=3)
    buf.put(make_group("p", [[1, 2, 3, 0], [3, 3, 3, 3]], lengths_N=[3, 4]))  # row 0 resumed twice
    buf.put(one_version("q", 3))
    buf.put(one_version("r", 3))
    m = buf.take(2, current_version=3).metrics
    # valid token staleness: [2, 1, 0], [0, 0, 0, 0], q: 8 x 0 -> sum 3 over 15 tokens
    assert m[rb.TOKEN_STALENESS_MEAN] == pytest.approx(3 / 15, abs=0, rel=1e-12)
    assert m[rb.TOKEN_STALENESS_MAX] == 2.0
    assert (m[rb.PARTIAL_NUM], m[rb.MAX_PARTIAL_SPAN]) == (1.0, 2.0)
    assert m[rb.PARTIAL_RATIO] == 0.25 and m[rb.MEAN_PARTIAL_SPAN] == 0.5
    assert m[rb.CURRENT_VERSION] == 3.0
    assert m[rb.STALE_GROUPS_PROCESSED] == 1.0  # group p (oldest token version 1)
    assert m[rb.STALE_ROWS_PROCESSED] == 1.0  # its row 0 only
    assert (m[rb.QUEUE_GROUPS], m[rb.QUEUE_SAMPLES]) == (1.0, 2.0)
    assert rb.DROPPED_STALE == "fully_async/count/dropped_stale_samples"
    assert rb.QUEUE_GROUPS == "monitor/queue/mq_queue_size"
    assert rb.MAX_PARTIAL_SPAN == "fully_async/partial/max_partial_span"


def test_a_token_from_a_future_version_is_refused():
    buf = RolloutBuffer(max_staleness=1)
    buf.put(one_version("a", 4))
    with pytest.raises(ValueError, match="policy version 4, newer than current_version 3"):
        buf.take(1, current_version=3)
    assert buf.depth_groups == 1 and buf.counts.taken == 0  # nothing left the buffer
    assert uids(buf.take(1, current_version=4).batch) == ["a", "a"]


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_every_consumed_token_is_within_the_bound_and_nothing_is_lost(policy):
    rng = np.random.default_rng(0)
    max_staleness = 1
    buf = RolloutBuffer(max_staleness=max_staleness, policy=policy)
    taken, put, version = [], [], 0
    for step in range(30):
        for k in range(3):
            start = version - int(rng.integers(0, 3)) if policy == "drop" else version
            versions_NxR = np.clip(np.sort(rng.integers(start, version + 1, size=(2, R)), axis=1), 0, None)
            uid = f"g{step}_{k}"
            buf.put(make_group(uid, versions_NxR, lengths_N=rng.integers(1, R + 1, size=2)))
            put.append(uid)
        out = buf.take(2, current_version=version)
        if out.batch is not None:
            mask = out.batch["response_mask"].astype(bool)
            assert (version - out.batch["token_versions"][mask]).max() <= max_staleness
            assert out.metrics[rb.TOKEN_STALENESS_MAX] <= max_staleness
            taken += uids(out.batch)[::2]
        version += int(rng.integers(0, 2))
    c = buf.counts
    assert len(taken) == len(set(taken)) == c.taken > 0
    assert c.taken + c.stale_dropped + buf.depth_groups == c.put == len(put)
    assert (c.stale_dropped > 0) == (policy == "drop")


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_wait_with_the_start_budget_never_meets_a_stale_group(max_staleness):
    """A rollouter that starts only what `start_budget` allows (at its weights' version, one
    sync behind the trainer at random) never leaves a stale group; the trainer only waits."""
    rng = np.random.default_rng(max_staleness)
    buf = RolloutBuffer(max_staleness=max_staleness, policy="wait")
    per_step, version, taken, statuses = 2, 0, [], []
    for step in range(40):
        rollout_version = max(0, version - int(rng.integers(0, 2)))
        budget = buf.start_budget(per_step, rollout_version, trainer_version=version)
        for k in range(min(3, budget)):
            buf.put(one_version(f"g{step}_{k}", rollout_version))
        out = buf.take(per_step, current_version=version)
        statuses.append(out.status)
        if out.batch is not None:
            mask = out.batch["response_mask"].astype(bool)
            assert (version - out.batch["token_versions"][mask]).max() <= max_staleness
            taken += uids(out.batch)[::2]
            version += 1  # the trainer updates its weights after each take
    assert "stale" not in statuses and statuses.count("ok") >= 10
    assert len(taken) == len(set(taken)) == buf.counts.taken


def test_start_budget_by_hand():
    buf = RolloutBuffer(max_staleness=1, policy="wait")
    assert buf.start_budget(4, rollout_version=3, trainer_version=3) == 8  # (1 - 0 + 1) * 4
    assert buf.start_budget(4, rollout_version=2, trainer_version=3) == 4  # one sync behind
    assert buf.start_budget(4, rollout_version=1, trainer_version=3) == 0  # two behind: nothing
    buf.put(one_version("a", 3))
    assert buf.start_budget(4, rollout_version=3, trainer_version=3, in_flight_groups=2) == 5
    assert RolloutBuffer(max_staleness=0).start_budget(4, rollout_version=3, trainer_version=3) == 4
    with pytest.raises(ValueError, match="ahead of trainer_version"):
        buf.start_budget(4, rollout_version=4, trainer_version=3)


# --------------------------------------------------------------------- checkpoints
def test_state_round_trip_continues_without_duplicates_or_losses():
    buf = RolloutBuffer(max_staleness=1, policy="drop")
    for i in range(6):  # g0, g1 at version 0; g2, g3 at 1; g4, g5 at 2
        buf.put(one_version(f"g{i}", i // 2))
    consumed = uids(buf.take(1, current_version=1).batch)[::2]
    buf.put(make_group("f", np.zeros((2, R)), failed=True))
    state = pickle.loads(pickle.dumps(buf.state_dict()))  # host-side: plain Python and NumPy
    assert state["policy_version"] == 1 and [g["seq"] for g in state["groups"]] == [1, 2, 3, 4, 5]
    resumed = RolloutBuffer(max_staleness=1, policy="drop")
    resumed.load_state_dict(state)
    assert resumed.counts == buf.counts and resumed.policy_version == 1
    assert (resumed.depth_groups, resumed.depth_samples) == (5, 10)
    for version in (2, 2):  # g1 is stale at version 2 and dropped by both
        a, b = buf.take(2, current_version=version), resumed.take(2, current_version=version)
        assert a.batch.equals(b.batch) and a.metrics == b.metrics
        consumed += uids(b.batch)[::2]
    assert consumed == ["g0", "g2", "g3", "g4", "g5"]
    assert resumed.counts == buf.counts and resumed.depth_groups == 0
    assert (resumed.counts.stale_dropped, resumed.counts.failed, resumed.replacements_needed) == (1, 1, 2)
    resumed.put(one_version("g6", 2))  # the sequence continues after the saved one
    assert resumed.state_dict()["groups"][0]["seq"] == 6
    with pytest.raises(ValueError, match="state format"):
        resumed.load_state_dict({**state, "format": 99})


# ------------------------------------------------------------------------- threads
def test_put_and_take_from_two_threads_lose_and_duplicate_nothing():
    buf = RolloutBuffer(max_staleness=0, capacity_groups=3)
    num_groups, per_take = 40, 2
    errors = []

    def produce():
        try:
            for i in range(num_groups):
                buf.put(one_version(f"g{i}", 0), timeout_s=10)
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    producer = threading.Thread(target=produce)
    producer.start()
    taken = []
    for _ in range(num_groups // per_take):
        taken += uids(buf.take(per_take, current_version=0, timeout_s=10).batch)[::2]
    producer.join(timeout=10)
    assert not producer.is_alive() and not errors
    assert taken == [f"g{i}" for i in range(num_groups)]  # one producer, one version: FIFO
    assert buf.counts.taken == num_groups and buf.depth_groups == 0


def test_waits_end_in_an_error_never_a_hang():
    buf = RolloutBuffer(max_staleness=0, capacity_groups=1)
    t0 = time.monotonic()
    with pytest.raises(BufferTimeoutError, match="0 of the 1 group"):
        buf.take(1, current_version=0, timeout_s=0.1)
    buf.put(one_version("a", 0))
    with pytest.raises(BufferFullError, match="full"):
        buf.put(one_version("b", 0))
    with pytest.raises(BufferTimeoutError, match="full"):
        buf.put(one_version("b", 0), timeout_s=0.1)
    assert buf.counts.put == 1
    buf.take(1, current_version=0)
    outcome = []

    def wait_for_groups():
        try:
            buf.take(1, current_version=0, timeout_s=30)
        except BufferClosedError as e:
            outcome.append(str(e))

    waiter = threading.Thread(target=wait_for_groups)
    waiter.start()
    time.sleep(0.05)
    buf.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and "closed" in outcome[0]
    assert time.monotonic() - t0 < 10
    with pytest.raises(BufferClosedError):
        buf.put(one_version("c", 0))
