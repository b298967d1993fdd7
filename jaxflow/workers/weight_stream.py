"""Weights streamed between two `jax.distributed` worlds (e.g. the trainer's and the
rollout's Ray worker groups), each process sending only its own shards, with
``jax.experimental.transfer``.

::

    # every process of both worlds: one endpoint (one transfer server) per process
    endpoint = StreamEndpoint(host_ip)
    endpoint.describe(role, "source" | "target")      # address, leaf paths, layout -> the driver
    plan = stream_plan(src_layout, dst_layout)          # the driver, once (match_trees first)
    route = StreamRoute(plan, dst_layout, source_addresses, target_addresses, bucket_bytes)
    endpoint.join(key, role, side, route)               # every process, once
    endpoint.sync(key, n)          # each sync: sources offer, targets receive, concurrently

The driver's side on Ray is `jaxflow.workers.ray.streams.WeightStream`; the endpoint is what
each `jaxflow.workers.ray_host.HostProcess` keeps (``stream_*`` methods). A role takes part
through two members every `jaxflow.workers.base.RoleWorker` has: ``params`` (its arrays on
its mesh) and ``replace_params`` (the target's new arrays, same tree).

The plan is :func:`jaxflow.reshard.weight_sync.overlap_targets` over world-independent
layouts: each shard box with its owner ``(process_index, device_id)``. Each piece (the
overlap of a source shard and a destination shard) gets a number ``k`` in the plan's order;
its owner slices (and casts to the target's dtype) it on its device and posts it under
``uuid = sync·2^32 + k`` (``TransferServer.await_pull``); a piece that several destination
replicas want is made once (per bucket) and posted under each of their numbers. The
destination's process pulls it from that sender's server (``TransferConnection.pull``)
straight onto its device and writes it into the destination shard in place. No process touches a piece of a shard it does not hold,
and nothing goes through a file or the host (on CPU the transfer server copies device memory
over a socket; on GPU/TPU it is PJRT's cross-host transfer).

Buckets. The pieces are cut, in plan order, into buckets of at most ``bucket_bytes``; a
sender makes and posts one bucket's pieces, then waits until every receiver of that bucket
acknowledges it (the receiver posts a one-byte array that the sender pulls, over the same
servers: no round trip through a driver) before it drops them and makes the next.

Faults. A process that fails in a sync (its role raises, its weights are not laid out as
the plan's, or a pull fails: the peer died and its connection closed, or the peer posted an
error, `StreamAborted`) posts an error array (``transfer.make_error_array``) under every
number of the sync it has not posted yet (`WeightSender.abort`, `WeightReceiver.abort`), then
raises: whoever waits on it fails at once and does the same, so every process of both worlds
comes back (see `jaxflow.workers.ray.streams`).

What a process holds of the model during a sync (counted from the arrays this module makes,
`StreamReport.peak_bytes`): a sender its own shards plus one bucket of pieces (a piece
that is a whole shard in the target's dtype is the shard itself); a receiver frees its
previous copy first (it never holds two), then holds its destination shards plus one piece
in flight. Neither ever holds a whole weight that either layout splits.

Measured in this JAX (0.10.2) on CPU: a transfer server started in each of two plain
processes (each its own client), and in each process of two Ray worker groups that are two
``jax.distributed`` worlds with gloo collectives, moves a pulled array onto the puller's
device; a pull issued before its piece is posted waits for it. See
``tests/test_weight_stream.py`` (two single-process worlds) and
``tests/test_weight_stream_ray.py`` (two Ray groups of 2 processes x 2 devices).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from jaxflow.reshard.weight_sync import overlap_targets, place_piece, take_piece

# per leaf: (shape, dtype name, ((owner, box), ...)) with owner = (process_index, device_id)
Layout = list[tuple[tuple[int, ...], str, tuple[tuple[tuple[int, int], tuple[tuple[int, int], ...]], ...]]]
SIDES = ("source", "target")


class WeightHolder(Protocol):
    """What a role needs to take part in a stream (every `RoleWorker` has both)."""

    @property
    def params(self) -> Any: ...

    def replace_params(self, params: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class StreamReport:
    """One process's part of one sync, measured (bytes counted from the arrays it made)."""

    process: int  # its index in its world
    side: str  # "source" | "target"
    bytes: int  # bytes it posted (source) or pulled (target), one count per piece moved
    pieces: int
    seconds: float  # wall time of its part, pieces posted (source) / arrays ready (target)
    held_bytes: int  # what it holds of the model: its devices' shards (source) / new shards (target)
    peak_bytes: int  # the most it held of the model during the sync: shards plus pieces
    largest_piece_bytes: int
    largest_shard_bytes: int  # its largest shard of one leaf


