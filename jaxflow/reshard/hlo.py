"""Read what a compiled SPMD program communicates: collectives, their per-device bytes and
replica groups, parsed from ``compiled.as_text()`` (the optimised, partitioned HLO, in which
every shape is already per device). Also: catching XLA's "Involuntary full
rematerialization" warning, which the SPMD partitioner writes to the process's stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np

REMAT_MARKER = "Involuntary full rematerialization"

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
}
_OPS = (
    "all-gather-start",
    "all-gather",
    "all-reduce-start",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute-start",
    "collective-permute",
    "collective-broadcast",
)
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>"
    + "|".join(re.escape(o) for o in _OPS)
    + r")\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_ANY_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*([a-z][a-z0-9]*\[[0-9,]*\])")


def shapes_in(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """All ``dtype[dims]`` array shapes in an HLO type (a tuple type gives several)."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_text)]


def nbytes(dtype: str, dims: Sequence[int]) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(math.ceil(_DTYPE_BYTES[dtype] * math.prod(dims)))


def _iota(sizes: Sequence[int], order: str | None) -> np.ndarray:
    """Device ids of a mesh ``sizes``, optionally listed as ``<=[dims]T(perm)``."""
    if not order:
        return np.arange(math.prod(sizes)).reshape(sizes)
    m = re.fullmatch(r"<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", order)
    if not m:
        raise ValueError(f"cannot read the device order {order!r}")
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(sizes)


