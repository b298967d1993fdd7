"""Resource pools: named, disjoint subsets of the devices.

A pool is what a role (or several colocated roles) runs on; each role then builds a mesh
over its pool (:mod:`jaxflow.mesh.specs`). Splitting 8 devices into an actor pool of 4 and
critic / reward pools of 2 each::

    pools = split_pools({"actor": 4, "critic": 2, "reward": 2})
    pools["critic"].devices  # (CpuDevice(id=4), CpuDevice(id=5))

Pools take devices in the order given (``jax.devices()`` by default), so contiguous pools
are contiguous device ids: on a GPU host that keeps a pool inside one NVLink island.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class ResourcePool:
    """A named, ordered set of devices."""

    name: str
    devices: tuple[Any, ...]

    def __post_init__(self):
        if not self.name:
            raise ValueError("a resource pool needs a non-empty name")
        if not self.devices:
            raise ValueError(f"resource pool {self.name!r} has no devices")
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"resource pool {self.name!r} lists a device twice: ids {ids}")

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, device_ids={list(self.device_ids)})"


def split_pools(
    sizes: Mapping[str, int] | Sequence[tuple[str, int]],
    devices: Sequence[Any] | None = None,
) -> dict[str, ResourcePool]:
    """Split ``devices`` (default: all of ``jax.devices()``) into consecutive named pools.

    ``sizes`` maps pool name -> number of devices, in order (a dict, or a sequence of
    ``(name, size)`` pairs, which is where a duplicate name can be caught). The sizes must
    add up to the number of devices exactly; one size may be ``-1`` to take the rest.
    """
    devices = tuple(jax.devices() if devices is None else devices)
    items = list(sizes.items()) if isinstance(sizes, Mapping) else [tuple(p) for p in sizes]
    if not items:
        raise ValueError("split_pools needs at least one pool")
    names = [name for name, _ in items]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate pool names {dupes} in {names}")
    fills = [name for name, size in items if size == -1]
    if len(fills) > 1:
        raise ValueError(f"at most one pool may have size -1 (fill the rest); got {fills}")
    for name, size in items:
        if not isinstance(size, int) or (size <= 0 and size != -1):
            raise ValueError(f"pool {name!r} has size {size!r}; sizes are positive integers (or -1)")
    fixed = sum(size for _, size in items if size != -1)
    if fills:
        rest = len(devices) - fixed
        if rest <= 0:
            raise ValueError(f"pool sizes {dict(items)} leave {rest} devices for {fills[0]!r} out of {len(devices)}")
        items = [(name, rest if size == -1 else size) for name, size in items]
    elif fixed != len(devices):
        raise ValueError(f"pool sizes {dict(items)} add up to {fixed} but there are {len(devices)} devices")
    pools: dict[str, ResourcePool] = {}
    start = 0
    for name, size in items:
        pools[name] = ResourcePool(name, devices[start : start + size])
        start += size
    return pools


def whole_pool(name: str = "global", devices: Sequence[Any] | None = None) -> ResourcePool:
    """One pool over every device (the colocated placement)."""
    return ResourcePool(name, tuple(jax.devices() if devices is None else devices))