def _boxes(shape: tuple[int, ...], sharding: Any) -> tuple:
    return tuple(
        ((dev.process_index, dev.id), tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape)))
        for dev, idx in sharding.devices_indices_map(shape).items()
    )


def layout(leaves: Sequence[jax.Array]) -> Layout:
    """The world-independent layout of a state's arrays (picklable plain tuples)."""
    return [(tuple(x.shape), np.dtype(x.dtype).name, _boxes(tuple(x.shape), x.sharding)) for x in leaves]


def layout_of_shardings(shapes: Sequence[Any], shardings: Sequence[Any], dtype: Any = None) -> Layout:
    """The layout that ``shardings`` give arrays of ``shapes`` (anything with ``.shape`` and
    ``.dtype``), in ``dtype`` if given (the generation copy's)."""
    return [
        (tuple(x.shape), np.dtype(dtype or x.dtype).name, _boxes(tuple(x.shape), s)) for x, s in zip(shapes, shardings)
    ]


def layout_dtypes(lay: Layout) -> list[np.dtype]:
    """The dtype of each leaf of a layout (a target's: what the senders cast to)."""
    return [np.dtype(d) for _, d, _ in lay]


def layout_bytes(lay: Layout) -> int:
    """Bytes of one whole copy of the model that ``lay`` lays out."""
    return sum(int(np.prod(shape)) * np.dtype(d).itemsize for shape, d, _ in lay)


def leaf_paths(tree: Any) -> list[str]:
    """The path of every leaf of ``tree`` (``jax.tree_util.keystr``), in flattening order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _some(paths: Sequence[str], shown: int = 3) -> str:
    if not paths:
        return "nothing"
    more = f" (+{len(paths) - shown} more)" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def match_trees(src_paths: Sequence[str], dst_paths: Sequence[str]) -> None:
    """Raises ValueError naming the leaves that only one side has (or the first out of order)."""
    if list(src_paths) == list(dst_paths):
        return
    only_src = [p for p in src_paths if p not in set(dst_paths)]
    only_dst = [p for p in dst_paths if p not in set(src_paths)]
    if not only_src and not only_dst:
        first = next(i for i, (a, b) in enumerate(zip(src_paths, dst_paths)) if a != b)
        raise ValueError(f"the weights' leaves are in another order: {src_paths[first]} vs {dst_paths[first]}")
    raise ValueError(
        f"the trainer's weights and the rollout's are different trees: only the trainer's has "
        f"{_some(only_src)}; only the rollout's has {_some(only_dst)}"
    )


def stream_plan(src: Layout, dst: Layout, paths: Sequence[str] | None = None) -> list[tuple]:
    """Per leaf, the destination shards and the pieces each is made of (`overlap_targets`);
    ``paths`` name the leaves in its errors."""
    if len(src) != len(dst):
        raise ValueError(f"the trainer's state has {len(src)} arrays but the rollout layout {len(dst)}")
    differ = [
        f"{paths[i] if paths else f'leaf {i}'} is {a} in the trainer's world, {b} in the rollout's"
        for i, ((a, _, _), (b, _, _)) in enumerate(zip(src, dst))
        if a != b
    ]
    if differ:
        raise ValueError(f"{len(differ)} of {len(src)} weights differ in shape: {_some(differ)}")
    plan = []
    for (_, _, s_boxes), (_, _, d_boxes) in zip(src, dst):
        blocks: dict = {}
        for owner, box in s_boxes:
            blocks.setdefault(box, []).append(owner)
        plan.append(overlap_targets(blocks, d_boxes))
    return plan


def _pieces(plan: list[tuple]):
    """(number, leaf, target, copy) over the whole plan, in the order both worlds number them."""
    k = 0
    for i, targets in enumerate(plan):
        for target in targets:
            for c in target.copies:
                yield k, i, target, c
                k += 1


STREAMS = 2**7  # streams told apart in transfer numbers (`StreamRoute.sync_tag`)


def _uuid(sync: int, k: int) -> int:
    """The transfer number of piece ``k`` of sync ``sync`` (a `StreamRoute.sync_tag` between
    the Ray groups): 63 bits for ``sync < 2^31``."""
    return sync * 2**32 + k


def _ack_uuid(sync: int, bucket: int, sender: int) -> int:
    """The number of a receiver's acknowledgement of ``bucket`` to process ``sender`` (above
    every piece number of the sync: pieces count below 2^31)."""
    return sync * 2**32 + 2**31 + bucket * 2**12 + sender


def _buckets(plan: list[tuple], dtypes: Sequence[Any], bucket_bytes: int | None) -> list[list[tuple]]:
    """The plan's pieces (`_pieces`) cut, in order, into buckets of at most ``bucket_bytes``
    (a larger piece is a bucket of its own; None: one bucket). Both worlds cut alike."""
    buckets: list[list[tuple]] = [[]]
    filled = 0
    for piece in _pieces(plan):
        _, i, _, c = piece
        size = int(np.prod(c.size)) * np.dtype(dtypes[i]).itemsize
        if bucket_bytes is not None and buckets[-1] and filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(piece)
        filled += size
    return buckets


ACK = jax.ShapeDtypeStruct((1,), jnp.int8)  # a receiver's word that it pulled a bucket


def _ack_sharding() -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.local_devices()[0])  # where acknowledgements are made and pulled


class StreamAborted(RuntimeError):
    """This process's part of a sync stopped because a process of the other world failed: it
    died (its connection closed) or it raised (it posted errors in place of the rest of its
    part, `WeightSender.abort`, `WeightReceiver.abort`). A symptom: the driver reports the
    failed process's own error."""


