"""Transfer protocols: how a worker-group method's inputs are spread over the group's ranks
and how the ranks' outputs come back (verl's dispatch/collect modes).

Terms. A worker group has ``world_size`` ranks (devices of the group's mesh for the local
backend, processes for a Ray backend). The batch is split into ``dp_size`` data-parallel
shards; rank ``r`` reads shard ``dp_rank_of[r]``. Several ranks may read the same shard
(tensor-parallel peers); for each shard ``d`` the output of rank ``collect_ranks[d]`` stands
for it and the others are ignored. `WorkerGroupInfo.from_mesh` derives all of this from a
mesh and the names of its data-parallel axes.

A `Protocol` bundles three functions:

* ``dispatch(info, args, kwargs) -> Dispatched``: one ``(args, kwargs)`` per rank, plus a
  ``state`` that the driver keeps for collect (e.g. how many padding rows were added). A
  plain list of ``(args, kwargs)`` is accepted too (``state=None``).
* ``collect(info, outputs, state) -> result``: ``outputs`` holds one output per rank.
* ``spmd(info, fn, args, kwargs) -> result`` (optional): the same method run as ONE program
  over the whole group, for a backend where one process drives every device. For
  ``DP_COMPUTE`` this is: pad the batch to a multiple of ``dp_size`` (`pad_for_dp`), run
  ``fn`` once on the whole padded batch (which ``fn`` shards over the dp mesh axes), then
  `unpad`. For a row-wise ``fn`` this equals split -> per-rank ``fn`` -> concat.

Two runners use them: `dispatch_method` (dispatch -> call each rank -> collect; what a Ray
backend does, with dispatch and collect on the driver and the calls in the ranks'
processes) and `call_spmd` (``protocol.spmd``; what the local backend does).

Built-in protocols (names are the constants below):

* ``ONE_TO_ALL``: the same args to every rank; collect returns the list of all ranks'
  outputs (under `call_spmd`, a list holding the one output). Callers that want one value
  take ``[0]``: every rank computed the same thing.
* ``DP_COMPUTE``: every `Batch` argument is padded to a multiple of ``dp_size *
  shard_multiple`` (`pad_for_dp`) and split into ``dp_size`` chunks, rank r getting chunk
  ``dp_rank_of[r]``; other arguments are replicated. Collect concatenates the collect ranks'
  output Batches in shard order and removes the padding (`unpad`).
* ``DP_COMPUTE_METRIC``: split as DP_COMPUTE; collect returns the list of the collect ranks'
  outputs (metric dicts, one per shard; `reduce_metrics` averages them). The padding rows
  are copies of the first rows and are seen by the metrics.
* ``ALL_TO_ALL``: every argument is a list with one value per rank, rank r gets element r;
  collect returns the list of all ranks' outputs. No single-program form.

New protocols are added with `register_protocol`; worker methods declare theirs with the
`register` decorator, which only attaches the protocol to the function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from jaxflow.data.batch import Batch

ONE_TO_ALL = "one_to_all"
DP_COMPUTE = "dp_compute"
DP_COMPUTE_METRIC = "dp_compute_metric"
ALL_TO_ALL = "all_to_all"

RankInputs = tuple[tuple[Any, ...], dict[str, Any]]
F = TypeVar("F", bound=Callable[..., Any])
_PROTOCOL_ATTR = "__jaxflow_protocol__"


@dataclasses.dataclass(frozen=True)
class WorkerGroupInfo:
    """The shape of a worker group as seen by protocols.

    Attributes:
      world_size: number of ranks.
      dp_size: number of data-parallel shards of a batch.
      dp_rank_of: for each rank, the shard it reads. Default: ``world_size // dp_size``
        consecutive ranks per shard.
      collect_ranks: for each shard, the rank whose output is collected. Default: the first
        rank that reads it.
      shard_multiple: each shard's row count is padded to a multiple of this (e.g. the
        data-parallel devices behind one Ray process), so a batch is padded to a multiple of
        ``dp_size * shard_multiple``.
      mesh: the group's mesh, when there is one (informational).
    """

    world_size: int
    dp_size: int
    dp_rank_of: tuple[int, ...] | None = None
    collect_ranks: tuple[int, ...] | None = None
    shard_multiple: int = 1
    mesh: jax.sharding.Mesh | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.dp_size < 1 or self.shard_multiple < 1:
            raise ValueError(
                f"world_size, dp_size and shard_multiple must be >= 1, got {self.world_size}, "
                f"{self.dp_size}, {self.shard_multiple}"
            )
        if self.dp_rank_of is None:
            if self.world_size % self.dp_size:
                raise ValueError(
                    f"world_size {self.world_size} is not a multiple of dp_size {self.dp_size}; "
                    "pass dp_rank_of explicitly"
                )
            per = self.world_size // self.dp_size
            dp_rank_of = tuple(r // per for r in range(self.world_size))
        else:
            dp_rank_of = tuple(int(d) for d in self.dp_rank_of)
        if len(dp_rank_of) != self.world_size:
            raise ValueError(f"dp_rank_of has {len(dp_rank_of)} entries for {self.world_size} ranks")
        if set(dp_rank_of) != set(range(self.dp_size)):
            raise ValueError(f"dp_rank_of {dp_rank_of} must use every shard 0..{self.dp_size - 1} and no other")
        object.__setattr__(self, "dp_rank_of", dp_rank_of)
        if self.collect_ranks is None:
            collect = tuple(dp_rank_of.index(d) for d in range(self.dp_size))
        else:
            collect = tuple(int(r) for r in self.collect_ranks)
        if len(collect) != self.dp_size or any(
            not 0 <= r < self.world_size or dp_rank_of[r] != d for d, r in enumerate(collect)
        ):
            raise ValueError(f"collect_ranks {collect} must name, for each shard d, a rank that reads d")
        object.__setattr__(self, "collect_ranks", collect)

    @classmethod
    def from_mesh(cls, mesh: jax.sharding.Mesh, dp_axes: Sequence[str]) -> WorkerGroupInfo:
        """Ranks are the mesh's devices in ``mesh.devices.flat`` order; a rank's shard is its
        position along ``dp_axes`` (major first, the order in which a PartitionSpec such as
        ``P(("dp", "fsdp"))`` splits the batch dimension). Then shard ``d`` is exactly the
        rows that ``NamedSharding(mesh, P(dp_axes))`` puts on the devices of shard ``d``.
        """
        names = list(mesh.axis_names)
        unknown = [a for a in dp_axes if a not in names]
        if unknown:
            raise ValueError(f"dp axes {unknown} are not mesh axes {names}")
        shape = mesh.devices.shape
        coords = np.indices(shape).reshape(len(shape), -1)  # [ndim, world]
        dims = [names.index(a) for a in dp_axes]
        dp_shape = tuple(shape[i] for i in dims)
        if dims:
            dp_rank_of = np.ravel_multi_index(tuple(coords[dims]), dp_shape)
        else:
            dp_rank_of = np.zeros(coords.shape[1], dtype=np.int64)
        return cls(
            world_size=int(mesh.devices.size),
            dp_size=math.prod(dp_shape),
            dp_rank_of=tuple(int(d) for d in dp_rank_of),
            mesh=mesh,
        )


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """What a dispatch function returns: per-rank inputs and a state for collect."""

    inputs: tuple[RankInputs, ...]
    state: Any = None


DispatchFn = Callable[[WorkerGroupInfo, tuple, dict], "Dispatched | Sequence[RankInputs]"]
CollectFn = Callable[[WorkerGroupInfo, list, Any], Any]
SpmdFn = Callable[[WorkerGroupInfo, Callable[..., Any], tuple, dict], Any]


@dataclasses.dataclass(frozen=True)
class Protocol:
    """A named (dispatch, collect[, spmd]) triple; see the module docstring."""

    name: str
    dispatch: DispatchFn
    collect: CollectFn
    spmd: SpmdFn | None = None


# ------------------------------------------------------------------ registry
_REGISTRY: dict[str, Protocol] = {}


def register_protocol(
    name: str,
    dispatch_fn: DispatchFn,
    collect_fn: CollectFn,
    spmd_fn: SpmdFn | None = None,
    *,
    override: bool = False,
) -> Protocol:
    """Registers and returns a protocol. A taken name is an error unless ``override`` (the
    keyword every registry of jaxflow uses to replace a registration)."""
    if name in _REGISTRY and not override:
        raise ValueError(f"protocol {name!r} is already registered; pass override=True")
    protocol = Protocol(name, dispatch_fn, collect_fn, spmd_fn)
    _REGISTRY[name] = protocol
    return protocol


def get_protocol(name: str | Protocol) -> Protocol:
    """The protocol registered under ``name`` (a Protocol is returned as is)."""
    if isinstance(name, Protocol):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown protocol {name!r}; registered: {protocol_names()}") from None


def protocol_names() -> list[str]:
    return sorted(_REGISTRY)


def register(protocol: str | Protocol) -> Callable[[F], F]:
    """Decorator for worker methods: records the protocol on the function (unwrapped, so
    the method can still be called directly). Read it back with `method_protocol`."""
    resolved = get_protocol(protocol)  # fail at decoration time on a typo

    def deco(fn: F) -> F:
        setattr(fn, _PROTOCOL_ATTR, resolved)
        return fn

    return deco


def method_protocol(fn: Callable[..., Any]) -> Protocol | None:
    """The protocol a method was decorated with (works on bound methods), else None."""
    return getattr(fn, _PROTOCOL_ATTR, None)


# ------------------------------------------------------------------- runners
def _dispatch(info: WorkerGroupInfo, protocol: Protocol, args: tuple, kwargs: dict) -> Dispatched:
    out = protocol.dispatch(info, tuple(args), dict(kwargs))
    if not isinstance(out, Dispatched):
        out = Dispatched(tuple(out))
    if len(out.inputs) != info.world_size:
        raise ValueError(f"protocol {protocol.name!r} dispatched {len(out.inputs)} inputs for {info.world_size} ranks")
    return out


def dispatch_method(
    info: WorkerGroupInfo,
    protocol: str | Protocol,
    fn: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """dispatch -> ``fn(*args_r, **kwargs_r)`` for every rank r in order -> collect."""
    protocol = get_protocol(protocol)
    dispatched = _dispatch(info, protocol, args, kwargs)
    outputs = [fn(*a, **kw) for a, kw in dispatched.inputs]
    return protocol.collect(info, outputs, dispatched.state)


def call_spmd(
    info: WorkerGroupInfo,
    protocol: str | Protocol,
    fn: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Runs ``fn`` once over the whole group with the protocol's single-program form."""
    protocol = get_protocol(protocol)
    if protocol.spmd is None:
        raise ValueError(f"protocol {protocol.name!r} has no single-program form; run it per rank with dispatch_method")
    return protocol.spmd(info, fn, tuple(args), dict(kwargs))


