"""What every model-holding role worker shares: its mesh and rules, its parameters placed on
that mesh, and the way batch columns arrive on it.

Role classes know nothing about backends. They are built from ``(model, mesh, rules,
config)`` and expose methods decorated with a transfer protocol
(`jaxflow.workers.protocols.register`); a worker group (`jaxflow.workers.group`) calls
them. A method reads the columns it needs with `RoleWorker.put`, which places them on the
role's mesh with rows split over the data-parallel axes (the ``batch`` rule). That is the one
place where data crosses from the driver (or another role's pool) onto this role's devices:
the local backend does a ``jax.device_put`` (device to device when the column already lives
on another pool); the Ray backend (one process per host, ``jax.distributed`` inside) builds
the global arrays from each process's rows before the call
(`jaxflow.workers.host_transfer.rows_to_global`), which `put` then finds in place.

``model`` may be an ``nnx.Module``, a ``(graphdef, state)`` pair, or a checkpoint directory
(loaded with `jaxflow.models.from_pretrained` directly into this mesh's layout); a
`jaxflow.mesh.MeshSpec` (or ``"fsdp=4,tp=2"``) instead of a mesh builds it over all devices
visible to the process, which is what a per-host process of a multi-process backend sees.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.batch import Batch
from jaxflow.mesh import (
    MeshSpec,
    Role,
    Rules,
    data_parallel_size,
    get_rules,
    logical_to_spec,
    sharding_rules,
    state_shardings,
)
from jaxflow.mesh.executables import ahead_of_time
from jaxflow.models import HEADS, from_pretrained, save_pretrained
from jaxflow.models.hf_io import host_array
from jaxflow.workers.forward import PROMPT_KEYS, ForwardConfig, map_micro, named
from jaxflow.workers.packing import pack, scatter_rows
from jaxflow.workers.protocols import ONE_TO_ALL, register

ModelLike = Any  # nnx.Module | tuple[nnx.GraphDef, nnx.State] | str | os.PathLike


def resolve_mesh(mesh: Mesh | MeshSpec | str) -> Mesh:
    """A Mesh as is; a MeshSpec (or its text form) built over ``jax.devices()``."""
    if isinstance(mesh, Mesh):
        return mesh
    return MeshSpec.parse(mesh).build(jax.devices())


def axes_tuple(axes: Any) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def split_model(model: ModelLike, mesh: Mesh, rules: Rules, head: str) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, params)`` with params placed on ``mesh`` by ``rules``."""
    if isinstance(model, (str, os.PathLike)):
        model = from_pretrained(model, mesh=mesh, rules=rules, head=head)
    if isinstance(model, tuple):
        graphdef, params = model
    else:
        if type(model) is not HEADS[head]:
            raise TypeError(f"expected a {HEADS[head].__name__} (head={head!r}), got {type(model).__name__}")
        graphdef, params = nnx.split(model)
    shardings = state_shardings(params, rules, mesh)
    return graphdef, jax.device_put(params, shardings)