def _arrived(arrays: Sequence[jax.Array], side: str, process: int) -> None:
    """Waits until ``arrays``, pulled from ``side`` process ``process`` of the other world,
    are here; a failed transfer (that process died, or posted an error) is `StreamAborted`."""
    try:
        jax.block_until_ready(arrays)
    except jax.errors.JaxRuntimeError as e:
        raise StreamAborted(f"{side} process {process} of the other world failed: {e}") from e


def _post_errors(server: Any, specs: Mapping[int, jax.ShapeDtypeStruct], message: str) -> None:
    """Posts an error array under each transfer number of ``specs`` (number -> what its
    puller expects): whoever pulls it gets ``message`` as a failed transfer, at once."""
    for uuid, spec in specs.items():
        server.await_pull(uuid, [transfer.make_error_array(spec, message)])


def _shard_bytes(leaves: Sequence[jax.Array]) -> tuple[int, int]:
    """(bytes of every shard on this process's devices, the largest one)."""
    sizes = [s.data.nbytes for x in leaves for s in x.addressable_shards]
    return sum(sizes), max(sizes, default=0)


def start_server(address: str = "127.0.0.1:0") -> Any:
    """This process's transfer server (one per process, kept for the run)."""
    return transfer.start_transfer_server(jax.devices()[0].client, address, [address])


