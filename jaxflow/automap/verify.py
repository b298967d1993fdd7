"""The compile check: a plan's programs lowered and compiled ahead of time on a simulated mesh
of the target size, through the dry run (the workers' own program builders on abstract
inputs), and its per-device memory from XLA's buffer assignment reported beside the
auto-mapper's analytic estimate. A plan whose compiled programs do not fit is rejected with
the program and the bytes.

Needs ``jax.device_count() >= num_devices`` (``XLA_FLAGS=--xla_force_host_platform_device_count``
set before JAX starts; ``python -m jaxflow.automap --verify`` does that).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from jaxflow.automap.profiles import DeviceProfile, GiB
from jaxflow.automap.search import Plan
from jaxflow.configs.run_spec import RunSpec
from jaxflow.mesh import MeshSpec, Placement


def plan_placement(plan: Plan, devices: Sequence[Any], spec: RunSpec) -> Placement:
    """The plan's `Placement` of ``spec``'s roles on ``devices``: one pool (``global``) or the
    plan's pools in device order, each named after its first role, with every role's mesh,
    the actor's generation tp and the models' shapes."""
    if len(plan.pools) == 1:
        groups = [("global", plan.pools[0].devices, plan.pools[0].roles)]
    else:
        groups = [(p.roles[0], p.devices, p.roles) for p in plan.pools]
    layouts = {role: rl.layout for p in plan.pools for role, rl in p.layouts.items()}
    return Placement.from_groups(
        groups,
        devices,
        meshes={role: MeshSpec(**layout.train_sizes) for role, layout in layouts.items()},
        gen_tp={"actor": layouts["actor"].gen_tp},
        models={role: m.config for role, m in spec.models.items() if m.config is not None},
    )


def apply_plan(spec: RunSpec, plan: Plan, devices: Sequence[Any]) -> RunSpec:
    """``spec`` placed as ``plan`` says on ``devices`` (their count is the run's): the pools
    and meshes, and the actor's decode slots when the plan lowered them."""
    seqs = plan.pool_of("actor").layouts["actor"].layout.max_num_seqs
    return dataclasses.replace(
        spec,
        num_devices=len(devices),
        placement=plan_placement(plan, devices, spec),
        rollout=dataclasses.replace(spec.rollout, max_num_seqs=seqs) if seqs else spec.rollout,
        mapping=dataclasses.replace(spec.mapping, type="colocated" if len(plan.pools) == 1 else "custom"),
    )


def _program_key(spec: Any) -> tuple:
    """What makes two plans' programs the same compile: the program, its mesh and its shapes
    (the description names rows, lengths, micro-batches, slots)."""
    return spec.name, tuple(spec.mesh.shape.items()), spec.description


def _program_row(p: Any, estimated_pool_bytes: int, cached: bool) -> dict[str, Any]:
    """One compiled program (a `jaxflow.plan.dry_run.ProgramReport`) as a row of the check."""
    return {
        "program": p.name,
        "role": p.role,
        "phase": p.phase,
        "mesh": p.mesh,
        "compiled_peak_bytes": p.peak_bytes,
        "compiled_peak_gib": p.peak_bytes / GiB,
        "resident_gib": p.resident_bytes / GiB,
        "compiled_total_gib": p.total_bytes / GiB,
        "estimated_pool_peak_gib": estimated_pool_bytes / GiB,
        "fits": p.fits,
        "compile_s": p.compile_seconds,
        "cached": cached,
    }


def _rejection(bad: Any, report: Any, prof: DeviceProfile) -> str | None:
    """Why the plan does not fit: the first program over the device memory, else the dry run's
    analytic estimate of a pool; None when it fits."""
    if bad is not None:
        return (
            f"{bad.name} needs {bad.total_bytes / GiB:.2f} GiB per device (compiled peak "
            f"{bad.peak_bytes / GiB:.2f} + resident {bad.resident_bytes / GiB:.2f}) > "
            f"{prof.memory_gib:.1f} GiB"
        )
    if not report.fits:
        pools = [pp.name for pp in report.pools if not pp.fits]
        return f"the dry run's analytic estimate of pool(s) {pools} exceeds {prof.memory_gib:.1f} GiB"
    return None


def compile_check(
    spec: RunSpec, plan: Plan, num_devices: int, prof: DeviceProfile, programs: Any = None, cache: dict | None = None
) -> dict[str, Any]:
    """Compile the plan's programs (the dry run's default set, or ``programs``) for
    ``num_devices`` simulated devices, in the order of a step, and judge them against the
    profile's device memory; stop at the first that does not fit. ``cache`` (a dict shared
    across plans) keeps each compiled program's memory by (program, mesh, shapes): a program
    several plans share compiles once. Returns ``{"fits", "programs": [...], "rejected":
    "program: bytes" | None, "compiled_now": programs compiled by this call}`` and stores it on
    ``plan.compiled``."""
    from jaxflow.plan.dry_run import compile_program, simulated_devices
    from jaxflow.plan.dry_run import plan as plan_programs
    from jaxflow.plan.lowering import CompiledMemory

    planned = apply_plan(spec, plan, simulated_devices(num_devices, spec.name))
    planned = dataclasses.replace(
        planned, dry_run=dataclasses.replace(planned.dry_run, device_memory_gib=prof.memory_gib)
    )
    t0 = time.perf_counter()
    report, specs = plan_programs(planned, programs)
    cache = {} if cache is None else cache
    rows, compiled_now, bad = [], 0, None
    for program in specs:
        key = _program_key(program)
        cached = key in cache
        if cached:
            program = dataclasses.replace(program, lower=None, measure=lambda m=cache[key]: m)
        p = compile_program(report, program)
        if not cached:
            compiled_now += 1
            cache[key] = CompiledMemory(**{f.name: getattr(p, f.name) for f in dataclasses.fields(CompiledMemory)})
        rows.append(_program_row(p, plan.pool_of(p.role).peak_bytes, cached))
        if not p.fits:
            bad = p
            break
    rejected = _rejection(bad, report, prof)
    result = {
        "fits": rejected is None,
        "programs": rows,
        "rejected": rejected,
        "compiled_now": compiled_now,
        "compiled_max_total_gib": max((r["compiled_total_gib"] for r in rows), default=0.0),
        "estimated_max_pool_gib": max(pc.peak_bytes for pc in plan.pools) / GiB,
        "wall_s": time.perf_counter() - t0,
    }
    plan.compiled = result
    return result


def _verdict(result: dict[str, Any]) -> str:
    """``fits (compiled max 1.20 GiB vs estimated 1.10 GiB per device)``, or ``REJECTED: why (...)``."""
    return ("fits" if result["fits"] else f"REJECTED: {result['rejected']}") + (
        f" (compiled max {result['compiled_max_total_gib']:.2f} GiB vs estimated "
        f"{result['estimated_max_pool_gib']:.2f} GiB per device)"
    )


def choose_verified(
    spec: RunSpec,
    plans: list[Plan],
    num_devices: int,
    prof: DeviceProfile,
    attempts: int = 1,
    log: Any = None,
    programs: Any = None,
) -> Plan:
    """Go down the ranked ``plans`` and return the first whose programs compile and fit
    (``programs`` as in :func:`compile_check`). Programs compiled once are not compiled
    again, so a plan that shares a program already too big is rejected at once; at most
    ``attempts`` plans that compile something new are tried. ValueError when none fits."""
    cache: dict = {}
    tried, rejected = 0, []
    for i, plan in enumerate(plans, 1):
        result = compile_check(spec, plan, num_devices, prof, programs=programs, cache=cache)
        if log is not None:
            how = "" if result["compiled_now"] else " (programs compiled before)"
            log(f"compiled plan {i}: {_verdict(result)}{how}")
        if result["fits"]:
            return plan
        rejected.append(f"plan {i}: {result['rejected']}")
        tried += result["compiled_now"] > 0
        if tried >= attempts:
            break
    raise ValueError(f"none of the {len(rejected)} best plans fits when compiled: " + "; ".join(rejected))


def memory_correction(plan: Plan, row: dict[str, Any]) -> tuple[str, float] | None:
    """``(phase, factor)`` by which the estimated working memory of a compiled program's phase
    (:func:`jaxflow.automap.search.transient_parts`) must grow to hold what XLA allocated: its
    compiled peak less the persistent state among its arguments and the bytes counted exactly.
    None for a program the analytic model has no working memory for."""
    from jaxflow.automap.search import transient_parts

    rl = plan.pool_of(row["role"]).layouts[row["role"]]
    parts = transient_parts(rl).get(row["phase"])
    if not parts or not parts[1]:
        return None
    exact, rough = parts
    # The arguments that stay in the pool: the train step's state; the forwards' weights; the
    # rollout's training weights (donated into its generation copy, counted in ``exact``).
    kept = {
        "train": rl.plan.param_bytes + rl.plan.optimizer_bytes,
        "infer": rl.plan.param_bytes,
        "generate": rl.plan.param_bytes,
    }.get(row["phase"], 0)
    return row["phase"], (row["compiled_peak_bytes"] - kept - exact) / rough


def search_verified(
    spec: RunSpec,
    mapper: Any,
    num_devices: int,
    attempts: int = 3,
    log: Any = None,
    programs: Any = None,
    top: int = 5,
    time_limit_s: float = 60.0,
) -> tuple[Plan, list[Plan]]:
    """The mapper's best plan that compiles and fits: search, compile the best plan; when a
    program holds more than its analytic estimate and does not fit, scale that phase's
    estimated working memory by what the compiler allocated (:meth:`Mapper.scale_memory`)
    and search again (a rejection the scales cannot explain moves down the ranking). At most
    ``attempts`` plans that compile something new. Returns ``(plan, the last ranking)``."""
    prof = mapper.prof
    cache: dict = {}
    rejected: dict[tuple, str] = {}
    tried = 0
    while True:
        plans = mapper.search(top=top, time_limit_s=time_limit_s)
        fresh = [p for p in plans if p.key() not in rejected]
        if not fresh:
            break
        plan = fresh[0]
        result = compile_check(spec, plan, num_devices, prof, programs=programs, cache=cache)
        if log is not None:
            log(f"compiled plan {plans.index(plan) + 1} of the ranking: {_verdict(result)}")
        if result["fits"]:
            return plan, plans
        rejected[plan.key()] = result["rejected"]
        tried += result["compiled_now"] > 0
        bad = next((r for r in result["programs"] if not r["fits"]), None)
        correction = memory_correction(plan, bad) if bad is not None else None
        if correction is not None and correction[1] > mapper.memory_scale.get(correction[0], 1.0) * 1.001:
            mapper.scale_memory(*correction)
            if log is not None:
                log(
                    f"  the compiled {bad['program']} holds {correction[1]:.2f} x the estimated {correction[0]} "
                    f"working memory: planning with that and searching again"
                )
        if tried >= attempts:
            break
    raise ValueError(
        f"no plan of {mapper.w.name} on {num_devices} {prof.name} devices fits when compiled "
        f"({len(rejected)} rejected): " + "; ".join(rejected.values())
    )
