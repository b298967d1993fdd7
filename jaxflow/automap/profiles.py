"""Device profiles: what the simulators know about an accelerator and its links.

Every number is an *analytic* input (a data-sheet rate, a published or assumed efficiency)
except in a profile written by :mod:`jaxflow.automap.calibrate`, whose fields are fitted to
times measured on the local machine. Where each built-in number comes from is said beside
it in :data:`PROFILES`.

Fields:

- ``flops``: dense bf16 matmul peak per device (FLOP/s). ``mfu``: the fraction of it that
  large matmuls reach in training and inference forwards (useful model FLOPs, attention
  counted causally, over time); ``decode_mfu``: the same for the matmuls of a decode step.
  Below the roofline's ridge a pass is memory-bound instead (see
  :mod:`jaxflow.automap.simulate`), so small per-device batches run far below ``mfu``.
- ``hbm_bw``: device memory bandwidth (bytes/s); ``hbm_eff``: the fraction of it a streaming
  read achieves (weights and KV cache in a decode step), in ``(0, 1]``.
- ``memory_gib``: device memory; ``usable``: the fraction a plan may fill (allocator slack,
  fragmentation, code).
- ``intra_bw`` / ``inter_bw``: per-device bandwidth of a ring collective's link inside one
  link domain (NVLink island, TPU slice) and between domains (InfiniBand / DCN), bytes/s.
  ``link_domain``: devices one fast interconnect joins (0: ``devices_per_host``).
- ``protocols``: the collective's latency model (:class:`Protocol`); the simulator takes
  the fastest protocol for each message size, as NCCL's tuner does.
- ``kernel_overhead_s``: fixed cost per kernel (launch gap) on the device; spreading a
  small pass over more devices does not shrink it. ``call_overhead_s``: fixed cost per
  program call (host dispatch).
- ``devices_per_host``: the host size (tensor parallelism stays inside one host).
- ``shared_host``: the devices are simulated on one machine's cores (XLA's host platform):
  concurrent devices and pools share one processor, so pools do not overlap and a stage's
  throughput is the host's, whatever its device count.
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
class Protocol:
    """One way of running a ring collective. Over ``k`` devices with ``s`` ring steps (``k-1``
    for an all-gather or reduce-scatter, ``2(k-1)`` for an all-reduce), ``s_net`` of them
    between link domains, of a message whose full (gathered / reduced) size is ``X`` bytes::

        t = base_s + (s - s_net) hop_s + s_net net_hop_s + (s / k) X / (bw_fraction bw)

    (``bw`` the slowest link's per-device bandwidth). NCCL's own cost model has this form
    (``src/graph/tuning.cc``: a base latency, a latency per ring step by link type, and a
    bus bandwidth discounted per protocol)."""

    name: str
    base_s: float
    hop_s: float
    net_hop_s: float
    bw_fraction: float


# NCCL's ring protocols as its tuner models them (NVIDIA/nccl src/graph/tuning.cc: baseLat
# for Ring {LL 3.6, LL128 10.0, Simple 8.4} us; hwLat per step, NVLink Ring {0.47, 1.9, 3.4}
# us, NET Ring {2.7, 4.0, 9.6} us; LL moves 1/4 of the bus bandwidth, LL128 ~0.92).
NCCL_RING = (
    Protocol("LL", 3.6e-6, 0.47e-6, 2.7e-6, 0.25),
    Protocol("LL128", 10.0e-6, 1.9e-6, 4.0e-6, 0.92),
    Protocol("Simple", 8.4e-6, 3.4e-6, 9.6e-6, 1.0),
)
# XLA's ICI collectives on TPU: no published per-step figure; assumed a few microseconds to
# start a collective and one per ring step (an order of magnitude, not a measurement).
TPU_ICI = (Protocol("ici", 5e-6, 1e-6, 10e-6, 1.0),)


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
    decode_mfu: float = 0.5
    hbm_eff: float = 0.8
    protocols: tuple[Protocol, ...] = NCCL_RING
    kernel_overhead_s: float = 2e-6
    call_overhead_s: float = 5e-4
    link_domain: int = 0
    usable: float = 0.9
    shared_host: bool = False
    source: str = "analytic"

    def __post_init__(self):
        for name in ("mfu", "decode_mfu", "hbm_eff", "usable"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"profile {self.name}: {name}={v} must be in (0, 1]")
        if not self.protocols:
            raise ValueError(f"profile {self.name}: needs at least one collective protocol")

    @property
    def domain(self) -> int:
        """Devices one fast link domain holds (NVLink island, TPU slice)."""
        return self.link_domain or self.devices_per_host

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    @property
    def budget_bytes(self) -> float:
        """Bytes a plan may use per device."""
        return self.memory_gib * GiB * self.usable

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "profile") -> DeviceProfile:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}")
        data = dict(data)
        if "protocols" in data:
            data["protocols"] = tuple(Protocol(**p) for p in data["protocols"])
        return cls(**data)


def _datasheet(
    name: str, tflops: float, tbps: float, gib: float, intra_gbps: float, inter_gbps: float, per_host: int, **kw: Any
) -> DeviceProfile:
    """A profile from its data sheet's units: peak TFLOP/s, HBM TB/s and GiB, the bandwidths
    within a link domain (NVLink, ICI) and across (network, DCN) in GB/s per device."""
    return DeviceProfile(
        name=name,
        flops=tflops * 1e12,
        hbm_bw=tbps * 1e12,
        memory_gib=gib,
        intra_bw=intra_gbps * 1e9,
        inter_bw=inter_gbps * 1e9,
        devices_per_host=per_host,
        **kw,
    )


def _gpu(name: str, tflops: float, tbps: float, gib: float, nvlink_gbps: float, net_gbps: float) -> DeviceProfile:
    """A GPU of hosts of 8."""
    return _datasheet(name, tflops, tbps, gib, nvlink_gbps, net_gbps, 8)


def _tpu(
    name: str, tflops: float, tbps: float, gib: float, ici_gbps: float, dcn_gbps: float, per_host: int, slice_chips: int
) -> DeviceProfile:
    """A TPU: its slice is the link domain, rings over ICI, no host kernel launches."""
    return _datasheet(
        name,
        tflops,
        tbps,
        gib,
        ici_gbps,
        dcn_gbps,
        per_host,
        link_domain=slice_chips,
        protocols=TPU_ICI,
        kernel_overhead_s=1e-6,
    )


# Sources.
# - Peak dense bf16 FLOP/s, HBM size and bandwidth: the vendors' data sheets (A100 SXM 40/80 GB,
#   H100 SXM, H200 SXM; Cloud TPU v4, v5e, v5p, v6e system-architecture pages).
# - mfu 0.5: Megatron-LM's 163 TFLOP/s per A100 on GPT-3 175B (Narayanan et al., SC'21: 52% of
#   312), assumed for the other accelerators too; decode_mfu the same (a decode step is mostly
#   below the ridge, where the memory term rules). hbm_eff 0.8: streaming kernels reach 80-90%
#   of the data-sheet bandwidth.
# - NVLink: NCCL caps the A100 ring bus bandwidth at 235 GB/s (tuning.cc, compute capability
#   8.0), 78% of NVLink 3's 300 GB/s per direction; H100/H200 take the same 78% of NVLink 4's
#   450 GB/s = 350 GB/s. InfiniBand: one NIC per GPU (DGX A100: HDR 200 Gb/s = 25 GB/s; DGX
#   H100: NDR 400 Gb/s = 50 GB/s), ~90% of line rate achieved: 22 and 45 GB/s.
# - kernel_overhead_s 2 us: the gap per kernel when short kernels are launched back to back in
#   a stream (NVIDIA, "Getting Started with CUDA Graphs": a few microseconds per kernel without
#   graphs, ~1 with). call_overhead_s 0.5 ms: Python dispatch of one jitted program with
#   hundreds of array arguments (an order of magnitude).
# - TPU ICI: a ring over one torus axis uses that axis' two links in both directions, i.e. the
#   per-chip bidirectional ICI bandwidth over the ports (v5e 400 GB/s / 4, v6e 800 / 4, v5p
#   1200 / 6; v4 taken as half of v5p, which Google quotes at twice v4's ICI bandwidth). DCN
#   per chip: v5p 50 Gb/s; v5e and v6e 2 x 100 Gb/s per host of 8; v4 assumed as v5p. A link
#   domain is the slice (pod size); kernel_overhead_s 1 us assumed (no host launches on TPU).
PROFILES: dict[str, DeviceProfile] = {
    "a100-40g": _gpu("a100-40g", 312, 1.555, 40, 235, 22),
    "a100-80g": _gpu("a100-80g", 312, 2.039, 80, 235, 22),
    "h100": _gpu("h100", 989, 3.35, 80, 350, 45),
    "h200": _gpu("h200", 989, 4.8, 141, 350, 45),
    "tpu-v4": _tpu("tpu-v4", 275, 1.2, 32, 100, 6.25, 4, 4096),
    "tpu-v5e": _tpu("tpu-v5e", 197, 0.819, 16, 100, 3.1, 8, 256),
    "tpu-v5p": _tpu("tpu-v5p", 459, 2.765, 95, 200, 6.25, 4, 8960),
    "tpu-v6e": _tpu("tpu-v6e", 918, 1.638, 32, 200, 3.1, 8, 256),
    # This CPU, uncalibrated (a guess for a few loaded cores simulating 8 devices); run
    # `python -m jaxflow.automap.calibrate` to replace it with a fitted profile.
    "cpu": _datasheet(
        "cpu",
        0.02,
        0.01,
        2.0,
        5,
        5,
        8,
        hbm_eff=1.0,
        protocols=(Protocol("host", 50e-6, 20e-6, 20e-6, 1.0),),
        kernel_overhead_s=20e-6,
        call_overhead_s=2e-3,
        shared_host=True,
    ),
}


def calibrated_path() -> str:
    return os.path.expanduser(os.environ.get(CALIBRATED_PATH_ENV, DEFAULT_CALIBRATED_PATH))


def load_profile(path: str) -> DeviceProfile:
    """A profile written by :func:`save_profile` (e.g. by ``jaxflow.automap.calibrate``)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return DeviceProfile.from_dict(data, f"profile {path}")


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
    for key, name in (
        ("h200", "h200"),
        ("h100", "h100"),
        ("a100", "a100-80g"),
        ("v6", "tpu-v6e"),
        ("v5p", "tpu-v5p"),
        ("v5", "tpu-v5e"),
        ("v4", "tpu-v4"),
    ):
        if key in kind:
            if name == "a100-80g" and "40" in kind:
                return "a100-40g"
            return name
    raise KeyError(f"no device profile for {kind!r}; pass --device_kind or a profile .json")