class WeightSender:
    """Posts this process's pieces of a sync (only shards its devices hold), a bucket at a
    time: with ``receiver_addresses`` (the receiving processes' servers by process index) it
    waits for each receiver's acknowledgement of a bucket before making the next, so that it
    holds at most its shards plus one bucket of pieces."""

    def __init__(self, server: Any, receiver_addresses: Mapping[int, str] | None = None):
        self.server = server
        self.connections = {q: server.connect(a) for q, a in (receiver_addresses or {}).items()}
        self.posted: set[int] = set()  # the transfer numbers posted in the current sync

    def abort(self, plan: list[tuple], sync: int, dtypes: Sequence[Any], message: str) -> None:
        """After this process failed in sync ``sync``: an error (``message``) in place of
        every piece it owns and has not posted, so that no receiver waits for it."""
        me, devices = jax.process_index(), {d.id: d for d in jax.local_devices()}
        specs = {
            _uuid(sync, k): jax.ShapeDtypeStruct(c.size, dtypes[i], sharding=SingleDeviceSharding(devices[c.src[1]]))
            for k, i, _, c in _pieces(plan)
            if c.src[0] == me and _uuid(sync, k) not in self.posted
        }
        _post_errors(self.server, specs, message)

    def offer(
        self,
        leaves: Sequence[jax.Array],
        plan: list[tuple],
        sync: int,
        dtypes: Sequence[Any] | None = None,
        bucket_bytes: int | None = None,
    ) -> StreamReport:
        """Posts every piece this process owns for sync number ``sync``, each cast to its
        leaf's entry of ``dtypes`` (the target's; default: the leaf's own), in buckets of
        ``bucket_bytes`` (None: all at once, and no acknowledgements awaited)."""
        t0, me = time.perf_counter(), jax.process_index()
        dtypes = [np.dtype(d) for d in (dtypes or [x.dtype for x in leaves])]
        if bucket_bytes is not None and not self.connections:
            raise ValueError("a bucketed offer awaits the receivers' acknowledgements: give receiver_addresses")
        shards = [{s.device.id: s.data for s in x.addressable_shards} for x in leaves]
        self.posted = set()
        sent = pieces = largest = most_made = 0
        ack = jax.ShapeDtypeStruct(ACK.shape, ACK.dtype, sharding=_ack_sharding())
        for b, bucket in enumerate(_buckets(plan, dtypes, bucket_bytes)):
            made: dict[tuple, jax.Array] = {}  # (leaf, device, start, size) -> piece: one per distinct piece
            made_bytes, receivers = 0, set()
            for k, i, target, c in bucket:
                if c.src[0] != me:
                    continue
                key = (i, c.src[1], c.src_start, c.size)
                if key not in made:
                    shard = shards[i][c.src[1]]
                    if c.size == shard.shape and dtypes[i] == shard.dtype:  # the shard itself: no copy
                        made[key] = shard
                    else:
                        start = np.asarray(c.src_start, np.int32)
                        made[key] = take_piece(shard, start, size=c.size, dtype=dtypes[i])
                        made_bytes += made[key].nbytes
                self.server.await_pull(_uuid(sync, k), [made[key]])
                self.posted.add(_uuid(sync, k))
                receivers.add(target.owner[0])
                sent, pieces, largest = sent + made[key].nbytes, pieces + 1, max(largest, made[key].nbytes)
            most_made = max(most_made, made_bytes)
            if bucket_bytes is not None:  # each receiver's word that it has this bucket
                for q in sorted(receivers):
                    _arrived(self.connections[q].pull(_ack_uuid(sync, b, me), [ack]), "target", q)
        held, largest_shard = _shard_bytes(leaves)
        seconds = time.perf_counter() - t0
        return StreamReport(me, "source", sent, pieces, seconds, held, held + most_made, largest, largest_shard)


