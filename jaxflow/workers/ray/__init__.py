"""The Ray backend: each worker group is its own `jax.distributed` world of one process per
host, driven by the single controller (this process, the Ray driver).

::

    backend = RayBackend(RayConfig(devices_per_host=2))          # joins or starts Ray
    placement = Placement.split(devices=backend.devices(8))      # 4 hosts x 2 devices
    with backend:
        w = backend.build_workers(placement, actor=recipe, ref=recipe, critic=value_recipe, ...)
        metrics = ppo_iteration(w, prompts, cfg)                  # same program as local

One concern per module:

==============  ==============================================================================
`config`        `RayConfig` (``jaxflow.ray.*``): a host's bundle, a pool's `PoolReservation`
`hosts`         the run's hosts without a cluster: the whole hosts of a pool (over the
                `jaxflow.mesh.devices.HostSlot`s), the per-host plan (`describe_hosts`)
`cluster`       which cluster (`choose_cluster`), joining or starting it, noticing it is gone
`pools`         a pool's bundles on Ray (placement groups, TPU slices); `Unschedulable` with the fix
`processes`     `ProcessGroup`: a pool's host processes, their world, builds, shutdown
`dispatch`      how a call's batch travels to the ranks and comes back
`deadlines`     how long the driver waits for a rank, and the errors when it does not answer
`errors`        `WorkerGroupError` (`WorkerDied`, `DeadlineExceeded`), `ClusterError`
                (`Unschedulable`, `ClusterLost`)
`backend`       `RayBackend`: the cluster and a run's worker groups (`RayWorkerGroup`, the driver's
                handle on a role), stopped on exit
`streams`       `WeightStream`: one group's weights into another group's layout, shard by shard
                between the two worlds (`jaxflow.workers.weight_stream`)
`rollout_pool`  `RayRolloutPool`: the actor's generation on a group of its own, fed by a
                `WeightStream` from the actor's group after each update
==============  ==============================================================================

Process model.

* **Pools are placement groups.** The driver's `Placement` is built over `HostSlot`s (one per
  device of a host: ``devices(n)``); a pool must hold whole hosts. Each pool reserves one
  bundle per host (`PoolReservation`: CPU hosts packed in one placement group; GPU hosts as
  verl, a ``STRICT_PACK`` placement group per node; TPU hosts as whole slices through
  ``ray.util.tpu``). A pool that the cluster cannot hold is reported (`Unschedulable`, with the
  fix): at once when the whole cluster is too small, else after ``schedule_timeout_s``.
* **One process per host per group, one JAX world per group** (`processes`): a
  `jaxflow.workers.ray_host.HostProcess` actor per bundle; roles that share a pool share its
  processes, and each process builds the same role objects as the local backend (over its
  world's global devices, so the meshes are the local backend's meshes on the same number of
  devices).
* **Lock-step calls** (`dispatch`): every rank receives the same calls in the same order;
  weights from the driver's memory travel as per-rank blocks (`ProcessGroup.ship_params`).
* **Deadlines** (`deadlines`): every remote call waits at most a deadline; a rank that dies or
  a call past its deadline raises naming the group and rank, and the group's processes are
  killed. `RayBackend.shutdown` kills every process it started; `RayBackend.close` (also on
  exit from ``with``) then stops the private Ray instance it started. Ray kills a driver's
  actors when the driver dies, and each `HostProcess` ends itself when its raylet dies.
* **Which cluster** (`cluster`): ``jaxflow.ray.address``, else ``RAY_ADDRESS``, else a cluster
  started with ``ray start``, else a private instance of the run's own; never another
  process's private instance. When the cluster goes away mid-run, the error says so
  (`ClusterLost`).

Ray is imported only when a backend is made: the local path never loads it.
"""

from jaxflow.mesh.devices import HostSlot, host_slots
from jaxflow.workers.ray.backend import RayBackend, RayWorkerGroup
from jaxflow.workers.ray.cluster import LOST_GRACE_S, ClusterChoice, choose_cluster
from jaxflow.workers.ray.config import ACCELERATORS, PoolReservation, RayConfig
from jaxflow.workers.ray.dispatch import ROWS_BY_PROCESS
from jaxflow.workers.ray.errors import (
    ClusterError,
    ClusterLost,
    DeadlineExceeded,
    Unschedulable,
    WorkerDied,
    WorkerGroupError,
)
from jaxflow.workers.ray.hosts import describe_hosts, pool_hosts
from jaxflow.workers.ray.pools import UNSCHEDULABLE_FIX, ReservedPool
from jaxflow.workers.ray.processes import ProcessGroup
from jaxflow.workers.ray.rollout_pool import RayRolloutPool
from jaxflow.workers.ray.streams import WeightStream

__all__ = [
    "ACCELERATORS",
    "LOST_GRACE_S",
    "ROWS_BY_PROCESS",
    "UNSCHEDULABLE_FIX",
    "ClusterChoice",
    "ClusterError",
    "ClusterLost",
    "DeadlineExceeded",
    "HostSlot",
    "PoolReservation",
    "ProcessGroup",
    "RayBackend",
    "RayConfig",
    "RayRolloutPool",
    "RayWorkerGroup",
    "ReservedPool",
    "Unschedulable",
    "WeightStream",
    "WorkerDied",
    "WorkerGroupError",
    "choose_cluster",
    "describe_hosts",
    "host_slots",
    "pool_hosts",
]
