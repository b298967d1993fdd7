"""Every test sees 8 simulated CPU devices: the flags must be set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # after the flags on purpose

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs one (started on first use; each test
    module starts and stops its own worker groups on it)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
