"""HybridFlow's device mapping (§6, Algorithm 1) over jaxflow's roles, pools and meshes.

::

    for placement in set_partitions(roles):              # Bell(k) ways to colocate k roles
        mins = [min_devices(S) for S in placement]       # by memory (smallest fitting pool)
        for sizes in allocations(N, mins):               # pool sizes summing to N
            layouts = [best_pool(S, n) for ...]          # Algorithm 2, cached per (roles, n)
            cost = schedule(dataflow, layouts)           # iteration time of the plan

``best_pool(S, n)`` chooses each role's layout on the pool (:mod:`jaxflow.automap.layouts`)
so that the roles' summed stage times (:mod:`jaxflow.automap.simulate`) are least and
their memory fits together: what colocated roles keep (parameters, optimizer state) plus the
largest transient of any of their phases within the device's usable memory. It is exact for
that objective: per role only the Pareto front of (time, kept bytes, transient bytes) can
be part of a best combination (any other layout is beaten on all three by one on the front),
and a branch and bound over the fronts finds the fastest combination that fits.

Pool sizes: divisors of the host size below one host, whole hosts above (the paper
allocates whole machines to large pools; tp stays within a host); only whole hosts with
``whole_hosts`` (the Ray backend's pools). Layouts and pools are cached per (role, n) and
per (roles, n), as the paper does. The whole search, layout enumeration included, runs
within ``time_limit_s``; a search cut short says so (``Mapper.truncated``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxflow.automap.layouts import RoleLayout, divisors, feasible_layouts
from jaxflow.automap.profiles import DeviceProfile, GiB
from jaxflow.automap.simulate import StageTime, stage_time
from jaxflow.automap.workload import Workload
from jaxflow.configs.resolve import mesh_key


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every partition of ``items`` into non-empty sets (Bell(len(items)) of them)."""
    items = list(items)
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [(first,) + part[i]] + part[i + 1 :]
        yield [(first,)] + part


