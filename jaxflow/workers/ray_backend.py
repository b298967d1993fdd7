"""The Ray backend: each worker group is its own `jax.distributed` world of one process per
host, driven by the single controller (this process, the Ray driver).

::

    backend = RayBackend(RayConfig(devices_per_host=2))          # joins or starts Ray
    placement = Placement.split(devices=backend.devices(8))      # 4 hosts x 2 devices
    with backend:
        w = backend.build_workers(placement, actor=recipe, ref=recipe, critic=value_recipe, ...)
        metrics = ppo_iteration(w, prompts, cfg)                  # same program as local

Process model.

* **Pools are placement groups.** The driver's `Placement` is built over `HostSlot`s (one per
  device of a host: ``devices(n)``); a pool must hold whole hosts. Each pool reserves one
  bundle per host (`PoolReservation`: CPU hosts packed in one placement group; GPU hosts as
  verl, a ``STRICT_PACK`` placement group per node; TPU hosts as whole slices through
  ``ray.util.tpu``). A pool that the cluster cannot hold is reported (`Unschedulable`, with the
  fix): at once when the whole cluster is too small, else after ``schedule_timeout_s``.
* **One process per host per group, one JAX world per group.** A `ProcessGroup` starts one
  `jaxflow.workers.ray_host.HostProcess` actor per bundle; rank 0 picks a free port and every
  rank calls ``jax.distributed.initialize``. Roles that share a pool share its processes, and
  each process builds the same role objects as the local backend (over its world's global
  devices, so the meshes are the local backend's meshes on the same number of devices).
* **Lock-step calls.** A `RayWorkerGroup` call is submitted to every rank in the same order,
  each argument put once in the object store; the batches of `ROWS_BY_PROCESS` protocols
  travel by process (each rank receives the rows its devices hold), the others whole. Each
  rank runs the method's single-program form over the global mesh and returns the shards it
  holds (`jaxflow.workers.host_transfer`), which the driver assembles. Per-rank protocols
  (``ALL_TO_ALL``) are dispatched by process. Weights from the driver's memory travel as
  per-rank blocks (`ProcessGroup.ship_params`).
* **Deadlines.** Every remote call waits at most a deadline: ``compile_deadline_s`` for a
  method's first call with given shapes (it compiles), ``step_deadline_s`` after that,
  ``sync_deadline_s`` for world set-up and builds. A rank that dies (`WorkerDied`) or a call
  past its deadline (`DeadlineExceeded`) raises naming the group and rank, and the group's
  processes are killed (the world cannot continue without a rank). `RayBackend.shutdown`
  kills every process it started; `RayBackend.close` (also on exit from ``with``) then stops
  the private Ray instance it started. Ray kills a driver's actors when the driver dies, and
  each `HostProcess` ends itself when its raylet dies (a parent-death watch).
* **Which cluster.** `choose_cluster`: ``jaxflow.ray.address``, else ``RAY_ADDRESS``, else a
  cluster started with ``ray start``, else a private instance of the run's own; never another
  process's private instance. When the cluster goes away mid-run, the error says so
  (`ClusterLost`); a pool the cluster can never hold is refused at once (`Unschedulable`).

Ray is imported only here and only when a backend is made: the local path never loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxflow.data.batch import Batch
from jaxflow.mesh import Placement
from jaxflow.mesh.devices import HostSlot, host_slots
from jaxflow.workers.group import LocalWorkerGroup, WorkerGroup, Workers
from jaxflow.workers.host_transfer import (
    RowSplit,
    ShippedParams,
    assemble,
    cut_blocks,
    split_rows,
)
from jaxflow.workers.local import workers_from_groups
from jaxflow.workers.protocols import (
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    Protocol,
    WorkerGroupInfo,
    get_protocol,
    method_protocol,
    pad_batch_args,
    unpad,
)
from jaxflow.workers.ray_host import ROLE_FROM_PLACEMENT, HostProcess
from jaxflow.workers.reward import RuleRewardWorker
from jaxflow.workers.roles import RoleSettings, role_class

log = logging.getLogger(__name__)
worker_log = logging.getLogger("jaxflow.workers.ray_host")  # the worker processes' forwarded output

ACCELERATORS = ("cpu", "gpu", "tpu")

# Protocols whose Batch tensors travel by process (each rank gets the rows its devices hold),
# and how the driver finishes the assembled result given the rows it padded. The others
# (DP_COMPUTE_REPEAT: generation schedules the whole prompt batch; DP_TRAIN: mini-batches are
# drawn from the whole batch) send the whole batch to every rank, put once.
ROWS_BY_PROCESS = {DP_COMPUTE: unpad, DP_COMPUTE_METRIC: lambda metrics, pad_size: metrics}
LOST_GRACE_S = 5.0  # after a worker's death, how long the cluster's GCS is watched for going away too
UNSCHEDULABLE_FIX = (
    "lower jaxflow.ray.cpus_per_host, or the hosts the run needs (jaxflow.num_devices / "
    "jaxflow.ray.devices_per_host), or run on a cluster that holds them (jaxflow.ray.address or RAY_ADDRESS; "
    "with both empty the run starts a Ray instance of its own, sized for it)"
)


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Settings of the Ray backend (``jaxflow.ray.*`` in an experiment config).

    Attributes:
      address: Ray cluster to join; ``""``: RAY_ADDRESS, else the cluster ``ray start``
        started on this machine, else a private instance (`choose_cluster`).
      devices_per_host: accelerators per host (CPU: simulated devices per process).
      cpus_per_host: CPU cores of each host's bundle.
      accelerator: ``cpu`` | ``gpu`` | ``tpu``.
      compile_deadline_s, step_deadline_s, sync_deadline_s: see the module docstring.
      schedule_timeout_s: how long a pool may wait for its bundles.
      local_num_cpus: logical CPUs of a local Ray started here, at least the machine's (a
        run's simulated hosts need one bundle each, however few cores the machine has).
      tpu_topology, tpu_version: on TPU, each pool reserves whole slices of this topology
        (e.g. ``4x4``) and generation (e.g. ``v5p``) with ``ray.util.tpu``; ``""``: one bundle
        per TPU VM (`PoolReservation`).
    """

    address: str = ""
    devices_per_host: int = 8
    cpus_per_host: float = 1.0
    accelerator: str = "cpu"
    compile_deadline_s: float = 600.0
    step_deadline_s: float = 300.0
    sync_deadline_s: float = 120.0
    schedule_timeout_s: float = 30.0
    local_num_cpus: int | None = None
    tpu_topology: str = ""
    tpu_version: str = ""

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if self.devices_per_host < 1:
            raise ValueError(f"devices_per_host must be >= 1, got {self.devices_per_host}")
        for name in ("compile_deadline_s", "step_deadline_s", "sync_deadline_s", "schedule_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.tpu_topology and not (
            self.tpu_version and all(n.isdigit() for n in self.tpu_topology.lower().split("x"))
        ):
            raise ValueError(f"tpu_topology {self.tpu_topology!r} needs the form AxB[xC] and a tpu_version (e.g. v5p)")

    def bundle(self) -> dict[str, float]:
        """One host's resources."""
        extra = {"gpu": {"GPU": self.devices_per_host}, "tpu": {"TPU": self.devices_per_host}}
        return {"CPU": self.cpus_per_host, **extra.get(self.accelerator, {})}

    def reservation(self, num_hosts: int) -> PoolReservation:
        """What a pool of ``num_hosts`` hosts asks Ray for (`PoolReservation`)."""
        bundle = self.bundle()
        if self.accelerator == "cpu":  # simulated hosts may share a node
            return PoolReservation(((tuple(dict(bundle) for _ in range(num_hosts)), "PACK"),))
        if self.accelerator == "gpu":  # as verl: one placement group per node, STRICT_PACK
            return PoolReservation(tuple(((dict(bundle),), "STRICT_PACK") for _ in range(num_hosts)))
        if self.tpu_topology:
            chips = math.prod(int(n) for n in self.tpu_topology.lower().split("x"))
            if chips % self.devices_per_host:
                raise ValueError(
                    f"a TPU slice of topology {self.tpu_topology} ({chips} chips) is not whole hosts of "
                    f"{self.devices_per_host} chips (jaxflow.ray.devices_per_host)"
                )
            per_slice = chips // self.devices_per_host
            if num_hosts % per_slice:
                raise ValueError(
                    f"a pool of {num_hosts} TPU hosts is not a whole number of slices of topology "
                    f"{self.tpu_topology} ({per_slice} hosts each; jaxflow.ray.tpu_topology)"
                )
            return PoolReservation(
                tpu_slice={
                    "topology": self.tpu_topology,
                    "accelerator_version": self.tpu_version,
                    "num_slices": num_hosts // per_slice,
                    "resources_per_bundle": bundle,
                },
                num_hosts=num_hosts,
            )
        # TPU without a slice topology: one bundle per TPU VM on distinct nodes.
        return PoolReservation(((tuple(dict(bundle) for _ in range(num_hosts)), "STRICT_SPREAD"),))


