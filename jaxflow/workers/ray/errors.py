"""What the Ray backend raises: a worker group's failure names the group and the rank; a
cluster fault (it cannot hold a pool, or it went away) says the fix."""

from __future__ import annotations


class WorkerGroupError(RuntimeError):
    """A worker group failed; ``group`` and ``rank`` say where."""

    def __init__(self, message: str, group: str, rank: int | None = None):
        super().__init__(message)
        self.group, self.rank = group, rank


class WorkerDied(WorkerGroupError):
    """A worker process died (killed, out of memory, crashed)."""


class DeadlineExceeded(WorkerGroupError):
    """A remote call did not finish within its deadline."""


class ClusterError(RuntimeError):
    """The Ray cluster cannot run the job (an infrastructure fault, not jaxflow's): it cannot
    hold a pool (`Unschedulable`) or it went away (`ClusterLost`). The message says the fix."""


class Unschedulable(WorkerGroupError, ClusterError):
    """The cluster cannot hold a pool's bundles."""


class ClusterLost(ClusterError):
    """The Ray cluster itself went away (its owner stopped it, its head died): not a worker's
    fault, and restarting worker groups in it cannot help."""
