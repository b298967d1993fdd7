"""Batches and results of a multi-process SPMD call, moved between the driver and the processes
that hold them.

Inputs (`RowSplit`). A data-parallel method's batch is padded to a multiple of the role's
data-parallel size and cut into its ``dp_size`` shards on the driver; each process receives
only the tensor rows of the shards its devices hold and builds the global arrays from them
(``jax.make_array_from_process_local_data``: `rows_to_global`). Host columns (strings, ids)
and meta are small and travel once for all processes.

Parameters (`ShippedParams`). A model held in the driver's memory (e.g. weights handed over
in memory) travels as per-process blocks: each process says which blocks of every parameter
its devices hold under the role's shardings (`block_keys`), the driver cuts exactly those
(`cut_blocks`) and puts them once per process, and the process builds its global arrays from
them (`from_blocks`). No process receives the whole model.

Results.
In a multi-process JAX world (one process per host, `jax.distributed`), a worker method
returns global ``jax.Array``s of which each process holds only its addressable shards. To
bring one to the driver without a collective and without sending any byte twice, every
process contributes the shards it holds with ``replica_id == 0`` (exactly one device in the
world holds replica 0 of each shard), and the driver writes the pieces of all processes
into one NumPy array:

    per process:   to_pieces(output, process_index)      # on the worker process
    on the driver: assemble([pieces_0, pieces_1, ...])    # one NumPy array per leaf

Leaves that every process computed alike (host NumPy values, Python scalars, fully replicated
arrays) travel from process 0 only. A `Batch` (not a pytree) is taken apart into its
tensors, which travel as pieces, and its host columns and meta, which come from process 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxflow.data.batch import Batch


@dataclasses.dataclass(frozen=True)
class Pieces:
    """One process's part of a global array: ``(index, block)`` for each shard it holds
    replica 0 of (``index`` is a tuple of slices into the global ``shape``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: tuple[tuple[tuple[slice, ...], np.ndarray], ...]


@dataclasses.dataclass(frozen=True)
class FromFirst:
    """Placeholder of a leaf that process 0 sends for everyone."""


@dataclasses.dataclass(frozen=True)
class _BatchParts:
    tensors: dict[str, Any]
    non_tensors: Any
    meta: Any


def _is_batch_parts(x: Any) -> bool:
    return isinstance(x, _BatchParts)


def _leaf_pieces(x: Any, process: int) -> Any:
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        blocks = tuple((tuple(s.index), np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0)
        return Pieces(tuple(x.shape), np.dtype(x.dtype), blocks)
    if process != 0:
        return FromFirst()
    return np.asarray(x) if isinstance(x, jax.Array) else x


def _split_batches(tree: Any) -> Any:
    def split(x: Any) -> Any:
        return _BatchParts(dict(x.tensors), x.non_tensors, x.meta) if isinstance(x, Batch) else x

    return jax.tree.map(split, tree, is_leaf=lambda x: isinstance(x, Batch))


def to_pieces(tree: Any, process: int) -> Any:
    """``tree`` (any pytree, Batches included) with every global array replaced by this
    process's `Pieces` and every other leaf kept by process 0 only."""
    tree = _split_batches(tree)

    def convert(x: Any) -> Any:
        if _is_batch_parts(x):
            tensors = {k: _leaf_pieces(v, process) for k, v in x.tensors.items()}
            if process != 0:
                return _BatchParts(tensors, FromFirst(), FromFirst())
            return _BatchParts(tensors, x.non_tensors, x.meta)
        return _leaf_pieces(x, process)

    return jax.tree.map(convert, tree, is_leaf=_is_batch_parts)


def to_host_local(tree: Any) -> Any:
    """``tree`` with its arrays as NumPy, for per-process results (each process's own value).
    A global array that this process does not hold whole is an error."""

    def convert(x: Any) -> Any:
        if isinstance(x, Batch):
            return x.to_host()
        if isinstance(x, jax.Array):
            if not (x.is_fully_addressable or x.is_fully_replicated):
                raise TypeError(
                    f"a per-process result holds a global array of shape {x.shape} that this process holds only "
                    "in part; return it from a single-program (e.g. DP_COMPUTE) method instead"
                )
            return np.asarray(x)
        return x

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, Batch))


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """How a role's batch rows fall on the processes of its world.

    The rows of a batch are split into ``dp_size`` consecutive shards (shard ``d`` is what
    ``NamedSharding(mesh, P(dp_axes))`` puts on the devices at position ``d`` of the
    data-parallel axes); ``process_shards[p]`` are the shards that the devices of process ``p``
    hold, ascending (several processes hold the same shard when a model axis spans processes).
    """

    dp_size: int
    process_shards: tuple[tuple[int, ...], ...]

    @classmethod
    def from_mesh(cls, mesh: jax.sharding.Mesh, dp_axes: Sequence[str], num_processes: int) -> RowSplit:
        from jaxflow.workers.protocols import WorkerGroupInfo

        info = WorkerGroupInfo.from_mesh(mesh, dp_axes)
        shards: list[set[int]] = [set() for _ in range(num_processes)]
        for rank, device in enumerate(mesh.devices.flat):
            shards[device.process_index].add(info.dp_rank_of[rank])
        return cls(info.dp_size, tuple(tuple(sorted(s)) for s in shards))

    def split(self, batch: Batch) -> list[dict[str, np.ndarray]]:
        """Per process, the tensor columns of the rows it holds (its shards, in order). The
        row count must be a multiple of ``dp_size``."""
        if len(batch) % self.dp_size:
            raise ValueError(f"{len(batch)} rows do not split into {self.dp_size} data-parallel shards")
        per = len(batch) // self.dp_size
        tensors = {k: np.asarray(v) for k, v in batch.tensors.items()}

        def rows(shards: tuple[int, ...]) -> np.ndarray:
            return np.concatenate([np.arange(d * per, (d + 1) * per) for d in shards]) if shards else np.zeros(0, int)

        out = []
        for shards in self.process_shards:
            idx = rows(shards)
            contiguous = len(idx) and idx[-1] - idx[0] == len(idx) - 1
            out.append({k: v[idx[0] : idx[-1] + 1] if contiguous else v[idx] for k, v in tensors.items()})
        return out


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """Stands for a `Batch` argument in a call whose tensor rows travel by process: the host
    columns and meta (shared by every process) and the global row count; the tensors are the
    ``slot``-th entry of each process's own rows."""

    slot: int
    num_rows: int
    non_tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


