"""Process-wide JAX setup: the number of devices a process sees when they are simulated on the
host CPU, and the persistent compilation cache; and the stand-ins a `Placement` is built over
when its devices are not this process's (`FakeDevice` for planning, `HostSlot` for a Ray
run's hosts)."""

from __future__ import annotations

import dataclasses
import os


def simulate_devices(n: int) -> None:
    """Simulate ``n`` host (CPU) devices: sets ``XLA_FLAGS``, which XLA reads when its backend
    starts, so call it before JAX first touches a device. Other XLA flags are kept."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


# Programs faster to compile than this are not stored (``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
# overrides): on CPU they compile in milliseconds; on an accelerator a small program (a cast,
# an advantage estimator, an eager op) takes ~0.1 s to compile and a run calls dozens of them,
# every one of which a warm start would compile again.
MIN_CACHED_COMPILE_SECONDS = {"cpu": 1.0, "gpu": 0.0, "tpu": 0.0}


def enable_compilation_cache(platform: str = "cpu") -> str:
    """Turn on JAX's persistent compilation cache (``$JAX_COMPILATION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jaxflow/jax`` or ``~/.cache/jaxflow/jax``), so a restarted run (or a
    worker process started again) loads its compiled programs instead of compiling them
    again; which programs it stores depends on the ``platform`` the run compiles for
    (`MIN_CACHED_COMPILE_SECONDS`). The ``jaxflow.run`` CLI and the Ray backend's worker
    processes call it; a library user calls it once, before the first compilation. Returns
    the directory."""
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxflow", "jax"
    )
    jax.config.update("jax_compilation_cache_dir", path)
    default = MIN_CACHED_COMPILE_SECONDS.get(platform, 1.0)
    min_seconds = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", default))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    return path


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands in for a device when a placement is planned without devices (``.id`` only)."""

    id: int


@dataclasses.dataclass(frozen=True)
class HostSlot:
    """A device of a Ray run as the driver sees it: the ``local``-th device of host ``host``.
    `Placement`s of a Ray run are built over these (the devices themselves live in the
    workers' processes)."""

    id: int
    host: int
    local: int


def host_slots(num_devices: int, devices_per_host: int) -> tuple[HostSlot, ...]:
    """``num_devices`` `HostSlot`s, ``devices_per_host`` per host: the devices a Ray run's
    `Placement` is built over."""
    if num_devices % devices_per_host:
        raise ValueError(
            f"{num_devices} devices are not whole hosts of {devices_per_host} (jaxflow.ray.devices_per_host)"
        )
    return tuple(HostSlot(i, i // devices_per_host, i % devices_per_host) for i in range(num_devices))