# ------------------------------------------------------------- DP helpers
def pad_for_dp(batch: Batch, dp_size: int) -> tuple[Batch, int]:
    """Pads ``batch`` to a multiple of ``dp_size`` rows (copies of its first rows).

    Returns ``(padded, pad_size)``. Used by the per-rank split and by the single-program
    path alike, so both see the same padded batch."""
    return batch.pad_to_multiple(dp_size)


def unpad(output: Any, pad_size: int) -> Any:
    """Removes the last ``pad_size`` rows from a Batch or array output, recursing into
    tuples, lists and dicts; None passes through."""
    if pad_size == 0 or output is None:
        return output
    if isinstance(output, Batch):
        return output.unpad(pad_size)
    if isinstance(output, (np.ndarray, jax.Array)):
        if output.ndim == 0 or output.shape[0] < pad_size:
            raise ValueError(f"cannot remove {pad_size} padding rows from shape {output.shape}")
        return output[: output.shape[0] - pad_size]
    if isinstance(output, (tuple, list)):
        return type(output)(unpad(o, pad_size) for o in output)
    if isinstance(output, Mapping):
        return {k: unpad(v, pad_size) for k, v in output.items()}
    raise TypeError(f"cannot unpad an output of type {type(output).__name__}")


def pad_batch_args(info: WorkerGroupInfo, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, int]:
    """Pads every Batch argument to a multiple of dp_size * shard_multiple; returns ``(args,
    kwargs, pad_size)``."""
    sizes = {f"args[{i}]": len(a) for i, a in enumerate(args) if isinstance(a, Batch)}
    sizes |= {f"kwargs[{k!r}]": len(v) for k, v in kwargs.items() if isinstance(v, Batch)}
    if not sizes:
        raise TypeError(f"protocol {name!r} needs at least one Batch argument")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"protocol {name!r}: Batch arguments differ in size: {sizes}")
    multiple = info.dp_size * info.shard_multiple

    def pad(x: Any) -> Any:
        return pad_for_dp(x, multiple)[0] if isinstance(x, Batch) else x

    pad_size = (-next(iter(sizes.values()))) % multiple
    return tuple(pad(a) for a in args), {k: pad(v) for k, v in kwargs.items()}, pad_size


