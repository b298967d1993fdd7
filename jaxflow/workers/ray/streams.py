"""The driver's side of a weight stream between two worker groups (two `jax.distributed`
worlds): the trainer's weights reach the rollout group's layout shard by shard, each piece
from the process that holds it to the process that wants it, never through the driver, a
file, or one process holding the whole model.

::

    stream = WeightStream(trainer_group, rollout_group)   # servers, layouts, the plan: once
    metrics = stream.sync()      # after each update (or every k): {"weight_sync/bytes": ..., ...}
    stream.reports               # the last sync's per-process `StreamReport`s

At construction every process of both groups starts its transfer server (one per process,
`HostProcess.stream_open`) and describes its role's weights; the driver takes the leaf paths
and layouts of rank 0 of each group (a layout is global: every rank computes the same),
checks that both sides hold the same tree of the same shapes (`match_trees`, `stream_plan`:
a ValueError naming the leaves otherwise), builds the piece plan once and hands it, with the
target's layout and the sources' addresses, to every process (put once). Each `sync` submits
the sources' offers and the targets' receives at once (the two groups work concurrently: a
pull issued before its piece is posted waits for it) and waits for both together under the
groups' deadline. The dtype of the target's weights is the one they arrive in (the sources
cast). The sources post their pieces
in buckets of ``bucket_bytes``, each acknowledged by its receivers before the next is made
(`jaxflow.workers.weight_stream`): a trainer process holds at most its shards plus one bucket.

Faults: every wait of a sync is a pull from the other world's transfer servers (a receiver
waits for pieces, a sender for acknowledgements), so a failure travels through them:

* a process that dies closes its connections: every pull from it, pending or later, fails
  at once;
* a process that raises (its role raised, its weights are no longer laid out as the plan's,
  or a pull failed) first posts an error array (``jax.experimental.transfer.make_error_array``,
  naming its error) under every transfer number of the sync it has not posted yet (its
  remaining pieces, or its acknowledgements), so that whoever pulls one fails at once.

A process whose pull fails raises `StreamAborted` and posts its own errors alike, so the
failure spreads to every process of the sync that waits, and every call comes back (a failed
process only posts, it never makes another wait). The driver waits for all of them
(`ABORT_GRACE_S` at most after the first fault) and raises the root cause: the process that
died (`WorkerDied` naming its group and rank; that group is stopped, as after any death),
else the first error a process raised of its own (noted with its group and rank), else a
`StreamAborted`; a note per other rank says how its call ended. The surviving group's
processes are not blocked and keep their state (its world is intact: a sync has no
collectives), except that a target whose sync failed holds no weights until a sync succeeds.
What a sender had posted and nobody pulled stays in its server (at most one bucket). The
groups' deadline still bounds a peer that vanishes without closing its connections. A sync
does not start while either group is stopped. Measured (`tests/test_weight_stream_ray.py`,
CPU): a rank that raises is raised 0.05-0.7 s after the sync began; a SIGKILLed one 5 s
after the kill, nearly all of it the backend's `LOST_GRACE_S` watch that the cluster itself
is still there (0.5-0.6 s with that watch cut to 0.5 s, as the test does).

A role takes part through ``params`` and ``replace_params`` (every `RoleWorker` has them).
Wiring a stream into the trainer's loop (after each update, or every k) is the async
trainer's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from jaxflow.workers.ray.backend import RayWorkerGroup
from jaxflow.workers.ray.cluster import ray_module
from jaxflow.workers.ray.deadlines import call_deadline, lost_rank
from jaxflow.workers.ray.errors import DeadlineExceeded, WorkerDied, WorkerGroupError
from jaxflow.workers.weight_stream import (
    STREAMS,
    StreamAborted,
    StreamReport,
    StreamRoute,
    layout_bytes,
    match_trees,
    stream_plan,
)

METRIC_PREFIX = "weight_sync/"
BUCKET_BYTES = 256 * 2**20  # what a sender holds of pieces at once, beyond its shards
ABORT_GRACE_S = 30.0  # after a fault, what the other calls of the sync get to come back (they take ~1 s)
_STREAM_IDS = itertools.count()  # this driver's streams, told apart in the processes' transfer numbers


class WeightStream:
    """Streams ``source``'s weights (a role of one worker group) into ``target``'s (a role of
    another group, any mesh and dtype of the same tree of shapes); see the module docstring.

    Args:
      bucket_bytes: the sources post their pieces in buckets of this many bytes (in plan
        order), each acknowledged by its receivers before the next is made: a source process
        holds at most its shards plus one bucket of pieces.

    Attributes:
      key: the stream's name in the processes (default ``"<source>-><target>"``).
      model_bytes: one whole copy of the model in the target's dtype.
      syncs: syncs done so far.
      reports: the last sync's `StreamReport` of every process (sources first).
    """

    def __init__(
        self, source: RayWorkerGroup, target: RayWorkerGroup, key: str | None = None, bucket_bytes: int = BUCKET_BYTES
    ):
        if source.processes is target.processes:
            raise ValueError(
                f"{source.name!r} and {target.name!r} share one world: reshard within it "
                "(jaxflow.reshard.HybridEngine / WeightSync), a stream joins two"
            )
        self.source, self.target = source, target
        self.key = key or f"{source.name}->{target.name}"
        sources = self._gather(source, source.processes.submit("stream_open", source.name, "source"), "opening")
        targets = self._gather(target, target.processes.submit("stream_open", target.name, "target"), "opening")
        match_trees(sources[0]["paths"], targets[0]["paths"])
        dst = targets[0]["layout"]
        plan = stream_plan(sources[0]["layout"], dst, sources[0]["paths"])
        self.model_bytes = layout_bytes(dst)
        addresses = [{d["process"]: d["address"] for d in described} for described in (sources, targets)]
        route = StreamRoute(plan, dst, *addresses, bucket_bytes, next(_STREAM_IDS) % STREAMS)
        payload = ray_module().put(route)
        joins = [
            (group, group.processes.submit("stream_join", self.key, group.name, side, payload))
            for group, side in ((source, "source"), (target, "target"))
        ]
        for group, refs in joins:
            self._gather(group, refs, "joining")
        self.syncs = 0
        self.reports: list[StreamReport] = []

    def _gather(self, group: RayWorkerGroup, refs: list[Any], what: str, deadline_s: float | None = None) -> list:
        processes = group.processes
        deadline_s = processes.config.sync_deadline_s if deadline_s is None else deadline_s
        return processes.gather(refs, f"weight stream {self.key!r}: {what}", deadline_s)

    def sync(self) -> dict[str, float]:
        """One sync: the target's weights become the source's current weights (in the
        target's layout and dtype). Returns its metrics (``weight_sync/*``): ``bytes`` moved
        between the worlds, ``seconds`` (the driver's wall time, both groups done),
        ``pieces``, ``model_bytes`` (one whole copy), ``max_process_bytes`` (the most any
        process of either world held of the model during the sync, `StreamReport.peak_bytes`)."""
        self.syncs += 1
        deadline_s = call_deadline(self.source.processes.config, self.syncs > 1)  # the first compiles
        for group in self.groups:  # neither side starts while the other cannot take part
            group.processes.check_alive()
        t0 = time.perf_counter()
        sides = [(group, group.processes.submit("stream_sync", self.key, self.syncs)) for group in self.groups]
        sent, received = self._gather_sides(sides, f"weight stream {self.key!r}: sync {self.syncs}", deadline_s)
        seconds = time.perf_counter() - t0
        self.reports = sent + received
        moved = sum(r.bytes for r in received)
        if moved != sum(r.bytes for r in sent):
            raise RuntimeError(f"weight stream {self.key!r}: sent {sum(r.bytes for r in sent)} bytes, received {moved}")
        return {
            f"{METRIC_PREFIX}bytes": float(moved),
            f"{METRIC_PREFIX}seconds": seconds,
            f"{METRIC_PREFIX}pieces": float(sum(r.pieces for r in received)),
            f"{METRIC_PREFIX}model_bytes": float(self.model_bytes),
            f"{METRIC_PREFIX}max_process_bytes": float(max(r.peak_bytes for r in self.reports)),
        }

    @property
    def groups(self) -> tuple[RayWorkerGroup, RayWorkerGroup]:
        return self.source, self.target

    def _gather_sides(self, sides: list[tuple[RayWorkerGroup, list[Any]]], what: str, deadline_s: float) -> list[list]:
        """Every rank's result of both groups' calls (``sides``: each group and its per-rank
        references), waited for together under ``deadline_s``. After a first fault the rest
        get `ABORT_GRACE_S`; then the root cause is raised (`_root_cause`)."""
        ray = ray_module()
        owner = {ref: (side, rank) for side, (_, refs) in enumerate(sides) for rank, ref in enumerate(refs)}
        results: list[list[Any]] = [[None] * len(refs) for _, refs in sides]
        faults: list[_Fault] = []
        pending, end = list(owner), time.monotonic() + deadline_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                faults += _past_deadline(sides, [owner[r] for r in pending], what, deadline_s)
                break
            side, rank = owner[ready[0]]
            processes = sides[side][0].processes
            try:
                results[side][rank] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the method raised: the process is fine
                error = e.cause if isinstance(e.cause, BaseException) else e
                faults.append(_Fault(processes.name, rank, error))
            except ray.exceptions.RayError as e:  # the process died: its group is stopped
                faults.append(_Fault(processes.name, rank, lost_rank(processes, rank, e, what)))
            if faults:
                end = min(end, time.monotonic() + ABORT_GRACE_S)
        if faults:
            raise _root_cause(faults, what)
        return results


@dataclasses.dataclass(frozen=True)
class _Fault:
    """How one rank's part of a sync ended, if not with its report."""

    group: str
    rank: int
    error: BaseException

    @property
    def order(self) -> int:
        """0: the process died; 1: it raised its own error; 2: it stopped because a process
        of the other world failed (`StreamAborted`); 3: it did not answer in time."""
        if isinstance(self.error, WorkerDied):
            return 0
        if isinstance(self.error, DeadlineExceeded):
            return 3
        return 2 if isinstance(self.error, StreamAborted) else 1


def _root_cause(faults: list[_Fault], what: str) -> BaseException:
    """The first fault of the lowest `_Fault.order` (what went wrong, not its echoes), with
    notes naming where it was raised and how every other rank's call ended."""
    first = min(faults, key=lambda f: f.order)  # stable: the first to arrive of its kind
    error = first.error
    if not isinstance(error, WorkerGroupError):
        error.add_note(f"raised by worker group {first.group!r} rank {first.rank} during {what}")
    for f in faults:
        if f is not first:
            error.add_note(f"then worker group {f.group!r} rank {f.rank}: {type(f.error).__name__}")
    return error


def _past_deadline(
    sides: list[tuple[RayWorkerGroup, list[Any]]], missing: list[tuple[int, int]], what: str, deadline_s: float
) -> list[_Fault]:
    """The groups with ranks that did not answer are stopped (as any call past its deadline)."""
    faults = []
    for side, (group, refs) in enumerate(sides):
        ranks = sorted(rank for s, rank in missing if s == side)
        if ranks:
            group.processes.shutdown(f"{what} passed its deadline")
            message = (
                f"worker group {group.processes.name!r}: {what} passed its deadline of {deadline_s:g}s; rank(s) "
                f"{ranks} of {len(refs)} did not answer (the group's processes were stopped)"
            )
            faults.append(
                _Fault(group.processes.name, ranks[0], DeadlineExceeded(message, group.processes.name, ranks[0]))
            )
    return faults