def _parse_mesh_groups(text: str) -> list[list[int]]:
    """The mesh-axes form ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes: ``'a':(pre)size``)."""
    m = re.fullmatch(r"mesh\[([^\]]*)\](<=\[[0-9,]+\](?:T\([0-9,]+\))?)?\s*\{([^}]*)\}", text.strip())
    if not m:
        raise ValueError(f"cannot read replica groups {text!r}")
    axes = [(name, int(size)) for name, size in re.findall(r"'?([\w]+)'?\s*=\s*(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    ids = _iota([s for _, s in axes], m.group(2))
    # Split each mesh axis that a sub-axis refers to into (pre, size, post).
    shape: list[int] = []
    group_dims: list[int] = []
    selected = {}
    for item in filter(None, (x.strip() for x in m.group(3).split(","))):
        sm = re.fullmatch(r"'?([\w]+)'?(?::\((\d+)\)(\d+))?", item)
        if not sm or sm.group(1) not in names:
            raise ValueError(f"cannot read replica-group axis {item!r} in {text!r}")
        if sm.group(1) in selected:
            raise ValueError(f"axis {sm.group(1)!r} selected twice in {text!r}")
        selected[sm.group(1)] = (int(sm.group(2)), int(sm.group(3))) if sm.group(2) else None
    for name, size in axes:
        sub = selected.get(name, "absent")
        if sub == "absent":
            shape.append(size)
        elif sub is None:
            group_dims.append(len(shape))
            shape.append(size)
        else:
            pre, sz = sub
            shape += [pre, sz, size // (pre * sz)]
            group_dims.append(len(shape) - 2)
    ids = ids.reshape(shape)
    ids = np.moveaxis(ids, group_dims, list(range(len(shape) - len(group_dims), len(shape))))
    return ids.reshape(-1, math.prod(shape[d] for d in group_dims)).tolist()


def _parse_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """``replica_groups`` in the explicit ``{{0,1},{2,3}}``, the iota ``[G,S]<=[dims]T(perm)``
    or the mesh-axes ``mesh['x'=2,'y'=4] {'y'}`` form (its device order as ``<=[dims]T(perm)``
    or ``, device_ids=([dims]T(perm))``); empty means one group of all."""
    m = re.search(
        r"replica_groups=(mesh\[[^\]]*\]),\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?)\)\s*(\{[^}]*\})", attrs
    )
    if m:  # the mesh's device order given separately: mesh[...], device_ids=([dims]T(perm)) {...}
        return _parse_mesh_groups(f"{m.group(1)}<={m.group(2)} {m.group(3)}")
    m = re.search(r"replica_groups=(mesh\[[^\]]*\](?:<=\[[0-9,]+\](?:T\([0-9,]+\))?)?\s*\{[^}]*\})", attrs)
    if m:
        return _parse_mesh_groups(m.group(1))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        groups = [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        groups = [grp for grp in groups if grp]
        return groups or [list(range(num_devices))]
    if "replica_groups=" in attrs:
        raise ValueError(f"cannot read the replica groups of: {attrs[:200]}")
    return [list(range(num_devices))]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a partitioned program; byte counts are per participating device."""

    op: str
    name: str
    out_bytes: int  # the op's output buffer(s) on one device
    groups: tuple[tuple[int, ...], ...]  # replica groups (logical device ids)
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute source -> target

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    def received_by(self, device: int) -> float:
        """Bytes ``device`` receives from other devices (ring algorithms for reductions)."""
        if self.op.startswith("collective-permute"):
            return float(self.out_bytes) * sum(1 for _, t in self.pairs if t == device)
        if not any(device in g for g in self.groups):
            return 0.0
        g = self.group_size
        op = self.op.removesuffix("-start")
        if op == "all-gather" or op == "all-to-all":
            return self.out_bytes * (g - 1) / g
        if op == "reduce-scatter":
            return float(self.out_bytes * (g - 1))
        if op == "all-reduce":
            return 2.0 * self.out_bytes * (g - 1) / g
        if op == "collective-broadcast":
            return float(self.out_bytes)
        raise ValueError(op)


def num_partitions(hlo_text: str) -> int:
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    return int(m.group(1)) if m else 1


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in a compiled module's text (``*-done`` halves are skipped)."""
    n = num_partitions(hlo_text)
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op, attrs = m.group("op"), m.group("attrs")
        shapes = shapes_in(m.group("type"))
        if op.endswith("-start"):
            # Async pairs carry (operands..., outputs..., [scratch]) tuples: the output half.
            shapes = shapes[len(shapes) // 2 :] if len(shapes) > 1 else shapes
        out_bytes = sum(nbytes(dt, dims) for dt, dims in shapes)
        pairs: tuple[tuple[int, int], ...] = ()
        if op.startswith("collective-permute"):
            pm = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
            pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pm.group(1) if pm else ""))
            groups: list[list[int]] = []
        else:
            groups = _parse_groups(attrs, n)
        out.append(Collective(op, m.group("name"), out_bytes, tuple(tuple(g) for g in groups), pairs))
    return out


def received_per_device(collectives: Sequence[Collective], num_devices: int) -> list[float]:
    """Bytes each device receives over the whole program."""
    return [sum(c.received_by(d) for c in collectives) for d in range(num_devices)]


def largest_buffer_bytes(hlo_text: str) -> int:
    """The largest array any instruction of the program produces, on one device."""
    best = 0
    for line in hlo_text.splitlines():
        m = _ANY_INSTR.match(line)
        if m:
            for dt, dims in shapes_in(m.group(1)):
                if dt in _DTYPE_BYTES:
                    best = max(best, nbytes(dt, dims))
    return best


def buffers_with_shape(hlo_text: str, dims: Sequence[int]) -> list[str]:
    """Instructions whose (per-device) array shape is exactly ``dims``: finding a weight's
    *global* shape in a partitioned program means some device materialised it whole."""
    dims = tuple(dims)
    hits = []
    for line in hlo_text.splitlines():
        m = _ANY_INSTR.match(line)
        if m and any(d == dims for _, d in shapes_in(m.group(1))):
            hits.append(line.strip()[:160])
    return hits


@contextlib.contextmanager
def capture_stderr() -> Iterator[list[str]]:
    """Capture everything written to file descriptor 2 (XLA's C++ logging goes there, not
    to ``sys.stderr``) inside the block; the captured text is appended to the yielded list
    on exit and also re-emitted, so nothing is lost."""
    sink: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield sink
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", "replace")
            sink.append(text)
            if text:
                sys.stderr.write(text)
