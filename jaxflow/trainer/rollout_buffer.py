"""A version-keyed buffer of rollout groups for asynchronous RL (issue 23, item 4).

A rollouter puts *groups* (the n samples of one prompt, never split); the trainer takes whole
groups for an update. Every generated token records the policy version that produced it
(``token_versions`` int32[n, R], aligned with ``responses``): a partial rollout interrupted by
a weight sync and resumed under the new weights holds several versions in one row. Padding
tokens' versions are ignored (``response_mask == 0``).

Staleness. With the trainer at policy version ``v`` (the version of the weights it updates),
a consumed token of version ``u`` has staleness ``v - u``. A group's staleness is that of its
oldest valid token, ``v - min_{valid} u``; the group is *stale* when that exceeds
``max_staleness`` (in policy versions). ``max_staleness=0`` consumes only groups produced
entirely by the current weights (the synchronous schedule). The bound holds for every token a
`RolloutBuffer.take` returns, under both policies:

* ``drop``: staleness is repaired where it is found. A stale group is discarded (at `put` when
  it is already stale for the last version seen, else at `take`), counted, and a replacement
  is owed; ``replacements_needed`` tells the rollouter how many groups to produce again.
* ``wait``: nothing is discarded; the consumer waits. A stale group at the head of the buffer
  is never consumed: `take` returns no batch and says why (``status="stale"``), as it does
  when fewer groups than asked for are buffered (``status="short"``). The rollouter throttles
  itself so that no group it starts can become stale before it is consumed (as verl's and
  AReaL's staleness thresholds do): `RolloutBuffer.start_budget` says how many groups it may
  start. A stale group under ``wait`` is the sign that it did not: `put` refuses a group
  already stale (`StaleGroupError`) and a blocking `take` reports a stale head after its
  timeout instead of hanging.

Order. Groups leave oldest version first (the version of their oldest valid token), ties in
the order they were put (FIFO). Stale groups are therefore always at the head.

Blocking. `put` and `take` are thread-safe (one lock and condition variable). Without
``timeout_s`` they never block: `take` returns a `TakeResult` with ``batch=None`` and a
reason, `put` into a full buffer raises `BufferFullError`. With ``timeout_s`` they wait on the
condition variable (no busy loop) and raise `BufferTimeoutError` with the last reason after
the timeout; `close` wakes every waiter (a waiting `take` then raises `BufferClosedError`).

Counts. ``stale_dropped`` (drop policy), ``filtered`` (groups that the caller's ``keep``
predicate rejected at `put`, e.g. DAPO's groups whose rewards are all equal), ``failed``
(groups the rollouter marked failed), ``replaced`` (groups put with ``replaces=True``).
``replacements_needed = stale_dropped + filtered + failed - replaced``.

Metrics use verl's fully-async names where they exist (``fully_async/count/...``,
``fully_async/partial/...``, ``monitor/queue/mq_queue_size``); a verl "sample" there is one
prompt's group and a "trajectory" one row. The token-level staleness statistics are new names.

Checkpoints. `RolloutBuffer.state_dict` is host-side NumPy and plain Python (the policy
version, the put/take counters, the counts and every buffered group's columns); a buffer
restored with `RolloutBuffer.load_state_dict` hands out exactly the groups the saved one would
have, in the same order, so a resumed run neither duplicates nor loses a group.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxflow.data.batch import RESPONSE_MASK, RESPONSES, Batch

DROP = "drop"
WAIT = "wait"
STALENESS_POLICIES = (DROP, WAIT)
TOKEN_VERSIONS = "token_versions"  # int32[B, Lr] column of a taken batch: each token's policy version
UID = "uid"
STATE_FORMAT = 1

# Metric names: verl's fully-async trainer's where one exists.
CURRENT_VERSION = "fully_async/count/current_param_version"
DROPPED_STALE = "fully_async/count/dropped_stale_samples"  # groups (verl's samples), cumulative
STALE_GROUPS_PROCESSED = "fully_async/count/stale_samples_processed"  # consumed groups with staleness >= 1
STALE_ROWS_PROCESSED = "fully_async/count/stale_trajectory_processed"  # consumed rows with staleness >= 1
PARTIAL_NUM = "fully_async/partial/total_partial_num"  # rows of this take with a version span > 0
PARTIAL_RATIO = "fully_async/partial/partial_ratio"
MAX_PARTIAL_SPAN = "fully_async/partial/max_partial_span"
QUEUE_GROUPS = "monitor/queue/mq_queue_size"  # buffer depth in groups
# New names (no verl counterpart).
MEAN_PARTIAL_SPAN = "fully_async/partial/mean_partial_span"
TOKEN_STALENESS_MEAN = "fully_async/staleness/token_mean"
TOKEN_STALENESS_MAX = "fully_async/staleness/token_max"
QUEUE_SAMPLES = "monitor/queue/mq_queue_samples"  # buffer depth in rows
FILTERED = "fully_async/count/filtered_groups"
FAILED = "fully_async/count/failed_groups"
REPLACED = "fully_async/count/replaced_groups"
REPLACEMENTS_NEEDED = "fully_async/count/replacements_needed"


class BufferTimeoutError(TimeoutError):
    """A blocking `put` or `take` waited ``timeout_s`` without success."""


class BufferClosedError(RuntimeError):
    """The buffer was closed: no more groups come in, and a blocking `take` cannot succeed."""


class BufferFullError(RuntimeError):
    """A non-blocking `put` into a buffer holding ``capacity_groups`` groups."""


class StaleGroupError(ValueError):
    """Under policy ``wait``, a group put that is already stale for the last version seen."""


def _valid_versions(token_versions_NxR: np.ndarray, response_mask_NxR: np.ndarray) -> np.ndarray:
    return token_versions_NxR[response_mask_NxR.astype(bool)]


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutGroup:
    """The ``n`` samples of one prompt and the policy version of each generated token.

    ``rows`` is a `Batch` of n rows with at least ``responses`` and ``response_mask``
    (int[n, R]); if it has a ``uid`` column, all rows share one uid. ``token_versions_NxR``
    (int[n, R], stored as int32) is the version of the policy that produced each token; entries
    where ``response_mask == 0`` are ignored. ``failed``: the rollouter gave up on this group
    (it is counted and replaced, never consumed). Arrays are moved to the host.
    """

    rows: Batch
    token_versions_NxR: np.ndarray
    failed: bool = False

    def __post_init__(self) -> None:
        rows = self.rows.to_host()
        for key in (RESPONSES, RESPONSE_MASK):
            if key not in rows.tensors:
                raise ValueError(f"a rollout group needs the tensor column {key!r}; it has {rows.keys()}")
        versions = np.asarray(self.token_versions_NxR)
        responses = rows.tensors[RESPONSES]
        if versions.shape != responses.shape:
            raise ValueError(
                f"token_versions has shape {versions.shape} but responses has {responses.shape}: "
                "one policy version per response token"
            )
        if versions.dtype.kind not in "iu":
            raise TypeError(f"token_versions must be integers (policy versions), got dtype {versions.dtype}")
        if len(rows) == 0:
            raise ValueError("a rollout group needs at least one row")
        if UID in rows.non_tensors and len(set(rows.non_tensors[UID].tolist())) != 1:
            raise ValueError(
                f"a rollout group is one prompt's samples, but its rows carry several uids: "
                f"{sorted(set(map(str, rows.non_tensors[UID].tolist())))}"
            )
        valid = _valid_versions(versions, rows.tensors[RESPONSE_MASK])
        if not self.failed and valid.size == 0:
            raise ValueError("a rollout group has no valid response token (response_mask is all 0)")
        if valid.size and valid.min() < 0:
            raise ValueError(f"token versions must be >= 0, got {int(valid.min())}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "token_versions_NxR", versions.astype(np.int32))

    @property
    def num_samples(self) -> int:
        return len(self.rows)

    @property
    def oldest_version(self) -> int:
        """The version of the group's oldest valid token (its staleness is measured from it)."""
        return int(_valid_versions(self.token_versions_NxR, self.rows.tensors[RESPONSE_MASK]).min())

    @property
    def newest_version(self) -> int:
        """The version of the group's newest valid token."""
        return int(_valid_versions(self.token_versions_NxR, self.rows.tensors[RESPONSE_MASK]).max())