def split_rows(split: RowSplit, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[list[dict[str, np.ndarray]]]]:
    """``(args, kwargs)`` with every Batch replaced by a `LocalRows`, and for each process the
    list of its rows of those Batches (by slot)."""
    per_process: list[list[dict[str, np.ndarray]]] = [[] for _ in split.process_shards]

    def replace(x: Any) -> Any:
        if not isinstance(x, Batch):
            return x
        for rows, mine in zip(split.split(x), per_process):
            mine.append(rows)
        return LocalRows(len(per_process[0]) - 1, len(x), dict(x.non_tensors), dict(x.meta))

    return tuple(replace(a) for a in args), {k: replace(v) for k, v in kwargs.items()}, per_process


def rows_to_global(
    args: tuple, kwargs: dict, rows: Sequence[dict[str, np.ndarray]], mesh: jax.sharding.Mesh, dp_axes: Sequence[str]
) -> tuple[tuple, dict]:
    """On a process: every `LocalRows` back to a `Batch` whose tensors are global arrays (rows
    over ``dp_axes``) built from this process's rows."""
    from jax.sharding import NamedSharding, PartitionSpec

    axes = tuple(dp_axes) or None

    def rebuild(x: Any) -> Any:
        if not isinstance(x, LocalRows):
            return x
        tensors = {
            k: jax.make_array_from_process_local_data(
                NamedSharding(mesh, PartitionSpec(axes, *([None] * (v.ndim - 1)))), v, (x.num_rows, *v.shape[1:])
            )
            for k, v in rows[x.slot].items()
        }
        return Batch(tensors, x.non_tensors, x.meta)

    return tuple(rebuild(a) for a in args), {k: rebuild(v) for k, v in kwargs.items()}


