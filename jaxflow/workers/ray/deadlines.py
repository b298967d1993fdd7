"""How long the driver waits for a worker group, and what it raises when a rank does not answer.

Every remote call waits at most a deadline (`RayConfig`): ``compile_deadline_s`` for a
method's first call with given shapes (it compiles), ``step_deadline_s`` after that
(`call_deadline`), ``sync_deadline_s`` for world set-up and builds. A rank that dies
(`WorkerDied`) or a call past its deadline (`DeadlineExceeded`) raises naming the group and
rank, and the group's processes are stopped (the world cannot continue without a rank). A
rank whose method raised gives the others ``sync_deadline_s`` to finish (or fail alike), then
its exception is raised with a note naming the group and rank. When the cluster itself went
away the error says so instead (`ClusterLost`, `Group.check_cluster`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from jaxflow.workers.ray.cluster import ray_module
from jaxflow.workers.ray.config import RayConfig
from jaxflow.workers.ray.errors import DeadlineExceeded, WorkerDied


class Group(Protocol):
    """What `gather` needs of a worker group (`processes.ProcessGroup`)."""

    name: str
    pids: list[Any]
    config: RayConfig

    def shutdown(self, reason: str) -> None: ...

    def check_cluster(self, what: str) -> None: ...


def call_deadline(config: RayConfig, compiled: bool) -> float:
    """The deadline of a method call: ``step_deadline_s`` once its program is ``compiled``
    (a call with the same shapes returned), else ``compile_deadline_s``."""
    return config.step_deadline_s if compiled else config.compile_deadline_s


def lost_rank(group: Group, rank: int, error: Exception, what: str) -> WorkerDied:
    """The `WorkerDied` of ``rank`` of ``group``, whose call during ``what`` ended in Ray's
    ``error`` (not the method's own exception): the process died (`RayActorError`), or Ray
    lost it (e.g. ``OutOfMemoryError``: its memory monitor killed it). The group's processes
    are stopped first (its world cannot continue without the rank); `ClusterLost` instead
    when the cluster itself went away."""
    ray = ray_module()
    group.check_cluster(what)
    first_line = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, ray.exceptions.RayActorError):
        group.shutdown(f"rank {rank} died")
        pid = group.pids[rank] if rank < len(group.pids) else "?"
        message = f"(pid {pid}) died during {what}: {first_line or type(error).__name__}"
    else:
        group.shutdown(f"rank {rank} lost")
        message = f"was lost during {what}: {type(error).__name__}: {first_line}"
    return WorkerDied(f"worker group {group.name!r} rank {rank} {message}", group.name, rank)


def gather(group: Group, refs: Sequence[Any], what: str, deadline_s: float) -> list[Any]:
    """Every rank's result of ``refs`` (one per rank of ``group``, in rank order), waiting at
    most ``deadline_s`` (see the module docstring)."""
    ray = ray_module()
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending, end = list(refs), time.monotonic() + deadline_s
    failure: tuple[int, BaseException] | None = None
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
        if not ready:
            missing = sorted(rank_of[r] for r in pending)
            group.shutdown(f"{what} passed its deadline")
            if failure is not None:
                rank, error = failure
                error.add_note(
                    f"raised by worker group {group.name!r} rank {rank} during {what}; ranks "
                    f"{missing} did not finish within {deadline_s:g}s, so the group was stopped"
                )
                raise error
            raise DeadlineExceeded(
                f"worker group {group.name!r}: {what} passed its deadline of {deadline_s:g}s; rank(s) {missing} "
                f"of {len(refs)} did not answer (the group's processes were stopped)",
                group.name,
                missing[0],
            )
        rank = rank_of[ready[0]]
        try:
            results[rank] = ray.get(ready[0])
        except ray.exceptions.RayTaskError as e:
            if failure is None:  # the others get the sync deadline to finish (or fail alike)
                failure = (rank, e.cause if isinstance(e.cause, BaseException) else e)
                end = min(end, time.monotonic() + group.config.sync_deadline_s)
        except ray.exceptions.RayError as e:
            raise lost_rank(group, rank, e, what) from None
    if failure is not None:
        rank, error = failure
        error.add_note(f"raised by worker group {group.name!r} rank {rank} during {what}")
        raise error
    return results
