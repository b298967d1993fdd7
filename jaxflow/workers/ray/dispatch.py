"""How a worker-group call travels to the processes of a pool and comes back.

A `RayWorkerGroup` call is submitted to every rank in the same order, each argument put once
in the object store. The batches of the `ROWS_BY_PROCESS` protocols travel by process (each
rank receives the rows its devices hold), the others whole. Each rank runs the method's
single-program form over the global mesh and returns the shards it holds
(`jaxflow.workers.host_transfer`), which the driver assembles. Per-rank protocols
(``ALL_TO_ALL``) are dispatched and collected by process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxflow.data.batch import Batch
from jaxflow.workers.host_transfer import RowSplit, assemble, split_rows
from jaxflow.workers.protocols import (
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    Protocol,
    WorkerGroupInfo,
    pad_batch_args,
    unpad,
)
from jaxflow.workers.ray.cluster import ray_module

# Protocols whose Batch tensors travel by process (each rank gets the rows its devices hold),
# and how the driver finishes the assembled result given the rows it padded. The others
# (DP_COMPUTE_REPEAT: generation schedules the whole prompt batch; DP_TRAIN: mini-batches are
# drawn from the whole batch) send the whole batch to every rank, put once.
ROWS_BY_PROCESS = {DP_COMPUTE: unpad, DP_COMPUTE_METRIC: lambda metrics, pad_size: metrics}


def host_tree(tree: Any) -> Any:
    """Arguments as host values: the driver's jax arrays become NumPy."""

    def convert(x: Any) -> Any:
        if isinstance(x, Batch):
            return x.to_host()
        return np.asarray(x) if isinstance(x, jax.Array) else x

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, Batch))


def call_signature(tree: Any) -> tuple:
    """Shapes and dtypes of the array leaves (a new signature means a compile)."""

    def sig(x: Any) -> Any:
        if isinstance(x, Batch):
            return tuple((k, np.shape(v), str(v.dtype)) for k, v in sorted(x.tensors.items()))
        return (np.shape(x), str(x.dtype)) if hasattr(x, "dtype") else type(x).__name__

    return tuple(jax.tree.leaves(jax.tree.map(sig, tree, is_leaf=lambda x: isinstance(x, Batch))))


def remote_calls(
    actors: Sequence[Any],
    role: str,
    method: str,
    protocol: Protocol,
    args: tuple,
    kwargs: dict,
    rows: RowSplit | None,
) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The remote calls of ``role.method(*args, **kwargs)`` (host values) on every rank, in
    rank order, and what makes the call's result of their results: the protocol's collect
    (per-rank protocols), or the assembled shards, unpadded (`ROWS_BY_PROCESS` protocols,
    given the role's ``rows``: each rank receives only the tensor rows its devices hold, the
    batch padded here to the data-parallel size)."""
    ray = ray_module()
    if protocol.spmd is None:
        info = WorkerGroupInfo(world_size=len(actors), dp_size=1)
        dispatched = protocol.dispatch(info, args, kwargs)
        inputs = getattr(dispatched, "inputs", dispatched)
        refs = [a.call.remote(role, method, ray.put(payload)) for a, payload in zip(actors, inputs)]
        return refs, lambda outputs: protocol.collect(info, outputs, getattr(dispatched, "state", None))
    if protocol.name in ROWS_BY_PROCESS and rows is not None:
        info = WorkerGroupInfo(world_size=rows.dp_size, dp_size=rows.dp_size)
        args, kwargs, pad_size = pad_batch_args(info, protocol.name, args, kwargs)
        args, kwargs, per_process = split_rows(rows, args, kwargs)
        shared = ray.put((args, kwargs))  # host columns and meta: put once, read by every rank
        refs = [
            a.call_rows.remote(role, method, shared, ray.put(mine))  # each rank's rows, put once
            for a, mine in zip(actors, per_process)
        ]
        return refs, lambda outputs: ROWS_BY_PROCESS[protocol.name](assemble(outputs), pad_size)
    payload = ray.put((args, kwargs))  # put once, read by every rank
    return [a.call.remote(role, method, payload) for a in actors], assemble