class WeightReceiver:
    """Pulls this process's destination shards of a sync from the senders' servers."""

    def __init__(self, server: Any, sender_addresses: Mapping[int, str]):
        self.server = server
        self.connections = {p: server.connect(a) for p, a in sender_addresses.items()}
        self.posted: set[int] = set()  # the acknowledgements posted in the current sync

    def abort(self, plan: list[tuple], dst: Layout, sync: int, bucket_bytes: int | None, message: str) -> None:
        """After this process failed in sync ``sync``: an error (``message``) in place of
        every acknowledgement it has not posted, so that no sender waits for it."""
        if bucket_bytes is None:
            return
        me, ack = jax.process_index(), jax.ShapeDtypeStruct(ACK.shape, ACK.dtype, sharding=_ack_sharding())
        specs = {
            _ack_uuid(sync, b, c.src[0]): ack
            for b, bucket in enumerate(_buckets(plan, layout_dtypes(dst), bucket_bytes))
            for _, _, target, c in bucket
            if target.owner[0] == me and _ack_uuid(sync, b, c.src[0]) not in self.posted
        }
        _post_errors(self.server, specs, message)

    def receive(
        self, plan: list[tuple], dst: Layout, shardings: Sequence[Any], sync: int, bucket_bytes: int | None = None
    ) -> tuple[list[jax.Array], StreamReport]:
        """The synced arrays (global, laid out by ``shardings``; ``dst`` their layout) and
        this process's `StreamReport`. With ``bucket_bytes`` (the senders' buckets), each
        bucket pulled is acknowledged to the senders it came from."""
        dtypes = layout_dtypes(dst)
        t0, me, pulled, pieces, largest, holding, peak = time.perf_counter(), jax.process_index(), 0, 0, 0, 0, 0
        devices = {d.id: d for d in jax.local_devices()}
        bufs: dict[tuple[int, int], jax.Array] = {}  # (leaf, device id) -> its shard
        ack = jnp.zeros(ACK.shape, ACK.dtype, device=jax.local_devices()[0])
        self.posted = set()
        for b, bucket in enumerate(_buckets(plan, dtypes, bucket_bytes)):
            senders = set()
            for k, i, target, c in bucket:
                if target.owner[0] != me:
                    continue
                senders.add(c.src[0])
                holding, peak, piece_bytes = self._pull_piece(
                    bufs, devices, dtypes, k, i, target, c, sync, holding, peak
                )
                pulled, pieces, largest = pulled + piece_bytes, pieces + 1, max(largest, piece_bytes)
            if bucket_bytes is not None:
                for p in sorted(senders):
                    self.server.await_pull(_ack_uuid(sync, b, p), [ack])
                    self.posted.add(_ack_uuid(sync, b, p))
        out = [
            jax.make_array_from_single_device_arrays(
                shape, s, [bufs[(i, t.owner[1])] for t in targets if t.owner[0] == me]
            )
            for i, ((shape, _, _), targets, s) in enumerate(zip(dst, plan, shardings))
        ]
        held, largest_shard = _shard_bytes(out)
        seconds = time.perf_counter() - t0
        return out, StreamReport(me, "target", pulled, pieces, seconds, held, peak, largest, largest_shard)

    def _pull_piece(self, bufs, devices, dtypes, k, i, target, c, sync, holding, peak) -> tuple[int, int, int]:
        """Pulls piece ``k`` onto its device and writes it into its destination shard in
        ``bufs`` (in place); the bytes then held and at most held, and the piece's bytes."""
        dev = devices[target.owner[1]]
        spec = jax.ShapeDtypeStruct(c.size, dtypes[i], sharding=SingleDeviceSharding(dev))
        pulled = self.connections[c.src[0]].pull(_uuid(sync, k), [spec])
        _arrived(pulled, "source", c.src[0])  # here before this bucket is acknowledged
        (piece,) = pulled
        key, piece_bytes = (i, dev.id), piece.nbytes
        if len(target.copies) == 1 and c.size == target.shape:
            bufs[key] = piece
            return holding + piece_bytes, max(peak, holding + piece_bytes), piece_bytes
        buf = bufs.pop(key, None)
        if buf is None:
            buf = jnp.zeros(target.shape, dtypes[i], device=dev)
            holding += buf.nbytes
        peak = max(peak, holding + piece_bytes)
        bufs[key] = place_piece(buf, piece, np.asarray(c.dst_start, np.int32)).block_until_ready()
        piece.delete()
        return holding, peak, piece_bytes


@dataclasses.dataclass(frozen=True)
class StreamRoute:
    """What every process of both worlds gets of a stream from the driver: the piece plan,
    the target's layout, the servers of both worlds' processes by process index, the
    bucket size, the stream's number."""

    plan: list[tuple]
    dst: Layout
    sources: Mapping[int, str]
    targets: Mapping[int, str]
    bucket_bytes: int | None
    stream_id: int = 0  # < STREAMS, distinct among the streams a process takes part in

    def sync_tag(self, sync: int) -> int:
        """The number that tells sync ``sync`` of this stream from every other stream's (the
        transfer numbers a process's one server sees): ``sync * STREAMS + stream_id``."""
        if not 0 <= self.stream_id < STREAMS:
            raise ValueError(f"stream_id {self.stream_id} is not in [0, {STREAMS})")
        return sync * STREAMS + self.stream_id


