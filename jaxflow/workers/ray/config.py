"""The Ray backend's settings (``jaxflow.ray.*``) and what one host of a pool asks Ray for."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ACCELERATORS = ("cpu", "gpu", "tpu")


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