def _dp_dispatch(name: str) -> DispatchFn:
    def dispatch(info: WorkerGroupInfo, args: tuple, kwargs: dict) -> Dispatched:
        args, kwargs, pad_size = pad_batch_args(info, name, args, kwargs)

        def chunks(x: Any) -> Any:
            return x.chunk(info.dp_size) if isinstance(x, Batch) else None

        arg_chunks = [chunks(a) for a in args]
        kw_chunks = {k: chunks(v) for k, v in kwargs.items()}
        inputs = []
        for d in info.dp_rank_of:
            a_r = tuple(a if c is None else c[d] for a, c in zip(args, arg_chunks))
            kw_r = {k: v if kw_chunks[k] is None else kw_chunks[k][d] for k, v in kwargs.items()}
            inputs.append((a_r, kw_r))
        return Dispatched(tuple(inputs), state=pad_size)

    return dispatch


def _collected(info: WorkerGroupInfo, outputs: list) -> list:
    return [outputs[r] for r in info.collect_ranks]


def _dp_collect(info: WorkerGroupInfo, outputs: list, pad_size: int) -> Batch | None:
    picked = _collected(info, outputs)
    if all(o is None for o in picked):
        return None
    for d, o in enumerate(picked):
        if not isinstance(o, Batch):
            raise TypeError(
                f"{DP_COMPUTE} collects Batch outputs; rank {info.collect_ranks[d]} (shard {d}) "
                f"returned {type(o).__name__}"
            )
    return unpad(Batch.concat(picked), pad_size)


