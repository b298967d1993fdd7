"""HybridFlow's device mapping (§6, Algorithm 1) over jaxflow's roles, pools and meshes.

::

    for placement in set_partitions(roles):              # Bell(k) ways to colocate k roles
        mins = [min_devices(S) for S in placement]       # by memory (smallest fitting pool)
        for sizes in allocations(N, mins):               # pool sizes summing to N
            layouts = [best_layouts(S, n) for ...]       # Algorithm 2, cached per (roles, n)
            cost = schedule(dataflow, layouts)           # iteration time of the plan

``best_layouts(S, n)`` chooses each role's layout on the pool (:mod:`jaxflow.automap.layouts`)
so that the roles' summed stage times (:mod:`jaxflow.automap.simulate`) are least and
their memory fits together: what colocated roles keep (parameters, optimizer state) plus the
largest transient of any of their phases within the device's usable memory.

Pool sizes: divisors of the host size below one host, whole hosts above (the paper
allocates whole machines to large pools; tp stays within a host). Search time is bounded by
caching per (role, n) and per (roles, n), and by trying only each role's fastest layouts and
its leanest ones jointly.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxflow.automap.layouts import RoleLayout, divisors, feasible_layouts
from jaxflow.automap.profiles import GiB, DeviceProfile
from jaxflow.automap.simulate import StageTime, stage_time
from jaxflow.automap.workload import Workload
from jaxflow.configs.resolve import mesh_key

# Per role, how many of its fastest layouts (and of its leanest) are tried jointly.
JOINT_CANDIDATES = 6


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every partition of ``items`` into non-empty sets (Bell(len(items)) of them)."""
    items = list(items)
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [(first,) + part[i]] + part[i + 1:]
        yield [(first,)] + part


