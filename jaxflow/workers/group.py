"""Worker groups: the driver's handle on a role, whatever runs it.

A `WorkerGroup` exposes every protocol-registered method of its worker class as a method of
the group: ``actor.log_probs(batch)`` dispatches the batch per the method's protocol, runs
it, and collects the result (a `Batch`, or for ``DP_COMPUTE_METRIC`` / ``DP_TRAIN`` one
metrics dict: each metric's mean over shards and steps, via `reduce_metrics`). Unregistered methods are not reachable through a
group: the registry is the contract between driver and workers.

Backends implement `WorkerGroup.execute`:

* `LocalWorkerGroup` (this module): one process drives the whole pool. A method runs once as
  a single SPMD program over the role's mesh (`call_spmd`): the protocol pads the batch to
  a multiple of the data-parallel size, the worker places the columns it reads on its mesh
  (`RoleWorker.put`, rows over the dp axes), runs its jitted program, and the protocol
  removes the padding rows.
* The Ray backend (`jaxflow.workers.ray`) starts one process per host of the pool,
  each building the same role class from the same arguments (`jaxflow.workers.roles`)
  inside its ``jax.distributed`` cluster; a call sends each process its rows and every
  process runs the same SPMD program (`jaxflow.workers.host_transfer`; see
  docs/PROCESS_MODEL.md). Role classes are unchanged; only how rows reach the devices and
  outputs come back is backend-specific.

This module also registers two protocols:

* ``DP_COMPUTE_REPEAT``: DP_COMPUTE for methods that return ``r`` rows per input row
  (rollouts with ``n`` samples per prompt, interleaved). The padding rows' ``r`` outputs each
  are removed (``r`` is read from the output size).
* ``DP_TRAIN``: DP_COMPUTE_METRIC that refuses to pad: a training batch must split evenly
  over the data-parallel shards, since padding rows (copies) would be trained on.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxflow.data.batch import Batch
from jaxflow.workers import protocols as P
from jaxflow.workers.protocols import (
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    Dispatched,
    WorkerGroupInfo,
    call_spmd,
    method_protocol,
    reduce_metrics,
)

DP_COMPUTE_REPEAT = "dp_compute_repeat"
DP_TRAIN = "dp_train"


def _repeat_unpad(output: Any, padded_rows: int, pad_size: int) -> Any:
    if pad_size == 0 or output is None:
        return output
    if not isinstance(output, Batch):
        raise TypeError(f"{DP_COMPUTE_REPEAT} collects Batch outputs, got {type(output).__name__}")
    rows = len(output)
    if rows % padded_rows:
        raise ValueError(
            f"{DP_COMPUTE_REPEAT}: {rows} output rows for {padded_rows} input rows is not a "
            "whole number of outputs per input"
        )
    return output.unpad(pad_size * (rows // padded_rows))


def _repeat_dispatch(info: WorkerGroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    dispatched = P.get_protocol(DP_COMPUTE).dispatch(info, args, kwargs)
    first = next(x for x in (*args, *kwargs.values()) if isinstance(x, Batch))
    padded = len(first) + dispatched.state
    return Dispatched(dispatched.inputs, state=(padded, dispatched.state))


def _repeat_collect(info: WorkerGroupInfo, outputs: list, state: Any) -> Any:
    padded, pad_size = state
    picked = [outputs[r] for r in info.collect_ranks]
    return _repeat_unpad(Batch.concat(picked), padded, pad_size)


def _repeat_spmd(info: WorkerGroupInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    sizes = {len(x) for x in (*args, *kwargs.values()) if isinstance(x, Batch)}
    if len(sizes) != 1:
        raise ValueError(f"{DP_COMPUTE_REPEAT} needs Batch arguments of one size, got sizes {sorted(sizes)}")
    multiple = info.dp_size * info.shard_multiple

    def pad(x: Any) -> Any:
        return P.pad_for_dp(x, multiple)[0] if isinstance(x, Batch) else x

    rows = sizes.pop()
    pad_size = (-rows) % multiple
    args, kwargs = tuple(pad(a) for a in args), {k: pad(v) for k, v in kwargs.items()}
    return _repeat_unpad(fn(*args, **kwargs), rows + pad_size, pad_size)


def _check_even(info: WorkerGroupInfo, args: tuple, kwargs: dict) -> None:
    multiple = info.dp_size * info.shard_multiple
    for x in (*args, *kwargs.values()):
        if isinstance(x, Batch) and len(x) % multiple:
            raise ValueError(
                f"{DP_TRAIN}: a training batch of {len(x)} rows does not split evenly over {multiple} "
                "data-parallel shards (padding would train on duplicated rows); make the rollout size a "
                "multiple of the mini-batch size and the mini-batch size a multiple of the dp size"
            )


def _train_dispatch(info: WorkerGroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    _check_even(info, args, kwargs)
    return P.get_protocol(DP_COMPUTE_METRIC).dispatch(info, args, kwargs)


def _train_spmd(info: WorkerGroupInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    _check_even(info, args, kwargs)
    return [fn(*args, **kwargs)]


if DP_COMPUTE_REPEAT not in P.protocol_names():
    P.register_protocol(DP_COMPUTE_REPEAT, _repeat_dispatch, _repeat_collect, _repeat_spmd)
if DP_TRAIN not in P.protocol_names():
    P.register_protocol(DP_TRAIN, _train_dispatch, P.get_protocol(DP_COMPUTE_METRIC).collect, _train_spmd)


class WorkerGroup(abc.ABC):
    """The driver-side handle of one role on one pool (see the module docstring)."""

    name: str
    info: WorkerGroupInfo
    worker_cls: type

    @abc.abstractmethod
    def execute(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Runs the registered ``method`` over the group per its protocol."""

    def methods(self) -> list[str]:
        """Names of the worker class's protocol-registered methods."""
        return sorted(
            n
            for n in dir(self.worker_cls)
            if not n.startswith("_") and method_protocol(getattr(self.worker_cls, n, None)) is not None
        )

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name in ("name", "info", "worker_cls"):
            raise AttributeError(name)
        fn = getattr(self.worker_cls, name, None)
        if fn is None or method_protocol(fn) is None:
            raise AttributeError(
                f"{type(self).__name__} {self.name!r} has no registered method {name!r}; registered: {self.methods()}"
            )

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.execute(name, *args, **kwargs)

        call.__name__ = name
        call.__doc__ = fn.__doc__
        return call

    @staticmethod
    def _finish(protocol: P.Protocol, result: Any) -> Any:
        if protocol.name in (DP_COMPUTE_METRIC, DP_TRAIN):
            return reduce_metrics(result)
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.worker_cls.__name__}, world_size={self.info.world_size}, dp_size={self.info.dp_size})"