def consumed_token_metrics(
    token_versions_BxR: np.ndarray, response_mask_BxR: np.ndarray, current_version: int
) -> dict[str, float]:
    """Staleness and version-span statistics of the valid tokens of a taken batch.

    Over valid tokens (``m = 1``): staleness ``s = v - u`` for token version ``u`` and trainer
    version ``v``: ``token_mean = mean(s)``, ``token_max = max(s)``. Per row b, the span
    ``max_t u_bt - min_t u_bt`` over its valid tokens (0 for a row produced by one policy);
    ``total_partial_num`` = rows with span > 0, ``partial_ratio`` = their fraction,
    ``max_partial_span`` and ``mean_partial_span`` over rows. Rows without a valid token are
    left out of the span statistics.
    """
    mask_BxR = response_mask_BxR.astype(bool)
    staleness = current_version - token_versions_BxR[mask_BxR].astype(np.int64)
    has_tokens_B = mask_BxR.any(axis=1)
    big = np.iinfo(np.int32).max
    newest_B = np.where(mask_BxR, token_versions_BxR, -1).max(axis=1)[has_tokens_B]
    oldest_B = np.where(mask_BxR, token_versions_BxR, big).min(axis=1)[has_tokens_B]
    span_B = (newest_B - oldest_B).astype(np.int64)
    return {
        TOKEN_STALENESS_MEAN: float(staleness.mean()) if staleness.size else 0.0,
        TOKEN_STALENESS_MAX: float(staleness.max()) if staleness.size else 0.0,
        PARTIAL_NUM: float((span_B > 0).sum()),
        PARTIAL_RATIO: float((span_B > 0).mean()) if span_B.size else 0.0,
        MAX_PARTIAL_SPAN: float(span_B.max()) if span_B.size else 0.0,
        MEAN_PARTIAL_SPAN: float(span_B.mean()) if span_B.size else 0.0,
    }


