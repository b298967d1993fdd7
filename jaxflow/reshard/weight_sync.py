"""Weights streamed from a trainer's pool to a rollout pool on other devices, shard by shard.

::

    sync = WeightSync(generation_shardings(abstract_state, train_rules, train_mesh,
                                           rollout_devices, gen_tp=2), dtype=jnp.bfloat16)
    gen_state, report = sync(train_state)          # after every update (or every k)
    report.bytes_moved, report.seconds             # measured

The trainer's weights are an ``nnx.State`` of ``jax.Array`` laid out on the training mesh
(e.g. fsdp=2, tp=2 over devices 0-3); the rollout pool wants them in its generation layout on
*other* devices (e.g. tp=2 with two replicas over devices 4-7). Unlike the
:class:`~jaxflow.reshard.engine.HybridEngine` (same devices, one jitted program whose
collectives XLA plans), the two pools share no device, so no SPMD program spans them.

Mechanism: point-to-point copies of slices
-------------------------------------------
For each leaf the plan intersects every destination shard's index box ``D`` with every
distinct source shard's box ``S`` (replicas of a source shard are used in turn, spreading the
load). For each non-empty ``P = D ∩ S``:

1. on the source device, ``P`` is sliced out of the source shard and cast to ``dtype`` (one
   jitted ``dynamic_slice`` + ``convert``; nothing at all when ``P`` is the whole shard and
   no cast is asked);
2. ``jax.device_put(piece, destination_device)``: a single-device copy (PJRT's
   CopyToDevice: a device-to-device DMA on GPU/TPU, a memcpy between simulated CPU devices);
3. on the destination device the piece is written into the destination shard's buffer by a
   jitted ``dynamic_update_slice`` that donates the buffer (in place), and the piece is freed.

A destination shard covered by a single piece is that piece. The shards are then joined by
``jax.make_array_from_single_device_arrays`` under the generation sharding. A device thus
holds at most its destination shards plus one piece in flight (the :class:`SyncReport`'s
``peak_device_bytes``, counted from the arrays this module creates), never a whole weight
that the generation layout splits, and nothing goes through the host.

Why not the alternatives (read in this JAX version, 0.10):

- ``jax.device_put(x, generation_sharding)`` between different device sets with a different
  layout falls to ``array.shard_sharded_device_array_slow_path``, which, when no source
  shard equals a destination shard, calls ``x._value``: a host gather of the whole weight.
- A ``jax.jit`` over the union of both pools' devices needs its input and output on one
  mesh; the arrays live on two meshes, so it would need the same device_put first.
- ``jax.experimental.transfer`` (``TransferServer.await_pull`` / ``TransferConnection.pull``)
  moves arrays between *processes* (its docstring: "DCN cross slice transfer"); inside one
  process the device copy above is the direct path. Between the Ray groups, which are
  separate ``jax.distributed`` worlds, it is the mechanism (`jaxflow.workers.weight_stream`,
  same piece plan: `overlap_targets`); it works on CPU in this JAX version.
- verl's checkpoint engines (``nccl``: all-gather each bucket on the trainer, then broadcast
  it to every rollout rank) move full tensors; here only the overlap of two shards moves, so
  a destination device receives exactly its generation shard and nothing else.

Delta mode (``delta=True``): before sending, a checksum of every distinct source shard is
computed *on its source device* over the bytes that would be sent (after the cast); only the
leaves with a changed checksum are sent, the others keep the rollout pool's previous arrays.
The checksum of a shard with bits ``u_i`` (``uint32`` words, row-major) is the pair

    m_i = h(u_i),   c = ( Σ_i m_i ,  Σ_i (2i+1)·m_i )   mod 2^32

with ``h`` the bijective xor-shift-multiply mixer ``h(u) = g(0x45d9f3b · g(u))``,
``g(u) = u ⊕ (u >> 16)``. As ``h`` is a bijection, a change of one word always changes the
first sum; several changes collide with probability about 2^-64 per shard. verl's
``delta_sharded`` reports 1-3% of bf16 bytes changing per step; ``SyncReport.changed_fraction``
is the same measure at leaf granularity.

The sync owns the rollout copy it returns: the next sync deletes the previous arrays of the
leaves it replaces (before assembling their new values, so the rollout pool never holds two
copies of a weight), and returns the same arrays for the leaves it keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from jaxflow.mesh.rules import Rules, get_rules, state_shardings
from jaxflow.mesh.specs import MeshSpec
from jaxflow.reshard.engine import derive_generation_rules, shard_bytes

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """One sync, measured: what moved, how long it took, what a device held at its worst."""

    bytes_moved: int  # bytes of the pieces copied between devices (summed over destinations)
    seconds: float  # wall time of the sync, outputs ready
    leaves_sent: int
    leaves_total: int
    model_bytes: int  # one copy of the whole model in the destination dtype
    changed_fraction: float  # bytes of the leaves sent / model_bytes (1.0 without delta)
    pieces: int  # device-to-device copies
    largest_piece_bytes: int
    dest_shard_bytes: int  # what the largest rollout device holds of the model
    peak_device_bytes: int  # the most a device held at once of the arrays this sync created

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Copy:
    """One piece: ``size`` elements from ``src_start`` of the source shard that ``src`` holds
    (a device) to ``dst_start`` of the destination shard."""

    src: Any
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    size: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Target:
    """One destination shard (held by ``owner``: a device) and the pieces it is assembled from."""

    owner: Any
    shape: tuple[int, ...]
    copies: tuple[_Copy, ...]


@dataclasses.dataclass(frozen=True)
class _LeafPlan:
    shape: tuple[int, ...]
    src_dtype: np.dtype
    dst_dtype: np.dtype
    src_sharding: Any
    dst_sharding: NamedSharding
    targets: tuple[_Target, ...]
    checksum_devices: tuple[Any, ...]  # one device per distinct source shard


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return tuple(sl.indices(dim)[:2] for sl, dim in zip(index, shape))


def _blocks(sharding: Any, shape: tuple[int, ...]) -> dict[Box, list[Any]]:
    """Distinct shard boxes of ``sharding`` -> the devices holding each (its replicas)."""
    out: dict[Box, list[Any]] = {}
    for dev, idx in sharding.devices_indices_map(shape).items():
        out.setdefault(_box(idx, shape), []).append(dev)
    return out


def overlap_targets(src_blocks: dict[Box, list[Any]], dst_boxes: Sequence[tuple[Any, Box]]) -> tuple[_Target, ...]:
    """Every destination box ``D`` (with its owner) intersected with every distinct source
    box ``S`` (with the owners of its replicas, used in turn): one `_Copy` per non-empty
    ``D ∩ S``. Owners are whatever identifies a holder: a device here, a (process, device
    id) pair between worlds (`jaxflow.workers.weight_stream`)."""
    turn = dict.fromkeys(src_blocks, 0)
    targets = []
    for owner, d_box in dst_boxes:
        copies = []
        for s_box, owners in src_blocks.items():
            lo = tuple(max(a[0], b[0]) for a, b in zip(d_box, s_box))
            hi = tuple(min(a[1], b[1]) for a, b in zip(d_box, s_box))
            if any(h <= l_ for l_, h in zip(lo, hi)):
                continue
            src = owners[turn[s_box] % len(owners)]  # replicas in turn
            turn[s_box] += 1
            copies.append(
                _Copy(
                    src,
                    tuple(l_ - s[0] for l_, s in zip(lo, s_box)),
                    tuple(l_ - d[0] for l_, d in zip(lo, d_box)),
                    tuple(h - l_ for l_, h in zip(lo, hi)),
                )
            )
        targets.append(_Target(owner, tuple(b - a for a, b in d_box), tuple(copies)))
    return tuple(targets)


def _plan_leaf(shape: tuple[int, ...], src_dtype, src: Any, dst: NamedSharding, dtype) -> _LeafPlan:
    """Intersect every destination shard with every distinct source shard."""
    blocks = _blocks(src, shape)
    dst_boxes = [(dev, _box(idx, shape)) for dev, idx in dst.devices_indices_map(shape).items()]
    return _LeafPlan(
        shape=shape,
        src_dtype=np.dtype(src_dtype),
        dst_dtype=np.dtype(dtype or src_dtype),
        src_sharding=src,
        dst_sharding=dst,
        targets=overlap_targets(blocks, dst_boxes),
        checksum_devices=tuple(devs[0] for devs in blocks.values()),
    )


# --- the device programs (each runs on the one device that holds its input) ---------------


@functools.partial(jax.jit, static_argnames=("size", "dtype"))
def take_piece(shard: jax.Array, start: jax.Array, *, size: tuple[int, ...], dtype: Any) -> jax.Array:
    """``shard[start : start + size]`` cast to ``dtype``, on the shard's device."""
    return lax.dynamic_slice(shard, tuple(start), size).astype(dtype)


