"""The programs of a training step compiled before step 1, concurrently, into JAX's persistent
compilation cache: the first step then loads them instead of compiling them one after another.

Which programs: the dry run's plan of the run (`jaxflow.plan.dry_run.plan`), lowered through
the workers' own builders on the run's meshes; ``tests/test_shared_programs.py`` checks, for
every shipped config, that these are exactly the programs a real step calls (same StableHLO),
so the persistent cache's keys match and nothing is compiled that the step never calls.
XLA compiles with the GIL released, so the threads run in parallel."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxflow.configs.run_spec import RunSpec


def cache_enabled() -> bool:
    """Whether JAX's persistent compilation cache has a directory (`enable_compilation_cache`)."""
    return bool(jax.config.jax_compilation_cache_dir)


def compile_ahead(spec: RunSpec, workers: int | None = None) -> dict[str, float]:
    """Compile the step's programs of ``spec`` (a placed RL run) in ``workers`` threads
    (default: one per program, at most the CPU count). Returns the MEASURED wall seconds of
    each program's compile, by the plan's program name."""
    from jaxflow.plan.dry_run import plan

    _, specs = plan(spec)
    jobs = [
        (spec.name if i == 0 else f"{spec.name}#{i}", low) for spec in specs for i, low in enumerate(spec.lowered())
    ]
    if not jobs:
        return {}

    def run(job):
        name, lowered = job
        t0 = time.perf_counter()
        lowered.compile()
        return name, time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=min(len(jobs), workers or os.cpu_count() or 1)) as pool:
        return dict(pool.map(run, jobs))


def describe(seconds: dict[str, float], wall_s: float) -> str:
    """``compiled ahead: 4 programs in 35.2 s (wall; 61.0 s of compiling): actor/train 34.7 s, ...``."""
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{name} {s:.1f} s" for name, s in ranked)
    return (
        f"compiled ahead: {len(seconds)} programs in {wall_s:.1f} s (wall; {sum(seconds.values()):.1f} s of "
        f"compiling, concurrently): {parts}"
    )