@dataclasses.dataclass(frozen=True)
class TakeResult:
    """What `RolloutBuffer.take` returns.

    ``batch``: the rows of the taken groups (group after group, each whole) with the column
    ``token_versions``, or None. ``status``: ``"ok"``, ``"short"`` (fewer groups buffered than
    asked for) or ``"stale"`` (policy ``wait``: the head group is beyond the bound).
    ``reason``: one line saying why there is no batch (empty when there is one). ``metrics``:
    the consumed tokens' statistics (`consumed_token_metrics`, only with a batch) and the
    buffer's counts and depth after the take.
    """

    batch: Batch | None
    status: str
    reason: str
    metrics: dict[str, float]


@dataclasses.dataclass
class BufferCounts:
    """Cumulative counts, in groups (rows where named)."""

    put: int = 0  # groups offered to `put`, including filtered and failed ones
    taken: int = 0  # groups handed out by `take`
    stale_dropped: int = 0
    filtered: int = 0
    failed: int = 0
    replaced: int = 0
    stale_groups_processed: int = 0  # taken groups with staleness >= 1
    stale_rows_processed: int = 0  # taken rows whose oldest valid token has staleness >= 1


class RolloutBuffer:
    """A thread-safe, version-keyed buffer of whole rollout groups; see the module docstring.

    Args:
      max_staleness: the largest staleness (in policy versions) of a consumed token, >= 0.
      policy: ``"drop"`` or ``"wait"``.
      keep: optional predicate over a group's rows; a group for which it is False is filtered
        at `put` (counted, replaced, never stored).
      capacity_groups: optional bound on the number of buffered groups.
    """

    def __init__(
        self,
        max_staleness: int,
        policy: str = DROP,
        keep: Callable[[Batch], bool] | None = None,
        capacity_groups: int | None = None,
    ) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, (int, np.integer)):
            raise TypeError(f"max_staleness must be an int (policy versions), got {max_staleness!r}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 policy versions, got {max_staleness}")
        if policy not in STALENESS_POLICIES:
            raise ValueError(f"unknown staleness policy {policy!r}; choose one of {STALENESS_POLICIES}")
        if capacity_groups is not None and capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1 or None, got {capacity_groups}")
        self.max_staleness = int(max_staleness)
        self.policy = policy
        self.keep = keep
        self.capacity_groups = capacity_groups
        self.counts = BufferCounts()
        self.policy_version = 0  # the newest trainer version seen (take's current_version)
        self._heap: list[tuple[int, int, RolloutGroup]] = []  # (oldest version, put sequence, group)
        self._next_seq = 0
        self._closed = False
        self._cond = threading.Condition()

    # ------------------------------------------------------------------ state
    @property
    def depth_groups(self) -> int:
        with self._cond:
            return len(self._heap)

    @property
    def depth_samples(self) -> int:
        with self._cond:
            return sum(g.num_samples for _, _, g in self._heap)

    @property
    def replacements_needed(self) -> int:
        """Groups lost to staleness, the filter or failures that no `put(replaces=True)` made up yet."""
        with self._cond:
            return self._owed()

    def _owed(self) -> int:
        c = self.counts
        return c.stale_dropped + c.filtered + c.failed - c.replaced

    def metrics(self) -> dict[str, float]:
        """The counts and depth now (the `TakeResult` of a take carries them too)."""
        with self._cond:
            return self._counts_metrics()

    def _counts_metrics(self) -> dict[str, float]:
        c = self.counts
        return {
            CURRENT_VERSION: float(self.policy_version),
            DROPPED_STALE: float(c.stale_dropped),
            STALE_GROUPS_PROCESSED: float(c.stale_groups_processed),
            STALE_ROWS_PROCESSED: float(c.stale_rows_processed),
            FILTERED: float(c.filtered),
            FAILED: float(c.failed),
            REPLACED: float(c.replaced),
            REPLACEMENTS_NEEDED: float(self._owed()),
            QUEUE_GROUPS: float(len(self._heap)),
            QUEUE_SAMPLES: float(sum(g.num_samples for _, _, g in self._heap)),
        }

    def start_budget(
        self, groups_per_step: int, rollout_version: int, trainer_version: int, in_flight_groups: int = 0
    ) -> int:
        """How many more groups a rollouter at version ``rollout_version`` may start now so that
        none exceeds ``max_staleness`` when consumed (the throttle that policy ``wait`` relies on).

        Model: the trainer's next take is at version ``v = trainer_version`` (its current
        weights), and it takes ``G = groups_per_step`` groups per version, oldest first. With
        ``b`` groups buffered and ``f`` in flight, a group started now at version ``u <= v`` is
        taken at version ``v + (b + f) // G``; its staleness ``v + (b + f) // G - u`` is at most
        ``max_staleness`` while ``b + f < (max_staleness - (v - u) + 1) * G``. The budget is what
        is left under that line, ``max(0, (max_staleness - (v - u) + 1) * G - b - f)``; at
        ``max_staleness=0`` with ``u = v`` it is one step's groups: the synchronous schedule.
        """
        if groups_per_step < 1 or in_flight_groups < 0:
            raise ValueError(
                f"need groups_per_step >= 1 and in_flight_groups >= 0, got {groups_per_step}, {in_flight_groups}"
            )
        if rollout_version > trainer_version:
            raise ValueError(f"rollout_version {rollout_version} is ahead of trainer_version {trainer_version}")
        room = (self.max_staleness - (trainer_version - rollout_version) + 1) * groups_per_step
        with self._cond:
            return max(0, room - len(self._heap) - in_flight_groups)

    def close(self) -> None:
        """No more groups will come: wakes every waiting `put` and `take`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    # -------------------------------------------------------------------- put
    def put(self, group: RolloutGroup, *, replaces: bool = False, timeout_s: float | None = None) -> bool:
        """Offers one group. Returns True when it was stored, False when it was counted instead
        (failed, filtered, or stale under ``drop``).

        ``replaces``: the group makes up for one lost earlier (raises when none is owed).
        ``timeout_s``: wait that long for room in a full buffer (else `BufferFullError`).
        """
        if not isinstance(group, RolloutGroup):
            raise TypeError(f"put takes a RolloutGroup, got {type(group).__name__}")
        # The filter runs outside the lock: it is the caller's code.
        kept = group.failed or self.keep is None or bool(self.keep(group.rows))
        with self._cond:
            if self._closed:
                raise BufferClosedError("put into a closed rollout buffer")
            to_store = kept and not group.failed and not self._is_stale(group.oldest_version, self.policy_version)
            if to_store:  # counts nothing before the wait, which may raise
                self._wait_for(self._room, timeout_s, self._full_line)
            if replaces and self._owed() <= 0:
                raise ValueError("put(replaces=True) but no replacement is owed (replacements_needed is 0)")
            stale = not group.failed and kept and self._is_stale(group.oldest_version, self.policy_version)
            if stale and self.policy == WAIT:
                raise StaleGroupError(self._stale_line(group, self.policy_version, "put"))
            self.counts.put += 1
            self.counts.replaced += int(replaces)
            if group.failed:
                self.counts.failed += 1
            elif not kept:
                self.counts.filtered += 1
            elif stale:
                self.counts.stale_dropped += 1
            else:
                heapq.heappush(self._heap, (group.oldest_version, self._next_seq, group))
                self._next_seq += 1
                self._cond.notify_all()
                return True
            return False

    def _room(self) -> bool:
        return self.capacity_groups is None or len(self._heap) < self.capacity_groups

    def _full_line(self) -> str:
        return f"the rollout buffer is full ({len(self._heap)} of capacity_groups={self.capacity_groups} groups)"

    def _wait_for(self, ready: Callable[[], bool], timeout_s: float | None, why: Callable[[], str]) -> None:
        """Under the lock: returns once ``ready()``; waits on the condition up to ``timeout_s``."""
        if ready():
            return
        if timeout_s is None:
            raise BufferFullError(why())
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self._closed:
                raise BufferClosedError(f"the rollout buffer was closed while waiting: {why()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BufferTimeoutError(f"waited {timeout_s:g} s: {why()}")
            self._cond.wait(left)

    def _is_stale(self, oldest_version: int, current_version: int) -> bool:
        return current_version - oldest_version > self.max_staleness

    def _stale_line(self, group: RolloutGroup, current_version: int, where: str) -> str:
        return (
            f"policy 'wait' at {where}: a group of version {group.oldest_version} has staleness "
            f"{current_version - group.oldest_version} > max_staleness={self.max_staleness} at policy "
            f"version {current_version}; the rollouter must not start groups it cannot deliver within the bound"
        )

    # ------------------------------------------------------------------- take
    def take(self, num_groups: int, current_version: int, *, timeout_s: float | None = None) -> TakeResult:
        """Takes ``num_groups`` whole groups for the trainer at policy version ``current_version``.

        Without ``timeout_s``: never blocks; with too few (fresh) groups the result has no batch
        and says why. With ``timeout_s``: waits for groups until then and raises
        `BufferTimeoutError` (or `BufferClosedError`) with the reason instead.
        """
        self._check_take(num_groups, current_version)
        with self._cond:
            if current_version < self.policy_version:
                raise ValueError(
                    f"current_version {current_version} is older than the version {self.policy_version} "
                    "already seen; policy versions only grow"
                )
            self.policy_version = int(current_version)

            def ready() -> bool:
                if self.policy == DROP:
                    self._drop_stale(current_version)
                return self._why_not(num_groups, current_version)[0] == "ok"

            if timeout_s is None and not ready():
                status, reason = self._why_not(num_groups, current_version)
                return TakeResult(None, status, reason, self._counts_metrics())
            self._wait_for(ready, timeout_s, lambda: self._why_not(num_groups, current_version)[1])
            return self._pop(num_groups, current_version)

    def _check_take(self, num_groups: int, current_version: int) -> None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"take needs num_groups >= 1, got {num_groups!r}")
        if self.capacity_groups is not None and num_groups > self.capacity_groups:
            raise ValueError(
                f"take of {num_groups} groups can never succeed: the buffer holds at most "
                f"capacity_groups={self.capacity_groups}"
            )
        if isinstance(current_version, bool) or not isinstance(current_version, (int, np.integer)):
            raise TypeError(f"current_version must be an int policy version, got {current_version!r}")
        if current_version < 0:
            raise ValueError(f"current_version must be >= 0, got {current_version}")

    def _drop_stale(self, current_version: int) -> None:
        """Stale groups are the oldest, hence at the head of the heap."""
        dropped = 0
        while self._heap and self._is_stale(self._heap[0][0], current_version):
            heapq.heappop(self._heap)
            dropped += 1
        if dropped:
            self.counts.stale_dropped += dropped
            self._cond.notify_all()  # room for a waiting put

    def _why_not(self, num_groups: int, current_version: int) -> tuple[str, str]:
        if self._heap and self._is_stale(self._heap[0][0], current_version):  # only under WAIT
            stale = sum(self._is_stale(v, current_version) for v, _, _ in self._heap)
            return "stale", self._stale_line(self._heap[0][2], current_version, "take") + (
                f" ({stale} stale group(s) buffered)"
            )
        if len(self._heap) < num_groups:
            return "short", (
                f"{len(self._heap)} of the {num_groups} group(s) asked for are buffered; "
                f"{self._owed()} replacement(s) owed"
            )
        return "ok", ""

    def _pop(self, num_groups: int, current_version: int) -> TakeResult:
        newest = max(g.newest_version for _, _, g in heapq.nsmallest(num_groups, self._heap))
        if newest > current_version:  # checked before anything leaves the buffer
            raise ValueError(
                f"a group to take holds tokens of policy version {newest}, newer than current_version "
                f"{current_version}: the trainer's version must be the newest weights"
            )
        groups = [heapq.heappop(self._heap)[2] for _ in range(num_groups)]
        self._cond.notify_all()  # room for a waiting put
        rows = Batch.concat([g.rows for g in groups])
        versions_BxR = np.concatenate([g.token_versions_NxR for g in groups], axis=0)
        mask_BxR = rows.tensors[RESPONSE_MASK]
        oldest_B = np.where(mask_BxR.astype(bool), versions_BxR, np.iinfo(np.int32).max).min(axis=1)
        self.counts.taken += num_groups
        self.counts.stale_groups_processed += sum(current_version - g.oldest_version >= 1 for g in groups)
        self.counts.stale_rows_processed += int((current_version - oldest_B[mask_BxR.any(axis=1)] >= 1).sum())
        batch = rows.update(tensors={TOKEN_VERSIONS: versions_BxR})
        metrics = consumed_token_metrics(versions_BxR, mask_BxR, current_version) | self._counts_metrics()
        return TakeResult(batch, "ok", "", metrics)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Host-side state: the policy version, the put/take counters (the buffer's position),
        the counts and the buffered groups in the order they will be taken."""
        with self._cond:
            ordered = sorted(self._heap, key=lambda item: item[:2])
            return {
                "format": STATE_FORMAT,
                "policy_version": self.policy_version,
                "next_seq": self._next_seq,
                "counts": dataclasses.asdict(self.counts),
                "groups": [_group_state(seq, g) for _, seq, g in ordered],
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict` (replacing this buffer's contents and counts)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"rollout buffer state format {state.get('format')!r}; this code reads {STATE_FORMAT}")
        unknown = set(state["counts"]) - {f.name for f in dataclasses.fields(BufferCounts)}
        if unknown:
            raise ValueError(f"rollout buffer state has unknown counts {sorted(unknown)}")
        heap = []
        for item in state["groups"]:
            group = _group_from_state(item)
            heap.append((group.oldest_version, int(item["seq"]), group))
        heapq.heapify(heap)
        with self._cond:
            self.policy_version = int(state["policy_version"])
            self._next_seq = int(state["next_seq"])
            self.counts = BufferCounts(**{k: int(v) for k, v in state["counts"].items()})
            self._heap = heap
            self._cond.notify_all()


def _group_state(seq: int, group: RolloutGroup) -> dict[str, Any]:
    rows = group.rows
    return {
        "seq": seq,
        "tensors": dict(rows.tensors),
        "non_tensors": dict(rows.non_tensors),
        "meta": dict(rows.meta),
        TOKEN_VERSIONS: group.token_versions_NxR,
    }


def _group_from_state(item: Mapping[str, Any]) -> RolloutGroup:
    rows = Batch(dict(item["tensors"]), dict(item["non_tensors"]), dict(item["meta"]))
    return RolloutGroup(rows, np.asarray(item[TOKEN_VERSIONS]))
