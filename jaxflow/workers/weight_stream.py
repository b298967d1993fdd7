"""Weights streamed between two `jax.distributed` worlds (e.g. the trainer's and the
rollout's Ray worker groups), each process sending only its own shards, with
``jax.experimental.transfer``.

::

    # every process of both worlds
    server = start_server()                                    # one per process
    src = layout(train_state)                  # trainer world: plain tuples, sent to the driver
    dst = layout_of_shardings(abstract_state, gen_shardings)   # rollout world
    plan = stream_plan(src, dst)                               # the same on every process
    # trainer processes                           # rollout processes
    WeightSender(server).offer(leaves, plan, n)   WeightReceiver(server, addresses).receive(plan, dst, gen_shardings, n)

The plan is :func:`jaxflow.reshard.weight_sync.overlap_targets` over world-independent
layouts: each shard box with its owner ``(process_index, device_id)``. Each piece (the
overlap of a source shard and a destination shard) gets a number ``k`` in the plan's order;
its owner slices (and casts) it on its device and posts it under ``uuid = sync·2^32 + k``
(``TransferServer.await_pull``); the destination's process pulls it from that sender's
server (``TransferConnection.pull``) straight onto its device and writes it into the
destination shard in place. No process touches a piece of a shard it does not hold, and
nothing goes through a file or the host (on CPU the transfer server copies device memory
over a socket; on GPU/TPU it is PJRT's cross-host transfer).

Measured in this JAX (0.10.2) on CPU: a transfer server started in each of two plain
processes (each its own client) moves a pulled array onto the puller's device; see
``tests/test_weight_stream.py`` (two single-process worlds of 2 simulated devices each).
Not yet done: the Ray worker groups' methods that host a sender and a receiver and the
driver that passes the layouts and addresses between them (issue 23, item 2).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from jaxflow.reshard.weight_sync import overlap_targets, place_piece, take_piece

# per leaf: (shape, dtype name, ((owner, box), ...)) with owner = (process_index, device_id)
Layout = list[tuple[tuple[int, ...], str, tuple[tuple[tuple[int, int], tuple[tuple[int, int], ...]], ...]]]


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


def stream_plan(src: Layout, dst: Layout) -> list[tuple]:
    """Per leaf, the destination shards and the pieces each is made of (`overlap_targets`)."""
    if len(src) != len(dst):
        raise ValueError(f"the trainer's state has {len(src)} arrays but the rollout layout {len(dst)}")
    plan = []
    for i, ((shape, _, s_boxes), (d_shape, _, d_boxes)) in enumerate(zip(src, dst)):
        if shape != d_shape:
            raise ValueError(f"leaf {i}: shape {shape} in the trainer's world, {d_shape} in the rollout's")
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


def _uuid(sync: int, k: int) -> int:
    return sync * 2**32 + k


def start_server(address: str = "127.0.0.1:0") -> Any:
    """This process's transfer server (one per process, kept for the run)."""
    return transfer.start_transfer_server(jax.devices()[0].client, address, [address])


class WeightSender:
    """Posts this process's pieces of a sync (only shards its devices hold)."""

    def __init__(self, server: Any):
        self.server = server

    def offer(self, leaves: Sequence[jax.Array], plan: list[tuple], sync: int, dtype: Any = None) -> int:
        """Posts every piece this process owns for sync number ``sync``; its byte count."""
        me = jax.process_index()
        shards = [{s.device.id: s.data for s in x.addressable_shards} for x in leaves]
        sent = 0
        for k, i, _, c in _pieces(plan):
            if c.src[0] != me:
                continue
            piece = take_piece(
                shards[i][c.src[1]], np.asarray(c.src_start, np.int32), size=c.size, dtype=dtype or leaves[i].dtype
            )
            self.server.await_pull(_uuid(sync, k), [piece])
            sent += piece.nbytes
        return sent


class WeightReceiver:
    """Pulls this process's destination shards of a sync from the senders' servers."""

    def __init__(self, server: Any, sender_addresses: Mapping[int, str]):
        self.connections = {p: server.connect(a) for p, a in sender_addresses.items()}

    def receive(self, plan: list[tuple], dst: Layout, shardings: Sequence[Any], sync: int):
        """The synced arrays (global, laid out by ``shardings``; ``dst`` their layout), the
        bytes this process pulled, and the wall seconds."""
        dtypes = [np.dtype(d) for _, d, _ in dst]
        t0, me, pulled = time.perf_counter(), jax.process_index(), 0
        devices = {d.id: d for d in jax.local_devices()}
        bufs: dict[tuple[int, int], jax.Array] = {}  # (leaf, device id) -> its shard
        for k, i, target, c in _pieces(plan):
            if target.owner[0] != me:
                continue
            dev = devices[target.owner[1]]
            spec = jax.ShapeDtypeStruct(c.size, dtypes[i], sharding=SingleDeviceSharding(dev))
            (piece,) = self.connections[c.src[0]].pull(_uuid(sync, k), [spec])
            pulled += piece.nbytes
            key = (i, dev.id)
            if len(target.copies) == 1 and c.size == target.shape:
                bufs[key] = piece
                continue
            buf = bufs.pop(key, None)
            if buf is None:
                buf = jnp.zeros(target.shape, dtypes[i], device=dev)
            bufs[key] = place_piece(buf, piece, np.asarray(c.dst_start, np.int32)).block_until_ready()
            piece.delete()
        out = [
            jax.make_array_from_single_device_arrays(
                shape, s, [bufs[(i, t.owner[1])] for t in targets if t.owner[0] == me]
            )
            for i, ((shape, _, _), targets, s) in enumerate(zip(dst, plan, shardings))
        ]
        return out, pulled, time.perf_counter() - t0
