"""The 3D-HybridEngine: the actor's weights switch from the training layout to the generation
layout on the same devices, generation runs, and the generation copy is dropped.

::

    engine = HybridEngine(train_mesh, HYBRID_TRAIN_RULES, gen_tp=2)   # strategy="hybrid"
    with engine.generation_swap(train_state, give_back=keep) as gen_state:   # jitted, cached
        out = generate_from_state(graphdef, gen_state, ..., mesh=engine.gen_mesh,
                                  rules=engine.gen_rules)
    # train_state was donated into gen_state (freed leaf by leaf as its generation copy was
    # made); on exit each device's training shard is sliced back out of its generation shard
    # (no communication under "hybrid"), gen_state is freed, and keep() gets the new state.

A device thus holds one generation shard of the weights while generating, never a training
shard beside it (HybridFlow's zero redundancy). `HybridEngine.generation` is the variant that
keeps the training copy alive (for measuring and tests).

Strategies (HybridFlow §5.4, Table 2 in :mod:`jaxflow.reshard.cost`):

- ``hybrid``: the generation mesh is :func:`jaxflow.mesh.generation_mesh` with the paper's
  grouping (micro-DP groups contiguous, generation TP groups strided), over the training
  mesh's devices in the same order. With rules whose generation layout coarsens the
  training layout (``HYBRID_TRAIN_RULES``), every device's training shard lies inside its
  generation shard and the only collectives are all-gathers inside micro-DP groups. The
  weights go over in a short sequence of small jitted programs (see ``bucket_bytes``) so
  that the peak is one generation shard; ``bucketed=False`` makes it one program.
- ``vanilla`` (HybridFlow-V): generation TP groups are consecutive devices, as a standalone
  inference engine would have them; the training shard is not part of the generation shard,
  so each device gathers the full weights within its training model-parallel group (one
  program), keeps its part (a second, local program) and drops the gathered copy.
- ``naive`` (DeepSpeed-Chat): the same two programs, gathering over every device.

With no training ``dp`` (all devices split the weights) naive and vanilla are the same
programs; they differ only where the training mesh has weight replicas.

Measurements (:meth:`HybridEngine.report`) come from the compiled programs: collectives and
their per-device bytes and replica groups from the optimised HLO, memory from XLA's buffer
assignment, and XLA's "Involuntary full rematerialization" warnings from its stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.mesh.rules import Rules, get_rules, state_shardings
from jaxflow.mesh.specs import generation_mesh, weight_axes
from jaxflow.reshard import hlo
from jaxflow.reshard.cost import Table2, table2

STRATEGIES = ("naive", "vanilla", "hybrid")


def _axes_tuple(axes: Any) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def derive_generation_rules(train_rules: Rules, train_mesh: Mesh) -> Rules:
    """Generation rules matching ``train_rules``: every logical name the training rules split
    over exactly the weight axes (those of ``heads``) is split over ``tp``; every other
    weight name is replicated; ``batch`` goes over every generation replica axis. For
    ``HYBRID_TRAIN_RULES*`` this gives ``HYBRID_GENERATE_RULES*``; for ``TRAIN_RULES``,
    ``GENERATE_RULES`` (plus the ``replica`` axis)."""
    wa = weight_axes(train_rules, train_mesh)
    out = []
    for name, axes in train_rules:
        if name == "batch":
            out.append(("batch", ("replica", "dp")))
            continue
        present = tuple(a for a in _axes_tuple(axes) if a in train_mesh.shape)
        out.append((name, "tp" if present and present == wa else None))
    return tuple(out)


def zero3_rules(train_rules: Rules, train_mesh: Mesh, weight_axes_: tuple[str, ...]) -> Rules:
    """``train_rules`` with every name split over the weight axes also split over the mesh's
    other (replica) axes, major: the ZeRO-3 layout of DeepSpeed-Chat, weights over all
    devices."""
    replica = tuple(a for a in train_mesh.axis_names if a not in weight_axes_ and train_mesh.shape[a] > 1)
    out = []
    for name, axes in train_rules:
        present = tuple(a for a in _axes_tuple(axes) if a in train_mesh.shape)
        out.append((name, replica + present if name != "batch" and present and present == weight_axes_ else axes))
    return tuple(out)


def _flat_shardings(tree: Any) -> list[NamedSharding]:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def same_layout(leaves: list[Any], src: list[NamedSharding], dst: list[NamedSharding]) -> bool:
    """Every leaf is laid out alike under ``src`` and ``dst`` (the same shard of it on the same
    device, e.g. on one device): the transition moves nothing."""
    return all(
        s.device_set == d.device_set and s.devices_indices_map(tuple(x.shape)) == d.devices_indices_map(tuple(x.shape))
        for x, s, d in zip(leaves, src, dst)
    )


def shard_bytes(leaves: list[Any], shardings: list[NamedSharding]) -> int:
    """Bytes one device holds of ``leaves`` under ``shardings`` (the largest device)."""
    per_device: dict[Any, int] = {}
    for x, s in zip(leaves, shardings):
        itemsize = np.dtype(x.dtype).itemsize
        for dev, idx in s.devices_indices_map(tuple(x.shape)).items():
            n = int(np.prod([len(range(*sl.indices(dim))) for sl, dim in zip(idx, x.shape)]))
            per_device[dev] = per_device.get(dev, 0) + n * itemsize
    return max(per_device.values()) if per_device else 0


def containment_violations(
    leaves: list[Any], train: list[NamedSharding], gen: list[NamedSharding], names: list[str] | None = None
) -> list[str]:
    """Where a device's training shard is *not* inside its generation shard (empty: the
    generation layout coarsens the training layout, zero redundancy is possible)."""
    bad = []
    for i, (x, ts, gs) in enumerate(zip(leaves, train, gen)):
        shape = tuple(x.shape)
        gmap = gs.devices_indices_map(shape)
        for dev, tidx in ts.devices_indices_map(shape).items():
            gidx = gmap[dev]
            for t, g, dim in zip(tidx, gidx, shape):
                t0, t1, _ = t.indices(dim)
                g0, g1, _ = g.indices(dim)
                if not (g0 <= t0 and t1 <= g1):
                    bad.append(f"{names[i] if names else i}: device {dev.id} train {tidx} not in gen {gidx}")
                    break
    return bad


def redundant_bytes(leaves: list[Any], train: list[NamedSharding], gen: list[NamedSharding]) -> int:
    """Bytes of a device's training shard that its generation shard does not contain (what
    it must keep besides the generation copy; the largest device). Zero under hybrid."""
    per_device: dict[Any, int] = {}
    for x, ts, gs in zip(leaves, train, gen):
        shape = tuple(x.shape)
        itemsize = np.dtype(x.dtype).itemsize
        gmap = gs.devices_indices_map(shape)
        for dev, tidx in ts.devices_indices_map(shape).items():
            total = overlap = 1
            for t, g, dim in zip(tidx, gmap[dev], shape):
                t0, t1, _ = t.indices(dim)
                g0, g1, _ = g.indices(dim)
                total *= t1 - t0
                overlap *= max(0, min(t1, g1) - max(t0, g0))
            per_device[dev] = per_device.get(dev, 0) + (total - overlap) * itemsize
    return max(per_device.values()) if per_device else 0


@dataclasses.dataclass
class TransitionReport:
    """What the compiled transition program does on one device (from its HLO and buffer
    assignment), with Table 2's prediction beside it."""

    strategy: str
    train_mesh: dict[str, int]
    gen_mesh: dict[str, int]
    train_degree: int  # t*p: product of the axes that split the training weights
    gen_tp: int  # t_g*p_g
    model_bytes: int  # M
    train_shard_bytes: int  # per device
    gen_shard_bytes: int  # per device: one generation shard
    redundancy_bytes: int  # per device: training weights outside the generation shard
    # Bytes one device receives (max over devices): a ring-algorithm model (all-gather over g
    # devices: (g-1)/g of its output; all-reduce 2(g-1)/g; ...) applied to the collectives of
    # the compiled HLO (op, per-device output shape, replica groups). Not a measured transfer.
    ring_received_bytes: float
    collective_output_bytes: int  # raw: the collectives' output buffers on one device, summed (max)
    group_sizes: list[int]  # distinct replica-group sizes of those collectives
    collectives: dict[str, int]  # op -> count
    gather_groups: list[list[int]]  # distinct replica groups of the collectives (device ids)
    output_bytes: int  # memory_analysis(): the generation copy's arrays
    temp_bytes: int  # memory_analysis(): the largest scratch of any program
    peak_extra_bytes: int  # allocated on top of the training weights, at the worst moment
    programs: int  # distinct compiled programs
    calls: int  # program calls per transition
    largest_buffer_bytes: int
    full_remat: bool  # XLA warned "Involuntary full rematerialization"
    whole_weights: list[str]  # HLO buffers with the full shape of a weight split in generation
    remat_log: list[str]
    table2: Table2
    seconds: float | None = None

    @property
    def comm_ratio(self) -> float:
        want = self.table2.comm_bytes
        got = self.ring_received_bytes
        return got / want if want else (0.0 if got == 0 else float("inf"))

    @property
    def peak_ratio(self) -> float:
        return self.peak_extra_bytes / self.table2.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["table2"] = dataclasses.asdict(self.table2)
        d.update(comm_ratio=self.comm_ratio, peak_ratio=self.peak_ratio)
        return d