BlockKey = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def block_keys(abstract: Any, shardings: Any) -> list[list[BlockKey]]:
    """Per leaf of ``abstract`` (arrays or ``ShapeDtypeStruct``s, flattened order), the distinct
    blocks that this process's devices hold under ``shardings``."""
    keys = []
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        shape = tuple(leaf.shape)
        index_map = sharding.addressable_devices_indices_map(shape)
        keys.append(sorted({tuple(s.indices(n)[:2] for s, n in zip(index, shape)) for index in index_map.values()}))
    return keys


def cut_blocks(tree: Any, keys: list[list[BlockKey]]) -> list[list[np.ndarray]]:
    """On the driver: the blocks ``keys`` of each leaf of ``tree`` as host arrays (only those
    blocks leave the driver's devices)."""
    return [
        [np.asarray(leaf[tuple(slice(a, b) for a, b in key)]) for key in leaf_keys]
        for leaf, leaf_keys in zip(jax.tree.leaves(tree), keys)
    ]


def from_blocks(abstract: Any, shardings: Any, keys: list[list[BlockKey]], blocks: list[list[np.ndarray]]) -> Any:
    """On a process: ``abstract``'s tree of global arrays laid out by ``shardings``, built from
    this process's ``blocks`` (`cut_blocks` of its `block_keys`)."""
    from jaxflow.models.hf_io import sharded_array

    leaves, treedef = jax.tree.flatten(abstract)
    arrays = []
    for leaf, sharding, leaf_keys, leaf_blocks in zip(leaves, jax.tree.leaves(shardings), keys, blocks):
        by_key = dict(zip(leaf_keys, leaf_blocks))

        def read(index: tuple[slice, ...], by_key=by_key) -> np.ndarray:
            return by_key[tuple((s.start, s.stop) for s in index)]

        arrays.append(sharded_array(tuple(leaf.shape), leaf.dtype, sharding, read))
    return jax.tree.unflatten(treedef, arrays)


@dataclasses.dataclass(frozen=True)
class ShippedParams:
    """A role's model sent from the driver by blocks: its graph, its abstract parameters
    (shapes and dtypes; the process derives the shardings from its mesh and rules) and the
    blocks of this process (`cut_blocks`, in `block_keys` order)."""

    graphdef: Any
    abstract: Any
    blocks: Any = None  # per process: an object-store reference to its blocks


def _is_piece_leaf(x: Any) -> bool:
    return isinstance(x, (Pieces, FromFirst, _BatchParts))


def _merge_leaf(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if not isinstance(first, Pieces):
        return first
    out = np.empty(first.shape, first.dtype)
    filled = 0
    for p in parts:
        for index, block in p.blocks:
            out[index] = block
            filled += block.size
    if filled != out.size:
        raise RuntimeError(
            f"assembling an array of shape {first.shape}: the processes sent {filled} of its {out.size} elements"
        )
    return out


def assemble(per_process: Sequence[Any]) -> Any:
    """The driver's value from every process's `to_pieces` output (process order)."""
    flats = [jax.tree.flatten(t, is_leaf=_is_piece_leaf) for t in per_process]
    treedef = flats[0][1]
    merged = []
    for i, first in enumerate(flats[0][0]):
        parts = [f[0][i] for f in flats]
        if isinstance(first, _BatchParts):
            tensors = {k: _merge_leaf([p.tensors[k] for p in parts]) for k in first.tensors}
            merged.append(Batch(tensors, first.non_tensors, first.meta))
        else:
            merged.append(_merge_leaf(parts))
    return jax.tree.unflatten(treedef, merged)
