"""The Ray backend's settings (``jaxflow.ray.*``) and what one host of a pool asks Ray for."""

from __future__ import annotations

import dataclasses
import math

from jaxflow.workers.ray.pools import PoolReservation

ACCELERATORS = ("cpu", "gpu", "tpu")


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
