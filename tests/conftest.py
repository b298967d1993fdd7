"""Every test sees 8 simulated CPU devices: the flags must be set before JAX initialises.

Compiling is most of the suite's time (tiny models, many programs, each run a few times), so:

- XLA:CPU compiles without LLVM's optimisations (`FAST_COMPILE`): machine code only. XLA's
  HLO passes (sharding, fusion, scheduling, buffer assignment) are untouched: the optimised
  HLO and ``memory_analysis()`` of a sharded train step and of the rollout are identical with
  and without it, so tests that read compiled programs see what a run compiles. Measured on
  the 2-core machine: tiny_llama's forward and backward compiles in 1.1-1.3 s of CPU instead
  of 2.1-2.6 s and runs a few milliseconds slower; a 5-step ``grpo_tiny`` run takes 27% less
  CPU time. Processes that tests start keep the flag (`tests.child_env`), Ray workers too
  (the backend passes the driver's flags on).
- One persistent compilation cache for the run, inside the checkout (``.pytest_cache/jax``):
  this process, its xdist sibling and the ``python -m jaxflow.run`` processes tests start share
  it (and it stays out of the user's ``~/.cache``). A clean clone starts it empty; a second
  run in the same checkout loads its programs from it (measured: 70% less CPU time for the
  in-process rollout tests). JAX's compile events, which tests count, fire for a program loaded
  from it as for one compiled.
"""

import os
from pathlib import Path

FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), FAST_COMPILE, "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # in this process: every program
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**30)  # bounded, and read and written under a file lock

import jax  # after the flags on purpose

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs one (started on first use; each test
    module starts and stops its own worker groups on it), without idle workers, as a run's own."""
    import ray

    from jaxflow.workers.ray.cluster import NO_IDLE_WORKERS

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _system_config=NO_IDLE_WORKERS)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(items):
    """Files holding a ``slow`` test (minutes-long end-to-end runs) first, in their order, the
    tests inside every file in theirs: xdist (``--dist loadfile``, pyproject.toml) hands a
    worker one file at a time in this order, so the long files start at once beside the many
    short ones, which fill both workers up to the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable
