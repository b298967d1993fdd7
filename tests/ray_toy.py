"""A model-free worker for the backend tests (importable by Ray worker processes)."""

import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.data.batch import Batch
from jaxflow.workers import DP_COMPUTE, DP_COMPUTE_METRIC, DP_COMPUTE_REPEAT, DP_TRAIN, ONE_TO_ALL, register
from jaxflow.workers.base import resolve_mesh
from jaxflow.workers.protocols import ALL_TO_ALL


class Toy:
    """Doubles a column on its mesh (rows over ``dp``), repeats rows, reports metrics."""

    def __init__(self, mesh):
        self.mesh, self.dp_axes = resolve_mesh(mesh), ("dp",)
        self.seen = []
        self._double = jax.jit(lambda x: x * 2)
        self._mix = jax.jit(lambda x: x / x.sum() * x.shape[0])  # a cross-device reduction each call

    def put(self, batch):
        sharding = NamedSharding(self.mesh, P("dp"))
        return {k: jax.device_put(v, sharding) for k, v in batch.tensors.items()}

    @register(DP_COMPUTE)
    def double(self, batch):
        x = self.put(batch)["x"]
        self.seen.append(x.shape[0])
        return Batch({"y": self._double(x)}, batch.non_tensors, batch.meta)

    @register(DP_COMPUTE_REPEAT)
    def rollout(self, batch, n=3):
        return batch.repeat(n).update(tensors={"sample": np.tile(np.arange(n), len(batch))})

    @register(DP_COMPUTE_METRIC)
    def stats(self, batch):
        return {"mean_x": np.asarray([batch["x"].mean()])}

    @register(DP_TRAIN)
    def train(self, batch):
        return {"rows": np.asarray([len(batch)])}

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