@dataclasses.dataclass(frozen=True)
class PoolReservation:
    """How a pool's hosts are reserved on Ray (`RayConfig.reservation`), one process per host.

    * CPU: one placement group of one ``{CPU}`` bundle per host, ``PACK`` (simulated hosts
      share a machine).
    * GPU: as verl's ``RayResourcePool``: one placement group per node, ``STRICT_PACK``, here
      of one bundle holding the host's GPUs (one process drives them all).
    * TPU with ``jaxflow.ray.tpu_topology``: whole slices, reserved with Ray's
      ``ray.util.tpu.slice_placement_group`` (one bundle per TPU VM of the slice, on the VMs of
      one slice); without it, or on a Ray without ``ray.util.tpu``, one placement group of one
      bundle per VM, ``STRICT_SPREAD``.

    Attributes:
      placement_groups: ``(bundles, strategy)`` of each placement group.
      tpu_slice: keyword arguments of ``ray.util.tpu.slice_placement_group`` (or None).
      num_hosts: the hosts of a ``tpu_slice`` reservation.
    """

    placement_groups: tuple[tuple[tuple[dict[str, float], ...], str], ...] = ()
    tpu_slice: dict[str, Any] | None = None
    num_hosts: int = 0

    def __post_init__(self) -> None:
        if self.tpu_slice is None:
            object.__setattr__(self, "num_hosts", sum(len(b) for b, _ in self.placement_groups))

    def shortfall(self, cluster: dict[str, float]) -> str:
        """What the reservation needs beyond ``cluster``'s total resources (``ray.cluster_resources()``),
        e.g. ``"CPU 64.0 (the cluster has 8.0)"``; ``""`` when the totals suffice."""
        need: dict[str, float] = {}
        for bundles, _ in self.placement_groups:
            for bundle in bundles:
                for resource, amount in bundle.items():
                    need[resource] = need.get(resource, 0.0) + amount
        return ", ".join(
            f"{resource} {amount:g} (the cluster has {cluster.get(resource, 0.0):g})"
            for resource, amount in sorted(need.items())
            if amount > cluster.get(resource, 0.0)
        )

    def slot(self, rank: int) -> tuple[int, int]:
        """``(placement group, bundle index)`` of host ``rank``."""
        if self.tpu_slice is not None or len(self.placement_groups) == 1:
            return 0, rank
        return rank, 0

    def fallback(self) -> PoolReservation:
        """The reservation without ``ray.util.tpu``: one bundle per VM, ``STRICT_SPREAD``."""
        bundle = self.tpu_slice["resources_per_bundle"]
        return PoolReservation(((tuple(dict(bundle) for _ in range(self.num_hosts)), "STRICT_SPREAD"),))

    def describe(self) -> str:
        if self.tpu_slice is not None:
            s = self.tpu_slice
            return (
                f"{s['num_slices']} TPU slice(s) {s['accelerator_version']} {s['topology']} via ray.util.tpu, "
                f"{self.num_hosts} x {s['resources_per_bundle']}"
            )
        (bundles, strategy), n = self.placement_groups[0], len(self.placement_groups)
        if n == 1:
            return f"placement group of {len(bundles)} x {bundles[0]} ({strategy})"
        return f"{n} placement groups (one per node) of {len(bundles)} x {bundles[0]} ({strategy})"


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