@dataclasses.dataclass
class _Joined:
    """One stream as one process takes part in it."""

    role: WeightHolder
    side: str
    route: StreamRoute
    peer: WeightSender | WeightReceiver
    paths: list[str]  # the role's leaves when it joined
    layout: Layout  # their layout then (every sync's must be the same: the plan is cut for it)

    def check_layout(self, leaves: Sequence[jax.Array]) -> None:
        """Raises ValueError naming the leaves whose shape, dtype or sharding is not the one
        the stream's plan was made for."""
        now = layout(leaves)
        if now == self.layout:
            return
        if len(now) != len(self.layout):
            changed = [f"{len(now)} arrays, not {len(self.layout)}"]
        else:
            changed = [p for p, a, b in zip(self.paths, self.layout, now) if a != b]
        raise ValueError(
            f"the {self.side}'s weights are not laid out as when the stream was built: {_some(changed)} "
            "changed (a stream's plan is made for one layout: build a new stream)"
        )


class StreamEndpoint:
    """One process's end of the weight streams it takes part in: one transfer server on
    ``host`` (this node's address, reachable from the other world's processes), and per
    stream (``key``) its role, side and plan."""

    def __init__(self, host: str = "127.0.0.1"):
        self.server = start_server(f"{host}:0")
        self.streams: dict[str, _Joined] = {}

    def describe(self, role: WeightHolder, side: str) -> dict[str, Any]:
        """This process's server address, and the leaf paths and layout of ``role``'s weights
        (the same on every process of a world: the driver reads one)."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        return {
            "process": jax.process_index(),
            "address": self.server.address(),
            "paths": leaf_paths(role.params),
            "layout": layout(jax.tree.leaves(role.params)),
        }

    def join(self, key: str, role: WeightHolder, side: str, route: StreamRoute) -> None:
        """Takes part in stream ``key`` as ``side`` along ``route`` (connecting to the other
        world's servers)."""
        if side == "source":
            peer: WeightSender | WeightReceiver = WeightSender(self.server, route.targets)
        else:
            peer = WeightReceiver(self.server, route.sources)
        self.streams[key] = _Joined(
            role, side, route, peer, leaf_paths(role.params), layout(jax.tree.leaves(role.params))
        )

    def sync(self, key: str, sync: int) -> StreamReport:
        """Sync number ``sync`` of stream ``key``: a source posts its pieces of its role's
        current weights; a target frees its role's previous weights, pulls its shards and
        gives them to the role (``replace_params``). A process that fails (its role raises,
        its weights are no longer laid out as the plan's, a peer failed: `StreamAborted`)
        first posts errors in place of the rest of its part, so that the other world's
        processes stop waiting for it at once, then raises. A target whose sync failed holds
        no weights until a later sync succeeds."""
        joined = self.streams[key]
        route, tag = joined.route, joined.route.sync_tag(sync)
        try:
            return self._sync(joined, tag)
        except Exception as error:
            message = (
                f"weight stream {key!r} sync {sync}: {joined.side} process {jax.process_index()} failed: "
                f"{type(error).__name__}: {error}"
            )
            if isinstance(joined.peer, WeightSender):
                joined.peer.abort(route.plan, tag, layout_dtypes(route.dst), message)
            else:
                joined.peer.abort(route.plan, route.dst, tag, route.bucket_bytes, message)
            raise

    @staticmethod
    def _sync(joined: _Joined, tag: int) -> StreamReport:
        route = joined.route
        if joined.side == "source":
            leaves = jax.tree.leaves(joined.role.params)
            joined.check_layout(leaves)
            return joined.peer.offer(leaves, route.plan, tag, layout_dtypes(route.dst), route.bucket_bytes)
        old, treedef = jax.tree.flatten(joined.role.params)
        joined.check_layout(old)
        shardings = [x.sharding for x in old]
        for x in old:  # never two copies of the rollout's weights
            x.delete()
        del old
        arrays, report = joined.peer.receive(route.plan, route.dst, shardings, tag, route.bucket_bytes)
        joined.role.replace_params(jax.tree.unflatten(treedef, arrays))
        return report