def pool_sizes(total: int, devices_per_host: int) -> list[int]:
    """Pool sizes the search allocates: divisors of a host below one host, whole hosts above."""
    small = [d for d in divisors(devices_per_host) if d <= total]
    hosts = [h * devices_per_host for h in range(1, total // devices_per_host + 1)]
    sizes = sorted(set(small + hosts + ([total] if total < devices_per_host else [])))
    return [s for s in sizes if s <= total]


def allocations(total: int, mins: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Tuples of allowed pool sizes, one per set, each at least its minimum, summing to ``total``."""
    if not mins:
        if total == 0:
            yield ()
        return
    rest_min = sum(mins[1:])
    for s in sizes:
        if s < mins[0] or s > total - rest_min:
            continue
        for tail in allocations(total - s, mins[1:], sizes):
            yield (s,) + tail


@dataclasses.dataclass
class PoolChoice:
    roles: tuple[str, ...]
    devices: int
    layouts: dict[str, RoleLayout]
    stage_times: dict[str, StageTime]
    peak_bytes: int  # analytic, per device

    @property
    def busy_seconds(self) -> float:
        return sum(t.seconds for t in self.stage_times.values())


@dataclasses.dataclass
class Plan:
    """One device mapping: pools (roles, devices, every role's layout), predicted stage times
    (analytic) and iteration time (the dataflow scheduled over the pools)."""

    pools: list[PoolChoice]
    iteration_s: float
    stage_spans: dict[str, tuple[float, float]]  # stage -> (start, end) in the schedule
    fits: bool = True
    compiled: dict[str, Any] | None = None  # filled by jaxflow.automap.verify

    def key(self) -> tuple:
        return tuple(sorted((p.roles, p.devices, tuple(sorted((r, l.layout) for r, l in p.layouts.items())))
                            for p in self.pools))

    def pool_of(self, role: str) -> PoolChoice:
        return next(p for p in self.pools if role in p.roles)

    def overrides(self, num_devices: int) -> dict[str, Any]:
        """Config keys that reproduce this plan (``jaxflow.placement.type=custom``)."""
        out: dict[str, Any] = {"jaxflow.num_devices": num_devices}
        if len(self.pools) == 1:
            out["jaxflow.placement.type"] = "colocated"
            out["jaxflow.placement.groups"] = ""
            out["jaxflow.placement.pool_sizes"] = ()
        else:
            out["jaxflow.placement.type"] = "custom"
            out["jaxflow.placement.groups"] = ";".join(",".join(p.roles) for p in self.pools)
            out["jaxflow.placement.pool_sizes"] = tuple(p.devices for p in self.pools)
        for p in self.pools:
            for role, rl in p.layouts.items():
                key = mesh_key(role)
                for axis, size in rl.layout.train_sizes.items():
                    out[f"{key}.{axis}"] = size
                if rl.layout.gen_tp:
                    out["jaxflow.mesh.actor.generate.tp"] = rl.layout.gen_tp
        return out

    def to_dict(self, num_devices: int) -> dict[str, Any]:
        pools = []
        for p in self.pools:
            pools.append({
                "roles": list(p.roles), "devices": p.devices,
                "meshes": {r: rl.meshes for r, rl in p.layouts.items()},
                "memory_gib": p.peak_bytes / GiB,
            })
        stages = {name: {"seconds": t.seconds, "compute": t.compute, "comm": t.comm, "memory": t.memory,
                         "overhead": t.overhead, "start": self.stage_spans[name][0], "end": self.stage_spans[name][1]}
                  for p in self.pools for name, t in p.stage_times.items()}
        return {
            "pools": pools,
            "predicted_iteration_s": self.iteration_s,
            "predicted_stage_s": stages,
            "memory_gib": max(p.peak_bytes for p in self.pools) / GiB,
            "fits": self.fits,
            "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides(num_devices).items()},
            **({"compiled": self.compiled} if self.compiled is not None else {}),
        }


def schedule(w: Workload, pools: Sequence[PoolChoice], shared_host: bool) -> tuple[float, dict[str, tuple]]:
    """List scheduling of the dataflow: a stage starts when its inputs are done and its pool
    is free (every pool is one resource on a shared host). Returns the makespan and spans."""
    pool_of = {r: i for i, p in enumerate(pools) for r in p.roles}
    times = {name: t.seconds for p in pools for name, t in p.stage_times.items()}
    free = [0.0] * len(pools)
    spans: dict[str, tuple[float, float]] = {}
    for stage in w.stages:
        i = 0 if shared_host else pool_of[stage.role]
        start = max([free[i]] + [spans[d][1] for d in stage.deps])
        end = start + times[stage.name]
        free[i] = end
        spans[stage.name] = (start, end)
    return max(end for _, end in spans.values()), spans


def _stage_names(w: Workload, role: str) -> list[tuple[str, str]]:
    return [(s.name, s.phase) for s in w.stages if s.role == role]


class Mapper:
    """The search over one workload, device count and profile, with its caches."""

    def __init__(self, w: Workload, num_devices: int, prof: DeviceProfile):
        self.w, self.n, self.prof = w, num_devices, prof
        self._role_cache: dict[tuple[str, int], list[tuple[float, dict[str, StageTime], RoleLayout]]] = {}
        self._pool_cache: dict[tuple[tuple[str, ...], int], PoolChoice | None] = {}
        self.evaluated = 0

    def role_options(self, role: str, n: int) -> list[tuple[float, dict[str, StageTime], RoleLayout]]:
        """(summed stage seconds, stage times, layout) of every feasible layout, fastest first."""
        key = (role, n)
        if key not in self._role_cache:
            opts = []
            for rl in feasible_layouts(self.w, role, n, self.prof.devices_per_host):
                times = {name: stage_time(self.w, phase, rl, self.prof) for name, phase in _stage_names(self.w, role)}
                opts.append((sum(t.seconds for t in times.values()), times, rl))
            opts.sort(key=lambda o: (o[0], o[2].persistent_bytes))
            self._role_cache[key] = opts
        return self._role_cache[key]

    def _candidates(self, role: str, n: int) -> list:
        opts = self.role_options(role, n)
        fastest = opts[:JOINT_CANDIDATES]
        leanest = sorted(opts, key=lambda o: (o[2].persistent_bytes + o[2].peak_transient_bytes, o[0]))
        picked = {id(o): o for o in fastest + leanest[:JOINT_CANDIDATES]}
        return sorted(picked.values(), key=lambda o: o[0])

    def best_pool(self, roles: tuple[str, ...], n: int) -> PoolChoice | None:
        """Algorithm 2 on one pool: the roles' layouts with the least summed time whose memory
        fits together (None if nothing fits)."""
        key = (roles, n)
        if key in self._pool_cache:
            return self._pool_cache[key]
        budget = self.prof.budget_bytes
        best: PoolChoice | None = None
        lists = [self._candidates(r, n) for r in roles]
        for combo in itertools.product(*lists):
            total = sum(o[0] for o in combo)
            if best is not None and total >= best.busy_seconds:
                continue
            kept = sum(o[2].persistent_bytes for o in combo)
            peak = kept + max(o[2].peak_transient_bytes for o in combo)
            if peak > budget:
                continue
            times = {name: t for o in combo for name, t in o[1].items()}
            best = PoolChoice(roles, n, {r: o[2] for r, o in zip(roles, combo)}, times, int(peak))
        self._pool_cache[key] = best
        return best

    def min_devices(self, roles: tuple[str, ...], sizes: Sequence[int]) -> int | None:
        for s in sizes:
            if self.best_pool(roles, s) is not None:
                return s
        return None

    def search(self, top: int = 5, time_limit_s: float = 60.0) -> list[Plan]:
        """Every placement and allocation within ``time_limit_s``; the ``top`` fastest plans."""
        t0 = time.perf_counter()
        sizes = pool_sizes(self.n, self.prof.devices_per_host)
        plans: dict[tuple, Plan] = {}
        for placement in set_partitions(self.w.roles):
            mins = [self.min_devices(s, sizes) for s in placement]
            if any(m is None for m in mins):
                continue
            for alloc in allocations(self.n, mins, sizes):
                if time.perf_counter() - t0 > time_limit_s:
                    break
                pools = [self.best_pool(s, a) for s, a in zip(placement, alloc)]
                if any(p is None for p in pools):
                    continue
                self.evaluated += 1
                ordered = sorted(pools, key=lambda p: (-p.devices, "actor" not in p.roles))
                makespan, spans = schedule(self.w, ordered, self.prof.shared_host)
                plan = Plan(ordered, makespan, spans)
                plans.setdefault(plan.key(), plan)
        ranked = sorted(plans.values(), key=lambda p: p.iteration_s)
        if not ranked:
            raise ValueError(f"no plan fits {self.w.name} on {self.n} {self.prof.name} devices "
                             f"({self.prof.budget_bytes / GiB:.1f} GiB usable each)")
        return ranked[:top]


def evaluate(w: Workload, prof: DeviceProfile, pools: Sequence[tuple[tuple[str, ...], int, dict[str, Any]]]) -> Plan:
    """The predicted plan for a given placement and layouts: ``pools`` as ``(roles, devices,
    {role: Layout})`` (used to predict plans that the search did not choose)."""
    from jaxflow.automap.layouts import role_layout

    choices = []
    for roles, n, lays in pools:
        rls = {r: role_layout(w, r, lays[r]) for r in roles}
        times = {name: stage_time(w, phase, rls[r], prof) for r in roles for name, phase in _stage_names(w, r)}
        peak = sum(rl.persistent_bytes for rl in rls.values()) + max(rl.peak_transient_bytes for rl in rls.values())
        choices.append(PoolChoice(tuple(roles), n, rls, times, int(peak)))
    makespan, spans = schedule(w, choices, prof.shared_host)
    return Plan(choices, makespan, spans, fits=all(c.peak_bytes <= prof.budget_bytes for c in choices))


def bell(k: int) -> int:
    """Bell numbers (partitions of a k-set), for checking :func:`set_partitions`."""
    row = [1]
    for _ in range(k):
        nxt = [row[-1]]
        for x in row:
            nxt.append(nxt[-1] + x)
        row = nxt
    return row[0]


__all__ = ["Mapper", "Plan", "PoolChoice", "allocations", "bell", "evaluate", "pool_sizes", "schedule",
           "set_partitions"]
