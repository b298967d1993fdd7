"""Model-free workers for the backend tests (importable by Ray worker processes)."""

import functools
import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.data.batch import Batch
from jaxflow.workers import (
    DP_COMPUTE,
    DP_COMPUTE_METRIC,
    DP_COMPUTE_REPEAT,
    DP_TRAIN,
    ONE_TO_ALL,
    register,
)
from jaxflow.workers.base import resolve_mesh
from jaxflow.workers.protocols import ALL_TO_ALL


class Toy:
    """Computes on its mesh (rows over ``dp``) with one jitted program per method: doubles a
    column, repeats rows, reports metrics; every result is a global array that the group
    brings back (on the Ray backend, from the processes that hold its shards)."""

    def __init__(self, mesh):
        self.mesh, self.dp_axes = resolve_mesh(mesh), ("dp",)
        self.seen = []
        rows = NamedSharding(self.mesh, P("dp"))
        self._double = jax.jit(lambda x: (x * 2, jnp.cumsum(x)), out_shardings=(rows, rows))
        self._mean = jax.jit(jnp.mean)
        self._train = jax.jit(lambda x: (jnp.sum(x * x), jnp.max(x)))
        self._mix = jax.jit(lambda x: x / x.sum() * x.shape[0])  # a cross-device reduction each call

    def put(self, batch):
        return {
            k: jax.device_put(v, NamedSharding(self.mesh, P("dp", *([None] * (v.ndim - 1)))))
            for k, v in batch.tensors.items()
        }

    @register(DP_COMPUTE)
    def double(self, batch):
        """``y = 2x`` and ``cumsum`` (the running sum over the whole padded batch: crosses shards)."""
        x = self.put(batch)["x"]
        self.seen.append(x.shape[0])
        y, total = self._double(x)
        return Batch({"y": y, "cumsum": total}, batch.non_tensors, batch.meta)

    @register(DP_COMPUTE_REPEAT)
    def rollout(self, batch, n=3):
        """``n`` samples per row, interleaved: ``x`` repeated and the sample index, on the mesh."""
        x = self.put(batch)["x"]
        rows = NamedSharding(self.mesh, P("dp"))
        repeat = jax.jit(lambda x: (jnp.repeat(x, n), jnp.tile(jnp.arange(n), x.shape[0])), out_shardings=(rows, rows))
        out, sample = repeat(x)
        return Batch(
            {"x": out, "sample": sample}, {k: np.repeat(v, n) for k, v in batch.non_tensors.items()}, batch.meta
        )

    @register(DP_COMPUTE_METRIC)
    def stats(self, batch):
        return {"mean_x": self._mean(self.put(batch)["x"])}

    @register(DP_TRAIN)
    def train(self, batch):
        sum_sq, top = self._train(self.put(batch)["x"])
        return {"rows": np.asarray([len(batch)]), "sum_sq": sum_sq, "max": top}

    @register(ONE_TO_ALL)
    def hello(self, name):
        return f"hi {name}"

    @register(ONE_TO_ALL)
    def rows_seen(self):
        return list(self.seen)

    @register(ONE_TO_ALL)
    def fail(self, message):
        raise ValueError(message)

    @register(ONE_TO_ALL)
    def busy(self, steps):
        """``steps`` all-reduces over the whole mesh, one after the other (a long step whose
        ranks wait on each other in collectives); returns the pid."""
        x = jax.device_put(np.ones(self.mesh.devices.size, np.float32), NamedSharding(self.mesh, P("dp")))
        for _ in range(int(steps)):
            x = self._mix(x)
        jax.block_until_ready(x)
        return os.getpid()

    @register(ALL_TO_ALL)
    def whoami(self, tag):
        return (tag, jax.process_index(), [d.id for d in jax.local_devices()])

    def not_registered(self):
        return 0


class Loaded:
    """A model read from an HF directory onto its mesh (``fsdp=4,tp=2`` over 4 processes x 2
    devices: each process holds a quarter of every sharded matrix), with what the reader read."""

    def __init__(self, path, mesh, scan_layers=False):
        from jaxflow.mesh import TRAIN_RULES
        from jaxflow.models import from_pretrained

        self.mesh, self.dp_axes = resolve_mesh(mesh), ("fsdp",)
        self.read = {}
        self.model = from_pretrained(
            path, mesh=self.mesh, rules=TRAIN_RULES, scan_layers=scan_layers, read_stats=self.read
        )

    @register(ALL_TO_ALL)
    def read_stats(self, _):
        return dict(self.read)

    @register(ONE_TO_ALL)
    def params(self):
        """The parameters as a nested dict (brought to the driver from the processes' shards)."""
        from flax import nnx

        return nnx.to_pure_dict(nnx.state(self.model))


class KillSwitch:
    """Built in a worker group's processes beside its placement roles: `arm` makes the next
    `ActorWorker.update` of each process SIGKILL that process inside the update, once its
    optimizer steps have run on the process's devices and before its result leaves (a trainer
    killed mid-update, at the same point on every run). The process writes the wall time
    (``time.time()``) of its kill to ``stamp`` just before it. A fresh process (a restart's)
    imports the unpatched class: the kill happens once."""

    @register(ONE_TO_ALL)
    def arm(self, stamp):
        from jaxflow.workers.actor import ActorWorker

        update = ActorWorker.update

        @functools.wraps(update)  # keeps the registered protocol
        def killed(worker, *args, **kwargs):
            update(worker, *args, **kwargs)
            Path(stamp).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        ActorWorker.update = killed
        return os.getpid()
