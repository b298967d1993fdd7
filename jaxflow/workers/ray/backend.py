"""The Ray backend's facade: `RayBackend` joins or starts the cluster and builds a run's worker
groups, one `ProcessGroup` per pool, with the same role classes and arguments as the local
backend; a context manager that stops them, and the Ray instance it started."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxflow.mesh import Placement
from jaxflow.mesh.devices import HostSlot, host_slots
from jaxflow.workers.group import LocalWorkerGroup, WorkerGroup, Workers
from jaxflow.workers.host_transfer import RowSplit
from jaxflow.workers.local import workers_from_groups
from jaxflow.workers.protocols import WorkerGroupInfo, get_protocol, method_protocol
from jaxflow.workers.ray.cluster import join_cluster, ray_module
from jaxflow.workers.ray.config import RayConfig
from jaxflow.workers.ray.hosts import pool_hosts
from jaxflow.workers.ray.processes import ProcessGroup
from jaxflow.workers.ray_host import ROLE_FROM_PLACEMENT
from jaxflow.workers.reward import RuleRewardWorker
from jaxflow.workers.roles import RoleSettings, role_class


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
    """Joins or starts Ray (`jaxflow.workers.ray.cluster.choose_cluster`) and starts worker
    groups; a context manager that stops them, and the Ray instance it started (`close`).
    ``cluster`` says in one line which cluster the run uses and why."""

    def __init__(self, config: RayConfig = RayConfig()):
        self.config = config
        self.groups: dict[str, ProcessGroup] = {}
        self.cluster, self.owns_cluster = join_cluster(config.address, config.local_num_cpus)

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
                ray_module().shutdown()

    def __enter__(self) -> RayBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
