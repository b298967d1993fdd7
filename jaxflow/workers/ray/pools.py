"""Resource pools on Ray: a pool's bundles once held (`ReservedPool`, what
`config.PoolReservation` asks for), reported as `Unschedulable` with the fix when the cluster
cannot hold them."""

from __future__ import annotations

import logging
from typing import Any

from jaxflow.workers.ray.cluster import ray_module
from jaxflow.workers.ray.config import RayConfig
from jaxflow.workers.ray.errors import Unschedulable

log = logging.getLogger(__name__)

UNSCHEDULABLE_FIX = (
    "lower jaxflow.ray.cpus_per_host, or the hosts the run needs (jaxflow.num_devices / "
    "jaxflow.ray.devices_per_host), or run on a cluster that holds them (jaxflow.ray.address or RAY_ADDRESS; "
    "with both empty the run starts a Ray instance of its own, sized for it)"
)


class ReservedPool:
    """The bundles of pool ``name`` held on Ray, one per host: its placement groups (or the
    TPU slice holding them), reserved when made. ``reservation``: what was asked for (the
    fallback of a TPU slice reservation on a Ray without ``ray.util.tpu``)."""

    def __init__(self, name: str, num_hosts: int, config: RayConfig):
        self.name, self.num_hosts, self.config = name, num_hosts, config
        self.reservation = config.reservation(num_hosts)
        self.placement_groups: list[Any] = []
        self.tpu_slice: Any = None
        if self.reservation.tpu_slice is not None:
            self._reserve_tpu_slice()
        if self.tpu_slice is None:
            self._reserve_placement_groups()
        self._wait_ready()

    def _reserve_tpu_slice(self) -> None:
        try:
            from ray.util.tpu import slice_placement_group
        except ImportError:  # an older Ray: one bundle per VM, not pinned to one slice
            log.warning(
                "ray.util.tpu is not available: worker group %r reserves one bundle per TPU VM "
                "(STRICT_SPREAD) instead of whole slices",
                self.name,
            )
            self.reservation = self.reservation.fallback()
            return
        try:
            self.tpu_slice = slice_placement_group(
                **self.reservation.tpu_slice, head_reservation_timeout_s=self.config.schedule_timeout_s
            )
        except Exception as e:  # no such slice in the cluster (Ray's own timeout)
            raise Unschedulable(
                f"worker group {self.name!r}: the TPU slice(s) {self.reservation.describe()} "
                f"could not be reserved: {e}",
                self.name,
            ) from e
        self.placement_groups = [self.tpu_slice.placement_group]

    def _reserve_placement_groups(self) -> None:
        """Raises `Unschedulable` at once when the whole cluster is too small."""
        from ray.util.placement_group import placement_group

        short = self.reservation.shortfall(ray_module().cluster_resources())
        if short:  # never schedulable, however long one waits
            raise Unschedulable(
                f"worker group {self.name!r}: {self.num_hosts} host bundle(s) of {self.config.bundle()} need "
                f"{short}, more than the whole Ray cluster has; {UNSCHEDULABLE_FIX}",
                self.name,
            )
        self.placement_groups = [
            placement_group(list(bundles), strategy=strategy) for bundles, strategy in self.reservation.placement_groups
        ]

    def _wait_ready(self) -> None:
        """Waits ``schedule_timeout_s`` for the bundles, else frees them and raises `Unschedulable`."""
        ray, config = ray_module(), self.config
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=config.schedule_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.release()
            raise Unschedulable(
                f"worker group {self.name!r}: {self.num_hosts} host bundle(s) of {config.bundle()} could not be "
                f"scheduled within {config.schedule_timeout_s:g}s (jaxflow.ray.schedule_timeout_s); the cluster has "
                f"{ray.cluster_resources()}, available {ray.available_resources()}; other jobs may hold them, "
                f"or no node holds a whole bundle: {UNSCHEDULABLE_FIX}",
                self.name,
            ) from None

    def scheduling_strategy(self, rank: int) -> Any:
        """Where host ``rank``'s process runs: its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, bundle_index = self.reservation.slot(rank)
        return PlacementGroupSchedulingStrategy(self.placement_groups[pg], placement_group_bundle_index=bundle_index)

    def release(self) -> None:
        """Frees the bundles (idempotent)."""
        from ray.util.placement_group import remove_placement_group

        pgs, tpu_slice = self.forget()
        if tpu_slice is not None:
            try:
                tpu_slice.shutdown()
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass
            return
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass

    def forget(self) -> tuple[list[Any], Any]:
        """Drops the handles without freeing anything (the cluster is gone); returns them."""
        held = self.placement_groups, self.tpu_slice
        self.placement_groups, self.tpu_slice = [], None
        return held