@functools.partial(jax.jit, donate_argnums=0)
def place_piece(buf: jax.Array, piece: jax.Array, start: jax.Array) -> jax.Array:
    """``buf[start : start + piece.shape] = piece``, in place (``buf`` is donated)."""
    return lax.dynamic_update_slice(buf, piece, tuple(start))


def _words_u32(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``uint32`` words (narrower types widened, 64-bit split)."""
    itemsize = np.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


@functools.partial(jax.jit, static_argnames="dtype")
def _checksum(shard: jax.Array, *, dtype: Any) -> jax.Array:
    """``uint32[2]``: the module docstring's pair of sums over the shard's bits after the cast."""
    u = _words_u32(shard.astype(dtype))

    def g(v):
        return v ^ (v >> 16)

    m = g(g(u) * jnp.uint32(0x45D9F3B))
    i = jnp.arange(m.shape[0], dtype=jnp.uint32)
    return jnp.stack([jnp.sum(m, dtype=jnp.uint32), jnp.sum((2 * i + 1) * m, dtype=jnp.uint32)])


class _Ledger:
    """Bytes each device holds of the arrays the sync created (and of the rollout copy it
    owns), and the most it held at once."""

    def __init__(self):
        self.now: dict[Any, int] = {}
        self.peak = 0

    def add(self, x: jax.Array) -> jax.Array:
        for s in x.addressable_shards:
            self.now[s.device] = self.now.get(s.device, 0) + s.data.nbytes
            self.peak = max(self.peak, self.now[s.device])
        return x

    def free(self, x: jax.Array) -> None:
        for s in x.addressable_shards:
            self.now[s.device] -= s.data.nbytes
        x.delete()


def generation_layout(
    train_rules: Rules | str, train_mesh: Mesh, rollout_devices: Sequence[Any], gen_tp: int
) -> tuple[Rules, Mesh]:
    """The rollout pool's generation rules and mesh: the rules
    :func:`~jaxflow.reshard.engine.derive_generation_rules` gives for ``train_rules``, on a
    mesh of ``gen_tp``-way tensor parallelism times replicas over ``rollout_devices``."""
    gen_rules = derive_generation_rules(get_rules(train_rules), train_mesh)
    return gen_rules, MeshSpec(dp=-1, tp=gen_tp).build(rollout_devices)


def generation_shardings(
    state: Any, train_rules: Rules | str, train_mesh: Mesh, rollout_devices: Sequence[Any], gen_tp: int
) -> Any:
    """The rollout pool's generation layout of ``state`` (abstract or concrete): its
    `generation_layout`'s shardings."""
    gen_rules, gen_mesh = generation_layout(train_rules, train_mesh, rollout_devices, gen_tp)
    return state_shardings(state, gen_rules, gen_mesh)


class WeightSync:
    """Streams a trainer's weights into the generation layout ``dst_shardings`` (a tree of
    ``NamedSharding`` matching the state, e.g. :func:`generation_shardings`) on devices that
    the trainer's do not include. ``dtype``: the generation copy's dtype (cast on the source
    devices); ``delta``: send only the leaves whose checksum changed since the last sync.
    Calling it returns ``(rollout_state, SyncReport)``; see the module docstring."""

    def __init__(self, dst_shardings: Any, *, dtype: Any = None, delta: bool = False):
        self.dst_def = jax.tree.structure(dst_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        self.dst = jax.tree.leaves(dst_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        bad = [s for s in self.dst if not isinstance(s, NamedSharding)]
        if bad:
            raise ValueError(f"the generation layout must be a tree of NamedSharding; got {type(bad[0]).__name__}")
        self.dst_devices = set().union(*(s.device_set for s in self.dst))
        self.dtype = dtype
        self.delta = delta
        self.plans: list[_LeafPlan] | None = None
        self.held: list[jax.Array] | None = None  # the rollout copy this sync returned last
        self.sums: list[np.ndarray] | None = None
        self.ledger = _Ledger()

    def __call__(self, train_state: Any) -> tuple[Any, SyncReport]:
        t0 = time.perf_counter()
        leaves, treedef = self._leaves(train_state)
        plans = self._plans_for(leaves)
        send = self._changed(leaves, plans)
        self.ledger.peak = max(self.ledger.now.values(), default=0)
        out = list(self.held) if self.held is not None else [None] * len(leaves)
        moved = pieces = largest = 0
        for i in send:
            if self.held is not None:
                self.ledger.free(self.held[i])  # before its new value: never two copies
            out[i], stats = self._send_leaf(plans[i], leaves[i])
            moved, pieces, largest = moved + stats[0], pieces + stats[1], max(largest, stats[2])
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        self.held = out
        leaf_bytes = [int(np.prod(p.shape)) * p.dst_dtype.itemsize for p in plans]
        report = SyncReport(
            bytes_moved=moved,
            seconds=seconds,
            leaves_sent=len(send),
            leaves_total=len(leaves),
            model_bytes=sum(leaf_bytes),
            changed_fraction=sum(leaf_bytes[i] for i in send) / max(1, sum(leaf_bytes)),
            pieces=pieces,
            largest_piece_bytes=largest,
            dest_shard_bytes=shard_bytes(out, self.dst),
            peak_device_bytes=self.ledger.peak,
        )
        return jax.tree.unflatten(treedef, out), report

    def _leaves(self, train_state: Any) -> tuple[list[jax.Array], Any]:
        """The state's arrays in the layout's order; clear errors for a wrong tree, a foreign
        leaf, or a source on the rollout devices."""
        try:
            per_sharding = self.dst_def.flatten_up_to(train_state)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"the trainer's state and the generation layout have different tree structures: {e}"
            ) from e
        leaves, treedef = jax.tree.flatten(train_state)
        if len(leaves) != len(per_sharding):
            raise ValueError(
                f"the trainer's state has {len(leaves)} arrays but the generation layout {len(per_sharding)} shardings"
            )
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array) or not x.is_fully_addressable:
                raise ValueError(f"leaf {i}: expected a jax.Array on this process's devices, got {type(x).__name__}")
            shared = sorted(d.id for d in x.sharding.device_set & self.dst_devices)
            if shared:
                raise ValueError(
                    f"leaf {i}: the trainer's and the rollout's pools overlap on devices {shared}; "
                    "a reshard on the same devices is the HybridEngine's"
                )
        return leaves, treedef

    def _plans_for(self, leaves: list[jax.Array]) -> list[_LeafPlan]:
        """The copy plan, made on the first sync and checked against every later one."""
        if self.plans is None:
            for i, (x, d) in enumerate(zip(leaves, self.dst)):
                try:
                    d.shard_shape(tuple(x.shape))
                except ValueError as e:
                    raise ValueError(f"leaf {i}: shape {tuple(x.shape)} does not fit the generation layout: {e}") from e
            self.plans = [
                _plan_leaf(tuple(x.shape), x.dtype, x.sharding, d, self.dtype) for x, d in zip(leaves, self.dst)
            ]
        for i, (x, p) in enumerate(zip(leaves, self.plans)):
            if tuple(x.shape) != p.shape or np.dtype(x.dtype) != p.src_dtype:
                raise ValueError(
                    f"leaf {i}: shape {tuple(x.shape)} {x.dtype} differs from {p.shape} {p.src_dtype} of the first sync"
                )
            if x.sharding != p.src_sharding:
                raise ValueError(f"leaf {i}: the training layout changed since the first sync ({x.sharding})")
        return self.plans

    def _changed(self, leaves: list[jax.Array], plans: list[_LeafPlan]) -> list[int]:
        """Indices of the leaves to send: all of them, or under ``delta`` those whose
        checksum (computed on the source devices) differs from the last sync's."""
        if not self.delta:
            return list(range(len(leaves)))
        sums = []
        for x, p in zip(leaves, plans):
            shards = {s.device: s.data for s in x.addressable_shards}
            sums.append([_checksum(shards[d], dtype=p.dst_dtype) for d in p.checksum_devices])
        sums = [np.stack(s) for s in jax.device_get(sums)]  # 8 bytes per shard
        old, self.sums = self.sums, sums
        if old is None or self.held is None:
            return list(range(len(leaves)))
        return [i for i, (a, b) in enumerate(zip(sums, old)) if not np.array_equal(a, b)]

    def _send_leaf(self, plan: _LeafPlan, x: jax.Array) -> tuple[jax.Array, tuple[int, int, int]]:
        """The leaf in the generation layout, assembled shard by shard; (bytes moved, pieces,
        largest piece)."""
        shards = {s.device: s.data for s in x.addressable_shards}
        out, moved, largest = [], 0, 0
        for target in plan.targets:
            if len(target.copies) == 1 and target.copies[0].size == target.shape:
                buf = self._piece(plan, target, target.copies[0], shards)
                moved, largest = moved + buf.nbytes, max(largest, buf.nbytes)
            else:
                buf = self.ledger.add(jnp.zeros(target.shape, plan.dst_dtype, device=target.owner))
                for c in target.copies:
                    piece = self._piece(plan, target, c, shards)
                    moved, largest = moved + piece.nbytes, max(largest, piece.nbytes)
                    self.ledger.now[target.owner] -= buf.nbytes  # donated: rewritten in place
                    # ready before the next piece is cut: one piece in flight per device
                    buf = self.ledger.add(
                        place_piece(buf, piece, np.asarray(c.dst_start, np.int32)).block_until_ready()
                    )
                    self.ledger.free(piece)
            out.append(buf.block_until_ready())  # one destination shard at a time: the bound
        pieces = sum(len(t.copies) for t in plan.targets)
        return jax.make_array_from_single_device_arrays(plan.shape, plan.dst_sharding, out), (moved, pieces, largest)

    def _piece(self, plan: _LeafPlan, target: _Target, c: _Copy, shards: dict[Any, jax.Array]) -> jax.Array:
        """One piece sliced (and cast) on its source device and copied to the target's."""
        shard = shards[c.src]
        whole = c.size == tuple(shard.shape) and plan.dst_dtype == plan.src_dtype
        src_piece = (
            shard
            if whole
            else self.ledger.add(
                take_piece(shard, np.asarray(c.src_start, np.int32), size=c.size, dtype=plan.dst_dtype)
            )
        )
        piece = self.ledger.add(jax.device_put(src_piece, target.owner))
        if not whole:
            self.ledger.free(src_piece)
        return piece
