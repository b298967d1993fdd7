"""The worker side of the Ray backend: one `HostProcess` per host per worker group.

A `HostProcess` is a plain class that `jaxflow.workers.ray` runs as a Ray actor. Its
life:

1. ``free_address()`` (rank 0 only): an ``ip:port`` for the group's JAX coordinator.
2. ``init_world(address, ...)``: ``jax.distributed.initialize`` with this rank, before
   anything touches a device, with the persistent compilation cache on (a restarted worker
   loads its programs from disk). On CPU, ``devices_per_process`` simulated devices and the gloo
   cross-process collectives. From then on ``jax.devices()`` are the group's global devices.
3. ``build(role, ...)``: builds a role worker inside this process, the same class with the
   same arguments as the local backend (``jaxflow.workers.roles.make_role_worker`` for
   placement roles, or any worker class). Roles sharing the pool share the process. A model
   is read or initialised here, each process only its shards; a model from the driver's
   memory arrives as this process's blocks (``block_keys`` says which).
4. ``call(role, method, payload)``: runs the method. Every process of the group receives the
   same calls in the same order (the driver submits them so, and a Ray actor runs its calls
   one at a time in order), so every process enters the same compiled programs in the same
   order. A method with a single-program form runs it (`call_spmd`) over the global mesh
   and returns its share of the result (`jaxflow.workers.host_transfer.to_pieces`);
   a per-rank method (ALL_TO_ALL) returns its own value. ``call_rows(role, method, shared,
   rows)`` is the same for a data-parallel method whose batch tensors arrive by process: this
   process's rows become global arrays (`jaxflow.workers.host_transfer.rows_to_global`).
5. ``stream_open(role, side)``, ``stream_join(...)``, ``stream_sync(key, sync)``: this
   process's end of a weight stream between two groups' worlds
   (`jaxflow.workers.weight_stream.StreamEndpoint`, one transfer server per process, started
   on first use; the driver's side is `jaxflow.workers.ray.streams.WeightStream`).

A thread of each process watches its parent (the raylet that started it) and ends the
process when that dies, so a process whose Ray instance is gone never lingers.

Nothing here imports Ray: the class is turned into an actor by the driver.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

ROLE_FROM_PLACEMENT = "placement"
PARENT_POLL_S = 0.5


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this process once ``parent_pid`` (the raylet that started it) is no longer its
    parent: the Ray instance is gone (e.g. its driver was killed), and nobody is left to stop
    this process, which may be inside a collective or a compiled loop for minutes."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


class HostProcess:
    """One process of one worker group (see the module docstring).

    Args:
      group: the group's name (for messages).
      rank: this process's index in the group's `jax.distributed` world.
      num_processes: processes in the group.
      devices_per_process: local devices of each process (CPU: simulated device count).
      platform: ``cpu`` | ``gpu`` | ``tpu``.
    """

    def __init__(self, group: str, rank: int, num_processes: int, devices_per_process: int, platform: str):
        self.group, self.rank, self.num_processes = group, rank, num_processes
        self.devices_per_process, self.platform = devices_per_process, platform
        self.roles: dict[str, Any] = {}
        self.infos: dict[str, Any] = {}
        self.endpoint: Any = None  # this process's StreamEndpoint, once a stream needs it
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
        # Measured: tensor bytes received by data-parallel calls (their rows), and parameter
        # bytes received from the driver (`ShippedParams` blocks).
        self.io = {"row_bytes": 0, "param_bytes": 0}

    def io_stats(self) -> dict[str, int]:
        """What this process has received so far (`io`)."""
        return dict(self.io)

    # ------------------------------------------------------------------ world
    def pid(self) -> int:
        return os.getpid()

    def free_address(self) -> str:
        """``ip:port`` of a port free on this host (the coordinator's)."""
        import ray  # inside a Ray actor, Ray is there

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ip}:{port}"

    def init_world(self, address: str, timeout_s: float) -> dict[str, Any]:
        """Joins the group's JAX world; returns what this process sees of it. The persistent
        compilation cache is on, so a restarted worker loads its programs from disk."""
        import jax

        from jaxflow.mesh import enable_compilation_cache

        enable_compilation_cache(self.platform)
        if self.platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", self.devices_per_process)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            address,
            num_processes=self.num_processes,
            process_id=self.rank,
            initialization_timeout=max(1, int(timeout_s)),
        )
        local = jax.local_devices()
        if len(local) != self.devices_per_process:
            raise RuntimeError(
                f"group {self.group!r} rank {self.rank}: {len(local)} local devices, expected "
                f"{self.devices_per_process}"
            )
        return {
            "process_index": jax.process_index(),
            "global_devices": jax.device_count(),
            "local_device_ids": [d.id for d in local],
            "pid": os.getpid(),
        }

    # ------------------------------------------------------------------ roles
    def _placement_layout(self, role: str, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """The placement of ``kwargs['pool']`` over this world's devices, and the mesh and
        rules that ``role``'s model is laid out with."""
        import jax

        from jaxflow.mesh import Role
        from jaxflow.workers.roles import pool_placement

        placement = pool_placement(kwargs["placement"], kwargs["pool"], tuple(jax.devices()))
        phase = "train" if Role(role).trains else "infer"
        return placement, placement.mesh(role, "train"), placement.rules(role, phase)

    def block_keys(self, role: str, kwargs: dict[str, Any], abstract: Any) -> list[list[tuple]]:
        """The blocks of each parameter (``abstract``: shapes and dtypes) that this process's
        devices hold in ``role``'s layout (`jaxflow.workers.host_transfer.block_keys`)."""
        from jaxflow.mesh import state_shardings
        from jaxflow.workers.host_transfer import block_keys

        _, mesh, rules = self._placement_layout(role, kwargs)
        return block_keys(abstract, state_shardings(abstract, rules, mesh))

    def build(self, role: str, worker_cls: Any, kwargs: dict[str, Any], blocks: Any = None) -> dict[str, Any]:
        """Builds ``worker_cls(**kwargs)`` as ``role`` (``worker_cls == "placement"``: the
        placement role ``role`` from ``kwargs = {placement, pool, model, settings}``).
        A callable ``model`` is called here (``model(mesh, rules)``) so that each process
        reads or initialises only what it needs; a `ShippedParams` model is built from
        ``blocks``, this process's blocks of it. Returns the seconds it took and, for a
        worker with a mesh, how its batch rows fall on the processes (a `RowSplit`)."""
        from jaxflow.mesh import state_shardings
        from jaxflow.workers.host_transfer import (
            RowSplit,
            ShippedParams,
            block_keys,
            from_blocks,
        )
        from jaxflow.workers.protocols import WorkerGroupInfo
        from jaxflow.workers.roles import make_role_worker

        start = time.perf_counter()
        if worker_cls == ROLE_FROM_PLACEMENT:
            placement, mesh, rules = self._placement_layout(role, kwargs)
            model = kwargs["model"]
            if isinstance(model, ShippedParams):
                self.io["param_bytes"] += sum(b.nbytes for leaf in blocks for b in leaf)
                shardings = state_shardings(model.abstract, rules, mesh)
                keys = block_keys(model.abstract, shardings)
                model = (model.graphdef, from_blocks(model.abstract, shardings, keys, blocks))
            elif callable(model):
                model = model(mesh, rules)
            worker = make_role_worker(role, placement, model, kwargs["settings"])
        else:
            worker = worker_cls(**kwargs)
        mesh = getattr(worker, "mesh", None)
        self.roles[role] = worker
        self.infos[role] = (
            WorkerGroupInfo(world_size=1, dp_size=1)
            if mesh is None
            else WorkerGroupInfo.from_mesh(mesh, worker.dp_axes)
        )
        rows = None if mesh is None else RowSplit.from_mesh(mesh, worker.dp_axes, self.num_processes)
        return {"seconds": time.perf_counter() - start, "rows": rows}

    def call(self, role: str, method: str, payload: tuple[tuple, dict]) -> Any:
        """Runs ``role.method`` on this process's part of the group (module docstring)."""
        import jax

        from jaxflow.workers.host_transfer import to_host_local, to_pieces
        from jaxflow.workers.protocols import call_spmd, method_protocol

        args, kwargs = payload
        bound = getattr(self.roles[role], method)
        protocol = method_protocol(bound)
        if protocol is None:
            raise AttributeError(f"{type(self.roles[role]).__name__}.{method} is not registered with a protocol")
        if protocol.spmd is None:
            return to_host_local(bound(*args, **kwargs))
        return to_pieces(call_spmd(self.infos[role], protocol, bound, *args, **kwargs), jax.process_index())

    def call_rows(self, role: str, method: str, shared: tuple[tuple, dict], rows: list[dict[str, Any]]) -> Any:
        """`call` of a data-parallel method whose Batch arguments arrived as `LocalRows` (host
        columns, shared) and ``rows`` (this process's tensor rows, already padded to the
        data-parallel size by the driver)."""
        from jaxflow.workers.host_transfer import rows_to_global

        worker = self.roles[role]
        self.io["row_bytes"] += sum(v.nbytes for r in rows for v in r.values())
        args, kwargs = rows_to_global(*shared, rows, worker.mesh, worker.dp_axes)
        return self.call(role, method, (args, kwargs))

    # ------------------------------------------------------------------ weight streams
    def stream_open(self, role: str, side: str) -> dict[str, Any]:
        """This process's transfer server address (the server started on first use, on this
        node's address) and ``role``'s leaf paths and layout as ``side`` of a stream
        (`StreamEndpoint.describe`)."""
        from jaxflow.workers.weight_stream import StreamEndpoint

        if self.endpoint is None:
            import ray  # inside a Ray actor, Ray is there

            self.endpoint = StreamEndpoint(ray.util.get_node_ip_address())
        return self.endpoint.describe(self.roles[role], side)

    def stream_join(self, key: str, role: str, side: str, route: Any) -> None:
        """Takes part in stream ``key`` as ``role``'s ``side`` along the driver's ``route`` (a
        `jaxflow.workers.weight_stream.StreamRoute`; `StreamEndpoint.join`)."""
        self.endpoint.join(key, self.roles[role], side, route)

    def stream_sync(self, key: str, sync: int) -> Any:
        """This process's part of sync number ``sync`` of stream ``key`` (a `StreamReport`)."""
        return self.endpoint.sync(key, sync)