def pool_hosts(placement: Placement, pool: str, devices_per_host: int) -> tuple[int, ...]:
    """The hosts ``pool`` takes; a pool of a Ray run must take whole hosts."""
    slots = placement.pools[pool].devices
    hosts = tuple(sorted({s.host for s in slots}))
    if len(slots) != devices_per_host * len(hosts) or any(s.local != i % devices_per_host for i, s in enumerate(slots)):
        raise ValueError(
            f"pool {pool!r} holds devices {[s.id for s in slots]}: a Ray pool takes whole hosts of "
            f"{devices_per_host} devices (jaxflow.ray.devices_per_host)"
        )
    return hosts


def _process_block(sizes: dict[str, int], per: int) -> dict[str, int]:
    """The part of a ``(dp, fsdp, tp)`` mesh (row-major over process-major devices) that one
    process of ``per`` devices holds."""
    block, left = {}, per
    for axis in reversed(list(sizes)):
        take = sizes[axis] if left % sizes[axis] == 0 else math.gcd(left, sizes[axis])
        block[axis], left = take, left // take
    return dict(reversed(block.items()))


def describe_hosts(placement: Placement, config: RayConfig) -> str:
    """The per-host plan of a Ray run, without a cluster: each pool's hosts and bundles (one
    process per host), and the mesh that the processes of each role form."""
    per = config.devices_per_host
    num_hosts = sum(p.size for p in placement.pools.values()) // per
    lines = [
        (
            f"ray backend: {num_hosts} hosts x {per} {config.accelerator} devices; one process per host per "
            "worker group, each group its own jax.distributed world"
        )
    ]
    for pool, roles in placement.groups().items():
        hosts = pool_hosts(placement, pool, per)
        lines.append(
            f"group {pool!r}: hosts {hosts[0]}..{hosts[-1]} ({len(hosts)} processes, ranks 0..{len(hosts) - 1}), "
            f"{config.reservation(len(hosts)).describe()}"
        )
        for role in roles:
            spec = placement.roles[role]
            sizes = spec.mesh.resolve(placement.pools[pool].size)
            mesh = ",".join(f"{a}={n}" for a, n in sizes.items())
            gen = ""
            if spec.gen_tp is not None:
                n = sizes["fsdp"] * sizes["tp"]
                gen = f"; generate: replica={sizes['dp']},tp={spec.gen_tp},dp={n // spec.gen_tp}"
            local = ",".join(f"{a}={n}" for a, n in _process_block(sizes, per).items())
            lines.append(
                f"  {role}: mesh {mesh} over {len(hosts)} x {per} devices; each process holds a {local} "
                f"block of it{gen}"
            )
    return "\n".join(lines)