@dataclasses.dataclass(frozen=True)
class _Step:
    """One call of a compiled program during the transition."""

    key: tuple  # program cache key
    leaf: int  # which leaf the call produces / updates
    chunk: int | None = None  # chunk index of an in-place update


class HybridEngine:
    """Train <-> generate layouts of one model on one pool.

    ``train_mesh`` / ``train_rules``: the actor's training layout. ``gen_tp``: generation
    tensor parallelism; it must divide the training weight-parallel degree (fsdp*tp under
    the hybrid rules). ``gen_rules``: defaults to :func:`derive_generation_rules`.

    ``bucket_bytes`` (hybrid strategy only): XLA's CPU and GPU backends all-gather along the
    most-major dimension only, so gathering a weight along a minor dimension (q_proj's heads,
    gate's mlp, lm_head's vocab: our weights are stored [in, out]) goes through a transposed
    scratch copy of the whole gathered weight. To keep the transition's peak at one
    generation shard, such weights are gathered in chunks along their (unsplit) leading
    dimension, each chunk written in place into a preallocated generation buffer (donated),
    and they go first, while the generation copies of the other weights (gathered straight
    into their output) are not yet allocated. Chunks are at most ``bucket_bytes`` of
    generation shard (default: 1/32 of the whole model's generation shard per device).
    ``bucketed=False`` compiles the whole transition as one XLA program instead (same
    collectives; scratch for those transposes, about 40% of a generation shard for Llama).
    """

    def __init__(
        self,
        train_mesh: Mesh,
        train_rules: Rules | str,
        gen_tp: int,
        strategy: str = "hybrid",
        gen_rules: Rules | str | None = None,
        bucketed: bool = True,
        bucket_bytes: int | None = None,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
        self.train_mesh = train_mesh
        self.train_rules = get_rules(train_rules)
        self.strategy = strategy
        self.gen_tp = gen_tp
        self.weight_axes = weight_axes(self.train_rules, train_mesh)
        if not self.weight_axes:
            raise ValueError(f"the training rules split 'heads' over none of the mesh axes {dict(train_mesh.shape)}")
        self.train_degree = int(np.prod([train_mesh.shape[a] for a in self.weight_axes]))
        grouping = "hybrid" if strategy == "hybrid" else "vanilla"
        self.gen_mesh = generation_mesh(train_mesh, gen_tp, self.weight_axes, grouping)
        self.gen_rules = (
            get_rules(gen_rules) if gen_rules is not None else derive_generation_rules(self.train_rules, train_mesh)
        )
        # d: the training layout's weight replicas (a training dp axis).
        self.replica_degree = int(train_mesh.devices.size // self.train_degree)
        if strategy == "naive" and self.replica_degree > 1:
            # DeepSpeed-Chat trains with ZeRO-3: its weights are split over every device
            # (t*p*d), the data-parallel axes included, and it gathers them from all of them.
            self.train_rules = zero3_rules(self.train_rules, train_mesh, self.weight_axes)
        self.bucketed = bucketed and strategy == "hybrid"
        self.bucket_bytes = bucket_bytes
        self._programs: dict[tuple, Any] = {}
        self._plans: dict[tuple, Any] = {}

    # --- layouts -------------------------------------------------------------------------

    def train_shardings(self, state: Any) -> Any:
        return state_shardings(state, self.train_rules, self.train_mesh)

    def gen_shardings(self, state: Any) -> Any:
        return state_shardings(state, self.gen_rules, self.gen_mesh)

    @property
    def micro_dp_groups(self) -> list[list[int]]:
        """Device ids that share a generation shard (and all-gather among themselves)."""
        names = list(self.gen_mesh.axis_names)
        devs = np.moveaxis(self.gen_mesh.devices, names.index("dp"), -1)
        return [[d.id for d in row] for row in devs.reshape(-1, devs.shape[-1])]

    # --- programs ------------------------------------------------------------------------

    def _get(self, key: tuple):
        """The jitted program for a cache key (built on first use)."""
        if key not in self._programs:
            self._programs[key] = self._build(key)
        return self._programs[key]

    @staticmethod
    def _build(key: tuple):
        """A new jitted program for a cache key. New function objects are also how
        :meth:`report` gets a fresh compile (JAX caches compiles per function, and XLA only
        warns about rematerialisation while compiling)."""
        kind = key[0]
        if kind in ("whole", "gather", "slice"):
            _, _, src, dst = key
            fn = jax.jit(
                lambda xs: [jax.lax.with_sharding_constraint(x, d) for x, d in zip(xs, dst)],
                in_shardings=(list(src),),
                out_shardings=list(dst),
            )
        elif kind == "direct":
            _, _, _, src, dst = key
            fn = jax.jit(lambda x: jax.lax.with_sharding_constraint(x, dst), in_shardings=src, out_shardings=dst)
        elif kind == "zeros":
            _, shape, dtype, dst = key
            fn = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=dst)
        elif kind == "update":
            _, _, _, src, dst, rows = key

            def update(out, x, k):
                chunk = jax.lax.dynamic_slice_in_dim(x, k * rows, rows, 0)
                chunk = jax.lax.with_sharding_constraint(chunk, src)  # a local slice
                chunk = jax.lax.with_sharding_constraint(chunk, dst)  # the all-gather
                return jax.lax.dynamic_update_slice_in_dim(out, chunk, k * rows, 0)

            fn = jax.jit(update, in_shardings=(dst, src, None), out_shardings=dst, donate_argnums=0)
        else:
            raise KeyError(kind)
        return fn

    def _abstract_args(self, key: tuple) -> tuple:
        kind = key[0]
        if kind in ("whole", "gather", "slice"):
            _, shapes, src, _ = key
            return ([jax.ShapeDtypeStruct(sh, dt, sharding=s) for (sh, dt), s in zip(shapes, src)],)
        if kind == "direct":
            _, shape, dtype, src, _ = key
            return (jax.ShapeDtypeStruct(shape, dtype, sharding=src),)
        if kind == "zeros":
            return ()
        _, shape, dtype, src, dst, _ = key
        return (
            jax.ShapeDtypeStruct(shape, dtype, sharding=dst),
            jax.ShapeDtypeStruct(shape, dtype, sharding=src),
            jax.ShapeDtypeStruct((), jnp.int32),
        )

    def _plan(self, state: Any, reverse: bool = False):
        """(treedef, steps): the program calls that build the target layout, in order."""
        leaves, treedef = jax.tree.flatten(state)
        shapes = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)
        pkey = (treedef, shapes, reverse)
        if pkey in self._plans:
            return self._plans[pkey]
        train = _flat_shardings(self.train_shardings(state))
        gen = _flat_shardings(self.gen_shardings(state))
        src, dst = (gen, train) if reverse else (train, gen)
        if not reverse and self.strategy != "hybrid":
            # Gather every weight whole on every device (naive) / within the training
            # model-parallel group (vanilla; the same when no axis replicates the weights),
            # then keep the generation shard and drop the gathered copy.
            full = tuple(NamedSharding(self.train_mesh, PartitionSpec()) for _ in shapes)
            steps = [_Step(("gather", shapes, tuple(src), full), -1), _Step(("slice", shapes, full, tuple(dst)), -1)]
        elif reverse or not self.bucketed:
            steps = [_Step(("whole", shapes, tuple(src), tuple(dst)), -1)]
        else:
            bucket = self.bucket_bytes or max(1, shard_bytes(leaves, dst) // 32)
            chunked, direct = [], []
            for i, ((shape, dtype), s, d) in enumerate(zip(shapes, src, dst)):
                rows = self._chunk_rows(shape, dtype, s, d, bucket)
                if rows is None:
                    direct.append(_Step(("direct", shape, dtype, s, d), i))
                else:
                    chunked.append(_Step(("zeros", shape, dtype, d), i))
                    ukey = ("update", shape, dtype, s, d, rows)
                    chunked += [_Step(ukey, i, k) for k in range(shape[0] // rows)]
            steps = chunked + direct
        self._plans[pkey] = (treedef, steps, src, dst)
        return self._plans[pkey]

    @staticmethod
    def _chunk_rows(shape, dtype, src: NamedSharding, dst: NamedSharding, bucket: int) -> int | None:
        """Rows of the leading dimension per chunk, or None to gather the leaf in one go
        (its gathered dimension is the leading one, or nothing is gathered)."""
        if len(shape) < 2 or shape[0] < 2:
            return None
        s_shard, d_shard = src.shard_shape(shape), dst.shard_shape(shape)
        gathered = [i for i, (a, b) in enumerate(zip(s_shard, d_shard)) if b > a]
        if not gathered or gathered[0] == 0 or s_shard[0] != shape[0] or d_shard[0] != shape[0]:
            return None
        leaf_bytes = int(np.prod(d_shard)) * np.dtype(dtype).itemsize
        if leaf_bytes <= bucket:
            chunks = 1
        else:
            need = -(-leaf_bytes // bucket)
            # the fewest chunks that split the leading dimension evenly and fit the bucket, else
            # one row each (e.g. a few stacked layers: the leading dimension is the layer count)
            chunks = next((k for k in range(need, shape[0] + 1) if shape[0] % k == 0), shape[0])
        return shape[0] // chunks

    # --- the transition ----------------------------------------------------------------------

    def _run(self, state: Any, reverse: bool, donate: bool = False) -> Any:
        """The transition's program calls in order. ``donate``: each input leaf's buffers are
        deleted as soon as the last program that reads it has run (XLA cannot write a
        generation shard over a smaller training shard in place, so the input is freed rather
        than aliased); the caller must not use ``state`` afterwards."""
        treedef, steps, src, dst = self._plan(state, reverse)
        leaves = jax.tree.leaves(state)

        def drop(xs: list[Any]) -> None:
            if donate:
                for x in xs:
                    x.delete()

        if same_layout(leaves, src, dst):  # e.g. one device: a copy of each leaf, no program to compile
            out = []
            for x, d in zip(leaves, dst):
                out.append(jax.device_put(x, d, may_alias=False))
                drop([x])
            return jax.tree.unflatten(treedef, out)

        if steps[0].key[0] == "whole":
            out = jax.block_until_ready(self._get(steps[0].key)(leaves))
            drop(leaves)
            return jax.tree.unflatten(treedef, out)
        if steps[0].key[0] == "gather":
            full = jax.block_until_ready(self._get(steps[0].key)(leaves))
            drop(leaves)
            out = jax.block_until_ready(self._get(steps[1].key)(full))
            for x in full:
                x.delete()
            return jax.tree.unflatten(treedef, out)
        last_read = {step.leaf: i for i, step in enumerate(steps) if step.key[0] in ("update", "direct")}
        out: list[Any] = [None] * len(leaves)
        for i, step in enumerate(steps):
            fn = self._get(step.key)
            kind = step.key[0]
            if kind == "zeros":
                out[step.leaf] = fn()
            elif kind == "update":
                out[step.leaf] = fn(out[step.leaf], leaves[step.leaf], step.chunk)
            else:
                out[step.leaf] = fn(leaves[step.leaf])
            # One program at a time: the memory bound assumes it, and XLA:CPU can deadlock
            # with many small collective programs in flight on simulated devices.
            out[step.leaf].block_until_ready()
            if last_read.get(step.leaf) == i:
                drop([leaves[step.leaf]])
        return jax.tree.unflatten(treedef, out)

    def to_generation(self, train_state: Any, *, donate: bool = False) -> Any:
        """A new state in the generation layout. ``train_state`` is read and kept, or with
        ``donate`` consumed: each training leaf is freed as soon as its generation copy
        exists, so the device holds the training copy and the generation copy of a weight
        at once only while that weight goes over (the zero-redundancy actor,
        `generation_swap`)."""
        return self._run(train_state, reverse=False, donate=donate)

    def to_training(self, gen_state: Any, *, donate: bool = False) -> Any:
        """The training layout back from a generation copy. Under the hybrid strategy this is
        local slicing only (every training shard is inside the generation shard: no
        collective), which is what lets a caller drop the training weights during generation
        (zero redundancy). ``donate``: the generation copy is freed as it goes."""
        return self._run(gen_state, reverse=True, donate=donate)

    @contextlib.contextmanager
    def generation(self, train_state: Any) -> Iterator[Any]:
        """``with engine.generation(train_state) as gen_state: ...``; the generation copy's
        buffers are deleted on exit (never a buffer the training state owns). The training
        copy stays alive beside it; `generation_swap` frees it."""
        gen_state = self.to_generation(train_state)
        try:
            yield gen_state
        finally:
            keep = {id(x) for x in jax.tree.leaves(train_state)}
            for x in jax.tree.leaves(gen_state):
                if isinstance(x, jax.Array) and id(x) not in keep and not x.is_deleted():
                    x.delete()

    @contextlib.contextmanager
    def generation_swap(self, train_state: Any, give_back: Callable[[Any], None]) -> Iterator[Any]:
        """The 3D-HybridEngine's zero-redundancy switch::

            with engine.generation_swap(params, give_back=set_params) as gen_params:
                ...generate with gen_params...

        ``train_state`` is donated into the generation copy (`to_generation` with
        ``donate``): during generation a device holds one generation shard of the weights and
        no training shard. On exit (also on an error), each device's training shard is taken
        back out of its generation shard (`to_training`: local slicing under the hybrid
        strategy), the generation copy is freed, and ``give_back`` receives the new training
        state, bit-identical to ``train_state``."""
        gen_state = self.to_generation(train_state, donate=True)
        try:
            yield gen_state
        finally:
            give_back(self.to_training(gen_state, donate=True))

    # --- measurement ----------------------------------------------------------------------

    def report(self, state: Any, reverse: bool = False, time_iters: int = 0) -> TransitionReport:
        """Compile the transition for ``state`` (an abstract ``nnx.eval_shape`` state is
        enough) and read, from the compiled programs, the collectives and the bytes each
        device receives, the memory each program allocates, and XLA's warnings. The peak is
        the sequential sum over the programs in the order they run: generation buffers
        allocated so far + the running program's new outputs and scratch.
        ``time_iters > 0`` also times it on ``state``, which must then hold real arrays."""
        _, steps, src, dst = self._plan(state, reverse)
        leaves = jax.tree.leaves(state)
        compiled: dict[tuple, Any] = {}
        with hlo.capture_stderr() as log:
            for step in steps:
                if step.key not in compiled:
                    compiled[step.key] = self._build(step.key).lower(*self._abstract_args(step.key)).compile()
        walk = _walk_programs(steps, compiled, list(self.train_mesh.devices.flat))
        model_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
        remat = [line for line in "".join(log).splitlines() if hlo.REMAT_MARKER in line]
        rep = TransitionReport(
            strategy=self.strategy,
            train_mesh=dict(self.train_mesh.shape),
            gen_mesh=dict(self.gen_mesh.shape),
            train_degree=self.train_degree,
            gen_tp=self.gen_tp,
            model_bytes=model_bytes,
            train_shard_bytes=shard_bytes(leaves, src),
            gen_shard_bytes=shard_bytes(leaves, dst),
            redundancy_bytes=redundant_bytes(leaves, src, dst),
            programs=len(compiled),
            calls=len(steps),
            full_remat=bool(remat),
            whole_weights=_whole_weights(compiled, leaves, src, dst),
            remat_log=remat,
            table2=table2(
                self.strategy,
                model_bytes,
                self.train_degree,
                self.gen_tp,
                dp=self.replica_degree if self.strategy == "naive" else 1,
            ),
            **walk,
        )
        if time_iters:
            rep.seconds = self.time(state, time_iters, reverse)
        return rep

    def time(self, state: Any, iters: int = 5, reverse: bool = False) -> float:
        """Median wall time of the transition on real arrays (outputs freed each time)."""
        times = []
        for i in range(iters + 1):
            t0 = time.perf_counter()
            out = jax.block_until_ready(self._run(state, reverse))
            if i:  # the first call compiles
                times.append(time.perf_counter() - t0)
            for x in jax.tree.leaves(out):
                x.delete()
        return statistics.median(times)

    def lowered(self, state: Any, reverse: bool = False) -> list[Any]:
        """Every distinct program of the transition, in the order they first run, lowered on
        abstract arguments (``state`` may be abstract): the programs `to_generation` /
        `to_training` call (none when both layouts are the same)."""
        _, steps, src, dst = self._plan(state, reverse)
        if same_layout(jax.tree.leaves(state), src, dst):
            return []
        keys = list(dict.fromkeys(step.key for step in steps))
        return [self._build(k).lower(*self._abstract_args(k)) for k in keys]

    def compiled_texts(self, state: Any, reverse: bool = False) -> list[str]:
        """The optimised HLO of every distinct program of the transition."""
        return [lowered.compile().as_text() for lowered in self.lowered(state, reverse)]


def _whole_weights(compiled: dict[tuple, Any], leaves: list, src: list, dst: list) -> list[str]:
    """Buffers of the compiled programs with the global shape of a weight that the
    generation layout splits: one was materialised whole (shapes that are also some shard's
    shape are ambiguous and skipped)."""
    shard_shapes = {s.shard_shape(tuple(x.shape)) for shs in (src, dst) for x, s in zip(leaves, shs)}
    split = {tuple(x.shape) for x, d in zip(leaves, dst) if d.shard_shape(tuple(x.shape)) != tuple(x.shape)}
    return sorted(
        {
            line
            for c in compiled.values()
            for shape in split - shard_shapes
            for line in hlo.buffers_with_shape(c.as_text(), shape)
        }
    )


def _program_memory(key: tuple, compiled: Any) -> tuple[int, int, int]:
    """(outputs, scratch, aliased) bytes per device of one compiled transition program."""
    mem = compiled.memory_analysis()
    n_out = len(key[3]) if key[0] in ("whole", "gather", "slice") else 1
    table = 8 * n_out if n_out > 1 else 0  # XLA's tuple index table, not array memory
    return int(mem.output_size_in_bytes) - table, int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)


def _walk_programs(steps: list, compiled: dict[tuple, Any], flat_devices: list) -> dict[str, Any]:
    """The transition's program calls in order: the bytes each device receives (ring model
    of the collectives in the HLO), the collectives' kinds, group sizes and device groups,
    and the memory: generation buffers allocated so far + the running program's outputs and
    scratch (`TransitionReport`'s fields)."""
    stats = {key: _program_memory(key, c) for key, c in compiled.items()}
    received = np.zeros(len(flat_devices))
    raw_out = np.zeros(len(flat_devices))
    sizes: set[int] = set()
    counts: dict[str, int] = {}
    groups: set[tuple[int, ...]] = set()
    alloc = peak = temp_max = 0
    for step in steps:
        colls = hlo.parse_collectives(compiled[step.key].as_text())
        received += np.asarray(hlo.received_per_device(colls, len(flat_devices)))
        for col in colls:
            counts[col.op] = counts.get(col.op, 0) + 1
            sizes.add(col.group_size)
            for d in {i for g in col.groups for i in g} or {t for _, t in col.pairs}:
                raw_out[d] += col.out_bytes
            groups.update(tuple(flat_devices[i].id for i in g) for g in col.groups)
        out, temp, alias = stats[step.key]
        peak = max(peak, alloc + out - alias + temp)
        alloc += out - alias
        temp_max = max(temp_max, temp)
        if step.key[0] == "slice":  # the gathered copy is dropped
            alloc -= stats[steps[0].key][0]
    return dict(
        ring_received_bytes=float(received.max()),
        collective_output_bytes=int(raw_out.max()),
        group_sizes=sorted(sizes),
        collectives=counts,
        gather_groups=[list(g) for g in sorted(groups)],
        output_bytes=alloc,
        temp_bytes=temp_max,
        peak_extra_bytes=peak,
        largest_buffer_bytes=max((hlo.largest_buffer_bytes(c.as_text()) for c in compiled.values()), default=0),
    )