def pool_sizes(total: int, devices_per_host: int, whole_hosts: bool = False) -> list[int]:
    """Pool sizes the search allocates: divisors of a host below one host, whole hosts above
    (``whole_hosts``: whole hosts only, or the whole cluster when it is below one host)."""
    hosts = [h * devices_per_host for h in range(1, total // devices_per_host + 1)]
    small = [] if whole_hosts and hosts else [d for d in divisors(devices_per_host) if d <= total]
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
        return tuple(
            sorted((p.roles, p.devices, tuple(sorted((r, l.layout) for r, l in p.layouts.items()))) for p in self.pools)
        )

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
                if rl.layout.max_num_seqs:
                    out["actor_rollout_ref.rollout.max_num_seqs"] = rl.layout.max_num_seqs
        return out

    def to_dict(self, num_devices: int) -> dict[str, Any]:
        pools = []
        for p in self.pools:
            pools.append(
                {
                    "roles": list(p.roles),
                    "devices": p.devices,
                    "meshes": {r: rl.meshes for r, rl in p.layouts.items()},
                    "memory_gib": p.peak_bytes / GiB,
                }
            )
        stages = {
            name: {
                "seconds": t.seconds,
                "compute": t.compute,
                "comm": t.comm,
                "memory": t.memory,
                "overhead": t.overhead,
                "start": self.stage_spans[name][0],
                "end": self.stage_spans[name][1],
            }
            for p in self.pools
            for name, t in p.stage_times.items()
        }
        return {
            "pools": pools,
            "predicted_iteration_s": self.iteration_s,
            "predicted_stage_s": stages,
            "memory_gib": max(p.peak_bytes for p in self.pools) / GiB,
            "fits": self.fits,
            "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides(num_devices).items()},
            **({"compiled": self.compiled} if self.compiled is not None else {}),
        }


def schedule(w: Workload, pools: Sequence[PoolChoice], concurrent: bool) -> tuple[float, dict[str, tuple]]:
    """List scheduling of the dataflow, stages in their order. A stage starts when its pool
    is free and, with ``concurrent``, when its inputs are done: stages on disjoint pools then
    overlap (HybridFlow's driver). Without it one stage runs at a time (jaxflow's
    iterations block after every stage, `jaxflow.iterations.steps.ready`; a simulated host runs
    one stage at a time anyway). Returns the makespan and each stage's (start, end)."""
    pool_of = {r: i for i, p in enumerate(pools) for r in p.roles}
    times = {name: t.seconds for p in pools for name, t in p.stage_times.items()}
    free = [0.0] * len(pools)
    spans: dict[str, tuple[float, float]] = {}
    for stage in w.stages:
        i = pool_of[stage.role] if concurrent else 0
        start = max([free[i]] + [spans[d][1] for d in stage.deps])
        end = start + times[stage.name]
        if concurrent:
            free[i] = end
        else:
            free = [end] * len(free)
        spans[stage.name] = (start, end)
    return max(end for _, end in spans.values()), spans


def _stage_names(w: Workload, role: str) -> list[tuple[str, str]]:
    return [(s.name, s.phase) for s in w.stages if s.role == role]


@dataclasses.dataclass(frozen=True)
class Option:
    """One feasible layout of a role on a pool size, with its predicted stage times and the
    largest transient bytes of its phases (analytic, times the mapper's memory scales)."""

    seconds: float  # the role's stages, summed (analytic)
    times: dict[str, StageTime]
    layout: RoleLayout
    transient: int

    @property
    def kept(self) -> int:
        return self.layout.persistent_bytes


def pareto_front(options: Sequence[Option]) -> list[Option]:
    """The options no other beats on time, kept bytes and transient bytes at once (ties:
    the first), fastest first."""
    front: list[Option] = []
    for o in sorted(options, key=lambda o: (o.seconds, o.kept, o.transient)):
        if not any(f.kept <= o.kept and f.transient <= o.transient for f in front):
            front.append(o)
    return front


def transient_parts(rl: RoleLayout) -> dict[str, tuple[int, int]]:
    """Phase -> (bytes counted exactly, working bytes estimated) of a layout's transient
    (:meth:`jaxflow.plan.dry_run.RolePlan.transient_bytes` split in two): training adds the
    gradients to its activations, generation the generation weights to the KV cache and its
    activations (`RolePlan.generation_weight_bytes`: a copy, or the training weights donated
    into it)."""
    p = rl.plan
    exact = {"train": p.gradient_bytes, "generate": p.generation_weight_bytes}
    rough = {"generate": p.kv_cache_bytes}
    return {phase: (exact.get(phase, 0), act + rough.get(phase, 0)) for phase, act in p.activation_bytes.items()}


class SearchTimeout(Exception):
    """The search ran past its time limit (caught by :meth:`Mapper.search`)."""


class Mapper:
    """The search over one workload, device count and profile, with its caches.

    ``concurrent``: whether stages on disjoint pools run at the same time (see
    :func:`schedule`; never on a ``shared_host`` profile). ``whole_hosts``: pools of whole
    hosts only. ``memory_scale``: phase -> factor on that phase's estimated working memory
    (:func:`transient_parts`; :meth:`scale_memory`: the compile check sets it when a compiled
    program holds more than the estimate). After :meth:`search`: ``truncated`` (cut short by the time limit),
    ``placements_done`` of ``placements_total``, ``evaluated`` allocations,
    ``layouts_simulated`` (each (role, pool size, layout) is simulated once).

    ``phases_elsewhere``: phases whose memory the pools do not hold (none here; a training
    pool beside a separate rollout pool leaves out ``generate``,
    :class:`jaxflow.automap.async_schedule.TrainingPoolMapper`)."""

    phases_elsewhere: frozenset[str] = frozenset()

    def __init__(
        self, w: Workload, num_devices: int, prof: DeviceProfile, *, concurrent: bool = False, whole_hosts: bool = False
    ):
        self.w, self.n, self.prof = w, num_devices, prof
        self.concurrent = concurrent and not prof.shared_host
        self.whole_hosts = whole_hosts
        self._sim_cache: dict[tuple[str, int], list[tuple[float, dict[str, StageTime], RoleLayout]]] = {}
        self._role_cache: dict[tuple[str, int], list[Option]] = {}
        self.memory_scale: dict[str, float] = {}
        self._front_cache: dict[tuple[str, int], list[Option]] = {}
        self._pool_cache: dict[tuple[tuple[str, ...], int], PoolChoice | None] = {}
        self._deadline = math.inf
        self.evaluated = 0
        self.layouts_simulated = 0
        self.truncated = False
        self.placements_total = bell(len(w.roles))
        self.placements_done = 0
        self.search_s = 0.0

    def _tick(self) -> None:
        if time.perf_counter() > self._deadline:
            raise SearchTimeout

    def role_options(self, role: str, n: int) -> list[Option]:
        """Every feasible layout of ``role`` on ``n`` devices with its stage times, fastest first."""
        key = (role, n)
        if key not in self._sim_cache:
            sims = []
            for rl in feasible_layouts(self.w, role, n, self.prof.devices_per_host):
                self._tick()
                times = {name: stage_time(self.w, phase, rl, self.prof) for name, phase in _stage_names(self.w, role)}
                self.layouts_simulated += 1
                sims.append((sum(t.seconds for t in times.values()), times, rl))
            self._sim_cache[key] = sims
        if key not in self._role_cache:
            opts = [Option(seconds, times, rl, self.transient_bytes(rl)) for seconds, times, rl in self._sim_cache[key]]
            opts.sort(key=lambda o: (o.seconds, o.kept))
            self._role_cache[key] = opts
        return self._role_cache[key]

    def transient_bytes(self, rl: RoleLayout) -> int:
        """The layout's largest transient over its phases (not those in ``phases_elsewhere``),
        each phase's working memory (what the analytic model estimates roughly: activations,
        the KV cache) times its memory scale, plus what it counts exactly (gradients, the
        generation copy of the weights)."""
        return int(
            max(
                (
                    exact + rough * self.memory_scale.get(phase, 1.0)
                    for phase, (exact, rough) in transient_parts(rl).items()
                    if phase not in self.phases_elsewhere
                ),
                default=0,
            )
        )

    def scale_memory(self, phase: str, factor: float) -> None:
        """Scale the estimated working memory of ``phase`` by ``factor`` (kept if larger than the
        current scale); the layouts' simulated times are kept, the pools searched again."""
        if factor > self.memory_scale.get(phase, 1.0):
            self.memory_scale[phase] = factor
            self._role_cache.clear()
            self._front_cache.clear()
            self._pool_cache.clear()

    def front(self, role: str, n: int) -> list[Option]:
        key = (role, n)
        if key not in self._front_cache:
            self._front_cache[key] = pareto_front(self.role_options(role, n))
        return self._front_cache[key]

    def best_pool(self, roles: tuple[str, ...], n: int) -> PoolChoice | None:
        """Algorithm 2 on one pool: the roles' layouts with the least summed time whose memory
        fits together (None if nothing fits): a branch and bound over the roles' fronts."""
        key = (roles, n)
        if key in self._pool_cache:
            return self._pool_cache[key]
        budget = self.prof.budget_bytes
        fronts = [self.front(r, n) for r in roles]
        best: list[Any] = [math.inf, None]
        if all(fronts):
            k = len(fronts)
            rest_time = [sum(f[0].seconds for f in fronts[i:]) for i in range(k + 1)]
            rest_kept = [sum(min(o.kept for o in f) for f in fronts[i:]) for i in range(k + 1)]

            def visit(i: int, seconds: float, kept: int, transient: int, chosen: tuple[Option, ...]) -> None:
                if i == k:
                    if seconds < best[0]:
                        best[:] = [seconds, chosen]
                    return
                self._tick()
                for o in fronts[i]:  # fastest first: once too slow, all the rest are
                    if seconds + o.seconds + rest_time[i + 1] >= best[0]:
                        break
                    if kept + o.kept + rest_kept[i + 1] + max(transient, o.transient) > budget:
                        continue
                    visit(i + 1, seconds + o.seconds, kept + o.kept, max(transient, o.transient), chosen + (o,))

            visit(0, 0.0, 0, 0, ())
        choice = None
        if best[1] is not None:
            combo = best[1]
            peak = sum(o.kept for o in combo) + max(o.transient for o in combo)
            choice = PoolChoice(
                roles,
                n,
                {r: o.layout for r, o in zip(roles, combo)},
                {name: t for o in combo for name, t in o.times.items()},
                int(peak),
            )
        self._pool_cache[key] = choice
        return choice

    def min_devices(self, roles: tuple[str, ...], sizes: Sequence[int]) -> int | None:
        for s in sizes:
            if self.best_pool(roles, s) is not None:
                return s
        return None

    def search(self, top: int = 5, time_limit_s: float = 60.0) -> list[Plan]:
        """Every placement and allocation within ``time_limit_s`` (all of the search: minimum
        pool sizes and layouts included); the ``top`` fastest plans. ``truncated`` says
        whether the limit cut it short. Raises ValueError when no plan fits."""
        t0 = time.perf_counter()
        self._deadline = t0 + time_limit_s
        self.truncated = False
        self.placements_done = 0
        sizes = pool_sizes(self.n, self.prof.devices_per_host, self.whole_hosts)
        plans: dict[tuple, Plan] = {}
        try:
            for placement in set_partitions(self.w.roles):
                mins = [self.min_devices(s, sizes) for s in placement]
                if all(m is not None for m in mins):
                    for alloc in allocations(self.n, mins, sizes):
                        self._tick()
                        pools = [self.best_pool(s, a) for s, a in zip(placement, alloc)]
                        if any(p is None for p in pools):
                            continue
                        self.evaluated += 1
                        ordered = sorted(pools, key=lambda p: (-p.devices, "actor" not in p.roles))
                        makespan, spans = schedule(self.w, ordered, self.concurrent)
                        plan = Plan(ordered, makespan, spans)
                        plans.setdefault(plan.key(), plan)
                self.placements_done += 1
        except SearchTimeout:
            self.truncated = True
        finally:
            self._deadline = math.inf
            self.search_s = time.perf_counter() - t0
        ranked = sorted(plans.values(), key=lambda p: p.iteration_s)
        if not ranked:
            if self.truncated:
                raise ValueError(
                    f"no plan found for {self.w.name} on {self.n} {self.prof.name} devices within the "
                    f"search's time limit of {time_limit_s:g} s ({self.placements_done} of "
                    f"{self.placements_total} placements explored); raise the limit"
                )
            raise ValueError(self.nothing_fits())
        return ranked[:top]

    def nothing_fits(self) -> str:
        """Why no plan fits: per role, the least memory per device it needs alone on the whole
        cluster (analytic; on a smaller pool it needs more), and what the roles need together
        on it, against the usable memory."""
        budget = self.prof.budget_bytes
        parts, kept, transient = [], 0, 0
        for role in self.w.roles:
            opts = self.role_options(role, self.n)
            if not opts:
                parts.append(f"{role}: no layout of its model divides over {self.n} devices")
                continue
            lean = min(opts, key=lambda o: o.kept + o.transient)
            kept += min(o.kept for o in opts)
            transient = max(transient, min(o.transient for o in opts))
            p = lean.layout.plan
            need = lean.kept + lean.transient
            parts.append(
                f"{role} needs {need / GiB:.1f} GiB per device at best ({lean.layout.layout.text()}: "
                f"parameters {p.param_bytes / GiB:.1f}, optimizer {p.optimizer_bytes / GiB:.1f}, largest "
                f"transient {lean.transient / GiB:.1f})" + ("" if need <= budget else " > the budget")
            )
        return (
            f"no plan fits {self.w.name} on {self.n} {self.prof.name} devices ({budget / GiB:.1f} GiB usable each): "
            f"alone on all {self.n} devices, " + "; ".join(parts) + f"; all colocated they need at least "
            f"{(kept + transient) / GiB:.1f} GiB per device, and on smaller pools each role needs more"
        )


def evaluate(
    w: Workload,
    prof: DeviceProfile,
    pools: Sequence[tuple[tuple[str, ...], int, dict[str, Any]]],
    concurrent: bool = False,
) -> Plan:
    """The predicted plan for a given placement and layouts: ``pools`` as ``(roles, devices,
    {role: Layout})`` (used to predict plans that the search did not choose); ``concurrent``
    as in :class:`Mapper`."""
    from jaxflow.automap.layouts import role_layout

    choices = []
    for roles, n, lays in pools:
        rls = {r: role_layout(w, r, lays[r]) for r in roles}
        times = {name: stage_time(w, phase, rls[r], prof) for r in roles for name, phase in _stage_names(w, r)}
        peak = sum(rl.persistent_bytes for rl in rls.values()) + max(rl.peak_transient_bytes for rl in rls.values())
        choices.append(PoolChoice(tuple(roles), n, rls, times, int(peak)))
    makespan, spans = schedule(w, choices, concurrent and not prof.shared_host)
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


__all__ = [
    "Mapper",
    "Option",
    "Plan",
    "PoolChoice",
    "SearchTimeout",
    "allocations",
    "bell",
    "evaluate",
    "pareto_front",
    "pool_sizes",
    "schedule",
    "set_partitions",
    "transient_parts",
]