def _ray():
    import ray

    return ray


@dataclasses.dataclass(frozen=True)
class ClusterChoice:
    """The Ray cluster a run uses: ``init_address`` is what ``ray.init`` gets (``"local"``: a
    private instance; None: Ray finds the one RAY_ADDRESS or ``ray start`` names, and turns on
    its token authentication as for any cluster it finds itself), ``reason`` says why, for the
    run's start-up line."""

    init_address: str | None
    reason: str

    @property
    def private(self) -> bool:
        return self.init_address == "local"


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at ``host:port`` (a Ray GCS)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _goes_away(address: str, within_s: float) -> bool:
    """Whether the GCS at ``address`` stops answering within ``within_s`` seconds: a cluster
    whose owner shuts it down kills its actors first and its GCS a second or two later."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not _answers(address, timeout_s=1.0):
            return True
        time.sleep(0.25)
    return False


def _ray_start_address() -> tuple[str, str] | None:
    """``(address, file)`` of the cluster that ``ray start`` last started on this machine (Ray
    records it in ``<ray temp dir>/ray_current_cluster``; ``ray stop`` removes it), or None."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # older Ray
        from ray._private.utils import get_ray_address_file
    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    return (address, path) if address else None


def choose_cluster(address: str = "") -> ClusterChoice:
    """Which Ray cluster a run uses: ``address`` (``jaxflow.ray.address``) when given, else
    ``RAY_ADDRESS``, else the cluster that ``ray start`` started on this machine if it answers,
    else a private instance that the run starts (and stops). Never a private instance of another
    process (a notebook's or a test session's plain ``ray.init()``, another run's), which Ray's
    ``address="auto"`` would join: the run would compete for its CPUs and die with it."""
    if address:
        return ClusterChoice(address, "jaxflow.ray.address names it")
    if os.environ.get("RAY_ADDRESS"):
        return ClusterChoice(None, "RAY_ADDRESS names it")
    started = _ray_start_address()
    if started is not None and _answers(started[0]):
        return ClusterChoice(None, f"it was started with `ray start` on this machine ({started[1]})")
    stale = f"; `ray start`'s cluster in {started[1]}, {started[0]}, does not answer" if started else ""
    return ClusterChoice(
        "local",
        "neither jaxflow.ray.address nor RAY_ADDRESS names a cluster and none was started with `ray start`"
        f"{stale}; other Ray instances on this machine are left alone; it stops with the run",
    )


def _ray_logs_to_python_logging() -> None:
    """Ray's log records (its ``ray`` loggers: start-up, token authentication, ...) go through
    Python logging like any library's, to the application's handlers (``jaxflow.run``: the
    log file, the console from WARNING up, Ray's below ERROR not), instead of Ray's own stderr
    handler."""
    ray_log = logging.getLogger("ray")
    for handler in list(ray_log.handlers):
        if type(handler).__name__ == "PlainRayHandler":
            ray_log.removeHandler(handler)
    ray_log.propagate = True


def _log_worker_lines(data: dict[str, Any]) -> None:
    who = data.get("actor_name") or data.get("task_name") or "worker"
    for line in data.get("lines", ()):
        worker_log.info("(%s pid=%s) %s", who, data.get("pid"), line)


def _worker_output_to_log() -> None:
    """What the worker processes print (Ray forwards it to the driver: gloo's connection
    reports, XLA's warnings) goes to the ``jaxflow.workers.ray_host`` logger at INFO (the run's
    log file), not to the console; a worker's failure reaches the driver as its exception."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: its own printing stays
        return
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("jaxflow_log", _log_worker_lines)


@contextlib.contextmanager
def _handlers_kept(*signums: int):
    """Restores the Python handlers of ``signums`` after the block (main thread only):
    ``ray.init`` replaces SIGTERM's with absl's failure handler (a C stack, exit 1), which
    would bypass the run's own (stop the groups, one line, exit 143)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def _env_for_workers(config: RayConfig) -> dict[str, str]:
    """The worker processes' environment: this jaxflow first on the path (the driver's
    checkout) and the driver's XLA flags without its simulated device count. On CPU the
    persistent compilation cache is off: measured here (jax 0.10, gloo collectives), a
    multi-process program loaded from the cache (e.g. the rollout) fails in its first
    cross-process collective (gloo context initialisation times out)."""
    flags = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {"XLA_FLAGS": flags, "PYTHONPATH": path}
    if config.accelerator == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def _host_tree(tree: Any) -> Any:
    """Arguments as host values: the driver's jax arrays become NumPy."""

    def convert(x: Any) -> Any:
        if isinstance(x, Batch):
            return x.to_host()
        return np.asarray(x) if isinstance(x, jax.Array) else x

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, Batch))


