"""Planners that never allocate a model: the dry run (plan a run, its `RunSpec`, and compile
its programs ahead of time on a simulated mesh through the workers' own program builders),
which the auto-mapper's compile check and the trainer's compile-ahead use too."""

from jaxflow.plan.dry_run import (
    DEFAULT_PROGRAMS,
    OPTIONAL_PROGRAMS,
    DryRunReport,
    PoolPlan,
    ProgramReport,
    RolePlan,
    dry_run,
    plan,
)
from jaxflow.plan.lowering import CompiledMemory, ProgramSpec

__all__ = [
    "DEFAULT_PROGRAMS",
    "OPTIONAL_PROGRAMS",
    "CompiledMemory",
    "DryRunReport",
    "PoolPlan",
    "ProgramReport",
    "ProgramSpec",
    "RolePlan",
    "dry_run",
    "plan",
]
