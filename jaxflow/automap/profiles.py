"""Device profiles: what the simulators know about an accelerator and its links.

Numbers are *analytic*: vendor peak rates times an achievable fraction, as HybridFlow's and
ReaL's simulators use them (the paper profiles per-layer costs; :mod:`jaxflow.automap.calibrate`
does that for the local machine and writes a profile file that :func:`get_profile` reads).

Fields:

- ``flops``: dense bf16 matmul peak per device (FLOP/s); ``mfu``: the fraction training and
  inference forwards achieve; ``decode_mfu`` the fraction a decode step's small matmuls do.
- ``hbm_bw``: device memory bandwidth (bytes/s) and ``hbm_eff`` its achievable fraction
  (generation decode reads every weight and the KV cache each step).
- ``memory_gib``: device memory; ``usable`` the fraction a plan may fill (allocator slack,
  fragmentation, code).
- ``intra_bw`` / ``inter_bw``: per-device bandwidth of a collective inside one host (NVLink,
  ICI) and across hosts (InfiniBand / DCN), bytes/s; ``latency_s`` per collective step.
- ``step_overhead_s``: fixed cost per decode step (kernel launches, sampling, loop control).
- ``devices_per_host``: the default host size (tensor parallelism stays inside one host).
- ``shared_host``: the devices are simulated on one machine's cores (XLA's host platform):
  the work of concurrent devices and of concurrent pools shares one processor, so pools do
  not overlap and a stage's throughput is the host's, whatever its device count.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

GiB = 1024**3
# Where `python -m jaxflow.automap.calibrate` writes the local machine's fitted profile.
CALIBRATED_PATH_ENV = "JAXFLOW_AUTOMAP_PROFILE"
DEFAULT_CALIBRATED_PATH = os.path.join("~", ".cache", "jaxflow", "cpu_profile.json")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: float
    hbm_bw: float
    memory_gib: float
    intra_bw: float
    inter_bw: float
    devices_per_host: int
    mfu: float = 0.5
    decode_mfu: float = 0.3
    hbm_eff: float = 0.7
    latency_s: float = 10e-6
    step_overhead_s: float = 2e-3
    usable: float = 0.9
    shared_host: bool = False
    # Calibrated CPU profiles: fixed cost per program call and per micro-batch (dispatch).
    call_overhead_s: float = 0.0
    source: str = "analytic"

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    @property
    def budget_bytes(self) -> float:
        """Bytes a plan may use per device."""
        return self.memory_gib * GiB * self.usable

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _gpu(name: str, tflops: float, tbps: float, gib: float, nvlink_gbps: float, ib_gbps: float,
         **kw: Any) -> DeviceProfile:
    return DeviceProfile(name=name, flops=tflops * 1e12, hbm_bw=tbps * 1e12, memory_gib=gib,
                         intra_bw=nvlink_gbps * 1e9, inter_bw=ib_gbps * 1e9, devices_per_host=8, **kw)


def _tpu(name: str, tflops: float, tbps: float, gib: float, ici_gbps: float, dcn_gbps: float,
         per_host: int, **kw: Any) -> DeviceProfile:
    # A TPU slice's ICI spans the whole slice: "intra" is ICI, "inter" (DCN) only between slices.
    return DeviceProfile(name=name, flops=tflops * 1e12, hbm_bw=tbps * 1e12, memory_gib=gib, intra_bw=ici_gbps * 1e9,
                         inter_bw=dcn_gbps * 1e9, devices_per_host=per_host, latency_s=5e-6, **kw)


# Peak dense bf16 rates and bandwidths from the vendors' data sheets; collective bandwidths
# are per device and unidirectional-effective (NVLink 3: 600 GB/s bidirectional -> ~240 GB/s
# achieved by ring collectives; 200 Gb/s InfiniBand per GPU -> ~22 GB/s).
PROFILES: dict[str, DeviceProfile] = {
    "a100-40g": _gpu("a100-40g", 312, 1.555, 40, 240, 22),
    "a100-80g": _gpu("a100-80g", 312, 2.039, 80, 240, 22),
    "h100": _gpu("h100", 989, 3.35, 80, 360, 45),
    "h200": _gpu("h200", 989, 4.8, 141, 360, 45),
    "tpu-v4": _tpu("tpu-v4", 275, 1.2, 32, 135, 25, 4),
    "tpu-v5e": _tpu("tpu-v5e", 197, 0.82, 16, 90, 25, 8),
    "tpu-v5p": _tpu("tpu-v5p", 459, 2.76, 95, 270, 25, 4),
    "tpu-v6e": _tpu("tpu-v6e", 918, 1.64, 32, 180, 25, 8),
    # This CPU, uncalibrated: 8 simulated devices on a few cores; calibrate replaces it.
    "cpu": DeviceProfile(name="cpu", flops=20e9, hbm_bw=10e9, memory_gib=2.0, intra_bw=5e9, inter_bw=5e9,
                         devices_per_host=8, mfu=0.5, decode_mfu=0.5, hbm_eff=1.0, latency_s=100e-6,
                         step_overhead_s=1e-3, shared_host=True, call_overhead_s=2e-3),
}


def calibrated_path() -> str:
    return os.path.expanduser(os.environ.get(CALIBRATED_PATH_ENV, DEFAULT_CALIBRATED_PATH))


def load_profile(path: str) -> DeviceProfile:
    """A profile written by :func:`save_profile` (e.g. by ``jaxflow.automap.calibrate``)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"profile {path}: unknown fields {unknown}")
    return DeviceProfile(**data)


def save_profile(profile: DeviceProfile, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=2)


def get_profile(kind: str, devices_per_host: int | None = None, memory_gib: float | None = None) -> DeviceProfile:
    """The profile of a device kind (``PROFILES``; ``cpu`` is the calibrated file when one
    exists, see :func:`calibrated_path`), or a path to a profile JSON file."""
    if kind.endswith(".json"):
        prof = load_profile(kind)
    elif kind == "cpu" and os.path.isfile(calibrated_path()):
        prof = load_profile(calibrated_path())
    elif kind in PROFILES:
        prof = PROFILES[kind]
    else:
        raise KeyError(f"unknown device kind {kind!r}; known: {', '.join(sorted(PROFILES))} (or a profile .json)")
    changes: dict[str, Any] = {}
    if devices_per_host:
        changes["devices_per_host"] = devices_per_host
    if memory_gib:
        changes["memory_gib"] = memory_gib
    return dataclasses.replace(prof, **changes) if changes else prof


def local_device_kind(device: Any) -> str:
    """The profile name for a JAX device (``jax.devices()[0]``)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    platform = getattr(device, "platform", "cpu")
    if platform == "cpu":
        return "cpu"
    for key, name in (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80g"), ("v6", "tpu-v6e"),
                      ("v5p", "tpu-v5p"), ("v5", "tpu-v5e"), ("v4", "tpu-v4")):
        if key in kind:
            if name == "a100-80g" and "40" in kind:
                return "a100-40g"
            return name
    raise KeyError(f"no device profile for {kind!r} ({platform}); pass --device_kind or a profile .json")