def _signature(tree: Any) -> tuple:
    """Shapes and dtypes of the array leaves (a new signature means a compile)."""

    def sig(x: Any) -> Any:
        if isinstance(x, Batch):
            return tuple((k, np.shape(v), str(v.dtype)) for k, v in sorted(x.tensors.items()))
        return (np.shape(x), str(x.dtype)) if hasattr(x, "dtype") else type(x).__name__

    return tuple(jax.tree.leaves(jax.tree.map(sig, tree, is_leaf=lambda x: isinstance(x, Batch))))


def _cluster_loss_said(method: Any) -> Any:
    """A `ProcessGroup` method whose Ray system error (not a worker's own exception) raises
    `ClusterLost` when the cluster itself went away."""

    @functools.wraps(method)
    def guarded(self: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        ray = _ray()
        try:
            return method(self, *args, **kwargs)
        except (ray.exceptions.RaySystemError, ray.exceptions.RayActorError, ConnectionError):
            self._check_cluster("starting it" if method.__name__ == "__init__" else method.__name__)
            raise

    return guarded


class ProcessGroup:
    """The processes of one pool: a placement group of ``num_hosts`` bundles, one
    `HostProcess` actor per bundle, one `jax.distributed` world (module docstring)."""

    @_cluster_loss_said
    def __init__(self, name: str, num_hosts: int, config: RayConfig):
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.num_hosts, self.config = name, num_hosts, config
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.dead: str | None = None
        self._seen: set[tuple] = set()
        self._pgs: list[Any] = []
        self._slice = None
        self.reservation = config.reservation(num_hosts)
        self._reserve()
        remote = ray.remote(HostProcess)
        options = {
            "num_cpus": config.cpus_per_host,
            "max_restarts": 0,
            "max_concurrency": 1,
            "runtime_env": {"env_vars": _env_for_workers(config)},
        }
        if config.accelerator == "gpu":
            options["num_gpus"] = config.devices_per_host
        elif config.accelerator == "tpu":
            options["resources"] = {"TPU": config.devices_per_host}
        try:
            for rank in range(num_hosts):
                pg, bundle_index = self.reservation.slot(rank)
                strategy = PlacementGroupSchedulingStrategy(self._pgs[pg], placement_group_bundle_index=bundle_index)
                self.actors.append(
                    remote.options(scheduling_strategy=strategy, **options).remote(
                        name, rank, num_hosts, config.devices_per_host, config.accelerator
                    )
                )
            (address,) = self._gather(
                [self.actors[0].free_address.remote()], "picking the coordinator port", config.sync_deadline_s
            )
            worlds = self._gather(
                [a.init_world.remote(address, config.sync_deadline_s) for a in self.actors],
                "jax.distributed.initialize",
                config.sync_deadline_s,
            )
        except BaseException:
            self.shutdown()
            raise
        self.pids = [w["pid"] for w in worlds]
        self.address = address
        log.info("worker group %r started: %d processes, pids %s, coordinator %s", name, num_hosts, self.pids, address)

    def _reserve(self) -> None:
        """Reserves the pool's bundles (`PoolReservation`), or raises `Unschedulable` with the
        fix: at once when the whole cluster is too small, else after ``schedule_timeout_s``."""
        ray, name, config = _ray(), self.name, self.config
        from ray.util.placement_group import placement_group

        if self.reservation.tpu_slice is not None:
            try:
                from ray.util.tpu import slice_placement_group
            except ImportError:  # an older Ray: one bundle per VM, not pinned to one slice
                log.warning(
                    "ray.util.tpu is not available: worker group %r reserves one bundle per TPU VM "
                    "(STRICT_SPREAD) instead of whole slices",
                    name,
                )
                self.reservation = self.reservation.fallback()
            else:
                try:
                    self._slice = slice_placement_group(
                        **self.reservation.tpu_slice, head_reservation_timeout_s=config.schedule_timeout_s
                    )
                except Exception as e:  # no such slice in the cluster (Ray's own timeout)
                    raise Unschedulable(
                        f"worker group {name!r}: the TPU slice(s) {self.reservation.describe()} "
                        f"could not be reserved: {e}",
                        name,
                    ) from e
                self._pgs = [self._slice.placement_group]
        if self._slice is None:
            short = self.reservation.shortfall(ray.cluster_resources())
            if short:  # never schedulable, however long one waits
                raise Unschedulable(
                    f"worker group {name!r}: {self.num_hosts} host bundle(s) of {config.bundle()} need {short}, "
                    f"more than the whole Ray cluster has; {UNSCHEDULABLE_FIX}",
                    name,
                )
            self._pgs = [
                placement_group(list(bundles), strategy=strategy)
                for bundles, strategy in self.reservation.placement_groups
            ]
        try:
            ray.get([pg.ready() for pg in self._pgs], timeout=config.schedule_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._release()
            raise Unschedulable(
                f"worker group {name!r}: {self.num_hosts} host bundle(s) of {config.bundle()} could not be "
                f"scheduled within {config.schedule_timeout_s:g}s (jaxflow.ray.schedule_timeout_s); the cluster has "
                f"{ray.cluster_resources()}, available {ray.available_resources()}; other jobs may hold them, "
                f"or no node holds a whole bundle: {UNSCHEDULABLE_FIX}",
                name,
            ) from None

    # ------------------------------------------------------------------ calls
    def _gather(self, refs: Sequence[Any], what: str, deadline_s: float) -> list[Any]:
        """Every rank's result, waiting at most ``deadline_s`` (module docstring)."""
        ray = _ray()
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending, end = list(refs), time.monotonic() + deadline_s
        failure: tuple[int, BaseException] | None = None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                missing = sorted(rank_of[r] for r in pending)
                self.shutdown(f"{what} passed its deadline")
                if failure is not None:
                    rank, error = failure
                    error.add_note(
                        f"raised by worker group {self.name!r} rank {rank} during {what}; ranks "
                        f"{missing} did not finish within {deadline_s:g}s, so the group was stopped"
                    )
                    raise error
                raise DeadlineExceeded(
                    f"worker group {self.name!r}: {what} passed its deadline of {deadline_s:g}s; rank(s) {missing} "
                    f"of {len(refs)} did not answer (the group's processes were stopped)",
                    self.name,
                    missing[0],
                )
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                pid = self.pids[rank] if rank < len(self.pids) else "?"
                self._check_cluster(what)
                self.shutdown(f"rank {rank} died")
                raise WorkerDied(
                    f"worker group {self.name!r} rank {rank} (pid {pid}) died during {what}: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
                    self.name,
                    rank,
                ) from None
            except ray.exceptions.RayTaskError as e:
                if failure is None:  # the others get the sync deadline to finish (or fail alike)
                    failure = (rank, e.cause if isinstance(e.cause, BaseException) else e)
                    end = min(end, time.monotonic() + self.config.sync_deadline_s)
            except ray.exceptions.RayError as e:  # e.g. OutOfMemoryError: Ray's memory monitor killed the process
                self._check_cluster(what)
                self.shutdown(f"rank {rank} lost")
                raise WorkerDied(
                    f"worker group {self.name!r} rank {rank} was lost during {what}: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}",
                    self.name,
                    rank,
                ) from None
        if failure is not None:
            rank, error = failure
            error.add_note(f"raised by worker group {self.name!r} rank {rank} during {what}")
            raise error
        return results

    def _check_cluster(self, what: str) -> None:
        """Raises `ClusterLost` when the cluster itself is gone (a worker's death is then its
        symptom); the group's handles are dropped, not killed (there is nobody to ask)."""
        gcs = _ray().get_runtime_context().gcs_address
        if not _goes_away(gcs, LOST_GRACE_S):
            return
        self.dead, self.actors, self._pgs, self._slice = "the Ray cluster is gone", [], [], None
        raise ClusterLost(
            f"the Ray cluster at {gcs} is gone (noticed during {what} of worker group {self.name!r}): whoever "
            "started it stopped it, or its head node died; run again (with jaxflow.ray.address and RAY_ADDRESS "
            "empty, the run starts a Ray instance of its own)"
        )

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise WorkerGroupError(f"worker group {self.name!r} is stopped ({self.dead})", self.name)

    @_cluster_loss_said
    def build(
        self, role: str, worker_cls: Any, kwargs: dict[str, Any], blocks: Sequence[Any] | None = None
    ) -> RowSplit | None:
        """Builds ``role`` in every process (see `HostProcess.build`; ``blocks``: each rank's
        object-store reference to its blocks of a `ShippedParams` model); how its batch rows
        fall on the processes (None for a worker without a mesh)."""
        self._check_alive()
        ref = _ray().put(kwargs)
        built = self._gather(
            [
                a.build.remote(role, worker_cls, ref, None if blocks is None else blocks[rank])
                for rank, a in enumerate(self.actors)
            ],
            f"building {role!r}",
            self.config.compile_deadline_s,
        )
        return built[0]["rows"]

    @_cluster_loss_said
    def ship_params(self, role: str, kwargs: dict[str, Any], params: Any) -> tuple[ShippedParams, list[Any]]:
        """``params`` (the driver's arrays) as a `ShippedParams` and, per rank, one object-store
        reference to the blocks that rank's devices hold in ``role``'s layout: no rank
        receives the whole model."""
        self._check_alive()
        ray = _ray()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        keys = self._gather(
            [a.block_keys.remote(role, kwargs, abstract) for a in self.actors],
            f"placing {role!r}'s parameters",
            self.config.sync_deadline_s,
        )
        return ShippedParams(None, abstract), [ray.put(cut_blocks(params, k)) for k in keys]

    @_cluster_loss_said
    def call(
        self, role: str, method: str, protocol: Protocol, args: tuple, kwargs: dict, rows: RowSplit | None = None
    ) -> Any:
        """``role.method(*args, **kwargs)`` in lock step on every rank; the assembled result
        (single-program protocols) or the protocol's collect of the per-rank results. For the
        protocols of `ROWS_BY_PROCESS`, given the role's ``rows``, each rank receives only the
        tensor rows its devices hold (the batch padded here to the data-parallel size)."""
        self._check_alive()
        ray = _ray()
        args, kwargs = _host_tree(args), _host_tree(kwargs)
        key = (role, method, _signature((args, kwargs)))
        deadline = self.config.step_deadline_s if key in self._seen else self.config.compile_deadline_s
        what = f"{role}.{method}"
        if protocol.spmd is None:
            info = WorkerGroupInfo(world_size=self.num_hosts, dp_size=1)
            dispatched = protocol.dispatch(info, args, kwargs)
            inputs = getattr(dispatched, "inputs", dispatched)
            refs = [a.call.remote(role, method, ray.put(payload)) for a, payload in zip(self.actors, inputs)]
            outputs = self._gather(refs, what, deadline)
            self._seen.add(key)
            return protocol.collect(info, outputs, getattr(dispatched, "state", None))
        if protocol.name in ROWS_BY_PROCESS and rows is not None:
            info = WorkerGroupInfo(world_size=rows.dp_size, dp_size=rows.dp_size)
            args, kwargs, pad_size = pad_batch_args(info, protocol.name, args, kwargs)
            args, kwargs, per_process = split_rows(rows, args, kwargs)
            shared = ray.put((args, kwargs))  # host columns and meta: put once, read by every rank
            refs = [
                a.call_rows.remote(role, method, shared, ray.put(mine))  # each rank's rows, put once
                for a, mine in zip(self.actors, per_process)
            ]
            outputs = self._gather(refs, what, deadline)
            self._seen.add(key)
            return ROWS_BY_PROCESS[protocol.name](assemble(outputs), pad_size)
        payload = ray.put((args, kwargs))  # put once, read by every rank
        outputs = self._gather([a.call.remote(role, method, payload) for a in self.actors], what, deadline)
        self._seen.add(key)
        return assemble(outputs)

    @_cluster_loss_said
    def io_stats(self) -> list[dict[str, int]]:
        """Each rank's `HostProcess.io_stats` (measured transfer counters)."""
        self._check_alive()
        return self._gather([a.io_stats.remote() for a in self.actors], "io_stats", self.config.sync_deadline_s)

    def shutdown(self, reason: str = "shut down") -> None:
        """Kills the group's processes and frees its bundles (idempotent)."""
        if self.dead is None:
            self.dead = reason
        ray = _ray()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        self._release()

    def _release(self) -> None:
        """Frees the pool's placement groups (idempotent)."""
        from ray.util.placement_group import remove_placement_group

        pgs, self._pgs = self._pgs, []
        if self._slice is not None:
            slice_, self._slice = self._slice, None
            try:
                slice_.shutdown()
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass
            return
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, hosts={self.num_hosts}, pids={self.pids})"


class RayWorkerGroup(WorkerGroup):
    """The driver's handle on one role of a `ProcessGroup` (a `WorkerGroup`: its methods are
    the worker class's registered methods, run in lock step on every process). ``rows``: how
    the role's batch rows fall on the processes (`ProcessGroup.build` returns it)."""

    def __init__(self, processes: ProcessGroup, role: str, worker_cls: type, rows: RowSplit | None = None):
        self.processes, self.name, self.worker_cls, self.rows = processes, role, worker_cls, rows
        self.info = WorkerGroupInfo(world_size=processes.num_hosts, dp_size=1)

    def execute(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        protocol = method_protocol(getattr(self.worker_cls, method, None))
        if protocol is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{method} is not registered with a protocol")
        protocol = get_protocol(protocol)
        return self._finish(protocol, self.processes.call(self.name, method, protocol, args, kwargs, self.rows))


class RayBackend:
    """Joins or starts Ray (`choose_cluster`) and starts worker groups; a context manager that
    stops them, and the Ray instance it started (`close`). ``cluster`` says in one line which
    cluster the run uses and why."""

    def __init__(self, config: RayConfig = RayConfig()):
        self.config = config
        self.groups: dict[str, ProcessGroup] = {}
        self.owns_cluster = False
        ray = _ray()
        if ray.is_initialized():
            self.cluster = (
                f"ray: using the Ray instance this process had joined ({ray.get_runtime_context().gcs_address})"
            )
            return
        choice, cpus = choose_cluster(config.address), {}
        _ray_logs_to_python_logging()
        with _handlers_kept(signal.SIGINT, signal.SIGTERM), warnings.catch_warnings():
            # Ray starts its GCS and raylet with fork + exec, which CPython's check for a fork
            # in a threaded process reports; nothing runs between the two.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            if choice.private:
                cpus = {"num_cpus": max(os.cpu_count() or 1, config.local_num_cpus or 0)}
            try:
                ray.init(address=choice.init_address, include_dashboard=False, configure_logging=False, **cpus)
            except (ConnectionError, ray.exceptions.AuthenticationError) as e:
                ray.shutdown()
                where = choice.init_address or os.environ.get("RAY_ADDRESS") or "the address `ray start` recorded"
                raise ClusterError(
                    f"cannot join the Ray cluster at {where} ({choice.reason}): {' '.join(str(e).split())[:300]}; "
                    "if it uses token authentication (Ray's default for the clusters it starts), set "
                    "RAY_AUTH_MODE=token"
                ) from e
            except BaseException:  # e.g. Ctrl-C while Ray starts: what it started so far stops
                ray.shutdown()
                raise
            self.owns_cluster = choice.private
        _worker_output_to_log()
        gcs = ray.get_runtime_context().gcs_address
        verb = "started a private Ray instance" if self.owns_cluster else "joined the Ray cluster"
        self.cluster = f"ray: {verb} at {gcs}: {choice.reason}"
        log.info("%s", self.cluster)

    def devices(self, num_devices: int) -> tuple[HostSlot, ...]:
        """``num_devices`` `HostSlot`s, ``devices_per_host`` per host (a Placement's devices)."""
        return host_slots(num_devices, self.config.devices_per_host)

    def process_group(self, name: str, num_hosts: int) -> ProcessGroup:
        if name in self.groups:
            raise ValueError(f"a worker group named {name!r} is already running")
        group = ProcessGroup(name, num_hosts, self.config)
        self.groups[name] = group
        return group

    def group(self, processes: ProcessGroup, worker_cls: type, *, name: str, **kwargs: Any) -> RayWorkerGroup:
        """A `RayWorkerGroup` of ``worker_cls(**kwargs)`` built in every process of ``processes``
        (mesh arguments as `MeshSpec` text: each process builds them over its world)."""
        return RayWorkerGroup(processes, name, worker_cls, processes.build(name, worker_cls, kwargs))

    def build_workers(
        self,
        placement: Placement,
        *,
        actor: Any,
        ref: Any = None,
        critic: Any = None,
        reward_model: Any = None,
        rule_reward: RuleRewardWorker | None = None,
        cost_model: Any = None,
        settings: RoleSettings = RoleSettings(),
        reward_weights: tuple[float, float] = (1.0, 1.0),
    ) -> Workers:
        """`jaxflow.workers.build_local_workers` on Ray: one `ProcessGroup` per pool, the
        roles built in its processes. A model is a checkpoint directory, a ``(graphdef,
        state)`` pair in the driver's memory (each process receives only the blocks its
        devices hold: `ProcessGroup.ship_params`) or a callable ``(mesh, rules) -> model`` run
        in every process (each reads or initialises its own shards). The rule scorer runs on
        the driver."""
        models = {"actor": actor, "ref": ref, "critic": critic, "reward": reward_model, "cost": cost_model}
        groups: dict[str, WorkerGroup] = {}
        for pool, roles in placement.groups().items():
            wanted = [r for r in roles if models.get(r) is not None]
            if not wanted:
                continue
            processes = self.process_group(pool, len(pool_hosts(placement, pool, self.config.devices_per_host)))
            for role in wanted:
                kwargs = {"placement": placement, "pool": pool, "model": models[role], "settings": settings}
                blocks = None
                if isinstance(models[role], tuple):  # weights in the driver's memory: each rank gets its blocks
                    graphdef, params = models[role]
                    shipped, blocks = processes.ship_params(role, {**kwargs, "model": None}, params)
                    kwargs["model"] = dataclasses.replace(shipped, graphdef=graphdef)
                groups[role] = RayWorkerGroup(
                    processes, role, role_class(role), processes.build(role, ROLE_FROM_PLACEMENT, kwargs, blocks)
                )
        rule = None if rule_reward is None else LocalWorkerGroup(rule_reward, name="rule_reward")
        return workers_from_groups(
            groups, rule_reward=rule, reward_weights=reward_weights, ref_in_actor=settings.ref_in_actor
        )

    def shutdown(self) -> None:
        """Stops every group this backend started (the cluster stays: a restart starts new ones)."""
        for group in self.groups.values():
            group.shutdown()
        self.groups.clear()

    def close(self) -> None:
        """`shutdown`, then stops the private Ray instance this backend started, all of its
        processes (GCS, raylet, dashboard agent, log monitor, workers); a joined cluster stays."""
        try:
            self.shutdown()
        finally:
            if self.owns_cluster:
                self.owns_cluster = False
                _ray().shutdown()

    def __enter__(self) -> RayBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
