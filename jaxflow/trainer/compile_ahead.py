"""The programs of a training step compiled before step 1, concurrently, into JAX's persistent
compilation cache and into the pool of `jaxflow.mesh.executables`, from which the step's own
programs take them: step 1 neither compiles nor loads them again.

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
from jaxflow.mesh import executables


def cache_enabled() -> bool:
    """Whether JAX's persistent compilation cache has a directory (`enable_compilation_cache`)."""
    return bool(jax.config.jax_compilation_cache_dir)


def step_programs(spec: RunSpec) -> tuple[str, ...]:
    """The plan's programs that a step of ``spec`` calls: the default ones (those of roles the
    run lacks are left out by the plan), the critic's value forward with a critic, and the
    actor's old-log-prob forward unless its update runs on-policy (`actor_on_policy`)."""
    from jaxflow.plan.dry_run import DEFAULT_PROGRAMS
    from jaxflow.plan.lowering import actor_on_policy

    optional = ("critic/values",) + (() if actor_on_policy(spec) else ("actor/log_probs",))
    return DEFAULT_PROGRAMS + optional


def compile_ahead(spec: RunSpec, workers: int | None = None) -> dict[str, float]:
    """Compile the step's programs of ``spec`` (a placed RL run) in ``workers`` threads
    (default: one per program, at most the CPU count). Returns the MEASURED wall seconds of
    each program's compile, by the plan's program name. The executables go to the pool of
    `jaxflow.mesh.executables`."""
    from jaxflow.plan.dry_run import plan

    _, specs = plan(spec, step_programs(spec))

    def run(name, lowered):
        t0 = time.perf_counter()
        compiled = lowered.compile()
        return name, time.perf_counter() - t0, (executables.lowered_name(lowered), compiled)

    # Lowering holds the GIL, compiling does not: each program compiles while the next lowers.
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futures = [
            pool.submit(run, spec.name if i == 0 else f"{spec.name}#{i}", lowered)
            for spec in specs
            for i, lowered in enumerate(spec.lowered())
        ]
        done = [f.result() for f in futures]
    executables.offer([named for _, _, named in done])
    return {name: seconds for name, seconds, _ in done}


def describe(seconds: dict[str, float], wall_s: float) -> str:
    """``compiled ahead: 4 programs in 35.2 s (wall; 61.0 s of compiling): actor/train 34.7 s, ...``."""
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{name} {s:.1f} s" for name, s in ranked)
    return (
        f"compiled ahead: {len(seconds)} programs in {wall_s:.1f} s (wall; {sum(seconds.values()):.1f} s of "
        f"compiling, concurrently): {parts}"
    )