@dataclasses.dataclass(frozen=True)
class RoleLayout:
    """What a role's jitted programs are built from: the model's structure and its layout
    (mesh, logical-axis rules, parameter shardings). A worker has one for its real
    parameters (`RoleWorker.layout`); a planner builds one from an abstract model."""

    graphdef: nnx.GraphDef
    mesh: Mesh
    rules: Rules
    param_shardings: Any

    @property
    def batch_axes(self) -> Any:
        """The mesh axes the ``batch`` rule splits rows over (a PartitionSpec entry)."""
        return logical_to_spec(("batch",), self.rules, self.mesh)[0]

    @property
    def dp_size(self) -> int:
        return data_parallel_size(self.rules, self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


class RoleWorker:
    """Base of the model-holding roles: ``mesh``, ``rules``, ``graphdef``, ``params``.

    Attributes:
      mesh: the role's (training / inference) mesh.
      rules: its logical-axis rules.
      batch_axes: the mesh axes the ``batch`` rule splits rows over (a PartitionSpec entry).
      dp_axes: the same as a tuple of axis names (`WorkerGroupInfo.from_mesh`'s argument).

    Subclasses name their ``role`` (`jaxflow.mesh.Role`); the model's head is the role's.
    """

    role: Role

    @property
    def head(self) -> str:
        """The output head the role's model carries (`Role.head`)."""
        return self.role.head

    def __init__(self, model: ModelLike, mesh: Mesh | MeshSpec | str, rules: Rules | str):
        self.mesh = resolve_mesh(mesh)
        self.rules = get_rules(rules)
        self.batch_axes = logical_to_spec(("batch",), self.rules, self.mesh)[0]
        self.dp_axes = axes_tuple(self.batch_axes)
        self.graphdef, params = split_model(model, self.mesh, self.rules, self.head)
        self._set_params(params)
        self._programs: dict[Any, Any] = {}
        self._model_config = None

    # Subclasses that train keep params inside a TrainState; see `params`.
    def _set_params(self, params: Any) -> None:
        self._params = params

    def replace_params(self, params: Any) -> None:
        """Replaces the parameters (same structure, shardings and dtypes) in place."""
        self._params = params

    @property
    def params(self) -> Any:
        """The parameters (an ``nnx.State`` on this role's mesh)."""
        return self._params

    @property
    def param_shardings(self) -> Any:
        return state_shardings(self.params, self.rules, self.mesh)

    @property
    def layout(self) -> RoleLayout:
        """This role's `RoleLayout` (what its program builders take)."""
        return RoleLayout(self.graphdef, self.mesh, self.rules, self.param_shardings)

    @property
    def dp_size(self) -> int:
        return data_parallel_size(self.rules, self.mesh)

    def row_sharding(self, ndim: int) -> NamedSharding:
        """Rows over the data-parallel axes, the other dimensions replicated."""
        return NamedSharding(self.mesh, PartitionSpec(self.batch_axes, *([None] * (ndim - 1))))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def put(self, batch: Batch | Mapping[str, Any], keys: Iterable[str] | None = None) -> dict[str, jax.Array]:
        """The tensor columns ``keys`` (default: all) on this role's mesh, rows split over the
        data-parallel axes. The row count must be a multiple of `dp_size` (the protocols pad
        batches to one)."""
        tensors = batch.tensors if isinstance(batch, Batch) else batch
        keys = list(tensors) if keys is None else list(keys)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise KeyError(f"{type(self).__name__} needs column(s) {missing}; the batch has {sorted(tensors)}")
        out = {}
        for k in keys:
            x = tensors[k]
            if x.shape[0] % self.dp_size:
                raise ValueError(
                    f"column {k!r} has {x.shape[0]} rows, not a multiple of the data-parallel "
                    f"size {self.dp_size} of {type(self).__name__}'s mesh {dict(self.mesh.shape)}"
                )
            out[k] = jax.device_put(x, self.row_sharding(x.ndim))
        return out

    def put_presplit(self, tensors: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Columns already cut into micro-batches (``[k, rows, ...]``) on this role's mesh,
        dimension 1 over the data-parallel axes."""
        return {
            k: jax.device_put(x, NamedSharding(self.mesh, PartitionSpec(None, self.batch_axes)))
            for k, x in tensors.items()
        }

    @register(ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """Writes the model as the HF directory ``path`` from its sharded parameters, one
        tensor at a time (`jaxflow.models.save_pretrained`: in a multi-process world process 0
        writes the files, every process takes part in gathering each tensor)."""
        save_pretrained(nnx.merge(self.graphdef, self.params), path)

    @property
    def model_config(self) -> Any:
        """The model's `jaxflow.models.ModelConfig` (a static attribute of its graph)."""
        if self._model_config is None:
            self._model_config = nnx.merge(self.graphdef, self.params).cfg
        return self._model_config

    def run_forward(
        self,
        batch: Batch,
        config: ForwardConfig,
        name: str,
        fn: Callable[[Any, dict, dict], dict],
        scalars: Mapping[str, Any],
        padded_program: Callable[[int], Any],
    ) -> Batch:
        """The role's forward ``fn(model, rows, scalars) -> {column: [b, R]}`` over ``batch``
        as ``config`` says: over its packed real tokens (`packed_forward`, the program named
        ``name``), or over its padded rows with ``padded_program(rows)``."""
        if config.use_remove_padding:
            return packed_forward(
                self,
                name,
                batch,
                fn,
                scalars,
                max_token_len=config.max_token_len_per_device,
                rows_per_micro=config.micro_batch_size_per_device,
            )
        return Batch(padded_program(len(batch))(self.params, self.put(batch, PROMPT_KEYS), dict(scalars)))

    def _compiled(self, key: Any, build) -> Any:
        """A jitted program built once per key (e.g. the set of input columns); it calls the
        executable compiled ahead for it when there is one (`mesh.executables`)."""
        if key not in self._programs:
            self._programs[key] = ahead_of_time(build())
        return self._programs[key]


def num_micro_batches(rows: int, per_device: int | None, dp_size: int, what: str) -> int:
    """How many micro-batches of ``per_device * dp_size`` rows make ``rows`` (1 if None, or if
    the rows are fewer than one micro-batch: a micro-batch size bounds memory, it is no
    minimum)."""
    if rows % dp_size:
        raise ValueError(f"{what}: {rows} rows do not split over {dp_size} data-parallel devices")
    if per_device is None or (per_device >= 1 and rows <= per_device * dp_size):
        return 1
    size = per_device * dp_size
    if per_device < 1 or rows % size:
        raise ValueError(
            f"{what}: {rows} rows do not split into micro-batches of {per_device} per device x "
            f"{dp_size} data-parallel devices = {size}"
        )
    return rows // size


def packed_program(layout: RoleLayout, fn: Callable[[Any, dict, dict], dict], name: str):
    """``jit(params, tensors, scalars) -> outputs`` running ``fn(model, micro, scalars)`` over
    the ``k`` micro-batches of a packed batch (every column ``[k, ...]``, dimension 1 over the
    data-parallel axes; `jaxflow.workers.packing`), one after the other. One compile per
    shape bucket; the program is named ``packed_<name>``."""
    rows = NamedSharding(layout.mesh, PartitionSpec(None, layout.batch_axes))
    graphdef, mesh, rules = layout.graphdef, layout.mesh, layout.rules

    def run(params, tensors, scalars):
        with sharding_rules(rules, mesh):
            model = nnx.merge(graphdef, params)
            if tensors["response_mask"].shape[0] == 1:  # one micro-batch: no loop
                return jax.tree.map(lambda x: x[None], fn(model, jax.tree.map(lambda x: x[0], tensors), scalars))
            return jax.lax.map(lambda t: fn(model, t, scalars), tensors)

    return jax.jit(
        named(run, f"packed_{name}"), in_shardings=(layout.param_shardings, rows, layout.replicated), out_shardings=rows
    )


def packed_forward(
    worker: RoleWorker,
    name: str,
    batch: Batch,
    fn,
    scalars: Mapping[str, Any],
    *,
    max_token_len: int | None,
    rows_per_micro: int | None,
) -> Batch:
    """``fn(model, micro, scalars) -> {column: [b, R]}`` over ``batch`` packed without padding
    (micro-batches of at most ``max_token_len`` tokens per device, or ``rows_per_micro`` rows
    per device; rows dealt to the data-parallel ranks balanced by tokens), the outputs
    scattered back to the batch's row order (host arrays). ``name``: the program's
    (`packed_program`)."""
    host = {k: host_array(batch[k]) for k in PROMPT_KEYS}  # whole on every process
    tensors, layout = pack(host, ranks=worker.dp_size, max_token_len=max_token_len, rows_per_micro=rows_per_micro)
    program = worker._compiled(("packed", name), lambda: packed_program(worker.layout, fn, name))
    out = program(worker.params, worker.put_presplit(tensors), dict(scalars))
    return Batch({k: scatter_rows(layout, host_array(v), len(batch)) for k, v in out.items()})


def row_program(layout: RoleLayout, fn: Callable[[Any, dict, dict], dict], num_micro: int = 1, *, name: str):
    """``jit(params, tensors, scalars) -> outputs`` running ``fn(model, tensors, scalars)``
    over the role's mesh: parameters in their layout, rows of every column and every output
    over the data-parallel axes, ``num_micro`` micro-batches one after the other (to bound
    activation memory). Compiled once per column set and shapes; named ``name``. The role
    builders (`jaxflow.workers.reference.log_probs_program`, ...) are this with their ``fn``."""
    rows = NamedSharding(layout.mesh, PartitionSpec(layout.batch_axes))
    graphdef, mesh, rules, batch_axes = layout.graphdef, layout.mesh, layout.rules, layout.batch_axes

    def run(params, tensors, scalars):
        with sharding_rules(rules, mesh):
            model = nnx.merge(graphdef, params)
            return map_micro(lambda t: fn(model, t, scalars), tensors, num_micro, mesh, batch_axes)

    return jax.jit(named(run, name), in_shardings=(layout.param_shardings, rows, layout.replicated), out_shardings=rows)
