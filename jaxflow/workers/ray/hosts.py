"""The hosts of a Ray run as the driver plans them, without a cluster: the hosts each pool
takes (whole hosts, over the `jaxflow.mesh.devices.HostSlot`s a `Placement` is built over),
and the per-host plan a run prints (`describe_hosts`)."""

from __future__ import annotations

import math

from jaxflow.mesh import Placement
from jaxflow.workers.ray.config import RayConfig


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
