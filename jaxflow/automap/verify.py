"""The compile check: a plan's programs lowered and compiled ahead of time on a simulated mesh
of the target size, through the dry run (the workers' own program builders on abstract
inputs), and its per-device memory from XLA's buffer assignment reported beside the
auto-mapper's analytic estimate. A plan whose compiled programs do not fit is rejected with
the program and the bytes.

Needs ``jax.device_count() >= num_devices`` (``XLA_FLAGS=--xla_force_host_platform_device_count``
set before JAX starts; ``python -m jaxflow.automap --verify`` does that).
"""

from __future__ import annotations

from typing import Any

from ml_collections import ConfigDict

from jaxflow.automap.profiles import GiB, DeviceProfile
from jaxflow.automap.search import Plan


def apply_plan(cfg: ConfigDict, plan: Plan, num_devices: int) -> ConfigDict:
    """A copy of ``cfg`` with the plan's placement and meshes (its config overrides)."""
    out = cfg.copy_and_resolve_references()
    with out.unlocked():
        for key, value in plan.overrides(num_devices).items():
            node = out
            *parents, leaf = key.split(".")
            for name in parents:
                node = node[name]
            node[leaf] = value
    return out


def compile_check(cfg: ConfigDict, plan: Plan, num_devices: int, prof: DeviceProfile,
                  programs: Any = None) -> dict[str, Any]:
    """Compile the plan's programs (the dry run's default set) for ``num_devices`` devices and
    judge them against the profile's device memory. Returns ``{"fits", "programs": [...],
    "rejected": "program: bytes" | None}`` and stores it on ``plan.compiled``."""
    from jaxflow.plan.dry_run import dry_run

    planned = apply_plan(cfg, plan, num_devices)
    with planned.unlocked():
        planned.jaxflow.dry_run.device_memory_gib = prof.memory_gib
    report = dry_run(planned, out=None, programs=programs)
    estimates = {r: plan.pool_of(r).peak_bytes for r in (rp.role for rp in report.roles)}
    rows = []
    for p in report.programs:
        rows.append({"program": p.name, "mesh": p.mesh, "compiled_peak_gib": p.peak_bytes / GiB,
                     "resident_gib": p.resident_bytes / GiB, "compiled_total_gib": p.total_bytes / GiB,
                     "estimated_pool_peak_gib": estimates[p.role] / GiB, "fits": p.fits,
                     "compile_s": p.compile_seconds})
    bad = [p for p in report.programs if not p.fits]
    rejected = None
    if bad:
        worst = max(bad, key=lambda p: p.total_bytes)
        rejected = (f"{worst.name} needs {worst.total_bytes / GiB:.2f} GiB per device (compiled peak "
                    f"{worst.peak_bytes / GiB:.2f} + resident {worst.resident_bytes / GiB:.2f}) > "
                    f"{prof.memory_gib:.1f} GiB")
    result = {"fits": not bad and report.fits, "programs": rows, "rejected": rejected,
              "compiled_max_total_gib": max((p.total_bytes for p in report.programs), default=0) / GiB,
              "estimated_max_pool_gib": max(pc.peak_bytes for pc in plan.pools) / GiB,
              "wall_s": report.wall_seconds}
    plan.compiled = result
    return result


def choose_verified(cfg: ConfigDict, plans: list[Plan], num_devices: int, prof: DeviceProfile,
                    top: int = 1, log: Any = None, programs: Any = None) -> Plan:
    """Compile the ranked plans in order (at most ``top``; ``programs`` as in
    :func:`compile_check`) and return the first that fits; ValueError when none does."""
    for plan in plans[:max(1, top)]:
        result = compile_check(cfg, plan, num_devices, prof, programs=programs)
        if log is not None:
            log(f"compiled plan {plans.index(plan) + 1}: "
                + ("fits" if result["fits"] else f"REJECTED: {result['rejected']}")
                + f" (compiled max {result['compiled_max_total_gib']:.2f} GiB vs estimated "
                  f"{result['estimated_max_pool_gib']:.2f} GiB per device)")
        if result["fits"]:
            return plan
    raise ValueError(f"none of the {min(top, len(plans))} best plans fits when compiled: "
                     + "; ".join(p.compiled["rejected"] or "?" for p in plans[:top] if p.compiled))
