"""The number of devices a process sees when they are simulated on the host CPU."""

from __future__ import annotations

import os


def simulate_devices(n: int) -> None:
    """Simulate ``n`` host (CPU) devices: sets ``XLA_FLAGS``, which XLA reads when its backend
    starts, so call it before JAX first touches a device. Other XLA flags are kept."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
