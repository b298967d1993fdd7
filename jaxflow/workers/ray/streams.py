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
pull issued before its piece is posted waits for it) and waits for both under the groups'
deadlines (the receivers' first: a receiver's error is raised at once). The dtype of the
target's weights is the one they arrive in (the sources cast). The sources post their pieces
in buckets of ``bucket_bytes``, each acknowledged by its receivers before the next is made
(`jaxflow.workers.weight_stream`): a trainer process holds at most its shards plus one bucket.

Faults: a side that raises leaves the other waiting on the transfer servers until its own
deadline (then that group is stopped too, as any group past its deadline); a process that
dies is a `WorkerDied` as for any call.

A role takes part through ``params`` and ``replace_params`` (every `RoleWorker` has them).
Wiring a stream into the trainer's loop (after each update, or every k) is the async
trainer's.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from jaxflow.workers.ray.backend import RayWorkerGroup
from jaxflow.workers.ray.cluster import ray_module
from jaxflow.workers.ray.deadlines import call_deadline
from jaxflow.workers.weight_stream import STREAMS, StreamReport, StreamRoute, layout_bytes, match_trees, stream_plan

METRIC_PREFIX = "weight_sync/"
BUCKET_BYTES = 256 * 2**20  # what a sender holds of pieces at once, beyond its shards
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
        t0 = time.perf_counter()
        offers = self.source.processes.submit("stream_sync", self.key, self.syncs)
        receives = self.target.processes.submit("stream_sync", self.key, self.syncs)
        # the receivers first: a receiver's error is raised at once (its senders wait for its
        # acknowledgement until their deadline)
        received = self._gather(self.target, receives, f"receiving sync {self.syncs}", deadline_s)
        sent = self._gather(self.source, offers, f"offering sync {self.syncs}", deadline_s)
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