class LocalWorkerGroup(WorkerGroup):
    """One process drives the role's whole mesh (GPU host, TPU VM, simulated CPU devices).

    Args:
      worker: a role worker instance, or a class to build with ``**kwargs``.
      name: for messages (default: the class name).

    A worker with a ``mesh`` (the model roles) gets ``info = WorkerGroupInfo.from_mesh(mesh,
    worker.dp_axes)``; a host-side worker (the rule scorer) a group of one rank.
    """

    def __init__(self, worker: Any, /, *, name: str | None = None, **kwargs: Any):
        if isinstance(worker, type):
            worker = worker(**kwargs)
        elif kwargs:
            raise TypeError("keyword arguments are for building a worker from its class")
        self.worker = worker
        self.worker_cls = type(worker)
        self.name = name or self.worker_cls.__name__
        mesh: Mesh | None = getattr(worker, "mesh", None)
        if mesh is None:
            self.info = WorkerGroupInfo(world_size=1, dp_size=1)
        else:
            self.info = WorkerGroupInfo.from_mesh(mesh, worker.dp_axes)

    @property
    def mesh(self) -> Mesh | None:
        return getattr(self.worker, "mesh", None)

    @property
    def devices(self) -> tuple[Any, ...]:
        """The devices this group runs on (empty for a host-side worker)."""
        mesh = self.mesh
        return () if mesh is None else tuple(mesh.devices.flat)

    def execute(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        bound = getattr(self.worker, method)
        protocol = method_protocol(bound)
        if protocol is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{method} is not registered with a protocol")
        return self._finish(protocol, call_spmd(self.info, protocol, bound, *args, **kwargs))

    def put(self, batch: Batch) -> Batch:
        """``batch`` with every tensor column on this group's devices (rows over its dp axes):
        how a batch moves onto this role's pool. Non-tensors and meta are kept."""
        put = getattr(self.worker, "put", None)
        if put is None:
            return batch.to_host()
        return Batch(put(batch), batch.non_tensors, batch.meta)


class MethodView(WorkerGroup):
    """Another group's registered methods under the names of ``worker_cls``'s: with LoRA the
    reference policy is the actor's base model, so ``w.ref.log_probs(batch)`` runs the actor
    group's ``ref_log_probs`` (on the actor's devices, from its weights)."""

    def __init__(self, group: WorkerGroup, worker_cls: type, methods: dict[str, str], *, name: str):
        self.group, self.worker_cls, self.methods_map, self.name = group, worker_cls, dict(methods), name
        self.info = group.info

    def execute(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        if method not in self.methods_map:
            raise AttributeError(f"{self.name!r} (a view of {self.group.name!r}) has no method {method!r}")
        return self.group.execute(self.methods_map[method], *args, **kwargs)


@dataclasses.dataclass
class Workers:
    """The worker groups an algorithm's iteration runs over (DESIGN.md's ``w``).

    ``reward`` is a callable ``Batch -> Batch`` giving ``token_level_scores`` (a
    `jaxflow.workers.reward.RewardFn` over a reward-model group and/or a rule scorer).
    ``cost`` is an optional cost-model group (Safe-RLHF).
    """

    actor: WorkerGroup
    ref: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    reward: Callable[[Batch], Batch] | None = None
    cost: WorkerGroup | None = None


def devices_of(x: jax.Array) -> set[int]:
    """Ids of the devices holding ``x`` (for placement checks)."""
    return {d.id for d in x.sharding.device_set}