def _dp_spmd(info: WorkerGroupInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    args, kwargs, pad_size = pad_batch_args(info, DP_COMPUTE, args, kwargs)
    return unpad(fn(*args, **kwargs), pad_size)


def _dp_metric_collect(info: WorkerGroupInfo, outputs: list, state: Any) -> list:
    return _collected(info, outputs)


def _dp_metric_spmd(info: WorkerGroupInfo, fn: Callable[..., Any], args: tuple, kwargs: dict):
    args, kwargs, _ = pad_batch_args(info, DP_COMPUTE_METRIC, args, kwargs)
    return [fn(*args, **kwargs)]


def reduce_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of each metric over a list of metric dicts. A value may be a scalar or an
    array/list (e.g. one entry per micro-batch); all entries of a key are averaged."""
    values: dict[str, list[np.ndarray]] = {}
    for m in metrics:
        for k, v in m.items():
            values.setdefault(k, []).append(np.ravel(np.asarray(jax.device_get(v), np.float64)))
    return {k: float(np.mean(np.concatenate(v))) for k, v in values.items()}


# ------------------------------------------------------ one-to-all, all-to-all
def _one_to_all_dispatch(info: WorkerGroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    return Dispatched(tuple((args, kwargs) for _ in range(info.world_size)))


def _all_collect(info: WorkerGroupInfo, outputs: list, state: Any) -> list:
    return list(outputs)


def _one_to_all_spmd(info: WorkerGroupInfo, fn: Callable[..., Any], args: tuple, kwargs: dict):
    return [fn(*args, **kwargs)]


def _all_to_all_dispatch(info: WorkerGroupInfo, args: tuple, kwargs: dict) -> Dispatched:
    named = {f"args[{i}]": a for i, a in enumerate(args)} | {f"kwargs[{k!r}]": v for k, v in kwargs.items()}
    for where, v in named.items():
        if not isinstance(v, (list, tuple)) or len(v) != info.world_size:
            got = type(v).__name__
            if isinstance(v, (list, tuple)):
                got += f" of {len(v)}"
            raise ValueError(
                f"{ALL_TO_ALL}: {where} must be a list with one value per rank ({info.world_size}), got {got}"
            )
    return Dispatched(
        tuple((tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(info.world_size))
    )


register_protocol(ONE_TO_ALL, _one_to_all_dispatch, _all_collect, _one_to_all_spmd)
register_protocol(DP_COMPUTE, _dp_dispatch(DP_COMPUTE), _dp_collect, _dp_spmd)
register_protocol(DP_COMPUTE_METRIC, _dp_dispatch(DP_COMPUTE_METRIC), _dp_metric_collect, _dp_metric_spmd)
register_protocol(ALL_TO_ALL, _all_to_all_dispatch, _all_collect)
