"""The processes of one pool: a `ProcessGroup` starts one
`jaxflow.workers.ray_host.HostProcess` actor per bundle of its `ReservedPool`; rank 0 picks a
free port and every rank calls ``jax.distributed.initialize``, one JAX world per group. Roles
that share a pool share its processes, and each process builds the same role objects as the
local backend (over its world's global devices). `ProcessGroup.shutdown` kills the processes
and frees the bundles; a Ray system error while the cluster itself went away raises
`ClusterLost` instead of a worker's failure.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax

from jaxflow.workers.host_transfer import RowSplit, ShippedParams, cut_blocks
from jaxflow.workers.protocols import Protocol
from jaxflow.workers.ray.cluster import lost_cluster, ray_module
from jaxflow.workers.ray.config import RayConfig
from jaxflow.workers.ray.deadlines import call_deadline, gather
from jaxflow.workers.ray.dispatch import call_signature, host_tree, remote_calls
from jaxflow.workers.ray.errors import WorkerGroupError
from jaxflow.workers.ray.pools import ReservedPool
from jaxflow.workers.ray_host import HostProcess

log = logging.getLogger(__name__)


def env_for_workers(config: RayConfig, num_processes: int) -> dict[str, str]:
    """The worker processes' environment: this jaxflow first on the path (the driver's
    checkout) and the driver's XLA flags without its simulated device count. On CPU the
    persistent compilation cache is off in a world of several processes: measured here (jax
    0.10, gloo collectives), a multi-process program loaded from the cache (e.g. the rollout)
    fails in its first cross-process collective (gloo context initialisation times out). A
    one-process world has no cross-process collective and keeps the driver's cache settings."""
    flags = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {"XLA_FLAGS": flags, "PYTHONPATH": path}
    if config.accelerator == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        if num_processes > 1:
            env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def _cluster_loss_said(method: Any) -> Any:
    """A `ProcessGroup` method whose Ray system error (not a worker's own exception) raises
    `ClusterLost` when the cluster itself went away."""

    @functools.wraps(method)
    def guarded(self: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        ray = ray_module()
        try:
            return method(self, *args, **kwargs)
        except (ray.exceptions.RaySystemError, ray.exceptions.RayActorError, ConnectionError):
            self.check_cluster("starting it" if method.__name__ == "__init__" else method.__name__)
            raise

    return guarded


class ProcessGroup:
    """The processes of one pool: one `HostProcess` actor per bundle of a `ReservedPool` of
    ``num_hosts`` bundles, one `jax.distributed` world (module docstring)."""

    @_cluster_loss_said
    def __init__(self, name: str, num_hosts: int, config: RayConfig):
        self.name, self.num_hosts, self.config = name, num_hosts, config
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.dead: str | None = None
        self._seen: set[tuple] = set()
        self.pool: ReservedPool | None = None  # set once its bundles are held
        self.pool = ReservedPool(name, num_hosts, config)
        try:
            self._start_actors()
            (address,) = self.gather(
                [self.actors[0].free_address.remote()], "picking the coordinator port", config.sync_deadline_s
            )
            worlds = self.gather(
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

    def _start_actors(self) -> None:
        """One `HostProcess` per bundle, each in its bundle, with the workers' environment."""
        config = self.config
        options = {
            "num_cpus": config.cpus_per_host,
            "max_restarts": 0,
            "max_concurrency": 1,
            "runtime_env": {"env_vars": env_for_workers(config, self.num_hosts)},
        }
        if config.accelerator == "gpu":
            options["num_gpus"] = config.devices_per_host
        elif config.accelerator == "tpu":
            options["resources"] = {"TPU": config.devices_per_host}
        remote = ray_module().remote(HostProcess)
        for rank in range(self.num_hosts):
            strategy = self.pool.scheduling_strategy(rank)
            self.actors.append(
                remote.options(scheduling_strategy=strategy, **options).remote(
                    self.name, rank, self.num_hosts, config.devices_per_host, config.accelerator
                )
            )

    def gather(self, refs: Sequence[Any], what: str, deadline_s: float) -> list[Any]:
        """Every rank's result, waiting at most ``deadline_s`` (`jaxflow.workers.ray.deadlines`)."""
        return gather(self, refs, what, deadline_s)

    def check_cluster(self, what: str) -> None:
        """Raises `ClusterLost` when the cluster itself is gone (a worker's death is then its
        symptom); the group's handles are dropped, not killed (there is nobody to ask)."""
        error = lost_cluster(what, self.name)
        if error is None:
            return
        self.dead, self.actors = "the Ray cluster is gone", []
        if self.pool is not None:
            self.pool.forget()
        raise error

    def check_alive(self) -> None:
        """Raises `WorkerGroupError` once the group is stopped (its processes are gone)."""
        if self.dead is not None:
            raise WorkerGroupError(f"worker group {self.name!r} is stopped ({self.dead})", self.name)

    @_cluster_loss_said
    def build(
        self, role: str, worker_cls: Any, kwargs: dict[str, Any], blocks: Sequence[Any] | None = None
    ) -> RowSplit | None:
        """Builds ``role`` in every process (see `HostProcess.build`; ``blocks``: each rank's
        object-store reference to its blocks of a `ShippedParams` model); how its batch rows
        fall on the processes (None for a worker without a mesh)."""
        self.check_alive()
        ref = ray_module().put(kwargs)
        built = self.gather(
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
        self.check_alive()
        ray = ray_module()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        keys = self.gather(
            [a.block_keys.remote(role, kwargs, abstract) for a in self.actors],
            f"placing {role!r}'s parameters",
            self.config.sync_deadline_s,
        )
        return ShippedParams(None, abstract), [ray.put(cut_blocks(params, k)) for k in keys]

    @_cluster_loss_said
    def call(
        self, role: str, method: str, protocol: Protocol, args: tuple, kwargs: dict, rows: RowSplit | None = None
    ) -> Any:
        """``role.method(*args, **kwargs)`` in lock step on every rank (`remote_calls`: the
        assembled result, or the protocol's collect of the per-rank results)."""
        self.check_alive()
        args, kwargs = host_tree(args), host_tree(kwargs)
        key = (role, method, call_signature((args, kwargs)))
        refs, finish = remote_calls(self.actors, role, method, protocol, args, kwargs, rows)
        outputs = self.gather(refs, f"{role}.{method}", call_deadline(self.config, key in self._seen))
        self._seen.add(key)
        return finish(outputs)

    def submit(self, method: str, *args: Any) -> list[Any]:
        """``HostProcess.method(*args)`` on every rank, in rank order, not waited for (`gather`
        the references: e.g. two groups' calls under way at once)."""
        self.check_alive()
        return [getattr(a, method).remote(*args) for a in self.actors]

    @_cluster_loss_said
    def io_stats(self) -> list[dict[str, int]]:
        """Each rank's `HostProcess.io_stats` (measured transfer counters)."""
        self.check_alive()
        return self.gather([a.io_stats.remote() for a in self.actors], "io_stats", self.config.sync_deadline_s)

    def shutdown(self, reason: str = "shut down") -> None:
        """Kills the group's processes and frees its bundles (idempotent)."""
        if self.dead is None:
            self.dead = reason
        ray = ray_module()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.pool is not None:
            self.pool.release()

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, hosts={self.num_hosts}, pids={self.pids})"
