"""The environment of a process a test starts (``python -m jaxflow.run``, ``python -m
jaxflow.export``, an experiment): the test's, with XLA's flags but not the simulated device
count, which the child chooses itself (`jaxflow.mesh.simulate_devices`). The other flags, such
as conftest.py's fast compile, and the run-wide compilation cache reach the child."""

import os


def child_env(**extra: str) -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return {**os.environ, "XLA_FLAGS": " ".join(flags), **extra}
